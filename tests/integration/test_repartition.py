"""Repartitioning against the real broker and Spark: every record exactly once, in the right place.

The checks read the target back with read_committed and compare it with the source read
independently: lineage headers, keys, values, headers and timestamps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from duality import changelog, cli, kafka, repartition, skew, workload
from duality.config import Settings
from tests import truth
from tests.harness import (
    ROOT,
    StreamProcess,
    assert_eventually,
    make_pipeline,
    read_topic,
    unique_name,
)

EVENTS, KEYS = 30_000, 1_000


def _records(settings: Settings, topic: str) -> list[dict]:
    rows = []
    for m in kafka.read_to_end(settings, topic):
        headers = list(m.headers() or [])
        rows.append(
            {
                "partition": m.partition(),
                "offset": m.offset(),
                "key": m.key(),
                "value": m.value(),
                "timestamp": m.timestamp()[1],
                "headers": headers,
            }
        )
    return rows


def _lineage(record: dict) -> tuple[int, int]:
    headers = dict(record["headers"])
    return int(headers["duality.source.partition"]), int(headers["duality.source.offset"])


def _assert_exact_copy(settings: Settings, source: str, target: str) -> list[dict]:
    """Target = source as multisets of (source partition, offset), contents and order kept."""
    originals = {(r["partition"], r["offset"]): r for r in _records(settings, source)}
    copies = _records(settings, target)
    lineage = Counter(_lineage(r) for r in copies)
    assert max(lineage.values(), default=1) == 1, "a source record was copied twice"
    assert set(lineage) == set(originals), (
        f"missing {len(set(originals) - set(lineage))}, extra {len(set(lineage) - set(originals))}"
    )
    for copy in copies:
        original = originals[_lineage(copy)]
        assert copy["key"] == original["key"] and copy["value"] == original["value"]
        assert copy["timestamp"] == original["timestamp"]
        assert copy["headers"][:-2] == original["headers"]
    # Per (target partition, source partition), the copies come in source offset order.
    seen: dict[tuple[int, int], int] = {}
    for copy in copies:
        source_partition, offset = _lineage(copy)
        where = (copy["partition"], source_partition)
        assert offset > seen.get(where, -1), f"order broken in {where}"
        seen[where] = offset
    return copies


def _produce(
    settings: Settings, folder: Path, topic: str, events: int, zipf: float, seed: int
) -> None:
    spec = make_pipeline(settings, folder, "product_sales", topic=topic)
    workload.produce(settings, spec, events=events, keys=KEYS, zipf=zipf, bad_fraction=0, seed=seed)


def test_key_hash_copy_is_exact_and_agrees_with_java(
    settings: Settings, spark, topic: str, tmp_path: Path
):
    source, target, reference = topic, f"{topic}-6p", f"{topic}-java"
    kafka.create_topic(settings, source, 4, config={"retention.ms": "86400000"})
    _produce(settings, tmp_path, source, EVENTS, 1.1, seed=31)
    # Records with headers and null keys too.
    producer = kafka.producer(settings)
    for i in range(200):
        kafka.send(producer, source, None, f"null-key-{i}", [("trace", str(i).encode())])
        kafka.send(producer, source, f"h-{i % 7}", f"v{i}", [("trace", str(i).encode())])
    assert producer.flush(30) == 0

    plan = repartition.plan(settings, source, target, 6)
    report = repartition.run(settings, plan)
    assert report.copied == EVENTS + 400
    assert kafka.partition_count(settings, target) == 6
    assert kafka.topic_overrides(settings, target)["retention.ms"] == "86400000"
    copies = _assert_exact_copy(settings, source, target)
    assert sum(report.target_partitions.values()) == len(copies)

    # Where Spark's Kafka sink (the Java producer's default partitioner) puts each key.
    keys = sorted({c["key"] for c in copies if c["key"] is not None})
    frame = spark.createDataFrame([(k, b"x") for k in keys], "key binary, value binary")
    kafka.create_topic(settings, reference, 6)
    options = settings.spark_kafka_options()
    frame.write.format("kafka").options(**options).option("topic", reference).save()
    java = {key: partition for partition, _, key, _ in read_topic(settings, reference)}
    assert len(java) == len(keys)
    for copy in copies:
        if copy["key"] is None:
            assert copy["partition"] == _lineage(copy)[0] % 6
        else:
            assert copy["partition"] == java[copy["key"]], copy["key"]

    # A later run copies only what arrived since.
    assert repartition.run(settings, plan).copied == 0
    _produce(settings, tmp_path, source, 1_000, 1.1, seed=32)
    again = repartition.run(settings, plan)
    assert again.copied == 1_000
    _assert_exact_copy(settings, source, target)
