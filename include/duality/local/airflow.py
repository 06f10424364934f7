"""The local stack's Airflow with this checkout's `dags/` and `plugins/` (docs/operations.md)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from duality.config import Settings
from duality.errors import LocalStackError, UsageError
from duality.local.ports import free_port, port_in_use
from duality.local.postgres import LocalPostgres, PostgresStatus
from duality.local.startup import tail, wait_started
from duality.process import end_processes, kill_group, live_pid, start_daemon, wait_exited

_START_TIMEOUT_S = 300.0
AIRFLOW_USER = "admin"
# Airflow's long-running components, each `airflow <name>` in a process of its own on
# PostgreSQL, after `airflow db migrate`: the commands of docker-compose.yml's Airflow services.
AIRFLOW_COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
AIRFLOW_MIGRATE = ("db", "migrate")


@dataclasses.dataclass(frozen=True)
class ComponentStatus:
    pid: int | None
    log: Path


@dataclasses.dataclass(frozen=True)
class AirflowStatus:
    db: str  # what it runs on: sqlite (standalone) or postgres (its components)
    url: str
    user: str
    password_file: Path
    home: Path
    state: str  # running, degraded (a component or the database is missing), stopped
    pid: int | None  # of standalone, or of the API server
    log: Path
    components: dict[str, ComponentStatus]  # standalone, or AIRFLOW_COMPONENTS
    healthy: bool
    postgres: PostgresStatus | None = None
    # Set by `start()`: whether all of it ran before it was asked to, and the admin's password.
    already_running: bool | None = None
    password: str | None = None


@dataclasses.dataclass(frozen=True)
class AirflowStopped:
    was_running: bool
    pid: int | None  # of standalone, or of the API server
    pids: dict[str, int]  # by component
    leftovers: list[int]  # what the components had started and left behind
    postgres: int | None  # the database server's pid


class LocalAirflow:
    """`airflow standalone` on SQLite, or (`DUALITY_AIRFLOW_DB=postgres`) each of
    `AIRFLOW_COMPONENTS` in its own process group on `LocalPostgres`, as docker-compose.yml; its
    tasks get every `DUALITY_*` setting, so they see the stack of the command that started it."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.home = settings.local_dir / "airflow"
        self.pid_file = self.home / "standalone.pid"
        self.log_file = self.home / "standalone.log"
        self.password_file = self.home / "passwords.json"
        self.postgres = LocalPostgres(settings)

    @property
    def port(self) -> int:
        return airflow_port(self.settings.airflow_url)

    def password(self) -> str:
        """The admin password; generated once per Airflow home."""
        if not self.password_file.is_file():
            self.home.mkdir(parents=True, exist_ok=True)
            secret = base64.urlsafe_b64encode(os.urandom(12)).decode()
            self.password_file.write_text(json.dumps({AIRFLOW_USER: secret}))
            self.password_file.chmod(0o600)
        return str(json.loads(self.password_file.read_text())[AIRFLOW_USER])

    def environment(self) -> dict[str, str]:
        """The environment Airflow and its tasks run with."""
        settings = self.settings
        # The Kafka provider's form: librdkafka properties in the extra, the login included.
        # Airflow masks `sasl.password` in task logs (a key with "password" in its name).
        kafka_extra = settings.kafka_client_config()
        secret_file = self.home / "jwt_secret"
        if not secret_file.is_file():
            self.home.mkdir(parents=True, exist_ok=True)
            secret_file.write_text(base64.urlsafe_b64encode(os.urandom(24)).decode())
        local = f"http://localhost:{self.port}"
        # The Spark provider's form; its password is the batch server's secret, which Airflow
        # masks in task logs, and which the hook gives the tasks' steps.
        spark = {"conn_type": "spark", "host": settings.spark_master}
        secret = settings.read_batch_server_secret() if settings.batch_server else None
        if secret is not None:
            spark["password"] = secret
        airflow = {
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(settings.home / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(settings.home / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{AIRFLOW_USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.password_file),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{local}/execution/",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__BASE_URL": settings.airflow_url.rstrip("/"),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secret_file.read_text().strip(),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
            "AIRFLOW_CONN_KAFKA_DEFAULT": json.dumps({"conn_type": "kafka", "extra": kafka_extra}),
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(spark),
            "NO_COLOR": "1",
            # Airflow's own processes need not probe the network for analytics.
            "SCARF_ANALYTICS": "false",
            "GX_ANALYTICS_ENABLED": "False",
        }
        if settings.airflow_db == "postgres":
            airflow["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = self.postgres.url()
            # The scheduler's and triggerer's servers (task logs, health) listen on fixed ports
            # by default: ports of this stack's own, so that two stacks on a machine never meet.
            ports = self._server_ports()
            airflow |= {
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(ports["worker_log_server"]),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(ports["trigger_log_server"]),
                "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_HOST": "127.0.0.1",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(ports["health"]),
            }
        # Standalone runs its components as `airflow ...` from PATH: this interpreter's one.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**settings.process_env(), **airflow, "PATH": path}

    def _server_ports(self) -> dict[str, int]:
        """Chosen free while no component runs; kept in `ports.json` for a restarted one."""
        saved = self.home / "ports.json"
        if saved.is_file() and any(map(self.component_pid, AIRFLOW_COMPONENTS)):
            return dict(json.loads(saved.read_text()))
        ports = {
            name: free_port() for name in ("worker_log_server", "trigger_log_server", "health")
        }
        saved.write_text(json.dumps(ports))
        return ports

    def pid(self) -> int | None:  # of `airflow standalone`
        return live_pid(
            self.pid_file,
            lambda cmdline: "standalone" in cmdline and any(p.endswith("airflow") for p in cmdline),
        )

    def component_log(self, name: str) -> Path:
        return self.home / f"{name}.log"

    def component_pid(self, name: str) -> int | None:
        # The API server's process title says `airflow api_server -- ...`.
        return live_pid(
            self.home / f"{name}.pid",
            lambda cmdline: f"airflow {name}" in " ".join(cmdline).replace("_", "-"),
        )

    def running_db(self) -> str | None:
        """What the Airflow of this home runs on now (`sqlite`, `postgres`), or None."""
        if self.pid() is not None:
            return "sqlite"
        if self.postgres.pid() is not None or any(map(self.component_pid, AIRFLOW_COMPONENTS)):
            return "postgres"
        return None

    def health(self, timeout: float = 3.0) -> dict[str, Any] | None:
        """Airflow's own health document, or None when the API server does not answer."""
        import urllib.request

        url = f"http://localhost:{self.port}/api/v2/monitor/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return dict(json.loads(response.read()))
        except (OSError, ValueError):
            return None

    def status(self) -> AirflowStatus:
        db = self.running_db() or self.settings.airflow_db
        database = None
        if db == "sqlite":
            components = {"standalone": ComponentStatus(self.pid(), self.log_file)}
            up = [components["standalone"].pid is not None]
        else:
            components = {
                name: ComponentStatus(self.component_pid(name), self.component_log(name))
                for name in AIRFLOW_COMPONENTS
            }
            database = self.postgres.status()
            up = [c.pid is not None for c in components.values()] + [database.pid is not None]
        state = "running" if all(up) else "degraded" if any(up) else "stopped"
        main = components.get("standalone") or components["api-server"]
        return AirflowStatus(
            db=db,
            url=self.settings.airflow_url,
            user=AIRFLOW_USER,
            password_file=self.password_file,
            home=self.home,
            state=state,
            pid=main.pid,
            log=main.log,
            components=components,
            healthy=state != "stopped" and _healthy(self.health()),
            postgres=database,
        )

    def start(self, progress: Callable[[str], None] = lambda _: None) -> AirflowStatus:
        """Start what does not run; wait until every component is healthy."""
        wanted = self.settings.airflow_db
        running = self.running_db()
        if running is not None and running != wanted:
            raise UsageError(
                f"the Airflow of {self.home} runs on {running}, and DUALITY_AIRFLOW_DB={wanted}: "
                "stop it first with `duality down`, or start it with the database it runs on"
            )
        for folder in ("dags", "plugins"):
            if not (self.settings.home / folder).is_dir():
                raise LocalStackError(
                    f"{self.settings.home / folder} is missing: set DUALITY_HOME to the checkout"
                )
        start = self._start_standalone if wanted == "sqlite" else self._start_components
        started = start(progress)
        return dataclasses.replace(
            self.status(), already_running=not started, password=self.password()
        )

    def _check_port(self) -> None:
        if port_in_use("127.0.0.1", self.port):
            raise LocalStackError(
                f"port {self.port} is taken by another process: stop it, or point "
                "DUALITY_AIRFLOW_URL at a free port (http://localhost:<port>)"
            )

    def _start_standalone(self, progress: Callable[[str], None]) -> bool:
        """Returns whether it started anything."""
        if self.pid() is not None:
            return False
        self._check_port()
        self.password()  # the file Airflow reads the admin's password from
        process = self._launch("standalone", self.environment())
        progress("starting Airflow (database, scheduler, DAG processor, triggerer, API server)")
        self._wait_healthy({"standalone": process})
        return True

    def _start_components(self, progress: Callable[[str], None]) -> bool:
        """Returns whether it started anything."""
        missing = [name for name in AIRFLOW_COMPONENTS if self.component_pid(name) is None]
        if not missing and self.postgres.pid() is not None:
            return False
        if "api-server" in missing:
            self._check_port()
        self.password()  # the file Airflow reads the admin's password from
        progress("starting PostgreSQL")
        self.postgres.start()
        environment = self.environment()
        if len(missing) == len(AIRFLOW_COMPONENTS):
            progress("migrating Airflow's database (airflow db migrate)")
            self._migrate(environment)
        launched = {}
        since = time.time()
        for name in missing:
            self._clear_predecessor(name)
            launched[name] = self._launch(name, environment)
        progress(f"starting Airflow's {', '.join(missing)} on PostgreSQL")
        self._wait_healthy(launched, since)
        return True

    def _launch(self, name: str, environment: dict[str, str]) -> subprocess.Popen[bytes]:
        """`airflow <name>` (`standalone`, or a component), its log and pid file named for it."""
        log, pid_file = self.component_log(name), self.home / f"{name}.pid"
        return start_daemon([str(_airflow()), name], log, pid_file, cwd=self.home, env=environment)

    def _migrate(self, environment: dict[str, str]) -> None:
        log = self.home / "db-migrate.log"
        with open(log, "ab") as out:
            done = subprocess.run(
                [str(_airflow()), *AIRFLOW_MIGRATE],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.home,
                env=environment,
                timeout=_START_TIMEOUT_S,
                check=False,
            )
        if done.returncode != 0:
            raise LocalStackError(
                f"`airflow {' '.join(AIRFLOW_MIGRATE)}` failed with code {done.returncode}; "
                f"last lines of {log}:\n{tail(log)}"
            )

    def _clear_predecessor(self, name: str) -> None:
        """End what a killed predecessor of `name` left in its session (side servers on the
        ports, idle workers, its database sessions, which its workers hold open); workers
        running a task finish it, and `stop()` ends them later."""
        try:
            session = int((self.home / f"{name}.pid").read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        members = []
        for process in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(process.pid) == session and self._ours(process):
                    members.append(process)
        busy: set[int] = set()
        for process in members:
            with contextlib.suppress(psutil.Error):
                title = " ".join(process.cmdline()).strip()  # a title pads with ''
                if title.startswith("airflow worker") and not title.endswith("<idle>"):
                    busy.add(process.pid)
                    busy.update(child.pid for child in process.children(recursive=True))
        self.postgres.end_sessions_held_by(members)
        end_processes([p for p in members if p.pid not in busy], self.settings.kill_grace_s)

    def _wait_healthy(
        self, launched: dict[str, subprocess.Popen[bytes]], since: float = 0.0
    ) -> None:
        """Each launched component must beat after `since`: a predecessor's beat is healthy."""
        wait_started(
            {f"Airflow's {name}": process for name, process in launched.items()},
            [self.component_log(name) for name in launched],
            lambda: _healthy(self.health(), {name: since for name in launched}),
            failure=f"Airflow did not become healthy on {self.settings.airflow_url}",
            timeout=_START_TIMEOUT_S,
            stop=self.stop,
            interval=1,
        )

    def stop(self) -> AirflowStopped:
        """Stop whichever runs, whatever DUALITY_AIRFLOW_DB says now, its `leftovers` and
        PostgreSQL; standalone shuts down on SIGINT, the components on SIGTERM."""
        pids = {"standalone": self.pid()} | {n: self.component_pid(n) for n in AIRFLOW_COMPONENTS}
        running = {name: pid for name, pid in pids.items() if pid is not None}
        processes = []
        for name, pid in running.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                process.send_signal(signal.SIGINT if name == "standalone" else signal.SIGTERM)
                processes.append(process)
        wait_exited(processes, 30.0)
        for pid in running.values():  # each leads its own group (start_daemon)
            kill_group(pid)
        left = self.leftovers()
        end_processes(left, self.settings.kill_grace_s)
        database = self.postgres.stop()
        for name in pids:
            (self.home / f"{name}.pid").unlink(missing_ok=True)
        return AirflowStopped(
            was_running=bool(running) or database is not None,
            pid=running.get("standalone") or running.get("api-server"),
            pids=running,
            leftovers=[process.pid for process in left],
            postgres=database,
        )

    def leftovers(self) -> list[psutil.Process]:
        """What this Airflow started and outlived its component (a killed scheduler's workers);
        not the streams, which tasks start detached on purpose."""
        me = psutil.Process()
        spared = {me.pid, *(parent.pid for parent in me.parents())}
        return [
            process
            for process in psutil.process_iter(["status"])
            if process.pid not in spared
            and process.info["status"] != psutil.STATUS_ZOMBIE
            and self._ours(process)
            and not _in_a_stream(process.pid)
        ]

    def _ours(self, process: psutil.Process) -> bool:
        """By its environment, or where a process title hides that, by title and folder."""
        home = str(self.home)
        try:
            env = process.environ()
            if env.get("AIRFLOW_HOME") == home and "AIRFLOW__API_AUTH__JWT_SECRET" in env:
                return True
            cwd = process.cwd()
            title = " ".join(process.cmdline()).strip()
        except psutil.Error:
            return False
        in_home = cwd == home or cwd.startswith(home + os.sep)
        return in_home and title.startswith(("airflow ", "[airflow"))


def _in_a_stream(pid: int) -> bool:
    """Whether `pid` is in the session of a stream (`python -m duality.stream`)."""
    try:
        leader = psutil.Process(os.getsid(pid))
        return "duality.stream" in leader.cmdline()
    except (OSError, psutil.Error):
        return False


def _airflow() -> Path:
    return Path(sys.executable).with_name("airflow")


def airflow_port(url: str) -> int:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            f"DUALITY_AIRFLOW_URL={url!r} is not an http URL: write it like http://localhost:8080"
        )
    return parts.port or (443 if parts.scheme == "https" else 80)


def _healthy(health: dict[str, Any] | None, beaten_since: dict[str, float] | None = None) -> bool:
    """Every part healthy, each of `beaten_since` with a heartbeat since then (epoch s)."""
    if not health:
        return False
    parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
    if not all((health.get(part) or {}).get("status") == "healthy" for part in parts):
        return False
    for component, since in (beaten_since or {}).items():
        part = component.replace("-", "_")
        beat = (health.get(part) or {}).get(f"latest_{part}_heartbeat")
        if part in parts and (not beat or datetime.fromisoformat(beat).timestamp() < since):
            return False
    return True
