"""This host's `duality serve` as a daemon, as `stream.control` is for streams: its pid file,
log, port and `serve.json` in `DUALITY_SERVE_DIR`, starting it detached, stopping it, its state,
and `ensure`, which the Airflow stream DAG's supervisor runs to keep the configured replicas
(`DUALITY_REPLICAS`) running: one that does not answer is started again when it is this
host's, and reported otherwise."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from duality.config import PREFIX, Settings
from duality.process import live_pid, start_daemon, stop_group

# Seconds `ensure` waits for a replica it started to answer /healthz.
ENSURE_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class ServingStatus:
    state: str  # running, starting, stopped
    url: str | None  # what DUALITY_REPLICAS names it by
    pid: int | None
    pipelines: list[str]
    healthy: bool  # /healthz answers 200: every replica's reader and end watcher run
    log: Path
    already_running: bool | None = None  # set by a start


@dataclasses.dataclass(frozen=True)
class ServingStopped:
    was_running: bool
    pid: int | None


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    """A configured replica as `ensure` found it: `action` none (it answers), started (this
    host's, started again), starting (this host's, running but not answering yet), down
    (another host's: reported, not started)."""

    url: str
    healthy: bool
    action: str


def _files(settings: Settings) -> tuple[Path, Path, Path, Path]:
    """(pid file, log, serve.json, the port it last ran on)."""
    root = settings.replica_dir
    return root / "serve.pid", root / "serve.log", root / "serve.json", root / "port"


def pid(settings: Settings) -> int | None:
    return live_pid(_files(settings)[0], lambda cmdline: "serve" in cmdline)


def port_on_file(settings: Settings) -> int | None:
    """The port this host's `duality serve` last ran on, if it ever ran here."""
    try:
        return int(_files(settings)[3].read_text())
    except (OSError, ValueError):
        return None


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether the replica at `url` answers /healthz with 200."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def status(settings: Settings) -> ServingStatus:
    running, log, record = pid(settings), _files(settings)[1], _files(settings)[2]
    if running is None:
        return ServingStatus("stopped", None, None, [], False, log)
    try:
        document = json.loads(record.read_text())
    except (OSError, ValueError):  # starting: its record is not written yet
        return ServingStatus("starting", None, running, [], False, log)
    url = str(document["url"])
    return ServingStatus("running", url, running, document["pipelines"], answers(url), log)


def launch(settings: Settings, port: int) -> subprocess.Popen[bytes]:
    """Start `duality serve` of every spec, detached, on 127.0.0.1:`port`; it does not wait."""
    pid_file, log, record, port_file = _files(settings)
    settings.replica_dir.mkdir(parents=True, exist_ok=True)
    port_file.write_text(f"{port}\n")
    record.unlink(missing_ok=True)
    environment = {
        **settings.process_env(),
        f"{PREFIX}SERVE_HOST": "127.0.0.1",
        f"{PREFIX}SERVE_PORT": str(port),
    }
    command = [sys.executable, "-m", "duality.cli", "serve"]
    return start_daemon(command, log, pid_file, cwd=settings.replica_dir, env=environment)


def stop(settings: Settings) -> ServingStopped:
    """SIGTERM (each replica ends its write, the stores close), SIGKILL after 30 s;
    idempotent."""
    running = pid(settings)
    if running is not None:
        stop_group(running, 30.0)
    pid_file, _, record, _ = _files(settings)
    pid_file.unlink(missing_ok=True)
    record.unlink(missing_ok=True)
    return ServingStopped(running is not None, running)


def ensure(settings: Settings, wait: float = ENSURE_WAIT_S) -> list[ReplicaState]:
    """Each replica of `DUALITY_REPLICAS` (none when it is unset): one that does not answer is
    started again when it is this host's (on 127.0.0.1 at the port this host's last ran on),
    waiting up to `wait` seconds for it to answer; another host's is reported down."""
    if not settings.replicas:
        return []
    own = port_on_file(settings)
    states = []
    for url in settings.replica_urls:
        if answers(url):
            states.append(ReplicaState(url, True, "none"))
            continue
        where = urllib.parse.urlsplit(url)
        if own is None or where.port != own or where.hostname not in ("127.0.0.1", "localhost"):
            states.append(ReplicaState(url, False, "down"))
            continue
        if pid(settings) is not None:
            states.append(ReplicaState(url, False, "starting"))
            continue
        process = launch(settings, own)
        deadline = time.monotonic() + wait
        while not answers(url) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.25)
        states.append(ReplicaState(url, answers(url), "started"))
    return states
