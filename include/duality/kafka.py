"""The one Kafka helper module: admin operations, producers and consumers built from Settings.

Every Python producer uses `partitioner=murmur2_random` so that a key lands in the partition
Java's default partitioner (and so Spark's Kafka sink) would choose, and every consumer states
its isolation level, because librdkafka and the Java client default to different ones.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    ConfigSource,
    NewTopic,
    OffsetSpec,
)

from duality.config import Settings
from duality.errors import BrokerUnavailable, UsageError

T = TypeVar("T")

Isolation = Literal["read_committed", "read_uncommitted"]

# librdkafka reports every failed connection attempt through this logger; commands turn
# unreachable brokers into one BrokerUnavailable error instead of a screen of retries.
_client_log = logging.getLogger("duality.kafka.client")
_client_log.addHandler(logging.NullHandler())

# Configs for topics that should compact quickly on the dev broker; callers pass them explicitly.
FAST_COMPACTION = {
    "cleanup.policy": "compact",
    "segment.ms": "1000",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "60000",
}


_COORDINATOR_BUSY = (
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
)


@dataclasses.dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]
    # Kafka's id of this incarnation of the topic: a deleted and recreated topic gets a new one.
    topic_id: str = ""


def _base_config(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = dict(settings.kafka_client_config())
    config["logger"] = _client_log
    return config


def admin(settings: Settings) -> AdminClient:
    return AdminClient(_base_config(settings))


def producer(settings: Settings, **overrides: Any) -> Producer:
    """An idempotent producer that partitions keys like Java's default partitioner."""
    config = _base_config(settings)
    config.update(
        {
            "partitioner": "murmur2_random",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 20,
            "compression.type": "lz4",
        }
    )
    config.update({k.replace("_", "."): v for k, v in overrides.items()})
    return Producer(config)


def send(
    producer: Producer,
    topic: str,
    key: bytes | str | None = None,
    value: bytes | str | None = None,
    headers: list[tuple[str, str | bytes | None]] | None = None,
) -> None:
    """Produce one record, waiting for room in the producer's queue when it is full."""
    while True:
        try:
            producer.produce(topic, key=key, value=value, headers=headers)
            return
        except BufferError:
            producer.poll(0.05)


def consumer(
    settings: Settings,
    group_id: str,
    *,
    isolation_level: Isolation = "read_committed",
    **overrides: Any,
) -> Consumer:
    """A consumer with an explicit isolation level and no automatic offset commits."""
    config = _base_config(settings)
    config.update(
        {
            "group.id": group_id,
            "isolation.level": isolation_level,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    config.update({k.replace("_", "."): v for k, v in overrides.items()})
    return Consumer(config)


def ensure_reachable(settings: Settings, timeout: float | None = None) -> int:
    """Wait up to `timeout` seconds for the cluster to answer; returns the number of brokers."""
    timeout = settings.connect_timeout_s if timeout is None else timeout
    client = admin(settings)
    try:
        metadata = client.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise unreachable(settings, timeout, exc) from None
    return len(metadata.brokers)


def unreachable(settings: Settings, timeout: float, cause: object) -> BrokerUnavailable:
    return BrokerUnavailable(
        f"cannot reach Kafka at {settings.bootstrap_servers} (DUALITY_BOOTSTRAP_SERVERS) "
        f"within {timeout:g}s: {_reason(cause)}. Start the local broker with `duality up`, "
        "or point DUALITY_BOOTSTRAP_SERVERS at a running cluster."
    )


def _reason(cause: object) -> str:
    if isinstance(cause, KafkaException) and cause.args and isinstance(cause.args[0], KafkaError):
        return str(cause.args[0].str())
    return str(cause)


def _result(future: Any, settings: Settings) -> Any:
    try:
        return future.result()
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if isinstance(error, KafkaError) and error.code() in (
            KafkaError._TRANSPORT,
            KafkaError._TIMED_OUT,
            KafkaError._ALL_BROKERS_DOWN,
        ):
            raise unreachable(settings, settings.connect_timeout_s, exc) from None
        raise


def create_topic(
    settings: Settings,
    name: str,
    partitions: int,
    *,
    config: Mapping[str, str] | None = None,
    replication_factor: int = 1,
    exist_ok: bool = False,
) -> bool:
    """Create a topic; returns False when it already existed and `exist_ok` allowed that."""
    if partitions < 1:
        raise UsageError(f"topic {name!r}: partitions must be at least 1, got {partitions}")
    ensure_reachable(settings)
    new = NewTopic(
        name,
        num_partitions=partitions,
        replication_factor=replication_factor,
        config=dict(config or {}),
    )
    client = admin(settings)  # kept alive until the futures resolve
    futures = client.create_topics([new], request_timeout=settings.connect_timeout_s)
    try:
        futures[name].result()
    except KafkaException as exc:
        error = exc.args[0]
        if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            if exist_ok:
                return False
            raise UsageError(
                f"topic {name!r} already exists: delete it or choose another name"
            ) from None
        raise
    return True


def delete_topic(settings: Settings, name: str) -> None:
    client = admin(settings)
    futures = client.delete_topics([name], request_timeout=settings.connect_timeout_s)
    _result(futures[name], settings)


def describe_topic(settings: Settings, name: str) -> TopicInfo:
    """Partitions, replication factor and non-default configs of one topic."""
    client = admin(settings)
    ensure_reachable(settings)
    futures = client.describe_topics(TopicCollection([name]))
    try:
        description = futures[name].result()
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise UsageError(
                f"topic {name!r} does not exist on {settings.bootstrap_servers}: "
                "check the name, or create it first"
            ) from None
        raise
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    entries = _result(client.describe_configs([resource])[resource], settings)
    config = {
        key: entry.value
        for key, entry in entries.items()
        if not entry.is_default and entry.value is not None
    }
    return TopicInfo(
        name=name,
        partitions=len(description.partitions),
        replication_factor=len(description.partitions[0].replicas) if description.partitions else 0,
        config=config,
        topic_id=str(description.topic_id),
    )


def topic_overrides(settings: Settings, name: str) -> dict[str, str]:
    """The configs set on the topic itself (not broker defaults): what a copy of it should get."""
    client = admin(settings)
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    entries = _result(client.describe_configs([resource])[resource], settings)
    return {
        key: entry.value
        for key, entry in entries.items()
        if _source(entry) == ConfigSource.DYNAMIC_TOPIC_CONFIG.value and entry.value is not None
    }


def max_message_bytes(settings: Settings, topic: str) -> int:
    """The largest record batch `topic` accepts: its max.message.bytes, broker default included."""
    client = admin(settings)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    entries = _result(client.describe_configs([resource])[resource], settings)
    return int(entries["max.message.bytes"].value)


def _source(entry: Any) -> int:
    return int(getattr(entry.source, "value", entry.source))


def topic_exists(settings: Settings, name: str) -> bool:
    try:
        metadata = admin(settings).list_topics(timeout=settings.connect_timeout_s)
    except KafkaException as exc:
        raise unreachable(settings, settings.connect_timeout_s, exc) from None
    return name in metadata.topics


def partition_count(settings: Settings, topic: str) -> int:
    metadata = admin(settings).list_topics(topic, timeout=settings.connect_timeout_s)
    entry = metadata.topics.get(topic)
    if entry is None or entry.error is not None:
        raise UsageError(
            f"topic {topic!r} does not exist on {settings.bootstrap_servers}: "
            "check the name, or create it first"
        )
    return len(entry.partitions)


def _list_offsets(
    settings: Settings, topic: str, spec: OffsetSpec, isolation: Isolation
) -> dict[int, int]:
    request = {TopicPartition(topic, p): spec for p in range(partition_count(settings, topic))}
    level = (
        IsolationLevel.READ_COMMITTED
        if isolation == "read_committed"
        else IsolationLevel.READ_UNCOMMITTED
    )
    client = admin(settings)
    futures = client.list_offsets(
        request, isolation_level=level, request_timeout=settings.connect_timeout_s
    )
    return {tp.partition: _result(future, settings).offset for tp, future in futures.items()}


def end_offsets(
    settings: Settings, topic: str, isolation: Isolation = "read_committed"
) -> dict[int, int]:
    """Per partition, the offset the next record will get (read_committed: the stable end)."""
    return _list_offsets(settings, topic, OffsetSpec.latest(), isolation)


def offsets_for_time(settings: Settings, topic: str, timestamp_ms: int) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is at or after `timestamp_ms`;
    -1 where no record is that recent."""
    return _list_offsets(
        settings, topic, OffsetSpec.for_timestamp(timestamp_ms), "read_uncommitted"
    )


def beginning_offsets(settings: Settings, topic: str) -> dict[int, int]:
    """Per partition, the first offset still stored (after retention and delete-records)."""
    return _list_offsets(settings, topic, OffsetSpec.earliest(), "read_uncommitted")


def delete_records(settings: Settings, topic: str, before: Mapping[int, int]) -> dict[int, int]:
    """Delete records below the given offset of each partition; returns the new low watermarks."""
    request = [TopicPartition(topic, partition, offset) for partition, offset in before.items()]
    client = admin(settings)
    futures = client.delete_records(
        request, request_timeout=settings.connect_timeout_s, operation_timeout=30
    )
    return {tp.partition: _result(future, settings).low_watermark for tp, future in futures.items()}


def consumer_groups(settings: Settings) -> list[str]:
    ensure_reachable(settings)
    client = admin(settings)
    result = _result(client.list_consumer_groups(), settings)
    return sorted(listing.group_id for listing in result.valid)


def _retrying(settings: Settings, call: Callable[[], T]) -> T:
    """`call()`, asked again while the group coordinator moves, loads or holds unstable offsets."""
    deadline = time.monotonic() + settings.connect_timeout_s * 3
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            busy = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in _COORDINATOR_BUSY
            )
            if not busy or time.monotonic() >= deadline:
                raise unreachable(settings, settings.connect_timeout_s, exc) from None
        time.sleep(0.2)


def group_offsets(settings: Settings, group: str) -> dict[tuple[str, int], int]:
    """The committed offsets of a consumer group: (topic, partition) -> offset."""
    client = admin(settings)
    futures = client.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])
    result = _result(futures[group], settings)
    return {(tp.topic, tp.partition): tp.offset for tp in result.topic_partitions if tp.offset >= 0}


def committed_offsets(
    settings: Settings, group: str, topic: str, isolation: Isolation = "read_committed"
) -> dict[int, tuple[int, str | None]]:
    """A group's committed (offset, metadata) per partition of `topic`; absent when none.

    read_committed asks for stable offsets (KIP-447): offsets an open transaction is committing
    are waited out, never half seen; read_uncommitted answers at once with the last stable ones.
    """
    partitions = partition_count(settings, topic)
    reader = consumer(settings, group, isolation_level=isolation)
    try:
        committed = _retrying(
            settings,
            lambda: reader.committed(
                [TopicPartition(topic, p) for p in range(partitions)],
                timeout=settings.connect_timeout_s,
            ),
        )
    finally:
        reader.close()
    return {tp.partition: (tp.offset, tp.metadata) for tp in committed if tp.offset >= 0}


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


def read_to_end(
    settings: Settings,
    topic: str,
    *,
    isolation: Isolation = "read_committed",
    timeout: float = 300.0,
) -> Iterator[Message]:
    """Every record of `topic` from its beginning up to the end offsets of the moment of the call.

    Under read_committed, records of aborted transactions are skipped by the client.
    """
    ends = end_offsets(settings, topic, isolation)
    starts = beginning_offsets(settings, topic)
    pending = {p for p, end in ends.items() if end > starts[p]}
    if not pending:
        return
    reader = consumer(settings, f"duality-reader-{uuid.uuid4().hex}", isolation_level=isolation)
    try:
        reader.assign([TopicPartition(topic, p, starts[p]) for p in pending])
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} did not reach offsets {ends} in {timeout:g}s")
            for message in reader.consume(num_messages=10_000, timeout=1.0):
                error = message.error()
                partition = message.partition()
                offset = message.offset()
                assert partition is not None and offset is not None
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(error)
                    # At EOF the position may sit past the end after transaction markers.
                    if offset >= ends[partition]:
                        pending.discard(partition)
                    continue
                if offset < ends[partition]:
                    yield message
                if offset + 1 >= ends[partition]:
                    pending.discard(partition)
    finally:
        reader.close()
