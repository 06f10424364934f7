"""What a snapshot version covers: the changelog's offsets and the matching source offsets."""

from __future__ import annotations

import dataclasses
from typing import Any

from duality.config import Settings
from duality.errors import CheckFailed
from duality.kafka import offsets, topics
from duality.spec import PipelineSpec


@dataclasses.dataclass(frozen=True)
class Coverage:
    """The changelog offsets a snapshot version covers, and the source offsets the stream had
    committed with them (in the same Kafka transactions)."""

    changelog_topic: str
    changelog_topic_id: str
    changelog: dict[int, int]
    source_topic: str
    source: dict[int, int]

    def as_dict(self) -> dict[str, Any]:
        """The form recorded in the table (partitions as text, in order)."""
        return {
            "changelog_topic": self.changelog_topic,
            "changelog_topic_id": self.changelog_topic_id,
            "changelog": {str(p): o for p, o in sorted(self.changelog.items())},
            "source_topic": self.source_topic,
            "source": {str(p): o for p, o in sorted(self.source.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Coverage:
        return cls(
            changelog_topic=data["changelog_topic"],
            changelog_topic_id=data["changelog_topic_id"],
            changelog={int(p): int(o) for p, o in data["changelog"].items()},
            source_topic=data["source_topic"],
            source={int(p): int(o) for p, o in data["source"].items()},
        )


def capture_coverage(settings: Settings, spec: PipelineSpec, attempts: int = 20) -> Coverage:
    """The changelog's stable end offsets and the stream's committed source offsets, as a pair.

    The stream commits changelog records and source offsets in one transaction, but the two
    become visible separately. Reading source, changelog, source, changelog until both repeat
    (with stable offsets, which wait out a committing transaction) gives a matching pair.
    """
    info = topics.describe_topic(settings, spec.changelog_topic)
    group, source_topic = spec.consumer_group, spec.source.topic
    for _ in range(attempts):
        source_before = source_offsets(settings, group, source_topic)
        changelog_before = offsets.end_offsets(settings, spec.changelog_topic)
        source_after = source_offsets(settings, group, source_topic)
        changelog_after = offsets.end_offsets(settings, spec.changelog_topic)
        if source_before == source_after and changelog_before == changelog_after:
            return Coverage(
                spec.changelog_topic, info.topic_id, changelog_after, source_topic, source_after
            )
    raise CheckFailed(
        f"the changelog {spec.changelog_topic} kept moving while its offsets were read "
        f"({attempts} tries): run the snapshot again"
    )


def source_offsets(settings: Settings, group: str, topic: str) -> dict[int, int]:
    """The stream's committed offsets of its source topic, per partition."""
    committed = offsets.committed_offsets(settings, group, topic)
    return {partition: offset for partition, (offset, _) in committed.items()}
