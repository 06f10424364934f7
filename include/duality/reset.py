"""The application reset tool: stop the stream, set its committed source offsets, delete the
checkpoint and recreate the changelog empty, to reprocess the source from a chosen point."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from duality import storage
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, offsets, topics
from duality.spec import PipelineSpec
from duality.stream import control
from duality.stream.seeding import checkpoint_dir
from duality.stream.topics import changelog_config


@dataclasses.dataclass
class ResetPlan:
    pipeline: str
    stop_pid: int | None
    source_topic: str
    offsets: dict[int, int]
    checkpoint: str
    checkpoint_exists: bool
    changelog_topic: str
    changelog_partitions: int | None
    changelog_records: int
    # A joined pipeline's copy of its table: emptied, the next start reads the table to its end.
    table_copy: str | None = None

    def steps(self) -> list[str]:
        steps = []
        if self.stop_pid is not None:
            steps.append(f"stop the running stream (pid {self.stop_pid})")
        offsets = ", ".join(f"{p}:{o}" for p, o in sorted(self.offsets.items()))
        steps.append(f"set the source offsets of {self.source_topic} to {offsets}")
        if self.checkpoint_exists:
            steps.append(f"delete the checkpoint {self.checkpoint}")
        if self.changelog_partitions is not None:
            steps.append(
                f"recreate {self.changelog_topic} empty ({self.changelog_partitions} partitions, "
                f"{self.changelog_records} records now)"
            )
        if self.table_copy is not None:
            steps.append(
                f"recreate {self.table_copy} empty (the next start reads the joined table's "
                "topic to its end)"
            )
        return steps

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "steps": self.steps()}


def parse_offsets(text: str, partitions: int) -> dict[int, int]:
    offsets: dict[int, int] = {}
    for item in text.split(","):
        partition, sep, offset = item.strip().partition(":")
        if not sep or not partition.isdigit() or not offset.isdigit():
            raise UsageError(
                f"--to-offsets {text!r}: write partition:offset pairs, as in 0:100,1:250"
            )
        if int(partition) >= partitions:
            raise UsageError(f"--to-offsets: the source has no partition {partition}")
        offsets[int(partition)] = int(offset)
    return offsets


def plan(
    settings: Settings,
    spec: PipelineSpec,
    *,
    to_datetime: datetime | None = None,
    to_offsets: str | None = None,
) -> ResetPlan:
    if to_datetime is not None and to_offsets is not None:
        raise UsageError("give --to-datetime or --to-offsets, not both")
    client.ensure_reachable(settings)
    source = spec.source.topic
    partitions = topics.partition_count(settings, source)
    earliest = offsets.beginning_offsets(settings, source)
    if to_offsets is not None:
        start = {**earliest, **parse_offsets(to_offsets, partitions)}
    elif to_datetime is not None:
        moment = to_datetime if to_datetime.tzinfo else to_datetime.replace(tzinfo=UTC)
        start = offsets.offsets_for_time(settings, source, int(moment.timestamp() * 1000))
    else:
        start = earliest
    exists = topics.topic_exists(settings, spec.changelog_topic)
    records = 0
    if exists:
        ends = offsets.end_offsets(settings, spec.changelog_topic, "read_uncommitted")
        starts = offsets.beginning_offsets(settings, spec.changelog_topic)
        records = sum(ends[p] - starts[p] for p in ends)
    checkpoint = checkpoint_dir(settings, spec)
    return ResetPlan(
        pipeline=spec.name,
        stop_pid=control.running_pid(settings, spec),
        source_topic=source,
        offsets=start,
        checkpoint=str(checkpoint),
        checkpoint_exists=checkpoint.exists(),
        changelog_topic=spec.changelog_topic,
        changelog_partitions=(
            topics.partition_count(settings, spec.changelog_topic) if exists else None
        ),
        changelog_records=records,
        table_copy=(
            spec.table_topic
            if spec.joined is not None and topics.topic_exists(settings, spec.table_topic)
            else None
        ),
    )


def execute(settings: Settings, spec: PipelineSpec, reset: ResetPlan) -> None:
    # The supervisor must not start the stream halfway through; afterwards it may again.
    with control.held(settings, spec):
        if reset.stop_pid is not None or control.running_pid(settings, spec) is not None:
            control.stop(settings, spec, hold=False)
        offsets.commit_offsets(settings, spec.consumer_group, spec.source.topic, reset.offsets)
        storage.remove_tree(settings.location(reset.checkpoint))
        if reset.changelog_partitions is not None:
            # KRaft has removed a topic when it answers the deletion: the name is free again.
            topics.delete_topic(settings, spec.changelog_topic)
            topics.create_topic(
                settings,
                spec.changelog_topic,
                reset.changelog_partitions,
                config=changelog_config(spec),
            )
        if reset.table_copy is not None:
            partitions = topics.partition_count(settings, reset.table_copy)
            topics.delete_topic(settings, reset.table_copy)
            topics.create_topic(
                settings, reset.table_copy, partitions, config=dict(topics.FAST_COMPACTION)
            )
