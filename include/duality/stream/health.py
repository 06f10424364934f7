"""The rules of the stream's Airflow supervisor (health, backoff) and `supervise_once`, the look
at a stream that its DAG takes every minute."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

import psutil

from duality.config import Settings
from duality.errors import UsageError
from duality.spec import PipelineSpec
from duality.stream import control, rescale
from duality.stream.control import StreamState, Wanted, describe, log_file, start, stop

# A running stream beats on every batch and while idle; silence this long, with records
# waiting, means stalled.
STALL_AFTER_S = 300.0
# Restarts within this window count towards the backoff: 0, 1, 2, 4 ... minutes, at most 15.
_BACKOFF_WINDOW_S = 3600.0
_BACKOFF_BASE_S = 60.0
_BACKOFF_MAX_S = 900.0

Action = Literal["ensure", "start", "stop", "restart", "rescale"]
ACTIONS: tuple[str, ...] = ("ensure", "start", "stop", "restart", "rescale")


@dataclasses.dataclass(kw_only=True)
class Supervision(StreamState):
    """One look of the supervisor at a stream: what it found and what it did."""

    action: str  # started, restarted, stopped, backoff or none
    health: str | None = None  # `ensure` only: stopped, starting, healthy or stalled
    reason: str | None = None
    desired: str | None = None
    retry_in_s: int | None = None  # with action backoff
    standby_action: str | None = None  # started or stopped: this host's standby, as wanted
    rescale: dict[str, Any] | None = None  # action rescale: its plan (`RescalePlan.as_dict`)


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
    settings: Settings, spec: PipelineSpec, now: float | None = None
) -> tuple[StreamState, str, str]:
    """`describe()` and the diagnosis of it: (state, health, reason); acts on nothing."""
    now = time.time() if now is None else now
    state = describe(settings, spec)
    try:
        started_at = psutil.Process(state.pid).create_time() if state.pid is not None else None
    except psutil.NoSuchProcess:  # ended between the two looks
        state.pid = started_at = None
    health, reason = diagnose(state.pid, started_at, state.heartbeat, state.lag, now)
    return state, health, reason


def supervise_once(
    settings: Settings,
    spec: PipelineSpec,
    action: Action = "ensure",
    *,
    replicas: int | None = None,
    partitions: int | None = None,
) -> Supervision:
    """`ensure` starts the stream when it should run and does not, and restarts it when stalled,
    with backoff; `start`, `stop` and `restart` are a person's orders and also set what the
    stream should be from now on; `rescale` rebuilds its state in `partitions` (default: what
    its spec asks for). `replicas` (1, or 2 for a warm standby on this host) is kept for the
    looks that follow; a running stream gets or loses its standby to match. Never waits for
    the stream to come up."""
    if action not in ACTIONS:
        raise UsageError(f"action {action!r} is unknown: use one of {', '.join(ACTIONS)}")
    if replicas is not None and replicas not in (1, 2):
        raise UsageError(
            f"replicas {replicas} is not supported: 1 (the stream) or 2 (and a warm standby)"
        )
    if action == "rescale":
        plan = rescale.plan(settings, spec, partitions)  # a bad number stops before any work
        rescale.execute(settings, spec, plan)
        done = "rescaled" if plan.steps() else "none"
        return Supervision(**vars(describe(settings, spec)), action=done, rescale=plan.as_dict())
    if replicas is not None:
        control.set_replicas(settings, spec, replicas)
    looked = _look(settings, spec, action)
    looked.standby_action = _match_replicas(settings, spec)
    return looked


def _match_replicas(settings: Settings, spec: PipelineSpec) -> str | None:
    """Start or stop this host's standby as the wanted replicas say, while the stream runs."""
    wanted = Wanted.load(settings, spec)
    running = control.running_pid(settings, spec, standby=True) is not None
    if wanted.desired != "running" or wanted.replicas < 2:
        return "stopped" if running and control.stop_standby(settings, spec) else None
    primary = control.running_pid(settings, spec)
    if running or primary is None:
        return None  # a standby joins a running stream, with its options
    start(settings, spec, wait=False, job_args=[*control.stream_options(primary), "--standby"])
    return "started"


def _look(settings: Settings, spec: PipelineSpec, action: Action) -> Supervision:
    if action == "stop":
        stopped = stop(settings, spec)
        return Supervision(
            pipeline=spec.name,
            state="stopped",
            pid=stopped.pid,
            log=str(log_file(settings, spec)),
            action="stopped" if stopped.was_running else "none",
        )
    if action == "start":
        started = start(settings, spec, wait=False)
        return Supervision(**vars(started), action="none" if started.already_running else "started")
    if action == "restart":
        stop(settings, spec, hold=False)
        return Supervision(**vars(start(settings, spec, wait=False)), action="restarted")

    now = time.time()
    wanted = Wanted.load(settings, spec)
    state, health, reason = check(settings, spec, now)
    found: dict[str, Any] = {**vars(state), "health": health, "reason": reason}
    found["desired"] = wanted.desired
    if wanted.desired == "stopped":
        return Supervision(**{**found, "reason": f"held stopped; {reason}"}, action="none")
    if health in ("healthy", "starting"):
        return Supervision(**found, action="none")
    wait = backoff_s(wanted.restarts, now)
    last = max(wanted.restarts, default=0.0)
    if now - last < wait:
        return Supervision(**found, action="backoff", retry_in_s=round(wait - (now - last)))
    if state.pid is not None:  # stalled: stop it first (the driver's batch never commits half)
        stop(settings, spec, hold=False)
    started = start(settings, spec, wait=False)
    wanted = Wanted.load(settings, spec)
    wanted.restarts = [t for t in wanted.restarts if now - t < _BACKOFF_WINDOW_S] + [now]
    wanted.save(settings, spec)
    return Supervision(
        **{**vars(started), "health": health, "reason": reason, "desired": wanted.desired},
        action="restarted" if state.pid is not None else "started",
    )
