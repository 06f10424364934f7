"""Waiting for the local stack's daemons to be ready, with their logs' last lines on failure."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from subprocess import Popen

from duality.errors import LocalStackError


def answers_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a daemon's health check at `url` answers 200 within `timeout` seconds."""
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=timeout) as answer:
        return bool(answer.status == 200)
    return False


def wait_started(
    launched: Mapping[str, Popen[bytes]],
    logs: Sequence[Path],
    ready: Callable[[], bool],
    *,
    failure: str,
    timeout: float,
    stop: Callable[[], object],
    interval: float = 0.25,
) -> None:
    """Wait until `ready()`; if a `launched` daemon exits first, or time is up, `stop()`."""
    deadline = time.monotonic() + timeout
    while not ready():
        for name, process in launched.items():
            if process.poll() is not None:
                stop()
                raise LocalStackError(
                    f"{name} exited with code {process.returncode} while starting; "
                    f"last lines of the logs:\n{_tails(logs)}"
                )
        if time.monotonic() > deadline:
            stop()
            raise LocalStackError(
                f"{failure} within {timeout:g}s; last lines of the logs:\n{_tails(logs)}"
            )
        time.sleep(interval)


def _tails(logs: Sequence[Path]) -> str:
    """Each log's first error lines (the cause; a daemon logs pages while it shuts down after
    it), then its last lines."""
    return "\n".join(f"--- {log}:\n{_first_errors(log)}{tail(log)}" for log in logs)


def _first_errors(log: Path, lines: int = 5) -> str:
    if not log.is_file():
        return ""
    errors = [
        line
        for line in log.read_text(errors="replace").splitlines()
        if " ERROR " in line or " FATAL " in line
    ][:lines]
    return "first errors:\n" + "\n".join(errors) + "\nlast lines:\n" if errors else ""


def tail(log: Path, lines: int = 25) -> str:
    if not log.is_file():
        return "(no log output)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
