"""Records: producing one, a consumer's end-of-partition events, and reading a topic up to its
end offsets."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from duality.config import Settings
from duality.kafka import client, offsets


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


def end_of_partition(message: Message) -> bool:
    """Whether `message` is a consumer's end-of-partition event; one that carries any other
    error raises it."""
    error = message.error()
    if error is None:
        return False
    if error.code() == KafkaError._PARTITION_EOF:
        return True
    raise KafkaException(error)


def read_to_end(
    settings: Settings,
    topic: str,
    *,
    isolation: client.Isolation = "read_committed",
    last: int | None = None,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    timeout: float = 300.0,
) -> Iterator[Message]:
    """Every record of `topic` from its beginning (or only the `last` ones of each partition,
    or from the offsets `start`) up to the end offsets of the moment of the call (or `end`).

    Under read_committed, records of aborted transactions are skipped by the client.
    """
    ends = dict(end) if end is not None else offsets.end_offsets(settings, topic, isolation)
    starts = offsets.beginning_offsets(settings, topic)
    if start is not None:
        starts = {p: max(first, start.get(p, first)) for p, first in starts.items()}
    if last is not None:
        starts = {p: max(first, ends[p] - last) for p, first in starts.items()}
    pending = {p for p, stop in ends.items() if stop > starts.get(p, 0)}
    if not pending:
        return
    reader = client.consumer(
        settings, f"duality-reader-{uuid.uuid4().hex}", isolation_level=isolation
    )
    try:
        reader.assign([TopicPartition(topic, p, starts[p]) for p in pending])
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                doing = f"deliver topic {topic!r} up to its end offsets {ends}"
                raise client.timed_out(
                    settings, doing, timeout, f"partitions {sorted(pending)} behind"
                )
            for message in reader.consume(num_messages=10_000, timeout=1.0):
                eof = end_of_partition(message)
                partition = message.partition()
                offset = message.offset()
                assert partition is not None and offset is not None
                if eof:
                    # At EOF the position may sit past the end after transaction markers.
                    if offset >= ends[partition]:
                        pending.discard(partition)
                    continue
                if offset < ends[partition]:
                    yield message
                if offset + 1 >= ends[partition]:
                    pending.discard(partition)
    except KafkaException as exc:
        raise client.failure(settings, f"read topic {topic!r}", exc) from None
    finally:
        reader.close()
