"""`duality produce`, `stream start|status|stop` and `reset` as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from duality.config import Settings
from duality.kafka import offsets, topics
from duality.stream import control
from tests.harness import assert_eventually, duality_json, make_pipeline


def _drivers(name: str) -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if "duality.stream" in (p.info["cmdline"] or []) and name in (p.info["cmdline"] or [])
    ]


def _running(name: str) -> list[psutil.Process]:
    """The processes of pipeline `name`'s stream: its supervisor and its driver."""
    return [p for p in psutil.process_iter(["cmdline"]) if name in (p.info["cmdline"] or [])]


def test_stream_lifecycle_and_reset(settings: Settings, tmp_path: Path):
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(settings, pipelines, "product_sales")
    scoped = settings.replace(pipelines=pipelines)
    produce = ("--events", "3000", "--keys", "100", "--bad-fraction", "0.05", "--seed", "5")
    produced = duality_json(scoped, "produce", spec.name, *produce)
    assert produced["produced"] == 3000 and sum(produced["bad"].values()) > 0

    try:
        first = duality_json(scoped, "stream", "start", spec.name)
        second = duality_json(scoped, "stream", "start", spec.name)
        assert first["already_running"] is False and second["already_running"] is True
        assert first["pid"] == second["pid"]
        assert len(_drivers(spec.name)) == 1

        status = duality_json(scoped, "stream", "status", spec.name)
        assert status["state"] == "running"
        assert status["heartbeat"]["ppid"] == first["pid"]  # the driver under the supervisor
    finally:
        stopped = duality_json(scoped, "stream", "stop", spec.name)
    assert stopped["was_running"] is True
    assert _drivers(spec.name) == []
    assert duality_json(scoped, "stream", "status", spec.name)["state"] == "stopped"

    plan = duality_json(scoped, "reset", spec.name, "--dry-run")
    assert plan["dry_run"] is True and plan["steps"]
    records_before = plan["changelog_records"]
    again = duality_json(scoped, "reset", spec.name, "--dry-run")
    assert again["changelog_records"] == records_before  # a dry run changes nothing

    done = duality_json(scoped, "reset", spec.name)
    assert done["dry_run"] is False
    committed = offsets.committed_offsets(settings, spec.consumer_group, spec.source.topic)
    assert {p: offset for p, (offset, _) in committed.items()} == {
        p: 0 for p in range(topics.partition_count(settings, spec.source.topic))
    }
    assert not (settings.checkpoint_root / spec.name).exists()
    assert (
        sum(offsets.end_offsets(settings, spec.changelog_topic, "read_uncommitted").values()) == 0
    )


def test_down_stops_a_stream_started_in_the_foreground(settings: Settings, tmp_path: Path):
    """`duality stream start --foreground` writes its own pid file, and `duality down`'s stream
    part finds it there and stops it gracefully, driver and all."""
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(settings, pipelines, "product_sales")
    topics.create_topic(settings, spec.source.topic, 2)
    with open(tmp_path / "stream.log", "wb") as log:
        # In the test's own process group, as no shell would run it: stopping it must not
        # take that group down.
        stream = subprocess.Popen(
            [sys.executable, "-m", "duality.cli", "stream", "start", spec.name, "--foreground"],
            env={**os.environ, **settings.replace(pipelines=pipelines).as_env()},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        assert_eventually(
            lambda: (control.describe(settings, spec).heartbeat or {}).get("state") == "running",
            timeout=180,
            message="the stream did not report running",
        )
        state = control.describe(settings, spec)
        assert state.state == "running" and state.pid == stream.pid
        assert state.heartbeat["ppid"] == stream.pid  # type: ignore[index]

        stopped = control.stop_all(settings)
        assert (spec.name, stream.pid) in [(s.pipeline, s.pid) for s in stopped], stopped
        assert stream.wait(30) == 0  # SIGTERM: the driver finished its batch and exited
        assert not control.pid_file(settings, spec).exists()
        assert_eventually(
            lambda: _running(spec.name) == [], timeout=30, message="the driver outlived it"
        )
    finally:
        if stream.poll() is None:
            stream.kill()
            stream.wait(30)
