"""A warm standby (`duality stream start --standby`): one driver is active at a time, however
many try; the active one SIGKILLed under load, the standby's first micro-batch commits soon
after, its supervisor's new driver becomes the standby, which takes over in turn when the whole
process group of the active one is killed; the changelog stays exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from duality import kafka, workload
from duality.config import Settings
from duality.stream import control, health, heartbeat
from tests.harness import (
    assert_eventually,
    duality_json,
    first_commit_after,
    make_pipeline,
    run_duality,
)
from tests.integration.spark.test_stream import _verify

EVENTS, LOAD_EVENTS, SECOND_LOAD_EVENTS, KEYS = 3_000, 10_000, 2_000, 200


def _beats(settings: Settings, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The active driver's latest heartbeat and the standby's."""
    beats = heartbeat.latest(settings)
    return beats.get(name, {}), beats.get(control.standby_key(name), {})


def test_a_warm_standby_takes_over_from_a_killed_driver(settings: Settings, tmp_path: Path):
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(settings, pipelines, "product_sales")
    scoped = settings.replace(pipelines=pipelines)
    name = spec.name
    kafka.create_topic(settings, spec.source.topic, 3)
    workload.produce(settings, spec, events=EVENTS, keys=KEYS, bad_fraction=0.05, seed=71)
    options = ("--max-offsets-per-trigger", "1000", "--trigger-seconds", "0.5")
    extra: subprocess.Popen[bytes] | None = None
    loads = [
        threading.Thread(
            target=workload.produce,
            args=(settings, spec),
            kwargs={
                "events": n,
                "keys": KEYS,
                "bad_fraction": 0.05,
                "rate": 200,
                "seed": seed,
            },
        )
        for n, seed in ((LOAD_EVENTS, 72), (SECOND_LOAD_EVENTS, 73))
    ]
    try:
        first = duality_json(scoped, "stream", "start", name, *options)
        assert first["heartbeat"]["state"] == "running"
        # What the supervisor DAG does when triggered with replicas 2: a standby with the
        # stream's options.
        look = health.supervise_once(scoped, spec, replicas=2)
        assert look.standby_action == "started"
        active, standby = assert_eventually(
            lambda: _beats(settings, name),
            lambda beats: beats[1].get("state") == "standby",
            timeout=120,
            message="the standby never reported waiting",
        )
        assert standby["pid"] != active["pid"]
        status = duality_json(scoped, "stream", "status", name)
        assert status["standby"]["pid"] == standby["pid"]

        # A third driver started by hand, outside both slots, also waits: never two actives.
        with open(tmp_path / "extra.log", "wb") as out:
            extra = subprocess.Popen(
                [sys.executable, "-m", "duality.stream.driver", name, *options],
                env={**os.environ, **scoped.as_env()},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        assert_eventually(
            lambda: "standby, waiting" in (tmp_path / "extra.log").read_text(), timeout=120
        )
        extra.send_signal(signal.SIGTERM)  # a standby asked to stop ends without running
        assert extra.wait(timeout=60) == 0
        assert _beats(settings, name)[0]["pid"] == active["pid"]
        assert "taking over" not in (tmp_path / "extra.log").read_text()

        loads[0].start()
        assert_eventually(
            lambda: (
                sum(
                    o
                    for o, _ in kafka.committed_offsets(
                        settings, spec.consumer_group, spec.source.topic
                    ).values()
                )
                > EVENTS
            ),
            timeout=120,
        )
        os.kill(active["pid"], signal.SIGKILL)  # the active driver alone; its supervisor lives
        killed = time.monotonic()
        failover = first_commit_after(settings, spec.changelog_topic, killed)
        print(f"failover: first commit {failover:.1f} s after the kill")
        taken, _ = _beats(settings, name)
        assert taken["pid"] == standby["pid"], "the standby did not take over"
        # The killed driver's supervisor started a new driver, which waits as the standby.
        assert_eventually(
            lambda: _beats(settings, name)[1],
            lambda beat: beat.get("state") == "standby" and beat.get("pid") != standby["pid"],
            timeout=120,
            message="no new standby after the failover",
        )
        # Now the whole process group of the active driver (its supervisor, the driver, its JVM
        # and so its local executors): the new standby takes over; no supervisor of that slot
        # is left to start another.
        replacement = _beats(settings, name)[1]["pid"]
        # Under load again: on a busy machine the first load may have ended by now, and with no
        # new record there would be no transaction to see.
        loads[1].start()
        os.killpg(os.getpgid(taken["pid"]), signal.SIGKILL)
        killed = time.monotonic()
        failover = first_commit_after(settings, spec.changelog_topic, killed)
        print(f"failover after a process group's kill: first commit {failover:.1f} s after it")
        assert _beats(settings, name)[0]["pid"] == replacement, "the new standby did not take over"
        for load in loads:
            load.join(timeout=120)
            assert not load.is_alive()
        produced = EVENTS + LOAD_EVENTS + SECOND_LOAD_EVENTS
        assert_eventually(
            lambda: sum(
                o
                for o, _ in kafka.committed_offsets(
                    settings, spec.consumer_group, spec.source.topic
                ).values()
            ),
            produced,
            timeout=180,
        )
    finally:
        if extra is not None and extra.poll() is None:
            extra.kill()
            extra.wait()
        stopped = run_duality(scoped, "stream", "stop", name)
        assert stopped.returncode == 0, stopped.stderr
    assert control.running_pid(scoped, spec) is None
    assert control.running_pid(scoped, spec, standby=True) is None
    _verify(settings, spec, produced)
