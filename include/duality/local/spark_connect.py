"""A Spark Connect server on this machine: the warm Spark that batch steps run on
(docs/decisions/0026-warm-spark-for-batch-steps.md), started with pyspark's own `spark-submit`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from duality.config import Settings
from duality.errors import LocalStackError
from duality.local.ports import LOCAL_HOSTS, free_port
from duality.local.spark_cluster import spark_home
from duality.local.startup import wait_started
from duality.process import live_pid, start_daemon, stop_group
from duality.spark import scratch_config, session_config

_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
# Work a client left behind (it was killed, or lost its connection) is interrupted this long
# after the client went, instead of Spark's 5 minutes; an idle session is released after 15
# minutes instead of 60 (a step that is running is never idle).
_REAPING = {
    "spark.connect.execute.manager.detachedTimeout": "20s",
    "spark.connect.execute.manager.maintenanceInterval": "5s",
    "spark.connect.execute.reattachable.senderMaxStreamDuration": "30s",
    "spark.connect.session.manager.defaultSessionTimeout": "15m",
}


# The server's log: warnings and errors only (Spark logs every task and every client call).
_LOGGING = """\
rootLogger.level = warn
rootLogger.appenderRef.console.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
"""


@dataclasses.dataclass(frozen=True)
class ConnectStatus:
    state: str  # running, stopped
    remote: str | None  # the address clients use, sc://127.0.0.1:<port>
    pid: int | None
    master: str | None
    log: Path
    already_running: bool | None = None  # set by `start()`


@dataclasses.dataclass(frozen=True)
class ConnectStopped:
    was_running: bool
    pid: int | None


class LocalSparkConnect:
    """One server in `root` (default `<local_dir>/spark-connect`), on the loopback address, the
    driver of an application on `settings.spark_master` (local mode or the standalone cluster)."""

    def __init__(self, settings: Settings, *, root: Path | None = None):
        self.settings = settings
        self.root = root if root is not None else settings.local_dir / "spark-connect"
        self.state_file = self.root / "server.json"
        self.properties_file = self.root / "spark-defaults.conf"
        self.pid_file = self.root / "server.pid"
        self.log = self.root / "server.log"

    def pid(self) -> int | None:
        return live_pid(
            self.pid_file,
            lambda cmdline: _SERVER_CLASS in cmdline and str(self.properties_file) in cmdline,
        )

    @property
    def remote(self) -> str:
        if not self.state_file.is_file():
            raise LocalStackError(f"the Spark Connect server in {self.root} is not running")
        return f"sc://127.0.0.1:{json.loads(self.state_file.read_text())['port']}"

    def status(self) -> ConnectStatus:
        pid = self.pid()
        master = json.loads(self.state_file.read_text())["master"] if pid is not None else None
        return ConnectStatus(
            state="running" if pid is not None else "stopped",
            remote=self.remote if pid is not None else None,
            pid=pid,
            master=master,
            log=self.log,
        )

    def _port(self) -> int:
        """The running server's port, else the one `settings.spark_remote` names here, else free."""
        if self.state_file.is_file() and self.pid() is not None:
            return int(json.loads(self.state_file.read_text())["port"])
        remote = self.settings.spark_remote or ""
        host, _, port = remote.removeprefix("sc://").split("/", 1)[0].rpartition(":")
        if host in LOCAL_HOSTS and port.isdigit():
            return int(port)
        return free_port()

    def start(self) -> ConnectStatus:
        """Start the server unless it runs; wait until it takes connections."""
        if self.pid() is not None:
            return dataclasses.replace(self.status(), already_running=True)
        if shutil.which("java") is None:
            raise LocalStackError("java is not on PATH: install Java 17 and try again")
        submit = spark_home() / "bin" / "spark-submit"
        if not submit.is_file():
            raise LocalStackError(f"{submit} is missing: reinstall pyspark (`make setup`)")
        port = self._port()
        self.root.mkdir(parents=True, exist_ok=True)
        master = self.settings.spark_master
        self.state_file.write_text(json.dumps({"port": port, "master": master}))
        config = session_config(self.settings, "duality-spark-connect")
        config |= scratch_config(self.root / "tmp")
        config |= _REAPING
        config |= {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(port),
            # Steps of different pipelines run side by side, each its jobs' fair share.
            "spark.scheduler.mode": "FAIR",
        }
        self.properties_file.write_text("".join(f"{k} {v}\n" for k, v in config.items()))
        (self.root / "log4j2.properties").write_text(_LOGGING)
        command = [str(submit), "--class", _SERVER_CLASS]
        command += ["--properties-file", str(self.properties_file)]
        environment = {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            "SPARK_CONF_DIR": str(self.root),  # nothing from a SPARK_CONF_DIR of the caller
            "SPARK_LOCAL_IP": "127.0.0.1",
            # UDFs (the repartition's copy) run in Python workers with duality importable.
            "PYSPARK_PYTHON": sys.executable,
        }
        process = start_daemon(command, self.log, self.pid_file, cwd=self.root, env=environment)
        wait_started(
            {"the Spark Connect server": process},
            [self.log],
            lambda: _answers(port),
            failure=f"the Spark Connect server did not take connections on port {port}",
            timeout=120.0,
            stop=self.stop,
        )
        return dataclasses.replace(self.status(), already_running=False)

    def stop(self) -> ConnectStopped:
        """Stop the server and what it started; idempotent."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 15.0)
        self.pid_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        shutil.rmtree(self.root / "tmp", ignore_errors=True)
        return ConnectStopped(pid is not None, pid)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False
