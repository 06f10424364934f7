"""The topics a stream creates: changelog, dead letters, its copy of a joined table's rows and
heartbeats (never its source, nor the table's own)."""

from __future__ import annotations

from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import topics
from duality.spec import PipelineSpec
from duality.stream import heartbeat


def changelog_config(spec: PipelineSpec) -> dict[str, str]:
    config = dict(topics.FAST_COMPACTION)
    if spec.window is not None:
        config["cleanup.policy"] = "compact,delete"
        # Windows are kept for a week after their last update, then deleted with their segment.
        config["retention.ms"] = str(7 * 24 * 3600 * 1000)
    return config


def ensure_topics(settings: Settings, spec: PipelineSpec) -> None:
    """Create the changelog, dead-letter and status topics when missing (never the source)."""
    source_partitions = topics.partition_count(settings, spec.source.topic)
    topics.create_topic(
        settings,
        spec.changelog_topic,
        spec.changelog.partitions or source_partitions,
        config=changelog_config(spec),
        exist_ok=True,
    )
    topics.create_topic(settings, spec.dlq_topic, source_partitions, exist_ok=True)
    if spec.joined is not None:
        table = spec.joined.topic
        if not topics.topic_exists(settings, table):
            raise UsageError(
                f"pipeline {spec.name} joins table {spec.joined.name}, whose topic {table!r} "
                "does not exist: create it (or start the pipeline that writes it) first"
            )
        topics.create_topic(
            settings,
            spec.table_topic,
            topics.partition_count(settings, table),
            config=dict(topics.FAST_COMPACTION),
            exist_ok=True,
        )
    heartbeat.ensure_topic(settings)
