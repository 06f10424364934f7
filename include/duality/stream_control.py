"""Starting, stopping and inspecting a pipeline's stream driver from the command line.

`start` runs `jobs/stream_aggregate.py` detached (pid file and log under `<local_dir>/streams`)
and waits until it reports `running`; the driver's own lock makes a second start fail rather
than run two streams on one checkpoint. `stop` is graceful (SIGTERM, the query finishes its
batch), with SIGKILL only after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from duality import kafka, status
from duality.config import Settings
from duality.errors import LocalStackError
from duality.spec import PipelineSpec

_STOP_GRACE_S = 90.0
_START_TIMEOUT_S = 180.0


def _folder(settings: Settings) -> Path:
    return settings.local_dir / "streams"


def pid_file(settings: Settings, spec: PipelineSpec) -> Path:
    return _folder(settings) / f"{spec.name}.pid"


def log_file(settings: Settings, spec: PipelineSpec) -> Path:
    return _folder(settings) / f"{spec.name}.log"


def running_pid(settings: Settings, spec: PipelineSpec) -> int | None:
    try:
        pid = int(pid_file(settings, spec).read_text().strip())
        cmdline = psutil.Process(pid).cmdline()
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    if any(part.endswith("stream_aggregate.py") for part in cmdline) and spec.name in cmdline:
        return pid
    return None


def job_path(settings: Settings) -> Path:
    path = settings.home / "jobs" / "stream_aggregate.py"
    if not path.is_file():
        raise LocalStackError(f"{path} is missing: set DUALITY_HOME to the duality checkout")
    return path


def start(settings: Settings, spec: PipelineSpec, *, wait: bool = True) -> dict[str, Any]:
    """Start the stream detached unless it runs; wait until it reports `running`."""
    pid = running_pid(settings, spec)
    if pid is not None:
        return {**describe(settings, spec), "already_running": True}
    kafka.ensure_reachable(settings)
    if not kafka.topic_exists(settings, spec.source.topic):
        raise LocalStackError(
            f"source topic {spec.source.topic!r} of pipeline {spec.name} does not exist on "
            f"{settings.bootstrap_servers}: create it, or produce to it with "
            f"`duality produce {spec.name}`"
        )
    _folder(settings).mkdir(parents=True, exist_ok=True)
    log = log_file(settings, spec)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, str(job_path(settings)), spec.name],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "DUALITY_HOME": str(settings.home)},
        )
    pid_file(settings, spec).write_text(f"{process.pid}\n")
    if wait:
        _wait_running(settings, spec, process, log)
    return {**describe(settings, spec), "already_running": False}


def _wait_running(
    settings: Settings, spec: PipelineSpec, process: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise LocalStackError(
                f"the stream of {spec.name} exited with code {process.returncode} while "
                f"starting; last lines of {log}:\n{tail}"
            )
        beat = status.latest(settings).get(spec.name, {})
        if process.pid in (beat.get("ppid"), beat.get("pid")) and beat.get("state") == "running":
            return
        time.sleep(1)
    raise LocalStackError(
        f"the stream of {spec.name} did not report running within {_START_TIMEOUT_S:g}s; see {log}"
    )


def stop(settings: Settings, spec: PipelineSpec) -> dict[str, Any]:
    pid = running_pid(settings, spec)
    if pid is None:
        pid_file(settings, spec).unlink(missing_ok=True)
        return {"pipeline": spec.name, "state": "stopped", "was_running": False}
    process = psutil.Process(pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(_STOP_GRACE_S)
    except psutil.TimeoutExpired:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        process.wait(10)
    pid_file(settings, spec).unlink(missing_ok=True)
    return {"pipeline": spec.name, "state": "stopped", "was_running": True, "pid": pid}


def describe(settings: Settings, spec: PipelineSpec) -> dict[str, Any]:
    """Process, last heartbeat and lag of one pipeline's stream."""
    pid = running_pid(settings, spec)
    result: dict[str, Any] = {
        "pipeline": spec.name,
        "state": "running" if pid else "stopped",
        "pid": pid,
        "log": str(log_file(settings, spec)),
    }
    kafka.ensure_reachable(settings)
    beat = status.latest(settings).get(spec.name)
    if beat is not None:
        result["heartbeat"] = beat
        result["heartbeat_age_s"] = round(time.time() - beat["last_progress_ms"] / 1000, 1)
    if kafka.topic_exists(settings, spec.source.topic):
        ends = kafka.end_offsets(settings, spec.source.topic)
        committed = kafka.committed_offsets(settings, spec.consumer_group, spec.source.topic)
        result["lag"] = sum(max(0, end - committed.get(p, (0, None))[0]) for p, end in ends.items())
    return result
