"""The local stack's PostgreSQL server, with the metadata database of Airflow's components."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from duality.config import Settings
from duality.errors import LocalStackError
from duality.local.ports import free_port, port_in_use
from duality.local.startup import wait_started
from duality.process import live_pid, start_daemon, stop_group

# The role and database Airflow uses: the same names as docker-compose.yml's postgres service.
AIRFLOW_DB_USER = "airflow"
AIRFLOW_DB_NAME = "airflow"
# Airflow's SQLAlchemy driver; Airflow derives its async engine's (asyncpg) from it.
AIRFLOW_DB_DRIVER = "postgresql+psycopg2"
# PostgreSQL refuses to run as root; then its programs run as Debian's user of the server.
POSTGRES_OS_USER = "postgres"


def postgres_programs() -> Path:
    """Debian's newest /usr/lib/postgresql/<major>/bin, else the folder of `initdb` on PATH."""
    folders = sorted(
        (p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")),
        key=lambda folder: int(folder.parent.name) if folder.parent.name.isdigit() else 0,
    )
    on_path = shutil.which("initdb")
    if on_path:
        folders.insert(0, Path(on_path).resolve().parent)
    for folder in reversed(folders):
        if (folder / "postgres").is_file():
            return folder
    raise LocalStackError(
        "PostgreSQL's server programs (initdb, postgres) are not installed: install Debian's "
        "postgresql package (apt-get install postgresql; `make test` does it), or run Airflow "
        "standalone with DUALITY_AIRFLOW_DB=sqlite"
    )


def _server_user() -> tuple[int, int] | None:
    """(uid, gid) to run PostgreSQL's programs as when we are root."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        user = pwd.getpwnam(POSTGRES_OS_USER)
    except KeyError:
        raise LocalStackError(
            f"PostgreSQL refuses to run as root, and there is no user {POSTGRES_OS_USER!r} to run "
            "it as: install Debian's postgresql package (it makes the user), or run duality as "
            "a user other than root"
        ) from None
    return user.pw_uid, user.pw_gid


@dataclasses.dataclass(frozen=True)
class PostgresStatus:
    state: str  # running, stopped
    pid: int | None
    port: int | None
    reachable: bool
    data_dir: Path
    log: Path


class LocalPostgres:
    """All under `<local_dir>/postgres`, on 127.0.0.1 with a password; run by root, it runs as
    Debian's `postgres` user, who must be able to reach `<local_dir>`."""

    def __init__(self, settings: Settings):
        self.root = settings.local_dir / "postgres"
        self.data_dir = self.root / "data"
        self.socket_dir = self.root / "run"
        self.password_file = self.root / "password"
        self.port_file = self.root / "port"
        self.pid_file = self.root / "postgres.pid"
        self.log_file = self.root / "postgres.log"

    def pid(self) -> int | None:
        data = str(self.data_dir)
        return live_pid(self.pid_file, lambda cmdline: "-D" in cmdline and data in cmdline)

    def port(self) -> int | None:
        try:
            return int(self.port_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def url(self) -> str:  # Airflow's `sql_alchemy_conn`
        from urllib.parse import quote

        port = self.port()
        if port is None or not self.password_file.is_file():
            raise LocalStackError(
                f"the PostgreSQL server in {self.root} was never started: start the stack with "
                "`duality up` (DUALITY_AIRFLOW_DB=postgres)"
            )
        secret = quote(self.password_file.read_text().strip(), safe="")
        return (
            f"{AIRFLOW_DB_DRIVER}://{AIRFLOW_DB_USER}:{secret}@127.0.0.1:{port}/{AIRFLOW_DB_NAME}"
        )

    def _connect(self, database: str = AIRFLOW_DB_NAME, timeout: int = 3) -> Any:
        import psycopg2

        return psycopg2.connect(
            host="127.0.0.1",
            port=self.port(),
            user=AIRFLOW_DB_USER,
            password=self.password_file.read_text().strip(),
            dbname=database,
            connect_timeout=timeout,
        )

    def _answers(self, database: str = AIRFLOW_DB_NAME) -> bool:
        import psycopg2

        try:
            self._connect(database).close()
            return True
        except psycopg2.OperationalError:
            return False

    def end_sessions_held_by(self, processes: Iterable[psutil.Process]) -> int:
        """End the database sessions whose client sockets `processes` hold; returns how many.
        The workers a killed scheduler forked hold its sockets, so its sessions outlive it with
        whatever transaction it was in: its row locks kept the next scheduler from queueing any
        task (tasks stayed `scheduled`). The workers themselves never use the database."""
        port = self.port()
        if port is None or self.pid() is None:
            return 0
        clients = set()
        for process in processes:
            with contextlib.suppress(psutil.Error):
                for connection in process.net_connections(kind="tcp"):
                    if connection.raddr and connection.raddr.port == port:
                        clients.add(connection.laddr.port)
        if not clients:
            return 0
        database = self._connect()
        try:
            database.autocommit = True
            with database.cursor() as cursor:
                cursor.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE client_port = ANY(%s) AND pid <> pg_backend_pid()",
                    (sorted(clients),),
                )
                row = cursor.fetchone()
        finally:
            database.close()
        return int(row[0]) if row else 0

    def status(self) -> PostgresStatus:
        pid = self.pid()
        return PostgresStatus(
            state="running" if pid is not None else "stopped",
            pid=pid,
            port=self.port(),
            reachable=pid is not None and self._answers(),
            data_dir=self.data_dir,
            log=self.log_file,
        )

    def start(self) -> None:
        """Unless it runs; wait until it answers and the `airflow` database exists."""
        if self.pid() is not None:
            return
        programs = postgres_programs()
        owner = _server_user()
        as_owner: dict[str, Any] = (
            {} if owner is None else {"user": owner[0], "group": owner[1], "extra_groups": []}
        )
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.data_dir / "PG_VERSION").is_file():
            self._initdb(programs, owner, as_owner)
        port = self.port()
        if port is None or port_in_use("127.0.0.1", port):
            port = free_port()
            self.port_file.write_text(f"{port}\n")
        command = [str(programs / "postgres"), "-D", str(self.data_dir), "-h", "127.0.0.1"]
        command += ["-p", str(port), "-k", str(self.socket_dir)]
        process = start_daemon(
            command, self.log_file, self.pid_file, cwd=self.root, env=_server_env(), **as_owner
        )
        wait_started(
            {"PostgreSQL": process},
            [self.log_file],
            lambda: self._answers("postgres"),
            failure=f"PostgreSQL did not answer on 127.0.0.1:{port}",
            timeout=60.0,
            stop=self.stop,
        )
        self._create_database()

    def _initdb(
        self, programs: Path, owner: tuple[int, int] | None, as_owner: dict[str, Any]
    ) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)  # what a failed first start left
        for folder in (self.data_dir, self.socket_dir):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self.password_file.is_file():
            self.password_file.write_text(base64.urlsafe_b64encode(os.urandom(18)).decode())
        self.password_file.chmod(0o600)
        if owner is not None:
            self.root.chmod(0o711)  # the server's user passes through to its folders
            for path in (self.data_dir, self.socket_dir, self.password_file):
                os.chown(path, *owner)
            reach = subprocess.run(["test", "-w", str(self.data_dir)], check=False, **as_owner)
            if reach.returncode != 0:
                raise LocalStackError(
                    f"PostgreSQL refuses to run as root, and its user {POSTGRES_OS_USER!r} cannot "
                    f"reach {self.data_dir}: let others pass through the folders above it "
                    "(chmod o+x), or set DUALITY_LOCAL_DIR to a folder they can reach"
                )
        command = [str(programs / "initdb"), "-D", str(self.data_dir), "-U", AIRFLOW_DB_USER]
        command += [f"--pwfile={self.password_file}", "--auth=scram-sha-256", "--encoding=UTF8"]
        command += ["--no-locale", "--no-instructions"]
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.root,
            env=_server_env(),
            check=False,
            **as_owner,
        )
        if result.returncode != 0:
            raise LocalStackError(
                f"initdb of {self.data_dir} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )

    def _create_database(self) -> None:
        connection = self._connect("postgres")
        try:
            connection.autocommit = True  # CREATE DATABASE runs outside a transaction
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (AIRFLOW_DB_NAME,))
                if cursor.fetchone() is None:
                    cursor.execute(f'CREATE DATABASE "{AIRFLOW_DB_NAME}"')
        finally:
            connection.close()

    def stop(self) -> int | None:
        """Fast shutdown (SIGINT: a clean checkpoint); returns the pid it stopped, if it ran."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, 30.0, signal.SIGINT)
        self.pid_file.unlink(missing_ok=True)
        return pid


def _server_env() -> dict[str, str]:  # no PG* variables of the caller's
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}
