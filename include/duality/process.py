"""The processes duality starts, for every caller: pid files, daemons in a group of their own,
stopping a group (a signal, a grace period, then SIGKILL), children that die with their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

# A SIGKILLed process is gone within moments; this bounds the wait for it.
_KILLED_WITHIN_S = 10.0
_PR_SET_PDEATHSIG = 1

try:  # resolved once here: a child between fork and exec should only make the call
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies, even by SIGKILL. Safe as a
    `preexec_fn` (between fork and exec) and in a child's own code; a no-op off Linux."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def live_pid(pid_file: Path, matches: Callable[[list[str]], bool]) -> int | None:
    """The pid in `pid_file` if that process runs and its command line `matches`; a stale pid
    file (the process gone, or the pid reused by another program) gives None."""
    try:
        pid = int(pid_file.read_text().strip())
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        cmdline = process.cmdline()
    except (FileNotFoundError, ValueError, psutil.Error):
        return None
    return pid if matches(cmdline) else None


def start_daemon(
    command: list[str],
    log: Path,
    pid_file: Path,
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    **popen: Any,
) -> subprocess.Popen[bytes]:
    """Start `command` in a session of its own (it outlives the command that started it), its
    output appended to `log`, its pid written to `pid_file`."""
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
            env=env,
            **popen,
        )
    pid_file.write_text(f"{process.pid}\n")
    return process


def group_alive(group: int) -> bool:
    """Whether a process of the group still runs (zombies waiting to be reaped do not count)."""
    for candidate in psutil.process_iter(["status"]):
        try:
            if os.getpgid(candidate.pid) == group and candidate.info["status"] != "zombie":
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def stop_group(
    pid: int,
    grace: float,
    first: signal.Signals = signal.SIGTERM,
    *,
    whole_group: bool = False,
    reap: subprocess.Popen[Any] | None = None,
) -> bool:
    """Send `first` to `pid`, the leader of its group (or to the group, `whole_group`), SIGKILL
    what of the group is left after `grace` seconds; returns whether anything had to be.
    `reap`: the `Popen` of `pid` when it is our child, reaped so that it stops counting."""
    try:
        group = os.getpgid(pid)
        if whole_group:
            os.killpg(group, first)
        else:
            os.kill(pid, first)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while True:
        if reap is not None:
            reap.poll()
        else:
            with contextlib.suppress(psutil.Error, ChildProcessError):
                psutil.Process(pid).wait(0)
        if not group_alive(group):
            return False
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    kill_group(group, reap=reap)
    return True


def kill_group(group: int, *, reap: subprocess.Popen[Any] | None = None) -> None:
    """SIGKILL every process of `group` now and wait until they are gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    deadline = time.monotonic() + _KILLED_WITHIN_S
    while time.monotonic() < deadline:
        if reap is not None:
            reap.poll()
        if not group_alive(group):
            return
        time.sleep(0.1)


def end_processes(processes: list[psutil.Process], grace: float) -> None:
    """SIGTERM each process, and SIGKILL those still alive after `grace` seconds (for processes
    that share a group with others that must stay, such as an Airflow worker's busy tasks)."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    for process in wait_exited(processes, grace):
        with contextlib.suppress(psutil.Error):
            process.kill()
            wait_exited([process], _KILLED_WITHIN_S)


def wait_exited(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` seconds until `processes` have exited; returns those still alive.
    Our own children are reaped; a zombie counts as exited, since its parent (the command that
    started it, gone since) may never reap it."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for process in processes:
            try:
                with contextlib.suppress(psutil.TimeoutExpired):
                    process.wait(0)
                if process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.Error:
                continue
        if not alive or time.monotonic() >= deadline:
            return alive
        processes = alive
        time.sleep(0.1)
