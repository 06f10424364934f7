"""A consumer group whose committed offsets carry another client's metadata (Kafka Streams
commits binary metadata, Base64 encoded): `duality skew --group` and `duality lag --group`
answer with its offsets, and never decode the metadata."""

from __future__ import annotations

import base64

from confluent_kafka import Consumer, TopicPartition

from duality.config import Settings
from duality.kafka import client, offsets, records, topics
from tests.harness import duality_json

PARTITIONS = 12


def test_skew_and_lag_of_a_group_with_binary_metadata(settings: Settings, topic: str):
    topics.create_topic(settings, topic, PARTITIONS)
    producer = client.producer(settings)
    for n in range(2400):
        records.send(producer, topic, key=f"k{n}", value=b"v")
    assert producer.flush(30) == 0
    group = f"{topic}-streams-app"
    # As Kafka Streams does: binary (a magic byte, a timestamp, processor metadata) in Base64.
    # confluent-kafka 2.16 reads it back past its end, up to the next NUL byte, and raised
    # UnicodeDecodeError when the bytes that follow were not UTF-8; lengths of 16n + 8 bytes
    # fill a heap allocation exactly, which made that likely. The commands run first, each in a
    # fresh process as users run them.
    committer = Consumer({**settings.kafka_client_config(), "group.id": group})
    streams_offsets = [
        TopicPartition(
            topic, p, 10 * p, base64.b64encode(bytes([2, 0xFF, 0xFE]) * (4 * p + 6)).decode()
        )
        for p in range(PARTITIONS)
    ]
    try:
        committer.commit(offsets=streams_offsets, asynchronous=False)
    finally:
        committer.close()

    skew = duality_json(settings, "skew", topic, "--group", group)
    loads = {load["partition"]: load for load in skew["partitions"]}
    ends = offsets.end_offsets(settings, topic)
    assert {p: load["lag"] for p, load in loads.items()} == {
        p: max(0, ends[p] - 10 * p) for p in range(PARTITIONS)
    }

    rows = duality_json(settings, "lag", "--group", group)["lag"]
    assert {(r["partition"], r["committed"]) for r in rows} == {
        (p, 10 * p) for p in range(PARTITIONS)
    }

    committed = offsets.committed_offsets(settings, group, topic)
    assert {p: offset for p, (offset, _) in committed.items()} == {
        p: 10 * p for p in range(PARTITIONS)
    }
    for p, (_, metadata) in committed.items():
        assert metadata is not None and metadata.startswith(streams_offsets[p].metadata.encode())
