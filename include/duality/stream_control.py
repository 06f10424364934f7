"""Starting, stopping, inspecting and supervising a pipeline's stream driver.

`start` runs `jobs/stream_aggregate.py` detached (pid file and log under `<local_dir>/streams`)
and waits until it reports `running`; the driver's own lock makes a second start fail rather
than run two streams on one checkpoint. `stop` is graceful (SIGTERM, the query finishes its
batch), with SIGKILL only after a grace period.

`supervise_once` is one look of the supervisor (the Airflow DAG runs it every minute): it starts
a stream that should run and does not, restarts one that is stalled, with backoff, and never
starts a second copy. What the user asked for (running or stopped) is kept in a small state
file beside the pid file, so a stream stopped on purpose stays stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import psutil

from duality import kafka, status
from duality.config import Settings
from duality.errors import LocalStackError, UsageError
from duality.process import live_pid, start_daemon
from duality.spec import PipelineSpec

_STOP_GRACE_S = 90.0
_START_TIMEOUT_S = 180.0
# A running stream beats on every batch and while idle; silence this long, with records
# waiting, means stalled.
STALL_AFTER_S = 300.0
# Restarts within this window count towards the backoff: 0, 1, 2, 4 ... minutes, at most 15.
_BACKOFF_WINDOW_S = 3600.0
_BACKOFF_BASE_S = 60.0
_BACKOFF_MAX_S = 900.0

Action = Literal["ensure", "start", "stop", "restart"]
ACTIONS: tuple[str, ...] = ("ensure", "start", "stop", "restart")


def _folder(settings: Settings) -> Path:
    return settings.local_dir / "streams"


def pid_file(settings: Settings, spec: PipelineSpec) -> Path:
    return _folder(settings) / f"{spec.name}.pid"


def log_file(settings: Settings, spec: PipelineSpec) -> Path:
    return _folder(settings) / f"{spec.name}.log"


def _stream_pid(path: Path, name: str) -> int | None:
    return live_pid(
        path,
        lambda cmdline: any(p.endswith("stream_aggregate.py") for p in cmdline) and name in cmdline,
    )


def running_pid(settings: Settings, spec: PipelineSpec) -> int | None:
    return _stream_pid(pid_file(settings, spec), spec.name)


def _terminate(pid: int) -> None:
    """SIGTERM (the running batch commits first), then SIGKILL of the group after the grace."""
    process = psutil.Process(pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(_STOP_GRACE_S)
    except psutil.TimeoutExpired:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        process.wait(10)


def job_path(settings: Settings) -> Path:
    path = settings.home / "jobs" / "stream_aggregate.py"
    if not path.is_file():
        raise LocalStackError(f"{path} is missing: set DUALITY_HOME to the duality checkout")
    return path


def start(
    settings: Settings, spec: PipelineSpec, *, wait: bool = True, job_args: Sequence[str] = ()
) -> dict[str, Any]:
    """Start the stream detached unless it runs (`job_args`: the job's options, as
    `StreamOptions.to_args` writes them); wait until it reports `running`."""
    set_desired(settings, spec, "running")
    pid = running_pid(settings, spec)
    if pid is not None:
        return {**describe(settings, spec), "already_running": True}
    kafka.ensure_reachable(settings)
    if not kafka.topic_exists(settings, spec.source.topic, wait_if_missing=True):
        raise LocalStackError(
            f"source topic {spec.source.topic!r} of pipeline {spec.name} does not exist on "
            f"{settings.bootstrap_servers}: create it, or produce to it with "
            f"`duality produce {spec.name}`"
        )
    _folder(settings).mkdir(parents=True, exist_ok=True)
    log = log_file(settings, spec)
    process = start_daemon(
        [sys.executable, str(job_path(settings)), spec.name, *job_args],
        log,
        pid_file(settings, spec),
        # The settings this command runs with (Airflow connections included) go along.
        env={**os.environ, **settings.as_env()},
    )
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


def stop(settings: Settings, spec: PipelineSpec, *, hold: bool = True) -> dict[str, Any]:
    """Stop the stream; with `hold`, the supervisor leaves it stopped until a start."""
    if hold:
        set_desired(settings, spec, "stopped")
    pid = running_pid(settings, spec)
    if pid is None:
        pid_file(settings, spec).unlink(missing_ok=True)
        return {"pipeline": spec.name, "state": "stopped", "was_running": False}
    _terminate(pid)
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


def stop_all(settings: Settings) -> list[dict[str, Any]]:
    """Stop every stream this local stack runs (`duality down`); they stay wanted as before."""
    stopped = []
    for path in sorted(_folder(settings).glob("*.pid")):
        pid = _stream_pid(path, path.stem)
        if pid is not None:
            _terminate(pid)
            stopped.append({"pipeline": path.stem, "pid": pid})
        path.unlink(missing_ok=True)
    return stopped


# -- supervision ---------------------------------------------------------------------------


def _state_file(settings: Settings, spec: PipelineSpec) -> Path:
    return _folder(settings) / f"{spec.name}.supervisor.json"


def _load_state(settings: Settings, spec: PipelineSpec) -> dict[str, Any]:
    try:
        return dict(json.loads(_state_file(settings, spec).read_text()))
    except (FileNotFoundError, ValueError):
        return {"desired": "running", "restarts": []}


def _save_state(settings: Settings, spec: PipelineSpec, state: dict[str, Any]) -> None:
    path = _state_file(settings, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(state))
    partial.replace(path)


def desired(settings: Settings, spec: PipelineSpec) -> str:
    """`running` (the default) or `stopped`: what the user last asked of this stream."""
    return str(_load_state(settings, spec).get("desired", "running"))


def set_desired(settings: Settings, spec: PipelineSpec, value: str) -> None:
    state = _load_state(settings, spec)
    state["desired"] = value
    if value == "running":
        state["restarts"] = []  # a person's start resets the backoff
    _save_state(settings, spec, state)


@contextlib.contextmanager
def held(settings: Settings, spec: PipelineSpec) -> Iterator[None]:
    """Keep the supervisor from starting the stream inside the block (reset uses it)."""
    before = desired(settings, spec)
    set_desired(settings, spec, "stopped")
    try:
        yield
    finally:
        state = _load_state(settings, spec)
        state["desired"] = before
        _save_state(settings, spec, state)


def backoff_s(restarts: list[float], now: float) -> float:
    """How long after the last (re)start the next one may wait, given the (re)starts of the
    last hour: the first restart is immediate, then 1, 2, 4 ... minutes, at most 15."""
    recent = [t for t in restarts if now - t < _BACKOFF_WINDOW_S]
    if len(recent) < 2:
        return 0.0
    return float(min(_BACKOFF_BASE_S * 2 ** (len(recent) - 2), _BACKOFF_MAX_S))


def diagnose(
    pid: int | None,
    started_at: float | None,
    beat: dict[str, Any] | None,
    lag: int | None,
    now: float,
    stall_after_s: float = STALL_AFTER_S,
) -> tuple[str, str]:
    """(health, reason): `stopped`, `starting`, `healthy` or `stalled`, from the process, its
    latest heartbeat and the lag. Pure, so the rules are unit-tested."""
    if pid is None:
        return "stopped", "no stream process is running"
    own = beat is not None and pid in (beat.get("ppid"), beat.get("pid"))
    if not own:
        age = now - (started_at or now)
        if age > stall_after_s:
            return "stalled", f"started {age:.0f}s ago and has not reported since"
        return "starting", f"started {age:.0f}s ago; no heartbeat yet"
    assert beat is not None
    state = beat.get("state")
    age = now - beat.get("last_progress_ms", 0) / 1000
    if state in ("stalled", "failed"):
        return "stalled", f"its last heartbeat says {state}: {beat.get('error') or ''}".strip()
    if age > stall_after_s and (lag or 0) > 0:
        return "stalled", f"no heartbeat for {age:.0f}s while {lag:,} records wait"
    if state in ("restoring", "restarting"):
        return "starting", f"{state} ({age:.0f}s ago)"
    return "healthy", f"{state}, heartbeat {age:.0f}s ago" + (
        f", lag {lag:,}" if lag is not None else ""
    )


def check(
    settings: Settings,
    spec: PipelineSpec,
    now: float | None = None,
    stall_after_s: float = STALL_AFTER_S,
) -> tuple[dict[str, Any], str, str]:
    """`describe()` and the diagnosis of it: (info, health, reason); acts on nothing."""
    now = time.time() if now is None else now
    info = describe(settings, spec)
    pid = info["pid"]
    try:
        started_at = psutil.Process(pid).create_time() if pid is not None else None
    except psutil.NoSuchProcess:  # ended between the two looks
        pid = started_at = None
    health, reason = diagnose(
        pid, started_at, info.get("heartbeat"), info.get("lag"), now, stall_after_s
    )
    return {**info, "pid": pid}, health, reason


def supervise_once(
    settings: Settings,
    spec: PipelineSpec,
    action: Action = "ensure",
    *,
    stall_after_s: float = STALL_AFTER_S,
    now: float | None = None,
) -> dict[str, Any]:
    """One look at the stream, and what it did: started, restarted, stopped, waited or nothing.

    `ensure` starts the stream when it should run and does not, and restarts it when it is
    stalled, with backoff between restarts; `start`, `stop` and `restart` are a person's
    orders and also set what the stream should be from now on. Starting never waits for the
    stream to come up (the caller may, without holding anything); a second copy is never started
    (`start` checks the pid, the driver's lock refuses a second driver).
    """
    if action not in ACTIONS:
        raise UsageError(f"action {action!r} is unknown: use one of {', '.join(ACTIONS)}")
    now = time.time() if now is None else now
    if action == "stop":
        result = stop(settings, spec)
        return {**result, "action": "stopped" if result["was_running"] else "none"}
    if action == "start":
        result = start(settings, spec, wait=False)
        return {**result, "action": "none" if result["already_running"] else "started"}
    if action == "restart":
        stop(settings, spec, hold=False)
        result = start(settings, spec, wait=False)
        return {**result, "action": "restarted"}

    state = _load_state(settings, spec)
    info, health, reason = check(settings, spec, now, stall_after_s)
    pid = info["pid"]
    base = {"pipeline": spec.name, "health": health, "reason": reason, "desired": state["desired"]}
    if state["desired"] == "stopped":
        return {**info, **base, "action": "none", "reason": f"held stopped; {reason}"}
    if health in ("healthy", "starting"):
        return {**info, **base, "action": "none"}
    wait = backoff_s(state.get("restarts", []), now)
    last = max(state.get("restarts", []), default=0.0)
    if now - last < wait:
        return {
            **info,
            **base,
            "action": "backoff",
            "retry_in_s": round(wait - (now - last)),
        }
    if pid is not None:  # stalled: stop it first (the driver's batch never commits half)
        stop(settings, spec, hold=False)
    result = start(settings, spec, wait=False)
    state = _load_state(settings, spec)
    state["restarts"] = [t for t in state.get("restarts", []) if now - t < _BACKOFF_WINDOW_S]
    state["restarts"].append(now)
    _save_state(settings, spec, state)
    return {**result, **base, "action": "restarted" if pid is not None else "started"}
