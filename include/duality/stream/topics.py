"""The topics a stream creates: changelog, dead letters and heartbeats (never its source)."""

from __future__ import annotations

from duality import kafka
from duality.config import Settings
from duality.spec import PipelineSpec
from duality.stream import heartbeat


def changelog_config(spec: PipelineSpec) -> dict[str, str]:
    config = dict(kafka.FAST_COMPACTION)
    if spec.window is not None:
        config["cleanup.policy"] = "compact,delete"
        # Windows are kept for a week after their last update, then deleted with their segment.
        config["retention.ms"] = str(7 * 24 * 3600 * 1000)
    return config


def ensure_topics(settings: Settings, spec: PipelineSpec) -> None:
    """Create the changelog, dead-letter and status topics when missing (never the source)."""
    source_partitions = kafka.partition_count(settings, spec.source.topic)
    kafka.create_topic(
        settings,
        spec.changelog_topic,
        spec.changelog.partitions or source_partitions,
        config=changelog_config(spec),
        exist_ok=True,
    )
    kafka.create_topic(settings, spec.dlq_topic, source_partitions, exist_ok=True)
    heartbeat.ensure_topic(settings)
