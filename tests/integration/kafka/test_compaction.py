"""The dev broker compacts within seconds: a compacted topic keeps the latest value per key;
the status topic keeps its last hour whole."""

from __future__ import annotations

from duality.config import Settings
from duality.kafka import client, topics
from duality.stream import heartbeat
from tests.harness import assert_eventually, read_topic


def test_compacted_topic_keeps_latest_value_per_key(settings: Settings, topic: str):
    topics.create_topic(settings, topic, 1, config=topics.FAST_COMPACTION)
    producer = client.producer(settings)
    keys = [f"k{i}" for i in range(50)]
    for version in range(5):
        for key in keys:
            producer.produce(topic, key=key, value=f"{key}=v{version}")
    producer.produce(topic, key="k0", value=None)  # tombstone: k0 goes away after compaction
    assert producer.flush(30) == 0
    assert len(read_topic(settings, topic)) == 251

    def compacted_view() -> dict[str, int]:
        # Compaction only cleans closed segments: each probe appends a record to a filler key so
        # that the segment holding the updates rolls once segment.ms has passed.
        producer.produce(topic, key="filler", value=b"x")
        producer.flush(10)
        counts: dict[str, int] = {}
        for _, _, key, _ in read_topic(settings, topic):
            counts[key.decode()] = counts.get(key.decode(), 0) + 1
        counts.pop("filler", None)
        return counts

    def compacted() -> dict[str, int] | None:
        counts = compacted_view()
        return counts if all(n == 1 for n in counts.values()) else None

    message = "the log cleaner did not compact the topic"
    counts = assert_eventually(compacted, timeout=90, interval=0.5, message=message)
    latest = {
        key.decode(): value.decode() if value is not None else None
        for _, _, key, value in read_topic(settings, topic)
        if key != b"filler"
    }
    assert latest.pop("k0", None) is None  # the tombstone or nothing at all
    assert latest == {key: f"{key}=v4" for key in keys[1:]}
    assert counts.keys() - {"k0"} == set(keys[1:])


def test_the_status_topic_keeps_the_last_hour_of_heartbeats(settings: Settings):
    """Created or found without it, `_duality-status` gets the compaction lag that keeps the
    pipelines page's hour of heartbeats whole."""
    kept = {"min.compaction.lag.ms": str(heartbeat.HISTORY_S * 1000)}
    heartbeat.ensure_topic(settings)
    assert topics.topic_overrides(settings, heartbeat.STATUS_TOPIC).items() >= kept.items()
    # As a topic created by an earlier version was: compacted with no lag.
    topics.set_topic_config(settings, heartbeat.STATUS_TOPIC, {"min.compaction.lag.ms": "0"})
    assert topics.topic_overrides(settings, heartbeat.STATUS_TOPIC)["min.compaction.lag.ms"] == "0"
    heartbeat.ensure_topic(settings)
    assert topics.topic_overrides(settings, heartbeat.STATUS_TOPIC).items() >= kept.items()
