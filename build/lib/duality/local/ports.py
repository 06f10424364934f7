"""The ports of this machine that the local stack's daemons listen on."""

from __future__ import annotations

import socket

# Names of this machine: a broker or master named so can be started here.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
