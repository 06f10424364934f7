"""Prometheus and its Pushgateway on the local stack (`duality up --monitoring`,
docs/monitoring.md): Debian's programs, each in a folder of its own under
`<local_dir>/monitoring/`, on the loopback address."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from duality.config import Settings
from duality.errors import LocalStackError
from duality.local.ports import LOCAL_HOSTS, free_port
from duality.local.startup import answers_ok, wait_started
from duality.metrics import targets_folder
from duality.process import live_pid, start_daemon, stop_group

# The scrape jobs: docker-compose.yml's Prometheus has the same (tests/unit/test_compose.py).
STREAMS_JOB = "duality-streams"  # each stream's endpoint, from its file in the targets folder
SPARK_JOB = "duality-spark"  # a Spark driver's PrometheusServlet, from its file there
BATCH_JOB = "duality-batch"  # the Pushgateway, holding what the batch steps pushed
SERVE_JOB = "duality-serve"  # each `duality serve`'s endpoint, from its file in the targets folder
# Scrapes and rule evaluations every 5 s: a stream's micro-batches are seconds apart locally.
LOCAL_INTERVAL = "5s"
# The shipped alert rules, in the checkout (docs/monitoring.md#alert-rules).
RULES = Path("monitoring") / "alerts.yml"


def prometheus_config(
    targets: Path, pushgateway: str, rules: Path, interval: str = LOCAL_INTERVAL
) -> dict[str, Any]:
    """Prometheus' configuration: the streams, Spark drivers and replicas (`duality serve`)
    that write their file into `targets`, and the Pushgateway; labels a target pushes or serves
    (`pipeline`, `step`, the Pushgateway's `job`) are kept as they are."""

    def discovered(pattern: str) -> list[dict[str, Any]]:
        return [{"files": [str(targets / pattern)], "refresh_interval": interval}]

    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": STREAMS_JOB,
                "honor_labels": True,
                "file_sd_configs": discovered("stream-*.json"),
            },
            # A Spark driver's target file sets `__metrics_path__` to its servlet's path.
            {"job_name": SPARK_JOB, "file_sd_configs": discovered("spark-*.json")},
            # The replicas' series carry their pipeline (docs/serving.md).
            {
                "job_name": SERVE_JOB,
                "honor_labels": True,
                "file_sd_configs": discovered("serve-*.json"),
            },
            {
                "job_name": BATCH_JOB,
                "honor_labels": True,
                "static_configs": [{"targets": [pushgateway]}],
            },
        ],
    }


@dataclasses.dataclass(frozen=True)
class ProgramStatus:
    state: str  # running, stopped
    address: str | None  # 127.0.0.1:<port>
    pid: int | None
    ready: bool  # it answers /-/ready
    log: Path


@dataclasses.dataclass(frozen=True)
class MonitoringStatus:
    prometheus: ProgramStatus
    pushgateway: ProgramStatus
    config: Path  # the generated prometheus.yml
    rules: Path
    already_running: bool | None = None  # set by `start()`

    @property
    def state(self) -> str:
        states = {self.prometheus.state, self.pushgateway.state}
        return states.pop() if len(states) == 1 else "degraded"


@dataclasses.dataclass(frozen=True)
class MonitoringStopped:
    was_running: bool
    pids: dict[str, int]  # by program


class _Program:
    """One of Debian's programs as a daemon in `root`: its port (remembered while it runs),
    pid file and log."""

    def __init__(self, root: Path, binary: str):
        self.root = root
        self.binary = binary
        self.state_file = root / "server.json"
        self.pid_file = root / f"{binary}.pid"
        self.log = root / f"{binary}.log"

    def port(self) -> int | None:
        if not self.state_file.is_file():
            return None
        return int(json.loads(self.state_file.read_text())["port"])

    def pid(self) -> int | None:
        port = self.port()
        if port is None:
            return None
        listen, program = _listen(port), f"/{self.binary}"
        return live_pid(
            self.pid_file,
            lambda cmdline: (
                cmdline[:1] != [] and cmdline[0].endswith(program) and listen in cmdline
            ),
        )

    def status(self) -> ProgramStatus:
        pid, port = self.pid(), self.port()
        if pid is None or port is None:
            return ProgramStatus("stopped", None, None, False, self.log)
        return ProgramStatus("running", f"127.0.0.1:{port}", pid, _ready(port), self.log)

    def launch(self, port: int, arguments: list[str]) -> subprocess.Popen[bytes]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps({"port": port}))
        command = [_program(self.binary), _listen(port), *arguments]
        return start_daemon(command, self.log, self.pid_file, cwd=self.root)

    def stop(self) -> int | None:
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 30.0)
        self.pid_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        return pid


class LocalMonitoring:
    """Prometheus (`<root>/prometheus`: its generated config, its data) scraping the streams,
    the Spark drivers and the Pushgateway (`<root>/pushgateway`) that batch steps push to, with
    the shipped alert rules. `root` defaults to `<local_dir>/monitoring`."""

    def __init__(self, settings: Settings, *, root: Path | None = None):
        self.settings = settings
        self.root = root if root is not None else settings.local_dir / "monitoring"
        self.prometheus = _Program(self.root / "prometheus", "prometheus")
        self.pushgateway = _Program(self.root / "pushgateway", "prometheus-pushgateway")
        self.config = self.prometheus.root / "prometheus.yml"
        self.rules = settings.home / RULES

    def status(self) -> MonitoringStatus:
        return MonitoringStatus(
            self.prometheus.status(), self.pushgateway.status(), self.config, self.rules
        )

    @property
    def pushgateway_address(self) -> str:
        """What DUALITY_PUSHGATEWAY is set to."""
        port = self.pushgateway.port()
        if port is None:
            raise LocalStackError(f"the Pushgateway in {self.pushgateway.root} is not running")
        return f"127.0.0.1:{port}"

    @property
    def prometheus_url(self) -> str:
        """What DUALITY_PROMETHEUS_URL is set to."""
        port = self.prometheus.port()
        if port is None:
            raise LocalStackError(f"Prometheus in {self.prometheus.root} is not running")
        return f"http://127.0.0.1:{port}"

    def start(self, timeout: float = 60.0) -> MonitoringStatus:
        """Start what of the two does not run; wait until both answer /-/ready."""
        if self.prometheus.pid() is not None and self.pushgateway.pid() is not None:
            return dataclasses.replace(self.status(), already_running=True)
        for binary in (self.prometheus.binary, self.pushgateway.binary):
            _program(binary)
        if not self.rules.is_file():
            raise LocalStackError(
                f"the alert rules {self.rules} are missing: DUALITY_HOME must be the checkout"
            )
        launched = {}
        if self.pushgateway.pid() is None:
            port = self._pushgateway_port()
            # Pushed figures survive a restart (a snapshot's age, the last verdict).
            persisted = f"--persistence.file={self.pushgateway.root / 'pushgateway.data'}"
            launched["the Pushgateway"] = self.pushgateway.launch(port, [persisted])
        if self.prometheus.pid() is None:
            port = self._prometheus_port()
            document = prometheus_config(
                targets_folder(self.settings), self.pushgateway_address, self.rules
            )
            targets_folder(self.settings).mkdir(parents=True, exist_ok=True)
            self.config.parent.mkdir(parents=True, exist_ok=True)
            self.config.write_text(yaml.safe_dump(document, sort_keys=False))
            arguments = [
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.prometheus.root / 'data'}",
            ]
            launched["Prometheus"] = self.prometheus.launch(port, arguments)
        ports = [self.prometheus.port(), self.pushgateway.port()]
        wait_started(
            launched,
            [self.prometheus.log, self.pushgateway.log],
            lambda: all(port is not None and _ready(port) for port in ports),
            failure=f"Prometheus and the Pushgateway were not ready on ports {ports}",
            timeout=timeout,
            stop=self.stop,
        )
        return dataclasses.replace(self.status(), already_running=False)

    def stop(self) -> MonitoringStopped:
        """Stop Prometheus and the Pushgateway; idempotent. Their data stays."""
        pids = {}
        for name, program in (("prometheus", self.prometheus), ("pushgateway", self.pushgateway)):
            pid = program.stop()
            if pid is not None:
                pids[name] = pid
        return MonitoringStopped(bool(pids), pids)

    def _pushgateway_port(self) -> int:
        """The port it last ran on, else the one `settings.pushgateway` names on this machine,
        else a free one."""
        remembered = self.pushgateway.port()
        if remembered is not None:
            return remembered
        host, _, port = (self.settings.pushgateway or "").rpartition(":")
        if host in LOCAL_HOSTS and port.isdigit():
            return int(port)
        return _free_port_but(self.prometheus.port())

    def _prometheus_port(self) -> int:
        remembered = self.prometheus.port()
        if remembered is not None:
            return remembered
        named = urlsplit(self.settings.prometheus_url or "")
        if named.hostname in LOCAL_HOSTS and named.port is not None:
            return named.port
        return _free_port_but(self.pushgateway.port())


def _program(binary: str) -> str:
    found = shutil.which(binary)
    if found is None:
        raise LocalStackError(
            f"{binary} is not installed: run `make monitoring` (Debian's prometheus and "
            "prometheus-pushgateway packages), or start the stack without --monitoring"
        )
    return found


def _listen(port: int) -> str:
    return f"--web.listen-address=127.0.0.1:{port}"


def _free_port_but(taken: int | None) -> int:
    while True:
        port = free_port()
        if port != taken:
            return port


def _ready(port: int) -> bool:
    return answers_ok(f"http://127.0.0.1:{port}/-/ready", timeout=1.0)
