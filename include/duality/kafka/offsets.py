"""Offsets: a topic's (beginning, end, for a time), deleting records below them, and consumer
groups' committed offsets and lag, read through a consumer that never subscribes
(docs/decisions/0021-offsets-through-a-consumer.md)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Literal

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from duality.config import Settings
from duality.kafka import client, topics

log = logging.getLogger("duality.kafka")


# What a consumer's offset lookup answers for a partition whose leader died (decision 21).
_LEADER_GONE = (*client.NO_ANSWER, KafkaError._UNKNOWN_PARTITION, KafkaError._DESTROY_BROKER)


def _list_offsets(
    settings: Settings,
    topic: str,
    at: Literal["earliest", "latest"] | int,
    isolation: client.Isolation,
) -> dict[int, int]:
    """Per partition of `topic`, the first offset still stored, the next to be written, or the
    first at or after the timestamp `at` (ms; -1 where there is none), asked through a consumer
    that never subscribes, not the admin client (decision 21)."""
    timeout = settings.connect_timeout_s

    def ask() -> dict[int, int]:
        # A consumer per attempt: a kept one would ask a dead leader again and again.
        partitions = [
            TopicPartition(topic, p) for p in range(topics.partition_count(settings, topic))
        ]
        reader = client.consumer(settings, "duality-offsets", isolation_level=isolation)
        try:
            if isinstance(at, str):
                marks = {
                    tp.partition: reader.get_watermark_offsets(tp, timeout=timeout, cached=False)
                    for tp in partitions
                }
                return {p: low if at == "earliest" else high for p, (low, high) in marks.items()}
            for tp in partitions:
                tp.offset = at
            found = reader.offsets_for_times(partitions, timeout)
            for tp in found:
                if tp.error is not None:
                    raise KafkaException(tp.error)
            return {tp.partition: tp.offset for tp in found}
        except KafkaException as exc:
            if client.error_code(exc) not in _LEADER_GONE:
                raise
            # No answer in time, or no leader known, for a partition whose leader died: asked
            # again (about 10 s later, Kafka's controller has elected another).
            raise KafkaException(
                KafkaError(
                    KafkaError.LEADER_NOT_AVAILABLE, client.error_reason(exc), retriable=True
                )
            ) from None
        finally:
            reader.close()

    return client.retrying(settings, f"list the offsets of topic {topic!r}", ask)


def end_offsets(
    settings: Settings, topic: str, isolation: client.Isolation = "read_committed"
) -> dict[int, int]:
    """Per partition, the offset the next record will get (read_committed: the stable end)."""
    return _list_offsets(settings, topic, "latest", isolation)


def offsets_for_time(settings: Settings, topic: str, timestamp_ms: int) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is at or after `timestamp_ms`;
    the end offset where no record is that recent."""
    found = _list_offsets(settings, topic, timestamp_ms, "read_uncommitted")
    ends = end_offsets(settings, topic, "read_uncommitted")
    return {p: offset if offset >= 0 else ends[p] for p, offset in found.items()}


def beginning_offsets(settings: Settings, topic: str) -> dict[int, int]:
    """Per partition, the first offset still stored (after retention and delete-records)."""
    return _list_offsets(settings, topic, "earliest", "read_uncommitted")


def is_empty(settings: Settings, topic: str, ends: Mapping[int, int] | None = None) -> bool:
    """Whether `topic` stores no record below `ends` (by default its end offsets under
    read_uncommitted: no record at all, committed or not)."""
    first = beginning_offsets(settings, topic)
    if ends is None:
        ends = end_offsets(settings, topic, "read_uncommitted")
    return all(end <= first.get(p, 0) for p, end in ends.items())


def delete_records(settings: Settings, topic: str, before: Mapping[int, int]) -> dict[int, int]:
    """Delete records below the given offset of each partition; returns the new low watermarks."""
    request = [TopicPartition(topic, partition, offset) for partition, offset in before.items()]
    futures = client.admin(settings).delete_records(
        request, request_timeout=settings.connect_timeout_s, operation_timeout=30
    )
    doing = f"delete records of topic {topic!r}"
    return {
        tp.partition: client.admin_result(future, settings, doing).low_watermark
        for tp, future in futures.items()
    }


# -- consumer groups ---------------------------------------------------------------------------


def _as_exception(error: KafkaError | KafkaException) -> KafkaException:
    return error if isinstance(error, KafkaException) else KafkaException(error)


def consumer_groups(settings: Settings) -> list[str]:
    doing = "list the consumer groups"
    future = client.admin(settings).list_consumer_groups(request_timeout=settings.connect_timeout_s)
    result = client.admin_result(future, settings, doing)
    refused = [
        e for e in result.errors if client.error_code(_as_exception(e)) not in client.NO_ANSWER
    ]
    if refused or (result.errors and not result.valid):
        raise client.failure(settings, doing, _as_exception((refused or result.errors)[0]))
    if result.errors:
        # Brokers that are down: their groups move to another coordinator within seconds, and
        # the groups of the brokers that answered are still worth showing.
        log.warning("%d broker(s) did not list their consumer groups", len(result.errors))
    return sorted(listing.group_id for listing in result.valid)


def _committed(
    settings: Settings, group: str, partitions: list[TopicPartition], isolation: client.Isolation
) -> list[TopicPartition]:
    """A group's committed offsets of `partitions`, asked through a consumer of the group that
    never subscribes. (The admin client's ListConsumerGroupOffsets is not used: librdkafka 2.16
    crashes the process when the group coordinator answers NOT_COORDINATOR to it.)"""
    reader = client.consumer(settings, group, isolation_level=isolation)

    def ask() -> list[TopicPartition]:
        try:
            found: list[TopicPartition] = reader.committed(
                partitions, timeout=settings.connect_timeout_s
            )
        except KafkaException:
            # A group the user may not read only times the call out; the consumer has the why.
            event = reader.poll(0)
            if event is not None and event.error() is not None:
                raise KafkaException(event.error()) from None
            raise
        return found

    try:
        return client.retrying(settings, f"read the committed offsets of group {group!r}", ask)
    finally:
        reader.close()


def group_offsets(settings: Settings, group: str) -> dict[tuple[str, int], int]:
    """The committed offsets of a consumer group: (topic, partition) -> offset."""
    partitions = [
        TopicPartition(topic, partition)
        for topic, entry in client.metadata(settings, "list its topics").topics.items()
        for partition in entry.partitions
    ]
    return {
        (tp.topic, tp.partition): tp.offset
        for tp in _committed(settings, group, partitions, "read_uncommitted")
        if tp.offset >= 0
    }


def committed_offsets(
    settings: Settings, group: str, topic: str, isolation: client.Isolation = "read_committed"
) -> dict[int, tuple[int, bytes | None]]:
    """A group's committed (offset, metadata) per partition of `topic`; absent when none.

    The metadata is bytes, never decoded here: it is the committing client's (Kafka Streams
    commits binary metadata), and only the code that wrote it knows its format.
    read_committed asks for stable offsets (KIP-447): offsets an open transaction is committing
    are waited out, never half seen; read_uncommitted answers at once with the last stable ones.
    """
    partitions = [TopicPartition(topic, p) for p in range(topics.partition_count(settings, topic))]
    found = _committed(settings, group, partitions, isolation)
    return {tp.partition: (tp.offset, _metadata_bytes(tp)) for tp in found if tp.offset >= 0}


def _metadata_bytes(partition: TopicPartition) -> bytes | None:
    """The committed metadata of `partition` as bytes. confluent-kafka 2.16 decodes it as UTF-8
    when the attribute is read, and reads librdkafka's unterminated copy up to the next NUL
    byte, so the bytes may end with a few that were never committed."""
    try:
        text: str | None = partition.metadata
    except UnicodeDecodeError as exc:
        return bytes(exc.object)
    return None if text is None else text.encode()


def commit_offsets(settings: Settings, group: str, topic: str, offsets: Mapping[int, int]) -> None:
    """Set the committed offsets of `group` on `topic` (a group with no member running)."""
    committer = client.consumer(settings, group)
    try:
        committer.commit(
            offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False
        )
    except KafkaException as exc:
        raise client.failure(settings, f"commit offsets of group {group!r}", exc) from None
    finally:
        committer.close()


@dataclasses.dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    committed: int
    end: int

    @property
    def lag(self) -> int:
        return max(0, self.end - self.committed)


def lag(settings: Settings, groups: Iterable[str] | None = None) -> list[PartitionLag]:
    """Consumer lag per group and partition: end offset minus committed offset."""
    selected = list(groups) if groups is not None else consumer_groups(settings)
    rows: list[PartitionLag] = []
    ends: dict[str, dict[int, int]] = {}
    for group in selected:
        for (topic, partition), committed in sorted(group_offsets(settings, group).items()):
            if topic not in ends:
                ends[topic] = end_offsets(settings, topic)
            rows.append(PartitionLag(group, topic, partition, committed, ends[topic][partition]))
    return rows
