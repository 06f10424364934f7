"""A broker of three SIGKILLed under a stream on two Spark workers, once for each Kafka role the
stream depends on: its source's partition leader, its changelog's, its transaction coordinator
and the election's group coordinator. Each time the stream must be exact again, the broker
still down, within the stall's bound of the kill; the time each took is printed (the issue's
30 s is met in most runs, not all: docs/operations.md#losing-a-broker)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duality.config import Settings
from duality.kafka import client, offsets, topics
from duality.local.kraft import LocalKafkaCluster
from duality.local.spark_cluster import LocalSparkCluster
from duality.spec import PipelineSpec
from duality.stream.election import DRIVERS_TOPIC
from tests.harness import (
    SteadyLoad,
    StreamProcess,
    assert_eventually,
    duality_json,
    make_pipeline,
    read_topic,
    settled,
)
from tests.integration.spark.test_stream import _verify_records

KEYS = 500
RATE = 200  # events a second, while the load runs
LOADED_AFTER_KILL_S = 5  # the load goes on this long into the outage, then pauses
# Exact again this long after the kill, whichever role the killed broker played. The issue's
# 30 s held in most runs on 2026-11-28, not in all: a micro-batch has hung in Spark's Kafka
# source after the loss of the changelog's leader and of the source's leader, until the driver's
# stall handling replaced the driver (decision 33, "Not solved yet"; librdkafka's hang in the
# transaction's offsets is cut after 5 s since). Every role is held to what that handling
# bounds: 60 s without a batch (`stall_timeout`), at most 60 s for the query to stop, then a new
# driver and its first batch. The test runs beside the others: its 30 s is `make bench`'s.
EXACT_WITHIN_S = 210
ROLES = ("source", "changelog", "transactions", "election")


def _java_hash(text: str) -> int:
    """Java's String.hashCode, which places a transactional id on its coordinator's partition."""
    value = 0
    for char in text:
        value = (31 * value + ord(char)) & 0xFFFFFFFF
    return value


def _leaders(settings: Settings, topic: str) -> dict[int, int]:
    metadata = client.admin(settings).list_topics(topic, timeout=10)
    return {p: entry.leader for p, entry in metadata.topics[topic].partitions.items()}


def _holder(settings: Settings, spec: PipelineSpec, role: str) -> int:
    """The broker that plays `role` for the stream of `spec` now."""
    if role == "source":
        return _leaders(settings, spec.source.topic)[0]
    if role == "changelog":
        return _leaders(settings, spec.changelog_topic)[0]
    if role == "transactions":
        # Kafka places a transactional id on the partition of __transaction_state that its
        # hash (made positive) modulo the topic's partition count names.
        states = _leaders(settings, "__transaction_state")
        return states[(_java_hash(f"duality-{spec.name}") & 0x7FFFFFFF) % len(states)]
    group = f"duality-{spec.name}-active"
    described = client.admin(settings).describe_consumer_groups([group])[group].result(timeout=10)
    return int(described.coordinator.id)


def _fully_replicated(settings: Settings, topics: list[str]) -> bool:
    """Every partition of `topics` has all of its replicas in sync (a broker that came back has
    caught up), so that losing another keeps min.insync.replicas."""
    metadata = client.admin(settings).list_topics(timeout=10)
    return all(
        len(entry.isrs) == len(entry.replicas)
        for topic in topics
        for entry in metadata.topics[topic].partitions.values()
    )


def _covered(settings: Settings, spec: PipelineSpec) -> bool:
    """Whether the stream's committed offsets cover its source and the transaction that
    committed them has reached its changelog and dead letters (harness.settled): with the load
    paused, they then hold all they ever will of these records."""
    ends = offsets.end_offsets(settings, spec.source.topic)
    committed = offsets.committed_offsets(settings, spec.consumer_group, spec.source.topic)
    return all(committed.get(p, (0, None))[0] >= end for p, end in ends.items()) and settled(
        settings, spec.changelog_topic, spec.dlq_topic
    )


def _assert_exact(settings: Settings, spec: PipelineSpec) -> None:
    """The changelog (read_committed) and the dead letters equal the truth computed from the
    source records read back."""
    _verify_records(settings, spec, read_topic(settings, spec.source.topic))


@pytest.fixture(scope="module")
def workers(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark standalone master and two workers: the production topology's executors."""
    spark = LocalSparkCluster(settings, workers=2, root=tmp_path_factory.mktemp("spark"))
    try:
        spark.start()
        yield spark.master_url
    finally:
        spark.stop()


@pytest.mark.timeout(900)
def test_stream_rides_through_the_loss_of_each_broker_role(
    cluster: LocalKafkaCluster, workers: str, tmp_path: Path
):
    settings = cluster.settings.replace(
        pipelines=tmp_path / "pipelines",
        local_dir=tmp_path / "local",
        checkpoint_root=tmp_path / "checkpoints",
        warehouse=tmp_path / "warehouse",
        reports=tmp_path / "reports",
        spark_master=workers,
    )
    spec = make_pipeline(settings, settings.pipelines, "product_sales")
    topics.create_topic(settings, spec.source.topic, 3)
    internal = [
        spec.source.topic,
        spec.changelog_topic,
        spec.dlq_topic,
        "__transaction_state",
        "__consumer_offsets",
        DRIVERS_TOPIC,
    ]
    # A micro-batch that hangs longer than a minute is ended by a new driver (decision 33).
    stream = StreamProcess(
        settings, spec, settings.pipelines, tmp_path / "stream.log", stall_timeout=60
    )
    load = SteadyLoad(settings, spec, rate=RATE, keys=KEYS, seed=460)
    load.start()
    stream.start()
    recovered: dict[str, float] = {}
    try:
        for role in ROLES:
            # The stream under load before the kill: it has covered records produced since,
            # twice over (the first batch after a start is the cold one, its executors' first
            # fetches and code generation, 15-16 s here: the kill lands in a running stream).
            load.resume()
            for _ in range(2):
                before = stream.covered()
                assert_eventually(
                    lambda before=before: stream.covered() >= before + RATE,
                    timeout=240,
                    message=f"the stream took in no load before losing its {role}; {stream.log}",
                )
            node = cluster.node(_holder(settings, spec, role))
            os.kill(node.pid() or 0, signal.SIGKILL)
            killed = time.monotonic()
            # Records keep coming into the outage, then stop, so that there is a truth to meet.
            while time.monotonic() < killed + LOADED_AFTER_KILL_S:
                stream.check()
                time.sleep(0.5)
            load.pause()
            within = EXACT_WITHIN_S
            assert_eventually(
                lambda: _covered(settings, spec),
                timeout=max(1.0, killed + within - time.monotonic()),
                message=f"the source not covered within {within}s of losing the "
                f"{role}'s broker {node.node_id}; {stream.log}:\n{stream.tail(40)}",
            )
            recovered[role] = round(time.monotonic() - killed, 1)
            _assert_exact(settings, spec)
            assert node.pid() is None, "the broker came back before the check"
            node.start()
            assert_eventually(
                lambda: _fully_replicated(settings, internal),
                timeout=120,
                message=f"broker {node.node_id} did not catch up after its restart",
            )
        # Back to three brokers and more load: still exact, and status says it is caught up.
        load.resume()
        before = stream.covered()
        assert_eventually(lambda: stream.covered() >= before + RATE, timeout=120)
        load.pause()
        assert_eventually(lambda: _covered(settings, spec), timeout=120)
        _assert_exact(settings, spec)
        status = duality_json(settings, "stream", "status", spec.name, timeout=60)
        assert status["lag"] == 0 and status["heartbeat"]["state"] == "running", status
    finally:
        stream.stop()
        load.stop()
        # The package's other tests share the cluster: a broker a failed round left down is
        # started again.
        for node in cluster.nodes:
            if node.pid() is None:
                node.start()
    print(f"exact again after the kill, by role (s): {recovered}")
