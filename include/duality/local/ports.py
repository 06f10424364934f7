"""The ports of this machine that the local stack's daemons listen on."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Names of this machine: a broker or master named so can be started here.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")

# Daemons' ports are drawn from here, below the kernel's ephemeral range: a port the kernel gives
# to an outgoing connection (any client on the machine) can never be one a daemon is about to
# bind, however long it takes to start (a broker formats its storage first).
_LOWEST = 20_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Handed out by this process: a port is not drawn twice before its daemon binds it.
_handed_out: set[int] = set()


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    """A port nothing listens on, outside the ephemeral range."""
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports outside the ephemeral range."""
    highest = _ephemeral_start() - count
    while True:
        # On a machine whose ephemeral range starts low, the kernel's choice.
        base = random.randint(_LOWEST, highest) if highest - _LOWEST >= 1_000 else _kernel_port()
        ports = range(base, base + count)
        if not _handed_out.intersection(ports) and all(_can_bind(port) for port in ports):
            _handed_out.update(ports)
            return base


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return not port_in_use("localhost", port)


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
