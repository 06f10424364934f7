"""A broker of a three-node cluster SIGKILLed for a minute under a stream, a repartition and a
snapshot at once, so the minute without it is paid once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from duality import repartition, workload
from duality.config import Settings
from duality.kafka import client, offsets, topics
from duality.local.kraft import LocalKafkaCluster
from duality.snapshot import build, delta_log
from duality.spec import PipelineSpec
from duality.stream import control, health, heartbeat
from duality.stream.topics import changelog_config
from tests.harness import ROOT, SteadyLoad, assert_eventually, duality_json, make_pipeline
from tests.integration.snapshot.test_snapshot import _table, _truth
from tests.integration.spark.test_repartition import _assert_exact_copy
from tests.integration.spark.test_stream import _verify

DOWN_S = 60  # the fault: the broker comes back a minute after it was killed
KEYS = 500
RATE = 150  # events per second of the load, produced until the broker is back
COPIED = 30_000  # records of the repartition's source, copied at 150/s per partition


class _Snapshot(threading.Thread):
    """One snapshot run in this process (its Spark session is the tests' one)."""

    def __init__(self, settings: Settings, spec: PipelineSpec, spark):  # type: ignore[no-untyped-def]
        super().__init__(daemon=True)
        self.settings, self.spec, self.spark = settings, spec, spark
        self.said: list[str] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            build.build(
                self.settings, self.spec, "auto", spark=self.spark, progress=self.said.append
            )
        except BaseException as error:  # kept for the test to judge
            self.error = error
        finally:
            self.done.set()


def _leaders(settings: Settings, topic: str) -> dict[int, int]:
    metadata = client.admin(settings).list_topics(topic, timeout=10)
    return {p: entry.leader for p, entry in metadata.topics[topic].partitions.items()}


def _job(settings: Settings, log: Path, job: str, *args: str) -> subprocess.Popen[bytes]:
    """A job of `jobs/` started as the DAGs start it: its result on stdout, its log apart."""
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "jobs" / job), *args],
            env={**os.environ, **settings.as_env()},
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )


def _version(spark, settings: Settings, spec: PipelineSpec, version: int) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    return _table(delta_log.load(spark, spec.snapshot_path(settings), version), spec)


def _assert_snapshot_exact(spark, settings: Settings, spec: PipelineSpec, version: int) -> None:  # type: ignore[no-untyped-def]
    versions = delta_log.history(spec.snapshot_path(settings))
    coverage, _ = delta_log.version_coverage(versions, version)
    assert coverage is not None, f"version {version} records no coverage"
    wanted = _truth(settings, spec, coverage.changelog)
    actual = _version(spark, settings, spec, version)
    assert actual.keys() == wanted.keys()
    for key, row in wanted.items():
        for column, value in row.items():
            assert actual[key][column] == pytest.approx(value), (key, column)


def test_leader_killed_mid_stream_repartition_and_snapshot(
    cluster: LocalKafkaCluster, spark, tmp_path: Path
):  # type: ignore[no-untyped-def]
    settings = cluster.settings.replace(
        pipelines=tmp_path / "pipelines",
        local_dir=tmp_path / "local",
        checkpoint_root=tmp_path / "checkpoints",
        warehouse=tmp_path / "warehouse",
        reports=tmp_path / "reports",
    )
    spec = make_pipeline(settings, settings.pipelines, "product_sales")
    group = spec.consumer_group
    topics.create_topic(settings, spec.source.topic, 3)
    # The stream's changelog, kept uncompacted for the test: the truth of a snapshot version is
    # the changelog below the version's offsets, which compaction would thin out meanwhile.
    config = {**changelog_config(spec), "min.compaction.lag.ms": "3600000"}
    topics.create_topic(settings, spec.changelog_topic, 3, config=config)
    workload.produce(settings, spec, events=3_000, keys=KEYS, bad_fraction=0.05, seed=61)
    control.start(settings, spec, wait=False, job_args=["--max-offsets-per-trigger", "2000"])

    # The repartition's source, for a copy throttled to be still running when the broker dies.
    source, target = f"{spec.name}-hot", f"{spec.name}-hot-5p"
    topics.create_topic(settings, source, 3)
    hot = make_pipeline(settings, tmp_path / "hot", "product_sales", topic=source)
    workload.produce(settings, hot, events=COPIED, keys=KEYS, bad_fraction=0, seed=62)
    plan = repartition.plan(settings, source, target, 5)

    def covered(topic: str, by: str) -> int:
        return sum(o for o, _ in offsets.committed_offsets(settings, by, topic).values())

    load = SteadyLoad(settings, spec, rate=RATE, keys=KEYS, seed=63)
    copy_log = tmp_path / "repartition.log"
    copier = None
    merging = _Snapshot(settings, spec, spark)
    try:
        assert_eventually(
            lambda: covered(spec.source.topic, group) >= 3_000,
            timeout=180,
            message="the stream never caught up with the first records",
        )
        before = build.build(settings, spec, "auto", spark=spark).version
        moves = ("--to", target, "--partitions", "5", "--throttle", "150")
        copier = _job(settings, copy_log, "repartition.py", source, *moves)
        load.start()
        assert_eventually(
            lambda: covered(spec.source.topic, group) >= 3_500,
            timeout=120,
            message="the stream did not take in the load",
        )
        assert_eventually(
            lambda: copier.poll() is None and covered(source, plan.group) >= 3_000,
            timeout=120,
            message=f"the copy never got going; see {copy_log}",
        )
        # Changes since the first version: this run merges them when the broker dies.
        merging.start()
        victim = _leaders(settings, heartbeat.STATUS_TOPIC)[0]
        for topic in (spec.source.topic, spec.changelog_topic, source, target):
            assert victim in _leaders(settings, topic).values(), (topic, victim)
        node = cluster.node(victim)
        assert_eventually(
            lambda: merging.done.is_set() or any("merging" in m for m in merging.said),
            timeout=120,
            message=f"the snapshot never started merging: {merging.said}",
        )
        merged_before_the_kill = merging.done.is_set()
        copy_ended = copier.poll()
        os.kill(node.pid() or 0, signal.SIGKILL)
        killed_at = time.monotonic()
        assert not merged_before_the_kill, f"the snapshot ended before the kill: {merging.said}"
        assert copy_ended is None, f"the copy ended before the kill; see {copy_log}"

        # While it is down, the commands and the supervisor answer with what they see.
        seen = duality_json(settings, "stream", "status", spec.name, timeout=60)
        assert seen["state"] == "running" and seen["heartbeat"]["state"] == "running", seen
        lags = duality_json(settings, "lag", "--group", group, timeout=60)["lag"]
        assert {row["topic"] for row in lags} == {spec.source.topic}, lags
        look = health.supervise_once(settings, spec)
        assert look.health == "healthy" and look.action == "none", look
        while time.monotonic() < killed_at + DOWN_S:
            assert control.running_pid(settings, spec), "the stream gave up"
            assert copier.poll() in (None, 0), copy_log.read_text()[-3000:]
            time.sleep(1)
        node.start()

        load.stop()
        # The stream recovered by itself and caught up with the load.
        assert_eventually(
            lambda: covered(spec.source.topic, group) >= 3_000 + load.produced,
            timeout=300,
            message="the stream did not catch up after the broker came back",
        )
    finally:
        load.stopping.set()
        control.stop(settings, spec)
        if copier is not None:
            copier.wait(timeout=300)
        merging.done.wait(timeout=300)
    _verify(settings, spec, 3_000 + load.produced)

    # The repartition finished by itself, every record exactly once.
    assert copier.returncode == 0, copy_log.read_text()[-3000:]
    assert copier.stdout is not None and json.loads(copier.stdout.read())["copied"] == COPIED
    _assert_exact_copy(settings, source, target)

    # The snapshot run committed a correct version or left the previous one; the next is exact.
    latest = delta_log.latest_data_version(delta_log.history(spec.snapshot_path(settings)))
    if merging.error is None:
        assert latest > before, merging.said
    else:
        assert latest == before, merging.error
    _assert_snapshot_exact(spark, settings, spec, latest)
    # The load went on after the merging run read its offsets, so the changelog has moved since.
    version = build.build(settings, spec, "auto", spark=spark).version
    assert version is not None and version > latest, (version, latest, merging.said)
    _assert_snapshot_exact(spark, settings, spec, version)
    assert _version(spark, settings, spec, version).keys() == _truth(settings, spec).keys()
