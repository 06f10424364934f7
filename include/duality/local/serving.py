"""The local stack's replicas (`duality serve`, `duality.serve`, docs/serving.md): one process
keeping a replica of every pipeline's table in `DUALITY_SERVE_DIR`, on the loopback address,
started by `duality up` and stopped by `duality down`."""

from __future__ import annotations

import dataclasses
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from duality.config import PREFIX, Settings
from duality.local.ports import free_port, port_in_use
from duality.local.startup import wait_started
from duality.process import live_pid, start_daemon, stop_group


@dataclasses.dataclass(frozen=True)
class ServingStatus:
    state: str  # running, stopped
    url: str | None  # what DUALITY_REPLICAS is set to
    pid: int | None
    pipelines: list[str]
    healthy: bool  # /healthz answers 200: every replica's reader and end watcher run
    log: Path
    already_running: bool | None = None  # set by `start()`


@dataclasses.dataclass(frozen=True)
class ServingStopped:
    was_running: bool
    pid: int | None


class LocalServing:
    """`duality serve` of every spec, its stores, log, pid file and `serve.json` (written by
    the process itself) in `settings.replica_dir`."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.root = settings.replica_dir
        self.pid_file = self.root / "serve.pid"
        self.log = self.root / "serve.log"
        self.record = self.root / "serve.json"  # url, pid, pipelines; while it runs
        self.port_file = self.root / "port"  # the port it last ran on, kept across `down`

    def pid(self) -> int | None:
        return live_pid(self.pid_file, lambda cmdline: "serve" in cmdline)

    def port(self) -> int:
        """The port it last ran on (clients know it), else the settings' if free, else a free
        one."""
        if self.port_file.is_file():
            return int(self.port_file.read_text())
        wanted = self.settings.serve_port
        if wanted and not port_in_use("127.0.0.1", wanted):
            return wanted
        return free_port()

    def client_settings(self, port: int) -> dict[str, str]:
        """The settings by which `duality query` (and a restart of this one) find it."""
        return {
            f"{PREFIX}SERVE_PORT": str(port),
            f"{PREFIX}REPLICAS": f"http://127.0.0.1:{port}",
        }

    def status(self) -> ServingStatus:
        pid = self.pid()
        if pid is None:
            return ServingStatus("stopped", None, None, [], False, self.log)
        try:
            running = json.loads(self.record.read_text())
        except (OSError, ValueError):  # starting: its record is not written yet
            return ServingStatus("starting", None, pid, [], False, self.log)
        url = str(running["url"])
        return ServingStatus("running", url, pid, running["pipelines"], _healthy(url), self.log)

    def start(self, timeout: float = 120.0) -> ServingStatus:
        """Start it unless it runs; wait until its API answers `/healthz`."""
        if self.pid() is not None:
            return dataclasses.replace(self.status(), already_running=True)
        port = self.port()
        self.root.mkdir(parents=True, exist_ok=True)
        self.port_file.write_text(f"{port}\n")
        self.record.unlink(missing_ok=True)
        command = [sys.executable, "-m", "duality.cli", "serve"]
        environment = {
            **self.settings.process_env(),
            f"{PREFIX}SERVE_HOST": "127.0.0.1",
            f"{PREFIX}SERVE_PORT": str(port),
        }
        process = start_daemon(command, self.log, self.pid_file, cwd=self.root, env=environment)
        wait_started(
            {"duality serve": process},
            [self.log],
            lambda: self.status().healthy,
            failure=f"duality serve did not answer /healthz on port {port}",
            timeout=timeout,
            stop=self.stop,
        )
        return dataclasses.replace(self.status(), already_running=False)

    def stop(self) -> ServingStopped:
        """SIGTERM (each replica ends its write, the stores close), SIGKILL after 30 s;
        idempotent."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 30.0)
        self.pid_file.unlink(missing_ok=True)
        self.record.unlink(missing_ok=True)
        return ServingStopped(pid is not None, pid)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2.0) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False
