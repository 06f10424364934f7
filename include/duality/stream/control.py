"""Starting, stopping and describing a pipeline's stream, and the files under
`<local_dir>/streams` that find it (docs/streams.md#the-streams-processes)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from duality import metrics
from duality.config import Settings
from duality.errors import LocalStackError
from duality.kafka import client, offsets, topics
from duality.process import end_processes, live_pid, start_daemon, stop_group
from duality.spec import PipelineSpec
from duality.stream import heartbeat, seeding

# The module that runs a stream: the marker a stream's supervisor carries in its command line.
MODULE = "duality.stream"
_STOP_GRACE_S = 90.0
_START_TIMEOUT_S = 180.0


@dataclasses.dataclass(frozen=True)
class TableLag:
    """A table a pipeline joins (docs/streams.md#joins): its name in the spec, the topic it is
    read from, the join's type (left or inner), the pipeline whose changelog it is (if any), and
    its lag: table records the stream's committed offsets do not cover yet (None: unknown)."""

    name: str
    topic: str
    join: str
    pipeline: str | None = None
    lag: int | None = None


@dataclasses.dataclass
class StreamState:
    """One pipeline's stream: its supervisor's process, last heartbeat and lag."""

    pipeline: str
    state: str  # running or stopped: whether the supervisor runs
    pid: int | None
    log: str
    heartbeat: dict[str, Any] | None = None  # the latest, as the driver published it
    heartbeat_age_s: float | None = None
    lag: int | None = None  # source records not yet covered by the committed offsets
    standby: dict[str, Any] | None = None  # the latest heartbeat of a driver waiting to take over
    tables: list[TableLag] = dataclasses.field(default_factory=list)  # the table it joins
    already_running: bool | None = None  # set by `start`


@dataclasses.dataclass
class StoppedStream:
    pipeline: str
    was_running: bool
    pid: int | None = None
    state: str = "stopped"


@dataclasses.dataclass
class Wanted:
    """What the user last asked of a stream, kept beside its pid file so that a stream stopped
    on purpose stays stopped, and the Airflow supervisor's recent (re)starts of it."""

    desired: str = "running"  # or stopped
    restarts: list[float] = dataclasses.field(default_factory=list)  # epoch seconds
    replicas: int = 1  # 2: a warm standby beside the stream on this host

    @classmethod
    def load(cls, settings: Settings, spec: PipelineSpec) -> Wanted:
        try:
            data = json.loads(_wanted_file(settings, spec).read_text())
            restarts = [float(t) for t in data["restarts"]]
            return cls(str(data["desired"]), restarts, int(data.get("replicas", 1)))
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            return cls()

    def save(self, settings: Settings, spec: PipelineSpec) -> None:
        path = _wanted_file(settings, spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(dataclasses.asdict(self)))
        partial.replace(path)


def desired(settings: Settings, spec: PipelineSpec) -> str:
    return Wanted.load(settings, spec).desired


def set_desired(settings: Settings, spec: PipelineSpec, value: str) -> None:
    wanted = Wanted.load(settings, spec)
    wanted.desired = value
    if value == "running":
        wanted.restarts = []  # a person's start resets the backoff
    wanted.save(settings, spec)


def set_replicas(settings: Settings, spec: PipelineSpec, replicas: int) -> None:
    """How many drivers this host keeps for the stream (2: a warm standby), for the supervisor."""
    wanted = Wanted.load(settings, spec)
    wanted.replicas = replicas
    wanted.save(settings, spec)


@contextlib.contextmanager
def held(settings: Settings, spec: PipelineSpec) -> Iterator[None]:
    """Keep the supervisor from starting the stream inside the block (reset uses it)."""
    before = desired(settings, spec)
    set_desired(settings, spec, "stopped")
    try:
        yield
    finally:
        wanted = Wanted.load(settings, spec)
        wanted.desired = before
        wanted.save(settings, spec)


def streams_folder(settings: Settings) -> Path:
    return settings.local_dir / "streams"


def slot(standby: bool) -> str:
    """This host's instances of a stream: the first, and a standby; which one's driver is
    active is the election's (duality.stream.election), not the slot's."""
    return ".standby" if standby else ""


def pid_file(settings: Settings, spec: PipelineSpec, standby: bool = False) -> Path:
    return streams_folder(settings) / f"{spec.name}{slot(standby)}.pid"


def _wanted_file(settings: Settings, spec: PipelineSpec) -> Path:
    return streams_folder(settings) / f"{spec.name}.supervisor.json"


def log_file(settings: Settings, spec: PipelineSpec, standby: bool = False) -> Path:
    return streams_folder(settings) / f"{spec.name}{slot(standby)}.log"


def is_stream(cmdline: list[str], name: str) -> bool:
    """Whether `cmdline` is the supervisor of pipeline `name` (named, or given as a spec file)."""
    return MODULE in cmdline and (
        name in cmdline or any(part.endswith((".yaml", ".yml")) for part in cmdline)
    )


def _stream_pid(path: Path, name: str) -> int | None:
    return live_pid(path, lambda cmdline: is_stream(cmdline, name))


def running_pid(settings: Settings, spec: PipelineSpec, standby: bool = False) -> int | None:
    return _stream_pid(pid_file(settings, spec, standby), spec.name)


def stream_options(pid: int) -> list[str]:
    """The options a running supervisor was started with (what follows its pipeline)."""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
    return cmdline[cmdline.index(MODULE) + 2 :] if MODULE in cmdline else []


def start(
    settings: Settings,
    spec: PipelineSpec,
    *,
    wait: bool = True,
    job_args: Sequence[str] = (),
) -> StreamState:
    """Start the stream detached unless it runs (`job_args`: its options, as
    `StreamOptions.to_args` writes them; with `--standby`, the second instance); wait until it
    reports `running` (a standby: until its driver waits to take over)."""
    standby = "--standby" in job_args
    set_desired(settings, spec, "running")
    if standby:  # a standby started by hand is kept by the Airflow supervisor too
        set_replicas(settings, spec, 2)
    pid = running_pid(settings, spec, standby)
    if pid is not None:
        return dataclasses.replace(describe(settings, spec), already_running=True)
    # A checkpoint of another layout or number of state partitions: said now, not in its log.
    seeding.checkpoint_usable(
        spec, seeding.checkpoint_dir(settings, spec), seeding.state_partitions(settings, spec)
    )
    client.ensure_reachable(settings)
    if not topics.topic_exists(settings, spec.source.topic, wait_if_missing=True):
        raise LocalStackError(
            f"source topic {spec.source.topic!r} of pipeline {spec.name} does not exist on "
            f"{settings.bootstrap_servers}: create it, or produce to it with "
            f"`duality produce {spec.name}`"
        )
    joined = spec.joined
    if joined is not None and not topics.topic_exists(settings, joined.topic, wait_if_missing=True):
        writer = f"start pipeline {joined.pipeline}" if joined.pipeline else "create it"
        raise LocalStackError(
            f"pipeline {spec.name} joins table {joined.name}, whose topic {joined.topic!r} does "
            f"not exist on {settings.bootstrap_servers}: {writer} first"
        )
    streams_folder(settings).mkdir(parents=True, exist_ok=True)
    log = log_file(settings, spec, standby)
    process = start_daemon(
        [sys.executable, "-m", MODULE, spec.name, *job_args],
        log,
        pid_file(settings, spec, standby),
        # The settings this command runs with (Airflow connections included) go along.
        env=settings.process_env(),
    )
    if wait:
        _wait_running(settings, spec, process, log, standby)
    return dataclasses.replace(describe(settings, spec), already_running=False)


def _wait_running(
    settings: Settings,
    spec: PipelineSpec,
    process: subprocess.Popen[bytes],
    log: Path,
    standby: bool = False,
) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise LocalStackError(
                f"the stream of {spec.name} exited with code {process.returncode} while "
                f"starting; last lines of {log}:\n{tail}"
            )
        beats = heartbeat.latest(settings)
        for beat in (beats.get(spec.name, {}), beats.get(standby_key(spec.name), {})):
            mine = process.pid in (beat.get("ppid"), beat.get("pid"))
            if mine and beat.get("state") in (("running", "standby") if standby else ("running",)):
                return
        time.sleep(1)
    raise LocalStackError(
        f"the stream of {spec.name} did not report running within {_START_TIMEOUT_S:g}s; see {log}"
    )


def _terminate(pid: int) -> None:
    """SIGTERM to the supervisor (the running batch commits first), SIGKILL after the grace."""
    try:
        leads_group = os.getpgid(pid) == pid
        process = psutil.Process(pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return
    if leads_group:  # started detached: its driver, JVM and Python workers are in its group
        stop_group(pid, _STOP_GRACE_S)
    else:  # in a group it does not lead (a shell's, say): its driver dies with it
        end_processes([process], _STOP_GRACE_S)


def stop(settings: Settings, spec: PipelineSpec, *, hold: bool = True) -> StoppedStream:
    """Stop the stream; with `hold`, the supervisor leaves it stopped until a start."""
    if hold:
        set_desired(settings, spec, "stopped")
    # The standby first: it would take over from the active one being stopped.
    pids = [running_pid(settings, spec, standby) for standby in (True, False)]
    for standby, pid in zip((True, False), pids, strict=True):
        if pid is not None:
            _terminate(pid)
        pid_file(settings, spec, standby).unlink(missing_ok=True)
    # Also when its driver had died without removing them: stopped is not down.
    metrics.forget_targets(settings, spec.name)
    pid = pids[1] if pids[1] is not None else pids[0]
    return StoppedStream(spec.name, was_running=pid is not None, pid=pid)


def stop_standby(settings: Settings, spec: PipelineSpec) -> bool:
    """Stop this host's standby alone (whichever driver is active goes on); whether it ran."""
    pid = running_pid(settings, spec, standby=True)
    if pid is not None:
        _terminate(pid)
    pid_file(settings, spec, standby=True).unlink(missing_ok=True)
    return pid is not None


def describe(settings: Settings, spec: PipelineSpec) -> StreamState:
    """Process, last heartbeat and lag of one pipeline's stream."""
    pid = running_pid(settings, spec)
    result = StreamState(
        spec.name, "running" if pid else "stopped", pid, str(log_file(settings, spec))
    )
    client.ensure_reachable(settings)
    beats = heartbeat.latest(settings)
    beat = beats.get(spec.name)
    if beat is not None:
        result.heartbeat = beat
        result.heartbeat_age_s = round(time.time() - beat.get("last_progress_ms", 0) / 1000, 1)
    waiting = beats.get(standby_key(spec.name))
    if waiting is not None and waiting.get("state") == "standby":
        result.standby = waiting
    result.lag = lag(settings, spec)
    result.tables = [dataclasses.replace(t, lag=table_lag(settings, spec)) for t in tables(spec)]
    return result


def lag(settings: Settings, spec: PipelineSpec) -> int | None:
    """Source records not yet covered by the stream's committed offsets; None when the source
    topic does not exist."""
    return _lag(settings, spec.consumer_group, spec.source.topic)


def tables(spec: PipelineSpec) -> list[TableLag]:
    """The table the pipeline joins, if any, as its spec names it (its lag not read)."""
    joined = spec.joined
    if joined is None:
        return []
    return [TableLag(joined.name, joined.topic, joined.type, joined.pipeline)]


def table_lag(settings: Settings, spec: PipelineSpec) -> int | None:
    """Records of the joined table's topic not yet covered by the stream's committed offsets
    (the group commits the table's offsets with each micro-batch); None when the pipeline joins
    no table or its topic does not exist."""
    if spec.joined is None:
        return None
    return _lag(settings, spec.consumer_group, spec.joined.topic)


def _lag(settings: Settings, group: str, topic: str) -> int | None:
    if not topics.topic_exists(settings, topic):
        return None
    ends = offsets.end_offsets(settings, topic)
    committed = offsets.committed_offsets(settings, group, topic)
    return sum(max(0, end - committed.get(p, (0, None))[0]) for p, end in ends.items())


def standby_key(pipeline: str) -> str:
    """The heartbeat key of a pipeline's standby drivers (the active one's is the pipeline)."""
    return f"{pipeline}@standby"


def stop_all(settings: Settings) -> list[StoppedStream]:
    """Stop every stream of this local stack, however it was started (`duality down`); they stay
    wanted as before."""
    stopped = []
    # Standbys first (`x.standby.pid` sorts after `x.pid`): none takes over from one stopped.
    for path in sorted(streams_folder(settings).glob("*.pid"), reverse=True):
        name = path.name.split(".")[0]  # a pipeline's name has no dot
        pid = _stream_pid(path, name)
        if pid is not None:
            _terminate(pid)
            stopped.append(StoppedStream(name, was_running=True, pid=pid))
        path.unlink(missing_ok=True)
        metrics.forget_targets(settings, name)
    return stopped
