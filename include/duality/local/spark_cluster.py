"""A Spark standalone cluster on this machine, run with pyspark's own `bin/spark-class`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from duality.config import Settings
from duality.errors import LocalStackError, UsageError
from duality.local.ports import LOCAL_HOSTS, free_port
from duality.local.startup import wait_started
from duality.process import kill_group, live_pid, start_daemon, stop_group

_SPARK_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_SPARK_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    index: int
    pid: int | None
    registered: bool  # the master lists it ALIVE
    log: Path


@dataclasses.dataclass(frozen=True)
class SparkStatus:
    state: str  # running, degraded (a worker is missing), stopped
    master_url: str | None
    master_ui: str | None
    master_pid: int | None
    workers: list[WorkerStatus]
    root: Path
    log: Path
    # Set by `start()`: whether all of it ran before it was asked to.
    already_running: bool | None = None


@dataclasses.dataclass(frozen=True)
class SparkStopped:
    was_running: bool
    pids: list[int]


def spark_home() -> Path:
    """The pyspark package folder: pip's pyspark is a whole Spark (with no `sbin` scripts)."""
    import importlib.util

    found = importlib.util.find_spec("pyspark")
    if found is None or found.origin is None:
        raise LocalStackError("pyspark is not installed in this interpreter: run `make setup`")
    return Path(found.origin).parent


class LocalSparkCluster:
    """A master and `workers` workers in `root/master` and `root/worker-<i>`, each leading its
    own process group, so that stopping or killing a worker takes its executors with it."""

    def __init__(
        self,
        settings: Settings,
        workers: int = 2,
        *,
        root: Path | None = None,
        cores: int = 1,
        memory: str = "1g",
    ):
        if workers < 1:
            raise UsageError(f"a Spark cluster needs at least one worker, got {workers}")
        if cores < 1:
            raise UsageError(f"a Spark worker needs at least one core, got {cores}")
        self.settings = settings
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.root = root if root is not None else settings.local_dir / "spark"
        self.state_file = self.root / "cluster.json"
        self.properties_file = self.root / "spark-defaults.conf"

    @property
    def master_dir(self) -> Path:
        return self.root / "master"

    def worker_dir(self, index: int) -> Path:
        if not 0 <= index < self.workers:
            raise UsageError(f"worker {index} does not exist: this cluster has {self.workers}")
        return self.root / f"worker-{index}"

    def work_dir(self, index: int) -> Path:  # one `<app id>/<executor id>/` per executor
        return self.worker_dir(index) / "work"

    def local_dir(self, index: int) -> Path:  # SPARK_LOCAL_DIRS: shuffle files, RocksDB copies
        return self.worker_dir(index) / "local"

    def ports(self) -> dict[str, Any]:
        """The ports that the last start chose, kept while the master runs."""
        if not self.state_file.is_file():
            raise LocalStackError(f"the Spark cluster in {self.root} is not running: start it")
        return dict(json.loads(self.state_file.read_text()))

    def _choose_ports(self) -> dict[str, Any]:
        """The running master's, else `settings.spark_master`'s on this machine, else free."""
        saved: dict[str, Any] = {}
        if self.state_file.is_file() and self.master_pid() is not None:
            saved = self.ports()
        workers: list[dict[str, int]] = list(saved.get("workers") or [])
        while len(workers) < self.workers:
            workers.append({"port": free_port(), "ui": free_port()})
        return {
            "master": saved.get("master") or self._configured_master_port() or free_port(),
            "master_ui": saved.get("master_ui") or free_port(),
            "workers": workers,
        }

    def _configured_master_port(self) -> int | None:
        master = self.settings.spark_master
        if not master.startswith("spark://"):
            return None
        host, _, port = master.removeprefix("spark://").rpartition(":")
        if host in LOCAL_HOSTS and port.isdigit():
            return int(port)
        return None

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.ports()['master']}"

    @property
    def master_ui(self) -> str:
        return f"http://127.0.0.1:{self.ports()['master_ui']}"

    def master_pid(self) -> int | None:
        return live_pid(
            self.master_dir / "master.pid",
            lambda cmdline: _SPARK_MASTER_CLASS in cmdline and str(self.properties_file) in cmdline,
        )

    def worker_pid(self, index: int) -> int | None:
        work_dir = str(self.work_dir(index))
        return live_pid(
            self.worker_dir(index) / "worker.pid",
            lambda cmdline: _SPARK_WORKER_CLASS in cmdline and work_dir in cmdline,
        )

    def master_state(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """The master's JSON status (workers, applications), or None when it does not answer."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.master_ui}/json/", timeout=timeout) as response:
                return dict(json.loads(response.read()))
        except (OSError, ValueError):
            return None

    def alive_workers(self) -> list[int]:
        state = self.master_state() or {}
        alive = {w.get("port") for w in state.get("workers", []) if w.get("state") == "ALIVE"}
        ports = self.ports()["workers"]
        return [i for i in range(self.workers) if ports[i]["port"] in alive]

    def processes(self) -> list[psutil.Process]:
        """The master and workers (by properties file), executors and Python workers (by cwd)."""
        root = str(self.root)
        found = []
        for process in psutil.process_iter(["cmdline", "cwd", "status"]):
            info = process.info
            cmdline = info["cmdline"] or []
            cwd = info["cwd"] or ""
            if info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if str(self.properties_file) in cmdline or (
                cwd.startswith(root + os.sep)
                and any("org.apache.spark." in part or "pyspark." in part for part in cmdline)
            ):
                found.append(process)
        return found

    def status(self) -> SparkStatus:
        master = self.master_pid()
        alive = set(self.alive_workers()) if master is not None else set()
        workers = [
            WorkerStatus(i, self.worker_pid(i), i in alive, self.worker_dir(i) / "worker.log")
            for i in range(self.workers)
        ]
        running = master is not None and all(w.pid is not None for w in workers)
        return SparkStatus(
            state="running" if running else "stopped" if master is None else "degraded",
            master_url=self.master_url if master is not None else None,
            master_ui=self.master_ui if master is not None else None,
            master_pid=master,
            workers=workers,
            root=self.root,
            log=self.master_dir / "master.log",
        )

    def start(self) -> SparkStatus:
        """Start what does not run; wait until the master lists every worker ALIVE."""
        if self.master_pid() is not None and all(
            self.worker_pid(i) is not None for i in range(self.workers)
        ):
            return dataclasses.replace(self.status(), already_running=True)
        if shutil.which("java") is None:
            raise LocalStackError("java is not on PATH: install Java 17 and try again")
        spark_class = spark_home() / "bin" / "spark-class"
        if not spark_class.is_file():
            raise LocalStackError(f"{spark_class} is missing: reinstall pyspark (`make setup`)")
        ports = self._choose_ports()
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(ports))
        # Read by the master and workers, not by applications: a taken port fails the start
        # instead of moving on silently, and no REST submission server opens a port of its own.
        self.properties_file.write_text(
            "spark.port.maxRetries 0\nspark.master.rest.enabled false\n"
        )
        launched: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        if self.master_pid() is None:
            launched["master"] = self._launch(
                "master",
                self.master_dir,
                _SPARK_MASTER_CLASS,
                ["--port", str(ports["master"]), "--webui-port", str(ports["master_ui"])],
                {},
            )
        # Workers that find no master retry only after several seconds: start them once it answers.
        self._wait(launched, lambda: self.master_state() is not None, "the master did not answer")
        for i in range(self.workers):
            if self.worker_pid(i) is not None:
                continue
            self.work_dir(i).mkdir(parents=True, exist_ok=True)
            self.local_dir(i).mkdir(parents=True, exist_ok=True)
            port, ui = ports["workers"][i]["port"], ports["workers"][i]["ui"]
            options = f"--port {port} --webui-port {ui} --cores {self.cores} --memory {self.memory}"
            launched[f"worker {i}"] = self._launch(
                "worker",
                self.worker_dir(i),
                _SPARK_WORKER_CLASS,
                [self.master_url, *options.split(), "--work-dir", str(self.work_dir(i))],
                {"SPARK_LOCAL_DIRS": str(self.local_dir(i))},
            )
        self._wait(
            launched,
            lambda: len(self.alive_workers()) == self.workers,
            f"the master did not list {self.workers} workers ALIVE",
        )
        return dataclasses.replace(self.status(), already_running=False)

    def _launch(
        self, name: str, folder: Path, main: str, args: list[str], env: dict[str, str]
    ) -> tuple[subprocess.Popen[bytes], Path]:
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"{name}.log"
        spark_class, properties = spark_home() / "bin" / "spark-class", self.properties_file
        command = [str(spark_class), main, "--host", "127.0.0.1", *args]
        command += ["--properties-file", str(properties)]
        environment = {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            # Only this cluster's configuration: nothing from a SPARK_CONF_DIR of the caller.
            "SPARK_CONF_DIR": str(self.root),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_DAEMON_MEMORY": "256m",
            **env,
        }
        process = start_daemon(command, log, folder / f"{name}.pid", cwd=folder, env=environment)
        return process, log

    def _wait(
        self,
        launched: dict[str, tuple[subprocess.Popen[bytes], Path]],
        ready: Callable[[], bool],
        failure: str,
    ) -> None:
        wait_started(
            {f"the Spark {name}": process for name, (process, _) in launched.items()},
            [log for _, log in launched.values()],
            ready,
            failure=f"{failure} ({self.master_ui}/json/)",
            timeout=120.0,
            stop=self.stop,
        )

    def kill_worker(self, index: int) -> int:
        """SIGKILL worker `index` and its executors, as if its machine died."""
        pid = self.worker_pid(index)
        if pid is None:
            raise LocalStackError(f"Spark worker {index} does not run ({self.worker_dir(index)})")
        kill_group(pid)  # it leads its group (start_daemon)
        return pid

    def stop(self) -> SparkStopped:
        """Workers (with their executors), then the master; idempotent, nothing is left."""
        pids = [self.worker_pid(i) for i in range(self.workers)] + [self.master_pid()]
        running = [pid for pid in pids if pid is not None]
        for pid in running:
            stop_group(pid, 15.0)
        # A process that left its group (none should) still belongs to the cluster's folders.
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                process.kill()
                process.wait(timeout=10)
        for pid_file in (self.master_dir / "master.pid", *self.root.glob("worker-*/worker.pid")):
            pid_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        return SparkStopped(bool(running), running)


def local_spark(settings: Settings, workers: int) -> LocalSparkCluster:
    """`duality up --spark-workers N`'s: workers of 2 cores and 2 GiB, like docker-compose.yml."""
    return LocalSparkCluster(settings, workers, cores=2, memory="2g")
