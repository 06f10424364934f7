"""The stream's supervisor (`python -m duality.stream PIPELINE`): holds the pipeline's lock and
pid file, and restarts its driver child when it exits on its own (stalled, JVM gone, crashed)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from duality.arguments import stream_arguments
from duality.config import Settings
from duality.errors import BrokerUnavailable, DualityError, LocalStackError, UsageError
from duality.process import die_with_parent
from duality.spec import PipelineSpec, find_spec
from duality.stream import heartbeat
from duality.stream.control import MODULE, pid_file, slot, standby_key, streams_folder
from duality.stream.options import StreamOptions

log = logging.getLogger("duality.stream")

# A driver that ends while a standby of its pipeline waits is replaced by a new standby once the
# takeover's first micro-batch is done (its first progress beat), or after this long: the new
# driver's JVM start would otherwise take that batch's cores on a shared host.
TAKEOVER_WAIT_S = 60.0
# A waiting standby beats every 5 s (`Election.wait_active`): one this recent is still there.
STANDBY_SEEN_S = 15.0
TAKEOVER_POLL_S = 1.0

# Why a driver exits for a new one (its last heartbeat says more): the codes it ends with.
STALLED_EXIT = 75  # no micro-batch committed for its stall timeout (a lost broker, say)
JVM_EXITED = 76  # its JVM is gone (killed, or ended by an OutOfMemoryError)
# Kafka did not answer its start: not a usage error that ends the stream, an outage to wait out.
BROKER_AWAY_EXIT = 69
_EXIT_REASONS = {
    STALLED_EXIT: "it stalled: no micro-batch committed for its --stall-timeout",
    JVM_EXITED: "its JVM exited",
    BROKER_AWAY_EXIT: "Kafka did not answer",
}


@contextlib.contextmanager
def exclusive(settings: Settings, spec: PipelineSpec, standby: bool = False) -> Iterator[None]:
    """Hold the lock of the pipeline's slot on this host (the first instance, or the standby)
    for the life of the stream, or fail if another stream holds it. Across slots and hosts,
    the election lets one driver at a time run the query."""
    path = streams_folder(settings) / f"{spec.name}{slot(standby)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LocalStackError(
                f"pipeline {spec.name} already runs (lock {path} is held): stop it first with "
                f"`duality stream stop {spec.name}`"
            ) from None
        yield  # closing the file releases the lock


@contextlib.contextmanager
def owned_pid_file(path: Path) -> Iterator[None]:
    """This process's pid in `path` while it runs, however it was started; removed at exit
    unless another process wrote its own since."""
    pid = str(os.getpid())
    path.write_text(f"{pid}\n")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            if path.read_text().strip() == pid:
                path.unlink()


def _driver_setup(nice: int) -> Callable[[], None]:
    """What the driver's process does before it runs (between fork and exec): die with the
    supervisor, and take the stream's priority (DUALITY_STREAM_NICE), which its JVM inherits.

    Where the kernel groups processes by session (autogroups, on by default in most Linux
    kernels), it shares the CPU between sessions before it weighs a process's nice, so a nice
    process in a session of its own gets as much as any other session. The priority is then set
    on the session too, when it is the stream's own: its supervisor leads it (`duality stream
    start` starts it so), not when the supervisor runs in a terminal's session."""

    def setup() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)
            if os.getsid(0) == os.getppid():
                with contextlib.suppress(OSError):  # a kernel without autogroups
                    Path("/proc/self/autogroup").write_text(str(nice))

    return setup


def supervise(settings: Settings, spec: PipelineSpec, pipeline: str, options: StreamOptions) -> int:
    """Hold the lock and the pid file and keep a driver process running until SIGTERM; a
    driver that exits with a usage error (a bad spec, say) ends the supervision."""
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def request_stop(*_: Any) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    command = [sys.executable, "-m", f"{MODULE}.driver", pipeline, *options.to_args()]
    backoff = 1.0
    with (
        exclusive(settings, spec, options.standby),
        owned_pid_file(pid_file(settings, spec, options.standby)),
    ):
        while not stopping.is_set():
            # The kernel kills the driver when the supervisor dies, even by SIGKILL, so a
            # killed stream never leaves a driver running without the lock.
            child = subprocess.Popen(command, preexec_fn=_driver_setup(settings.stream_nice))
            code = child.wait()
            if stopping.is_set():
                break
            if code == UsageError.exit_code:
                return code
            why = _EXIT_REASONS.get(code, "it failed; see the lines above")
            log.warning(
                "%s: driver exited with %d (%s); starting a new one in %.0fs",
                spec.name,
                code,
                why,
                backoff,
            )
            # From the exit on: the standby's first progress beat may come within the backoff.
            await_takeover(settings, spec, child.pid, stopping)
            stopping.wait(backoff)
            backoff = min(backoff * 2, 30.0)
    return 0


def await_takeover(
    settings: Settings, spec: PipelineSpec, ended: int, stopping: threading.Event
) -> None:
    """If another driver of the pipeline stood by when the driver `ended` exited, wait until
    that one's query reports progress as the active driver, it ends, `stopping` is set or
    `TAKEOVER_WAIT_S` passes. Without a standby, or with Kafka away, return at once."""
    now_ms = int(time.time() * 1000)
    since_ms = now_ms - int(STANDBY_SEEN_S * 1000)
    deadline = time.monotonic() + TAKEOVER_WAIT_S
    while not stopping.is_set():
        try:
            beats = heartbeat.history(settings, since_ms)
        except Exception as error:  # whatever stops the look, the new driver starts now
            log.warning("%s: reading the heartbeats failed: %s", spec.name, error)
            return
        others = [b for b in beats.get(standby_key(spec.name), []) if b.get("pid") != ended]
        if not others or others[-1].get("state") not in ("standby", "active"):
            return
        standby = others[-1]["pid"]
        if any(
            b.get("pid") == standby
            and b.get("state") == "running"
            and "committed_offsets" in b  # a micro-batch's progress, or the query idle
            and b.get("last_progress_ms", 0) >= now_ms
            for b in beats.get(spec.name, [])
        ):
            log.info("%s: driver %s took over; starting a new standby", spec.name, standby)
            return
        if time.monotonic() > deadline:
            log.warning(
                "%s: driver %s has not taken over within %.0fs; starting a new driver",
                spec.name,
                standby,
                TAKEOVER_WAIT_S,
            )
            return
        stopping.wait(TAKEOVER_POLL_S)


def entry_point(
    prog: str,
    run: Callable[[Settings, PipelineSpec, str, StreamOptions], int],
    argv: list[str] | None = None,
) -> int:
    """`prog PIPELINE [options]`, the supervisor or its driver; a DualityError is the exit code."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Run one pipeline's changelog-backed stream until SIGTERM."
    )
    stream_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings.from_env()
        options = StreamOptions.from_args(args)
        spec = find_spec(settings, args.pipeline)
        return run(settings, spec, args.pipeline, options)
    except BrokerUnavailable as error:
        log.error("%s", error)
        return BROKER_AWAY_EXIT
    except DualityError as error:
        log.error("%s", error)
        return error.exit_code


def main(argv: list[str] | None = None) -> int:
    return entry_point(f"python -m {MODULE}", supervise, argv)
