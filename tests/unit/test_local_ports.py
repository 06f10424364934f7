"""The local stack's daemon ports: outside the kernel's ephemeral range, free, never handed out
twice; a daemon that fails to start names the first error of its log."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from duality.errors import LocalStackError
from duality.local import ports
from duality.local.startup import wait_started


def test_ports_are_below_the_ephemeral_range_free_and_never_handed_out_twice():
    lowest_ephemeral = ports._ephemeral_start()
    drawn = [ports.free_port() for _ in range(200)]
    assert len(set(drawn)) == len(drawn)
    assert all(ports._LOWEST <= port < lowest_ephemeral for port in drawn)
    base = ports.free_ports(6)
    assert base + 5 < lowest_ephemeral and not set(drawn) & set(range(base, base + 6))
    for port in range(base, base + 6):  # each one can be listened on
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_never_drawn(monkeypatch: pytest.MonkeyPatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy, free = taken.getsockname()[1], ports._kernel_port()
        draws = iter([busy, free])
        monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
        assert ports.free_port() == free


def test_a_daemon_that_exits_while_starting_names_its_first_error(tmp_path: Path):
    log = tmp_path / "server.log"
    lines = ["[t] INFO starting", "[t] ERROR Address already in use: bind to port 1234"]
    log.write_text("\n".join(lines + [f"[t] INFO shutting down part {i}" for i in range(40)]))
    daemon = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    daemon.wait()
    with pytest.raises(LocalStackError) as failed:
        wait_started(
            {"the broker": daemon},
            [log],
            lambda: False,
            failure="never",
            timeout=30,
            stop=lambda: None,
        )
    said = str(failed.value)
    assert "the broker exited with code 1" in said
    assert said.index("Address already in use") < said.index("shutting down part 39")
    assert "shutting down part 10" not in said  # the middle of the log is left out
