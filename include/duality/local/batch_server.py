"""The batch server of the local stack (`duality batch-server`, `duality.batch_server`): the warm
Spark that batch steps run on (docs/decisions/0026-warm-spark-for-batch-steps.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from duality.batch_server import server_report
from duality.config import PREFIX, Settings
from duality.errors import LocalStackError
from duality.local.ports import LOCAL_HOSTS, free_port
from duality.local.startup import wait_started
from duality.process import live_pid, start_daemon, stop_group

# The server's Spark log: warnings and errors only (Spark logs every task).
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
class BatchServerStatus:
    state: str  # running, stopped
    address: str | None  # what DUALITY_BATCH_SERVER is set to, 127.0.0.1:<port>
    pid: int | None
    master: str | None
    log: Path
    steps: list[str] | None = None  # the commands it runs; None when it does not answer
    already_running: bool | None = None  # set by `start()`


@dataclasses.dataclass(frozen=True)
class BatchServerStopped:
    was_running: bool
    pid: int | None


class LocalBatchServer:
    """One server in `root` (default `<local_dir>/batch-server`), on the loopback address, the
    driver of an application on `settings.spark_master` (local mode or the standalone cluster)."""

    def __init__(self, settings: Settings, *, root: Path | None = None):
        self.settings = settings
        self.root = root if root is not None else settings.local_dir / "batch-server"
        self.state_file = self.root / "server.json"
        self.pid_file = self.root / "server.pid"
        self.log = self.root / "server.log"

    def pid(self) -> int | None:
        if not self.state_file.is_file():
            return None
        port = json.loads(self.state_file.read_text())["port"]
        return live_pid(
            self.pid_file, lambda cmdline: "batch-server" in cmdline and str(port) in cmdline
        )

    @property
    def address(self) -> str:
        if not self.state_file.is_file():
            raise LocalStackError(f"the batch server in {self.root} is not running")
        return f"127.0.0.1:{json.loads(self.state_file.read_text())['port']}"

    def status(self) -> BatchServerStatus:
        pid = self.pid()
        if pid is None:
            return BatchServerStatus("stopped", None, None, None, self.log)
        steps = None
        with contextlib.suppress(OSError, ValueError):  # still starting, or stopping
            report = server_report(self.address, timeout=2.0)
            steps = [step["command"] for step in report["steps"]]
        master = json.loads(self.state_file.read_text())["master"]
        return BatchServerStatus("running", self.address, pid, master, self.log, steps)

    def _port(self) -> int:
        """The port it last ran on (clients know it), else the one `settings.batch_server` names
        on this machine, else a free one."""
        if self.state_file.is_file():
            return int(json.loads(self.state_file.read_text())["port"])
        host, _, port = (self.settings.batch_server or "").rpartition(":")
        if host in LOCAL_HOSTS and port.isdigit():
            return int(port)
        return free_port()

    def start(self, timeout: float = 600.0) -> BatchServerStatus:
        """Start the server unless it runs; wait until it takes steps (its Spark started and
        warmed). A server that exits fails at once; the deadline is for one that hangs: on a
        busy machine, the first job of a cluster's executors, which start cold, took over 180 s
        (a CI run with three stacks starting side by side on two cores)."""
        if self.pid() is not None:
            return dataclasses.replace(self.status(), already_running=True)
        if shutil.which("java") is None:
            raise LocalStackError("java is not on PATH: install Java 17 and try again")
        port = self._port()
        self.root.mkdir(parents=True, exist_ok=True)
        master = self.settings.spark_master
        self.state_file.write_text(json.dumps({"port": port, "master": master}))
        (self.root / "log4j2.properties").write_text(_LOGGING)
        command = [sys.executable, "-m", "duality.cli", "batch-server"]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        # Its log4j2.properties, named to its driver's JVM, and pyspark's own configuration
        # folder, nothing of the caller's: the driver's class path is then the one its class
        # archive was made with (decision 31), which a folder of its own would not be.
        logging = f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}"
        environment = {
            **os.environ,
            **self.settings.as_env(),
            "SPARK_SUBMIT_OPTS": f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {logging}".strip(),
        }
        environment.pop("SPARK_CONF_DIR", None)
        environment.pop(f"{PREFIX}BATCH_SERVER", None)
        process = start_daemon(command, self.log, self.pid_file, cwd=self.root, env=environment)
        wait_started(
            {"the batch server": process},
            [self.log],
            lambda: _answers(port),
            failure=f"the batch server did not take steps on port {port}",
            timeout=timeout,
            stop=self.stop,
        )
        return dataclasses.replace(self.status(), already_running=False)

    def stop(self) -> BatchServerStopped:
        """Stop the server (its steps are interrupted) and its Spark; idempotent."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 30.0)
        self.pid_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        return BatchServerStopped(pid is not None, pid)


def _answers(port: int) -> bool:
    """Whether the server takes connections: it listens only once its Spark is warm."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as probe:
            probe.sendall(b"{}\n")  # not a step: the server closes the connection
            return True
    except OSError:
        return False
