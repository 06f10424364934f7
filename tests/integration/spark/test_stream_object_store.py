"""Stream checkpoints on object storage (docs/streams.md "Checkpoints on object storage"): with
DUALITY_CHECKPOINT_ROOT an `s3a://` location on the real S3 server `duality up --object-store`
runs (SeaweedFS), the stream's driver SIGKILLed and restarted resumes from Spark's offsets and
state on S3; its checkpoint deleted from S3 while it is stopped, the restart rebuilds the state
from the changelog; a warm standby takes over from the S3 checkpoint when the active driver is
killed. Each time the changelog is exact against tests/truth.py's oracle; `stream rescale`
deletes a checkpoint on S3. A checkpoint root on S3 without an endpoint stops `stream start`
before any work, naming the setting."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duality import storage, workload
from duality.config import Settings
from duality.kafka import topics
from duality.stream import control, seeding
from tests.harness import (
    StreamProcess,
    assert_eventually,
    duality_json,
    make_pipeline,
    run_duality,
    unique_name,
)
from tests.integration.spark.test_standby import _beats, _consumed, _takes_over
from tests.integration.spark.test_stream import _verify

EVENTS, KEYS = 3_000, 300


@pytest.fixture(scope="module")
def s3_settings(settings: Settings, object_store_settings: Settings) -> Iterator[Settings]:
    """The session's broker, with stream checkpoints in a prefix of the S3 server's bucket of
    this module's own (removed after it)."""
    reached = {k: v for k, v in object_store_settings.as_env().items() if "_S3_" in k}
    root = f"s3a://{object_store_settings.s3_bucket}/{unique_name('streams')}/checkpoints"
    scoped = Settings.from_env({**settings.as_env(), **reached, "DUALITY_CHECKPOINT_ROOT": root})
    assert isinstance(scoped.checkpoint_root, storage.ObjectPath)
    yield scoped
    storage.remove_tree(scoped.checkpoint_root.parent)


def _on_s3(settings: Settings, spec) -> storage.ObjectPath:  # type: ignore[no-untyped-def]
    """The pipeline's checkpoint, holding Spark's offsets and commits and its state store's
    files on S3 (and nothing of it on local disk)."""
    checkpoint = seeding.checkpoint_dir(settings, spec)
    assert isinstance(checkpoint, storage.ObjectPath)
    names = {p.name for p in checkpoint.iterdir()}
    assert {"offsets", "commits", "state", "duality-engine.json"} <= names, names
    assert any((checkpoint / "state").rglob("*")), "no state store files on S3"
    return checkpoint


def test_a_killed_driver_resumes_from_its_checkpoint_on_s3(s3_settings: Settings, tmp_path: Path):
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(s3_settings, pipelines, "product_sales")
    topics.create_topic(s3_settings, spec.source.topic, 3)
    workload.produce(s3_settings, spec, events=EVENTS, keys=KEYS, bad_fraction=0.05, seed=81)
    stream = StreamProcess(
        s3_settings, spec, pipelines, tmp_path / "stream.log", max_offsets_per_trigger=500
    )
    try:
        stream.start()
        assert_eventually(lambda: stream.covered() >= EVENTS // 3, timeout=240)
        stream.kill()  # mid-way through the backlog, the whole group (JVM too)
        workload.produce(s3_settings, spec, events=1_000, keys=KEYS, bad_fraction=0.05, seed=82)
        stream.start()
        stream.wait_caught_up()
    finally:
        stream.stop()
    log = stream.log.read_text()
    # Seeded once, from an empty changelog; the restart resumed from the state on S3.
    assert re.findall(r"restored (\d+) keys", log) == ["0"], log[-3000:]
    assert "resuming from the checkpoint s3a://" in log, log[-3000:]
    checkpoint = _on_s3(s3_settings, spec)
    _verify(s3_settings, spec, EVENTS + 1_000)
    # `duality reset` of the stopped stream deletes its checkpoint on S3, as it does locally.
    done = duality_json(s3_settings.replace(pipelines=pipelines), "reset", spec.name)
    assert f"delete the checkpoint {checkpoint}" in done["steps"], done
    assert not checkpoint.exists() and not any(checkpoint.rglob("*"))


def test_a_checkpoint_deleted_from_s3_is_rebuilt_from_the_changelog(
    s3_settings: Settings, tmp_path: Path
):
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(s3_settings, pipelines, "product_sales")
    topics.create_topic(s3_settings, spec.source.topic, 3)
    workload.produce(s3_settings, spec, events=EVENTS, keys=KEYS, bad_fraction=0.05, seed=83)
    stream = StreamProcess(s3_settings, spec, pipelines, tmp_path / "stream.log")
    stream.run_until_caught_up()
    checkpoint = _on_s3(s3_settings, spec)
    storage.remove_tree(checkpoint)
    assert not checkpoint.exists()
    workload.produce(s3_settings, spec, events=1_000, keys=KEYS, bad_fraction=0.05, seed=84)
    stream.start()
    try:
        stream.wait_caught_up()
    finally:
        assert stream.stop() == 0, stream.tail()
    restores = re.findall(r"restored (\d+) keys", stream.log.read_text())
    # The second start's state came from the changelog, its seed files written to S3.
    assert len(restores) == 2 and int(restores[1]) > 0, restores
    assert any((checkpoint / "seed").rglob("*.parquet"))
    _on_s3(s3_settings, spec)
    _verify(s3_settings, spec, EVENTS + 1_000)
    # `stream rescale` of the stopped stream deletes its checkpoint on S3, whose marker gave the
    # number it had; the next start seeds the state in the new number, as above.
    before = seeding.checkpoint_partitions(checkpoint)
    assert before is not None
    wanted = s3_settings.replace(pipelines=pipelines, stream_partitions=before + 1)
    plan = duality_json(wanted, "stream", "rescale", spec.name)
    assert plan["checkpoint"] == str(checkpoint) and plan["partitions"] == before + 1, plan
    assert not checkpoint.exists()


def test_a_warm_standby_takes_over_from_the_checkpoint_on_s3(s3_settings: Settings, tmp_path: Path):
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(s3_settings, pipelines, "product_sales")
    scoped = s3_settings.replace(pipelines=pipelines)
    name = spec.name
    topics.create_topic(scoped, spec.source.topic, 3)
    workload.produce(scoped, spec, events=EVENTS, keys=KEYS, bad_fraction=0.05, seed=85)
    options = ("--max-offsets-per-trigger", "1000", "--trigger-seconds", "0.5")
    load_events = 4_000
    load = threading.Thread(
        target=workload.produce,
        args=(scoped, spec),
        kwargs={"events": load_events, "keys": KEYS, "bad_fraction": 0.05, "rate": 200, "seed": 86},
    )
    try:
        active = duality_json(scoped, "stream", "start", name, *options)["heartbeat"]
        assert active["state"] == "running"
        duality_json(scoped, "stream", "start", name, "--standby", *options)
        _, standby = assert_eventually(
            lambda: _beats(scoped, name),
            lambda beats: beats[1].get("state") == "standby",
            timeout=180,
            message="the standby never reported waiting",
        )
        assert standby["pid"] != active["pid"]
        load.start()
        assert_eventually(lambda: _consumed(scoped, spec) > EVENTS, timeout=120)
        os.kill(active["pid"], signal.SIGKILL)  # the active driver alone
        failover = _takes_over(scoped, name, standby["pid"], time.monotonic())
        print(f"failover from the S3 checkpoint: first progress {failover:.1f} s after the kill")
        load.join(timeout=120)
        assert not load.is_alive()
        assert_eventually(lambda: _consumed(scoped, spec), EVENTS + load_events, timeout=180)
    finally:
        if load.is_alive():
            load.join(timeout=120)
        stopped = run_duality(scoped, "stream", "stop", name)
        assert stopped.returncode == 0, stopped.stderr
    assert control.running_pid(scoped, spec) is None
    assert control.running_pid(scoped, spec, standby=True) is None
    standby_log = control.log_file(scoped, spec, standby=True).read_text()
    assert "warmed up in" in standby_log and "resuming from the checkpoint s3a://" in standby_log
    # The standby's warm-up ran on local scratch, which it removed: nothing of it on S3.
    assert [p.name for p in s3_settings.checkpoint_root.iterdir() if "warm-up" in p.name] == []
    _on_s3(scoped, spec)
    _verify(scoped, spec, EVENTS + load_events)


def test_a_checkpoint_root_on_s3_without_an_endpoint_stops_stream_start(
    settings: Settings, tmp_path: Path
):
    """Before any work: no stream's log, nothing started; the error names the setting."""
    mine = settings.replace(local_dir=tmp_path / "local")
    env = {k: v for k, v in mine.as_env().items() if "_S3_" not in k}
    env["DUALITY_CHECKPOINT_ROOT"] = "s3a://somewhere/checkpoints"
    done = run_duality(env, "stream", "start", "product_sales", "--json", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr[-2000:]
    error = json.loads(done.stdout)["error"]
    assert "DUALITY_CHECKPOINT_ROOT=s3a://somewhere/checkpoints" in error, error
    assert "DUALITY_S3_ENDPOINT is not set" in error, error
    assert not (mine.local_dir / "streams").exists()
