"""The local stack: a single-node KRaft Kafka broker run from the Maven-fetched jars, a Spark
standalone cluster from pyspark's own scripts, and Airflow: standalone on SQLite, or its
components as separate processes on a PostgreSQL server of the stack's own.

`LocalBroker` formats its storage on first start, starts `kafka.Kafka` detached with its data,
logs and pid file under `<local_dir>/kafka`, waits until the broker answers, and stops it without
leaving a process behind. Starting a running broker reports it instead of starting another.
`LocalSparkCluster`, `LocalPostgres` and `LocalAirflow` follow the same pattern.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from duality import kafka
from duality.config import STACK_FILE, Settings, jaas_quote, java_properties
from duality.errors import BrokerUnavailable, DualityError, LocalStackError, UsageError
from duality.process import end_processes, live_pid, start_daemon, stop_group, wait_exited

_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_MAIN_CLASS = "kafka.Kafka"
_START_TIMEOUT_S = 90.0
_STOP_TIMEOUT_S = 30.0

# Tuned so that compaction is visible within seconds: short segments, an eager cleaner.
_DEV_BROKER_CONFIG = {
    "num.partitions": "1",
    "auto.create.topics.enable": "false",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "8",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "log.roll.ms": "10000",
    "log.cleaner.backoff.ms": "500",
    "log.cleaner.min.cleanable.ratio": "0.01",
    "log.cleaner.min.compaction.lag.ms": "0",
    "log.cleaner.dedupe.buffer.size": "33554432",
    "log.retention.check.interval.ms": "5000",
    "log.segment.delete.delay.ms": "1000",
}

_LOG4J2 = """\
status = warn
appender.file.type = RollingFile
appender.file.name = server
appender.file.fileName = {logs}/server.log
appender.file.filePattern = {logs}/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = info
rootLogger.appenderRef.file.ref = server
logger.cleaner.name = kafka.log.LogCleaner
logger.cleaner.level = info
"""


SCRAM_MECHANISM = "SCRAM-SHA-512"
# The user the nodes of a SCRAM broker or cluster log in as to each other.
BROKER_USER = "duality-broker"
_SCRAM_ITERATIONS = 4096
_SCRAM_USER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@-")


def _secret() -> str:
    return base64.urlsafe_b64encode(os.urandom(24)).decode()


@dataclasses.dataclass(frozen=True)
class Scram:
    """SCRAM-SHA-512 logins of a local broker or cluster (docs/decisions/0014-sasl-scram.md).

    Clients reach it on a SASL_PLAINTEXT listener; the nodes log in to each other as
    `BROKER_USER` on the same listener, with `broker_password`; the KRaft controller listener
    stays PLAINTEXT. The users (name -> password) and the broker user are created when the
    storage is formatted, from salted passwords computed here, so no password is on a command
    line. With `acls`, the StandardAuthorizer denies what no ACL allows, except to
    `super_users` (and the nodes themselves).
    """

    users: Mapping[str, str] = dataclasses.field(repr=False)
    acls: bool = False
    super_users: tuple[str, ...] = ()
    broker_password: str = dataclasses.field(default_factory=_secret, repr=False)

    def __post_init__(self) -> None:
        for name in [*self.users, *self.super_users]:
            if not name or not set(name) <= _SCRAM_USER_CHARS or name == BROKER_USER:
                raise UsageError(
                    f"SCRAM user name {name!r} of the local broker: use letters, digits and "
                    f"'._@-' only, and not {BROKER_USER!r}"
                )
        for name, password in self.users.items():
            if not password:
                raise UsageError(f"SCRAM user {name!r} of the local broker needs a password")

    @classmethod
    def from_settings(cls, settings: Settings) -> Scram:
        """The one login `settings` name, for a local broker they will reach (`duality up`)."""
        if (
            settings.security_protocol != "SASL_PLAINTEXT"
            or settings.sasl_mechanism != SCRAM_MECHANISM
            or not settings.sasl_username
            or not settings.sasl_password
        ):
            raise UsageError(
                "a local broker with SCRAM logins needs DUALITY_SECURITY_PROTOCOL=SASL_PLAINTEXT, "
                f"DUALITY_SASL_MECHANISM={SCRAM_MECHANISM}, DUALITY_SASL_USERNAME and "
                "DUALITY_SASL_PASSWORD: set them"
            )
        return cls({settings.sasl_username: settings.sasl_password})

    def login(self, settings: Settings, user: str) -> Settings:
        """`settings` that log in as `user` (one of `users`)."""
        return settings.replace(
            security_protocol="SASL_PLAINTEXT",
            sasl_mechanism=SCRAM_MECHANISM,
            sasl_username=user,
            sasl_password=self.users[user],
        )


def _scram_argument(user: str, password: str) -> str:
    """StorageTool's `--add-scram` value for one user, with a salted password (RFC 5802's
    Hi(): PBKDF2 with HMAC-SHA-512), so the password itself is not on the command line."""
    salt = os.urandom(32)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, _SCRAM_ITERATIONS)
    encode = base64.b64encode
    return (
        f"{SCRAM_MECHANISM}=[name={user},salt={encode(salt).decode()},"
        f"saltedpassword={encode(salted).decode()},iterations={_SCRAM_ITERATIONS}]"
    )


@dataclasses.dataclass(frozen=True)
class QuorumNode:
    """One KRaft node (broker and controller) of a local cluster: its id and ports."""

    node_id: int
    port: int
    controller_port: int


class LocalBroker:
    """The dev broker of one `local_dir`, listening where `settings.bootstrap_servers` says.

    With `quorum`, it is node `node_id` of that KRaft quorum instead (`LocalKafkaCluster`): its
    own ports, its own folder `kafka-<id>`, and the cluster id all nodes were formatted with.
    With `scram`, clients log in with SCRAM-SHA-512 on a SASL_PLAINTEXT listener (`Scram`);
    `settings` must then log in as one of its users.
    """

    def __init__(
        self,
        settings: Settings,
        node_id: int = 1,
        quorum: tuple[QuorumNode, ...] = (),
        cluster_id: str | None = None,
        *,
        scram: Scram | None = None,
    ):
        self.settings = settings
        self.node_id = node_id
        self.quorum = quorum
        self.cluster_id = cluster_id
        self.scram = scram
        self.root = settings.local_dir / ("kafka" if not quorum else f"kafka-{node_id}")
        self.data_dir = self.root / "data"
        self.logs_dir = self.root / "logs"
        self.config_file = self.root / "server.properties"
        self.pid_file = self.root / "broker.pid"
        # The node's java.io.tmpdir: what its JVM unpacks (LZ4's native library) stays in its
        # folder, and a killed node's leftovers are cleared when it starts again.
        self.tmp_dir = self.root / "tmp"
        self.jar_dir = settings.jar_cache / "broker"

    # -- what is there ---------------------------------------------------------------------

    @property
    def log_file(self) -> Path:
        return self.logs_dir / "server.log"

    def pid(self) -> int | None:
        """The pid of this broker's running process, or None (a stale pid file is ignored)."""
        return live_pid(self.pid_file, _runs_config(self.config_file))

    def _listening(self) -> str | None:
        if self.pid() is None or not self.config_file.is_file():
            return None
        for line in self.config_file.read_text().splitlines():
            if line.startswith("advertised.listeners="):
                # Written by `java_properties`: ':' and '=' escaped with a backslash.
                return re.sub(r"\\(.)", r"\1", line).split("://", 1)[1]
        return None

    def status(self) -> dict[str, Any]:
        pid = self.pid()
        reachable = False
        if pid is not None:
            address = self._listening() or self.settings.bootstrap_servers
            try:
                kafka.ensure_reachable(self.settings.replace(bootstrap_servers=address), timeout=3)
                reachable = True
            except DualityError:  # no answer, or a refused login
                reachable = False
        return {
            "state": "running" if pid is not None else "stopped",
            "pid": pid,
            # Where the running broker listens, which may differ from the current settings.
            "bootstrap_servers": self._listening() or self.settings.bootstrap_servers,
            "reachable": reachable,
            "data_dir": str(self.data_dir),
            "log": str(self.log_file),
        }

    # -- start -----------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start the broker unless it runs already; returns its status plus `already_running`."""
        if self.pid() is not None:
            return {**self.status(), "already_running": True}
        self._check_can_start()
        self._wait_until_ready(self._prepare_and_launch())
        return {**self.status(), "already_running": False}

    def _prepare_and_launch(self) -> subprocess.Popen[bytes]:
        """Write the config, format the storage once, launch the node and record its pid."""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir()
        self._write_config()
        if not (self.data_dir / "meta.properties").is_file():
            self._format_storage()
        return self._launch()

    def _check_can_start(self) -> None:
        host = self.settings.first_bootstrap[0]
        if host not in _LOCAL_HOSTS or "," in self.settings.bootstrap_servers:
            raise UsageError(
                f"DUALITY_BOOTSTRAP_SERVERS={self.settings.bootstrap_servers!r} names a remote "
                "cluster; `duality up` starts a broker on this machine only: unset the variable "
                "or set it to localhost:<port>"
            )
        if self.scram is not None:
            user = self.settings.sasl_username
            if (
                self.settings.security_protocol != "SASL_PLAINTEXT"
                or self.settings.sasl_mechanism != SCRAM_MECHANISM
                or user not in self.scram.users
            ):
                raise UsageError(
                    "the local broker takes SCRAM logins: set DUALITY_SECURITY_PROTOCOL="
                    f"SASL_PLAINTEXT, DUALITY_SASL_MECHANISM={SCRAM_MECHANISM} and "
                    "DUALITY_SASL_USERNAME to one of its users "
                    f"({', '.join(sorted(self.scram.users))})"
                )
        elif self.settings.security_protocol != "PLAINTEXT":
            raise UsageError(
                f"DUALITY_SECURITY_PROTOCOL={self.settings.security_protocol}: this local broker "
                "speaks PLAINTEXT; unset the variable, or start it with SCRAM logins"
            )
        if shutil.which("java") is None:
            raise LocalStackError("java is not on PATH: install Java 17 and try again")
        if not list(self.jar_dir.glob("kafka_2.13-*.jar")):
            raise LocalStackError(
                f"no Kafka jars in {self.jar_dir}: run `make setup` to fetch them from Maven"
            )
        me = next(n for n in self._nodes() if n.node_id == self.node_id)
        for busy in (me.port, me.controller_port):
            if _port_in_use(host, busy):
                raise LocalStackError(
                    f"port {busy} on {host} is taken by another process: stop it, or choose free "
                    "ports with DUALITY_BOOTSTRAP_SERVERS and DUALITY_CONTROLLER_PORT"
                )

    def _nodes(self) -> tuple[QuorumNode, ...]:
        _, port = self.settings.first_bootstrap
        return self.quorum or (QuorumNode(1, port, self.settings.controller_port),)

    def _write_config(self) -> None:
        host = self.settings.first_bootstrap[0]
        nodes = self._nodes()
        me = next(n for n in nodes if n.node_id == self.node_id)
        # Kafka's internal topics: three replicas, two in sync, once there are three nodes.
        replicas, in_sync = (3, 2) if len(nodes) >= 3 else (1, 1)
        clients = "PLAINTEXT" if self.scram is None else "SASL_PLAINTEXT"
        config = {
            "process.roles": "broker,controller",
            "node.id": str(me.node_id),
            "controller.quorum.voters": ",".join(
                f"{n.node_id}@{host}:{n.controller_port}" for n in nodes
            ),
            "listeners": f"{clients}://{host}:{me.port},CONTROLLER://{host}:{me.controller_port}",
            "advertised.listeners": f"{clients}://{host}:{me.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": clients,
            "listener.security.protocol.map": f"{clients}:{clients},CONTROLLER:PLAINTEXT",
            **self._sasl_config(),
            "log.dirs": str(self.data_dir),
            **_DEV_BROKER_CONFIG,
            "offsets.topic.replication.factor": str(replicas),
            "transaction.state.log.replication.factor": str(replicas),
            "transaction.state.log.min.isr": str(in_sync),
            "share.coordinator.state.topic.replication.factor": str(replicas),
            "share.coordinator.state.topic.min.isr": str(in_sync),
        }
        self.config_file.write_text(java_properties(config))
        self.config_file.chmod(0o600)  # it holds the nodes' own password
        (self.root / "log4j2.properties").write_text(_LOG4J2.format(logs=self.logs_dir))

    def _sasl_config(self) -> dict[str, str]:
        """The SCRAM listener's settings: the nodes log in to each other as BROKER_USER."""
        if self.scram is None:
            return {}
        jaas = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f"username={jaas_quote(BROKER_USER)} password={jaas_quote(self._broker_password())};"
        )
        config = {
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            f"listener.name.sasl_plaintext.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": jaas,
        }
        if self.scram.acls:
            supers = [BROKER_USER, *self.scram.super_users, "ANONYMOUS"]
            config["authorizer.class.name"] = (
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
            )
            # ANONYMOUS: the principal of the PLAINTEXT controller listener (the nodes).
            config["super.users"] = ";".join(f"User:{user}" for user in supers)
        return config

    def _broker_password(self) -> str:
        """The nodes' password: the one the storage was formatted with, kept beside it."""
        assert self.scram is not None
        path = self.root / "broker.secret"
        if not path.is_file():
            path.touch(mode=0o600)
            path.write_text(self.scram.broker_password)
        return path.read_text()

    def _java(self, main: str, *args: str, heap: str = "256m") -> list[str]:
        return [
            "java",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Djava.io.tmpdir={self.tmp_dir}",
            f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.logs_dir}",
            "-cp",
            f"{self.jar_dir}/*",
            main,
            *args,
        ]

    def _format_storage(self) -> None:
        cluster_id = self.cluster_id or new_cluster_id()
        command = self._java(
            "kafka.tools.StorageTool",
            "format",
            "--cluster-id",
            cluster_id,
            "--config",
            str(self.config_file),
            "--ignore-formatted",
            *self._scram_arguments(),
        )
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise LocalStackError(
                f"formatting the broker storage in {self.data_dir} failed:\n"
                f"{result.stdout}{result.stderr}"
            )

    def _scram_arguments(self) -> list[str]:
        if self.scram is None:
            return []
        users = {BROKER_USER: self._broker_password(), **self.scram.users}
        return [
            part
            for user, password in users.items()
            for part in ("--add-scram", _scram_argument(user, password))
        ]

    def _launch(self) -> subprocess.Popen[bytes]:
        return start_daemon(
            self._java(_MAIN_CLASS, str(self.config_file), heap="1g"),
            self.logs_dir / "stdout.log",
            self.pid_file,
            cwd=self.root,
        )

    def _wait_until_ready(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        last: DualityError | None = None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise LocalStackError(
                    f"the broker exited with code {process.returncode} while starting; "
                    f"last lines of {self.log_file}:\n{self.log_tail()}"
                )
            try:
                kafka.ensure_reachable(self.settings, timeout=2)
                return
            except (BrokerUnavailable, UsageError) as error:
                # A login refused while the broker loads its SCRAM users is not the last word.
                last = error
                continue
        self.stop()
        raise LocalStackError(
            f"the broker did not answer on {self.settings.bootstrap_servers} within "
            f"{_START_TIMEOUT_S:g}s ({last}); last lines of {self.log_file}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        texts = []
        for path in (self.log_file, self.logs_dir / "stdout.log"):
            if path.is_file():
                texts.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(texts[-lines:]) or "(no log output)"

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> dict[str, Any]:
        """Stop the broker (SIGTERM, then SIGKILL after a grace period); idempotent."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return {"state": "stopped", "was_running": False}
        stop_group(pid, _STOP_TIMEOUT_S)
        self.pid_file.unlink(missing_ok=True)
        return {"state": "stopped", "was_running": True, "pid": pid}


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def new_cluster_id() -> str:
    """A KRaft cluster id: a random UUID in URL-safe base64, never starting with '-'.

    An id starting with '-' reads as an option to `kafka-storage format` (Kafka's own
    Uuid.randomUuid() draws again in that case too).
    """
    while True:
        candidate = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not candidate.startswith("-"):
            return candidate


@contextlib.contextmanager
def ephemeral_broker(
    settings: Settings, *, scram: Scram | None = None, user: str | None = None
) -> Iterator[Settings]:
    """A throw-away broker on free ports in a temporary folder; yields settings that point at it.

    With `scram`, the broker takes SCRAM-SHA-512 logins and the settings log in as `user`
    (default: the first of its users). Tests and benchmarks use it when
    DUALITY_BOOTSTRAP_SERVERS does not name a cluster.
    """
    root = Path(tempfile.mkdtemp(prefix="duality-broker-"))
    scoped = settings.replace(
        bootstrap_servers=f"localhost:{free_port()}",
        controller_port=free_port(),
        local_dir=root,
    )
    if scram is not None:
        scoped = scram.login(scoped, user or next(iter(scram.users)))
    with _running(LocalBroker(scoped, scram=scram), root):
        yield scoped


@contextlib.contextmanager
def _running(kafka_nodes: LocalBroker | LocalKafkaCluster, root: Path) -> Iterator[None]:
    """Start a throw-away broker or cluster; stop it after, and delete its folder `root`
    unless the block failed with an error (then its logs are kept); an interruption (Ctrl-C,
    SIGTERM) deletes it too."""
    try:
        kafka_nodes.start()
        yield
    finally:
        kafka_nodes.stop()
        kafka.forget(kafka_nodes.settings)
        if not isinstance(sys.exc_info()[1], Exception):
            shutil.rmtree(root, ignore_errors=True)


class LocalKafkaCluster:
    """A KRaft cluster of the `quorum`'s nodes on this machine, each a combined broker and
    controller with its own ports and folder under `<local_dir>`; `.settings` name them all."""

    def __init__(
        self,
        settings: Settings,
        quorum: tuple[QuorumNode, ...],
        cluster_id: str,
        *,
        scram: Scram | None = None,
    ):
        host = "localhost"
        self.settings = settings.replace(
            bootstrap_servers=",".join(f"{host}:{node.port}" for node in quorum)
        )
        # Each node's settings reach that node alone.
        self.nodes = [
            LocalBroker(
                settings.replace(bootstrap_servers=f"{host}:{node.port}"),
                node.node_id,
                quorum,
                cluster_id,
                scram=scram,
            )
            for node in quorum
        ]

    def start(self) -> None:
        """Start every node that does not run; a quorum needs a majority, so they are all
        launched before any is waited for."""
        launched = []
        try:
            for node in self.nodes:
                if node.pid() is not None:
                    continue
                node._check_can_start()
                launched.append((node, node._prepare_and_launch()))
            for node, process in launched:
                node._wait_until_ready(process)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every node at once: one at a time, the last would wait out its grace period
        for a quorum that is already gone."""
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(LocalBroker.stop, self.nodes))

    def node(self, node_id: int) -> LocalBroker:
        return next(n for n in self.nodes if n.node_id == node_id)

    def status(self) -> dict[str, Any]:
        nodes = [{"node_id": n.node_id, **n.status()} for n in self.nodes]
        running = [n for n in nodes if n["state"] == "running"]
        return {
            "state": "running"
            if len(running) == len(nodes)
            else "degraded"
            if running
            else "stopped",
            "bootstrap_servers": self.settings.bootstrap_servers,
            "nodes": nodes,
        }


def local_cluster(
    settings: Settings, brokers: int, *, scram: Scram | None = None
) -> LocalKafkaCluster:
    """The cluster `duality up --brokers N` runs in `<local_dir>`: node i (from 1) listens on
    the bootstrap port + 2(i-1) and the controller port + 2(i-1), with its folder `kafka-<i>`;
    the cluster id is the one its nodes were formatted with, or a new one."""
    if brokers < 2:
        raise UsageError(f"a local cluster has two brokers or more, not {brokers}")
    _, port = settings.first_bootstrap
    quorum = tuple(
        QuorumNode(i + 1, port + 2 * i, settings.controller_port + 2 * i) for i in range(brokers)
    )
    meta = settings.local_dir / "kafka-1" / "data" / "meta.properties"
    cluster_id = None
    if meta.is_file():
        for line in meta.read_text().splitlines():
            if line.startswith("cluster.id="):
                cluster_id = line.split("=", 1)[1].strip()
    return LocalKafkaCluster(settings, quorum, cluster_id or new_cluster_id(), scram=scram)


def _runs_config(config: Path) -> Callable[[list[str]], bool]:
    return lambda cmdline: _MAIN_CLASS in cmdline and str(config) in cmdline


def stop_brokers(settings: Settings) -> list[dict[str, Any]]:
    """Stop every Kafka node this `local_dir` runs (`kafka/`, `kafka-<i>/`), all at once."""
    folders = [*sorted(settings.local_dir.glob("kafka-*")), settings.local_dir / "kafka"]
    running = []
    for folder in folders:
        pid = live_pid(folder / "broker.pid", _runs_config(folder / "server.properties"))
        if pid is not None:
            running.append((folder.name, pid))
    with concurrent.futures.ThreadPoolExecutor(max(1, len(running))) as pool:
        list(pool.map(lambda item: stop_group(item[1], _STOP_TIMEOUT_S), running))
    for folder in folders:
        (folder / "broker.pid").unlink(missing_ok=True)
    return [{"node": name, "pid": pid} for name, pid in running]


# -- the stack `duality up` started ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Topology:
    """What `duality up` runs: Kafka nodes, Spark workers (0: Spark in local mode), Airflow's
    metadata database."""

    brokers: int = 1
    spark_workers: int = 0
    airflow_db: str = "sqlite"
    # Clients log in with SCRAM-SHA-512 (the user and password of the settings).
    sasl: bool = False

    def __post_init__(self) -> None:
        if self.brokers < 1:
            raise UsageError(f"--brokers {self.brokers}: a stack needs at least one broker")
        if self.spark_workers < 0:
            raise UsageError(f"--spark-workers {self.spark_workers}: use 0 (local mode) or more")


# What `duality up --brokers 3 --spark-workers 2 --airflow-db postgres` runs: docker-compose.yml's
# topology (tests/unit/test_compose.py compares them).
PRODUCTION = Topology(brokers=3, spark_workers=2, airflow_db="postgres")


def recorded_stack(settings: Settings) -> Topology | None:
    """The topology `duality up` recorded in `<local_dir>/stack.json`, if it did."""
    path = settings.local_dir / STACK_FILE
    if not path.is_file():
        return None
    return Topology(**json.loads(path.read_text())["topology"])


def record_stack(settings: Settings, topology: Topology, chosen: dict[str, str]) -> None:
    """Keep the topology and the settings it chose (addresses), read by every later command's
    `Settings.from_env` where the environment does not say otherwise."""
    settings.local_dir.mkdir(parents=True, exist_ok=True)
    document = {"topology": dataclasses.asdict(topology), "settings": chosen}
    (settings.local_dir / STACK_FILE).write_text(json.dumps(document, indent=2) + "\n")


def forget_stack(settings: Settings) -> None:
    (settings.local_dir / STACK_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def ephemeral_cluster(
    settings: Settings,
    brokers: int = 3,
    *,
    scram: Scram | None = None,
    user: str | None = None,
) -> Iterator[LocalKafkaCluster]:
    """A throw-away KRaft cluster of `brokers` nodes on free ports in a temporary folder, for
    tests: `.settings` reach the whole cluster (with `scram`, logged in as `user`, default the
    first of its users), `.node(i)` is one node to stop and start."""
    root = Path(tempfile.mkdtemp(prefix="duality-cluster-"))
    quorum = tuple(QuorumNode(i + 1, free_port(), free_port()) for i in range(brokers))
    scoped = settings.replace(local_dir=root)
    if scram is not None:
        scoped = scram.login(scoped, user or next(iter(scram.users)))
    cluster = LocalKafkaCluster(scoped, quorum, new_cluster_id(), scram=scram)
    with _running(cluster, root):
        yield cluster


# -- Spark standalone ---------------------------------------------------------------------

_SPARK_START_TIMEOUT_S = 120.0
_SPARK_STOP_GRACE_S = 15.0
_SPARK_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_SPARK_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"

# Read by the master and the workers, not by applications: a taken port fails the start instead
# of moving silently to the next port, and no REST submission server opens a port of its own.
_SPARK_DAEMON_PROPERTIES = {
    "spark.port.maxRetries": "0",
    "spark.master.rest.enabled": "false",
}


def spark_home() -> Path:
    """The pyspark package folder: pip's pyspark is a whole Spark (jars, `bin/spark-class`)."""
    import importlib.util

    found = importlib.util.find_spec("pyspark")
    if found is None or found.origin is None:
        raise LocalStackError("pyspark is not installed in this interpreter: run `make setup`")
    return Path(found.origin).parent


class LocalSparkCluster:
    """A Spark standalone master and `workers` workers on this machine, run with pyspark's own
    `bin/spark-class` (the pip package has no `sbin` scripts to lean on).

    Every process has a folder under `root` (default `<local_dir>/spark`) with its log and pid
    file: `master/` and `worker-<i>/` (i from 0). A worker keeps its executors' work dirs in
    `worker-<i>/work` and their local dirs (shuffle files, the state store's RocksDB working
    copies) in `worker-<i>/local`. Each process leads its own process group, so stopping or
    killing a worker takes its executors with it. The master listens on the port of
    `settings.spark_master` when that names a master on this machine, else on a free port; the
    chosen ports are kept in `cluster.json` while the master runs.
    """

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

    # -- folders and ports -----------------------------------------------------------------

    @property
    def master_dir(self) -> Path:
        return self.root / "master"

    def worker_dir(self, index: int) -> Path:
        if not 0 <= index < self.workers:
            raise UsageError(f"worker {index} does not exist: this cluster has {self.workers}")
        return self.root / f"worker-{index}"

    def work_dir(self, index: int) -> Path:
        """Where worker `index` runs its executors: one `<app id>/<executor id>/` each."""
        return self.worker_dir(index) / "work"

    def local_dir(self, index: int) -> Path:
        """Worker `index`'s SPARK_LOCAL_DIRS, under which its executors keep their local files."""
        return self.worker_dir(index) / "local"

    def ports(self) -> dict[str, Any]:
        """The ports that the last start chose (`cluster.json`, removed by `stop()`)."""
        if not self.state_file.is_file():
            raise LocalStackError(f"the Spark cluster in {self.root} is not running: start it")
        return dict(json.loads(self.state_file.read_text()))

    def _choose_ports(self) -> dict[str, Any]:
        """The running master's ports, else new ones; free ports for workers not yet known."""
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
        if host in _LOCAL_HOSTS and port.isdigit():
            return int(port)
        return None

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.ports()['master']}"

    @property
    def master_ui(self) -> str:
        return f"http://127.0.0.1:{self.ports()['master_ui']}"

    # -- what runs -------------------------------------------------------------------------

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
        """Indexes of this cluster's workers that the master lists as ALIVE."""
        state = self.master_state() or {}
        alive = {w.get("port") for w in state.get("workers", []) if w.get("state") == "ALIVE"}
        ports = self.ports()["workers"]
        return [i for i in range(self.workers) if ports[i]["port"] in alive]

    def processes(self) -> list[psutil.Process]:
        """Every live Spark process of this cluster: the master and workers (their command
        lines name its properties file) and the executors and their Python workers, which run
        in the workers' folders."""
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

    def status(self) -> dict[str, Any]:
        master = self.master_pid()
        alive = set(self.alive_workers()) if master is not None else set()
        workers = [
            {
                "index": i,
                "pid": self.worker_pid(i),
                "registered": i in alive,
                "log": str(self.worker_dir(i) / "worker.log"),
            }
            for i in range(self.workers)
        ]
        running = master is not None and all(w["pid"] is not None for w in workers)
        return {
            "state": "running" if running else "stopped" if master is None else "degraded",
            "master_url": self.master_url if master is not None else None,
            "master_ui": self.master_ui if master is not None else None,
            "master_pid": master,
            "workers": workers,
            "root": str(self.root),
            "log": str(self.master_dir / "master.log"),
        }

    # -- start -----------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start whatever of the cluster does not run; wait until the master lists every worker
        ALIVE. Returns the status plus `already_running`."""
        if self.master_pid() is not None and all(
            self.worker_pid(i) is not None for i in range(self.workers)
        ):
            return {**self.status(), "already_running": True}
        if shutil.which("java") is None:
            raise LocalStackError("java is not on PATH: install Java 17 and try again")
        spark_class = spark_home() / "bin" / "spark-class"
        if not spark_class.is_file():
            raise LocalStackError(f"{spark_class} is missing: reinstall pyspark (`make setup`)")
        ports = self._choose_ports()
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(ports))
        self.properties_file.write_text(
            "".join(f"{k} {v}\n" for k, v in _SPARK_DAEMON_PROPERTIES.items())
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
        # Workers that find no master retry only after several seconds: start them once it
        # answers.
        self._wait(launched, lambda: self.master_state() is not None, "the master to answer")
        for i in range(self.workers):
            if self.worker_pid(i) is not None:
                continue
            self.work_dir(i).mkdir(parents=True, exist_ok=True)
            self.local_dir(i).mkdir(parents=True, exist_ok=True)
            launched[f"worker {i}"] = self._launch(
                "worker",
                self.worker_dir(i),
                _SPARK_WORKER_CLASS,
                [
                    self.master_url,
                    "--port",
                    str(ports["workers"][i]["port"]),
                    "--webui-port",
                    str(ports["workers"][i]["ui"]),
                    "--cores",
                    str(self.cores),
                    "--memory",
                    self.memory,
                    "--work-dir",
                    str(self.work_dir(i)),
                ],
                {"SPARK_LOCAL_DIRS": str(self.local_dir(i))},
            )
        self._wait(
            launched,
            lambda: len(self.alive_workers()) == self.workers,
            f"the master to list {self.workers} workers ALIVE",
        )
        return {**self.status(), "already_running": False}

    def _launch(
        self, name: str, folder: Path, main: str, args: list[str], env: dict[str, str]
    ) -> tuple[subprocess.Popen[bytes], Path]:
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"{name}.log"
        command = [
            str(spark_home() / "bin" / "spark-class"),
            main,
            "--host",
            "127.0.0.1",
            *args,
            "--properties-file",
            str(self.properties_file),
        ]
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
        what: str,
    ) -> None:
        deadline = time.monotonic() + _SPARK_START_TIMEOUT_S
        while not ready():
            for name, (process, log) in launched.items():
                if process.poll() is not None:
                    self.stop()
                    raise LocalStackError(
                        f"the Spark {name} exited with code {process.returncode} while "
                        f"starting; last lines of {log}:\n{_tail(log)}"
                    )
            if time.monotonic() >= deadline:
                logs = "\n".join(f"--- {log}:\n{_tail(log)}" for _, log in launched.values())
                self.stop()
                raise LocalStackError(
                    f"waited {_SPARK_START_TIMEOUT_S:g}s for {what} ({self.master_ui}/json/) "
                    f"in vain; last lines of the logs:\n{logs}"
                )
            time.sleep(0.25)

    # -- faults and stop -------------------------------------------------------------------

    def kill_worker(self, index: int) -> int:
        """SIGKILL worker `index` and its executors (its process group), as if its machine
        died; returns the worker's pid."""
        pid = self.worker_pid(index)
        if pid is None:
            raise LocalStackError(f"Spark worker {index} does not run ({self.worker_dir(index)})")
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(timeout=10)
        return pid

    def stop(self) -> dict[str, Any]:
        """Stop the workers (and their executors), then the master; idempotent, and nothing of
        the cluster is left running."""
        pids = [self.worker_pid(i) for i in range(self.workers)] + [self.master_pid()]
        running = [pid for pid in pids if pid is not None]
        for pid in running:
            stop_group(pid, _SPARK_STOP_GRACE_S)
        # A process that left its group (none should) still belongs to the cluster's folders.
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                process.kill()
                process.wait(timeout=10)
        for pid_file in (self.master_dir / "master.pid", *self.root.glob("worker-*/worker.pid")):
            pid_file.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        return {"state": "stopped", "was_running": bool(running), "pids": running}


def local_spark(settings: Settings, workers: int) -> LocalSparkCluster:
    """The Spark cluster `duality up --spark-workers N` runs in `<local_dir>/spark`: workers of 2
    cores and 2 GiB each, like docker-compose.yml's."""
    return LocalSparkCluster(settings, workers, cores=2, memory="2g")


# -- PostgreSQL, the metadata database of Airflow's components ----------------------------

_POSTGRES_START_TIMEOUT_S = 60.0
# The role and database Airflow uses: the same names as docker-compose.yml's postgres service.
AIRFLOW_DB_USER = "airflow"
AIRFLOW_DB_NAME = "airflow"
# Airflow's SQLAlchemy driver; Airflow derives its async engine's (asyncpg) from it.
AIRFLOW_DB_DRIVER = "postgresql+psycopg2"
# PostgreSQL refuses to run as root; then its programs run as Debian's user of the server.
POSTGRES_OS_USER = "postgres"


def postgres_programs() -> Path:
    """The folder of PostgreSQL's server programs (`initdb`, `postgres`): Debian's newest
    /usr/lib/postgresql/<major>/bin, else the folder `initdb` on PATH lives in."""
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
    """(uid, gid) to run PostgreSQL's programs as when we are root, else None (run as we are)."""
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


class LocalPostgres:
    """The PostgreSQL server of the local stack, holding Airflow's metadata database.

    Everything is under `<local_dir>/postgres`: the data folder `data/`, the socket folder
    `run/`, the server's log, its pid file, the generated password of the `airflow` role (a 0600
    file) and the port, chosen free on the first start and kept in `port`. It listens on
    127.0.0.1 only and asks for the password (SCRAM). Run as root, the server and `initdb` run
    as Debian's `postgres` user, who owns `data/`, `run/` and the password file, and who must be
    able to reach `<local_dir>` (its folders must let others through).
    """

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

    def url(self) -> str:
        """Airflow's `sql_alchemy_conn` for this server."""
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

    def status(self) -> dict[str, Any]:
        pid = self.pid()
        return {
            "state": "running" if pid is not None else "stopped",
            "pid": pid,
            "port": self.port(),
            "reachable": pid is not None and self._answers(),
            "data_dir": str(self.data_dir),
            "log": str(self.log_file),
        }

    def start(self) -> dict[str, Any]:
        """Start the server unless it runs (`initdb` on the first start); wait until it answers
        and the `airflow` database exists. Returns its status plus `already_running`."""
        if self.pid() is not None:
            return {**self.status(), "already_running": True}
        programs = postgres_programs()
        owner = _server_user()
        as_owner: dict[str, Any] = (
            {} if owner is None else {"user": owner[0], "group": owner[1], "extra_groups": []}
        )
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.data_dir / "PG_VERSION").is_file():
            self._initdb(programs, owner, as_owner)
        port = self.port()
        if port is None or _port_in_use("127.0.0.1", port):
            port = free_port()
            self.port_file.write_text(f"{port}\n")
        command = [
            str(programs / "postgres"),
            "-D",
            str(self.data_dir),
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-k",
            str(self.socket_dir),
        ]
        process = start_daemon(
            command, self.log_file, self.pid_file, cwd=self.root, env=_server_env(), **as_owner
        )
        deadline = time.monotonic() + _POSTGRES_START_TIMEOUT_S
        while not self._answers("postgres"):
            if process.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise LocalStackError(
                    f"PostgreSQL exited with code {process.returncode} while starting; last "
                    f"lines of {self.log_file}:\n{_tail(self.log_file)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise LocalStackError(
                    f"PostgreSQL did not answer on 127.0.0.1:{port} within "
                    f"{_POSTGRES_START_TIMEOUT_S:g}s; last lines of {self.log_file}:\n"
                    f"{_tail(self.log_file)}"
                )
            time.sleep(0.2)
        self._create_database()
        return {**self.status(), "already_running": False}

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
        command = [
            str(programs / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            AIRFLOW_DB_USER,
            f"--pwfile={self.password_file}",
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--no-locale",
            "--no-instructions",
        ]
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

    def stop(self) -> dict[str, Any]:
        """Fast shutdown (SIGINT: clients disconnected, a clean checkpoint), SIGKILL of its
        group after the grace period; idempotent."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return {"state": "stopped", "was_running": False}
        stop_group(pid, _STOP_TIMEOUT_S, signal.SIGINT)
        self.pid_file.unlink(missing_ok=True)
        return {"state": "stopped", "was_running": True, "pid": pid}


def _server_env() -> dict[str, str]:
    """A clean environment for PostgreSQL's programs: no PG* variables of the caller's."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}


# -- Airflow ------------------------------------------------------------------------------

_AIRFLOW_START_TIMEOUT_S = 300.0
AIRFLOW_USER = "admin"
# Airflow's long-running components, each `airflow <name>` in a process of its own on
# PostgreSQL, after `airflow db migrate`: the commands of docker-compose.yml's Airflow services.
AIRFLOW_COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
AIRFLOW_MIGRATE = ("db", "migrate")


class LocalAirflow:
    """Airflow with this checkout's `dags/` and `plugins/`, on what `DUALITY_AIRFLOW_DB` says:

    - `sqlite` (default): `airflow standalone` (SQLite, LocalExecutor), one process tree.
    - `postgres`: a `LocalPostgres` server, `airflow db migrate`, then each of
      `AIRFLOW_COMPONENTS` as its own process (group, pid file `<name>.pid`, log `<name>.log`),
      as in docker-compose.yml. Starting again starts the components that do not run.

    Its home is `<local_dir>/airflow`. The connections `kafka_default` and `spark_default` are
    given as `AIRFLOW_CONN_*` variables built from the settings (`kafka_default` with the SASL
    login, if any), and every `DUALITY_*` setting is passed on, so tasks see the same stack as
    the command that started Airflow. `stop()` stops
    whichever of the two runs, whatever the setting says now.
    """

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
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
                {"conn_type": "spark", "host": settings.spark_master}
            ),
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
        return {**os.environ, **settings.as_env(), **airflow, "PATH": path}

    def _server_ports(self) -> dict[str, int]:
        """The ports of the components' side servers: chosen free while no component runs,
        kept in `ports.json` for the components started later (a restarted scheduler)."""
        saved = self.home / "ports.json"
        if saved.is_file() and any(map(self.component_pid, AIRFLOW_COMPONENTS)):
            return dict(json.loads(saved.read_text()))
        ports = {
            name: free_port() for name in ("worker_log_server", "trigger_log_server", "health")
        }
        saved.write_text(json.dumps(ports))
        return ports

    # -- what runs -------------------------------------------------------------------------

    def pid(self) -> int | None:
        """The pid of `airflow standalone`, when that runs."""
        return live_pid(
            self.pid_file,
            lambda cmdline: "standalone" in cmdline and any(p.endswith("airflow") for p in cmdline),
        )

    def component_log(self, name: str) -> Path:
        return self.home / f"{name}.log"

    def component_pid(self, name: str) -> int | None:
        """The pid of component `name` (one of `AIRFLOW_COMPONENTS`), when it runs."""
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

    def status(self) -> dict[str, Any]:
        db = self.running_db() or self.settings.airflow_db
        result: dict[str, Any] = {
            "db": db,
            "url": self.settings.airflow_url,
            "user": AIRFLOW_USER,
            "password_file": str(self.password_file),
            "home": str(self.home),
        }
        if db == "sqlite":
            pid = self.pid()
            result.update(
                state="running" if pid is not None else "stopped",
                pid=pid,
                log=str(self.log_file),
                components={"standalone": {"pid": pid, "log": str(self.log_file)}},
            )
        else:
            components = {
                name: {"pid": self.component_pid(name), "log": str(self.component_log(name))}
                for name in AIRFLOW_COMPONENTS
            }
            database = self.postgres.status()
            up = [c["pid"] is not None for c in components.values()] + [database["pid"] is not None]
            result.update(
                state="running" if all(up) else "degraded" if any(up) else "stopped",
                pid=components["api-server"]["pid"],
                log=str(self.component_log("api-server")),
                components=components,
                postgres=database,
            )
        result["healthy"] = result["state"] != "stopped" and _healthy(self.health())
        return result

    # -- start -----------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
        """Start Airflow on `DUALITY_AIRFLOW_DB`'s database unless it runs; wait until every
        component is healthy. Returns the status plus `already_running` and the password."""
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
        if wanted == "sqlite":
            return self._start_standalone(progress)
        return self._start_components(progress)

    def _check_port(self) -> None:
        if _port_in_use("127.0.0.1", self.port):
            raise LocalStackError(
                f"port {self.port} is taken by another process: stop it, or point "
                "DUALITY_AIRFLOW_URL at a free port (http://localhost:<port>)"
            )

    def _start_standalone(self, progress: Callable[[str], None]) -> dict[str, Any]:
        if self.pid() is not None:
            return {**self.status(), "already_running": True, "password": self.password()}
        self._check_port()
        self.home.mkdir(parents=True, exist_ok=True)
        password = self.password()
        process = start_daemon(
            [str(_airflow()), "standalone"],
            self.log_file,
            self.pid_file,
            cwd=self.home,
            env=self.environment(),
        )
        progress("starting Airflow (database, scheduler, DAG processor, triggerer, API server)")
        self._wait_healthy({"standalone": (process, self.log_file)})
        return {**self.status(), "already_running": False, "password": password}

    def _start_components(self, progress: Callable[[str], None]) -> dict[str, Any]:
        missing = [name for name in AIRFLOW_COMPONENTS if self.component_pid(name) is None]
        if not missing and self.postgres.pid() is not None:
            return {**self.status(), "already_running": True, "password": self.password()}
        if "api-server" in missing:
            self._check_port()
        self.home.mkdir(parents=True, exist_ok=True)
        password = self.password()
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
            log = self.component_log(name)
            pid_file = self.home / f"{name}.pid"
            process = start_daemon(
                [str(_airflow()), name], log, pid_file, cwd=self.home, env=environment
            )
            launched[name] = (process, log)
        progress(f"starting Airflow's {', '.join(missing)} on PostgreSQL")
        self._wait_healthy(launched, since)
        return {**self.status(), "already_running": False, "password": password}

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
                timeout=_AIRFLOW_START_TIMEOUT_S,
                check=False,
            )
        if done.returncode != 0:
            raise LocalStackError(
                f"`airflow {' '.join(AIRFLOW_MIGRATE)}` failed with code {done.returncode}; "
                f"last lines of {log}:\n{_tail(log)}"
            )

    def _clear_predecessor(self, name: str) -> None:
        """Before component `name` starts again: end what its killed predecessor left in its
        session (side servers on the ports the new one needs, idle LocalExecutor workers), but
        not the workers still running a task, nor their tasks: those finish, and report to the
        API server, and `stop()` ends them later."""
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
        end_processes([p for p in members if p.pid not in busy], self.settings.kill_grace_s)

    def _wait_healthy(
        self, launched: dict[str, tuple[subprocess.Popen[bytes], Path]], since: float = 0.0
    ) -> None:
        """Wait until Airflow reports every part healthy and each launched component has
        beaten since `since` (a predecessor's last heartbeat still counts as healthy)."""
        deadline = time.monotonic() + _AIRFLOW_START_TIMEOUT_S
        while not _healthy(self.health(), {name: since for name in launched}):
            for name, (process, log) in launched.items():
                if process.poll() is not None:
                    self.stop()
                    raise LocalStackError(
                        f"Airflow's {name} exited with code {process.returncode} while starting; "
                        f"last lines of {log}:\n{_tail(log)}"
                    )
            if time.monotonic() > deadline:
                self.stop()
                logs = "\n".join(f"--- {log}:\n{_tail(log)}" for _, log in launched.values())
                raise LocalStackError(
                    f"Airflow did not become healthy on {self.settings.airflow_url} within "
                    f"{_AIRFLOW_START_TIMEOUT_S:g}s; last lines of the logs:\n{logs}"
                )
            time.sleep(1)

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> dict[str, Any]:
        """Stop whatever of this Airflow runs, whatever DUALITY_AIRFLOW_DB says now: standalone
        (SIGINT, its own shutdown) or the components (SIGTERM), each process group after the
        grace period, then what Airflow started and left behind (`leftovers`), then
        PostgreSQL. Idempotent; no process of it is left."""
        pids = {"standalone": self.pid()} | {n: self.component_pid(n) for n in AIRFLOW_COMPONENTS}
        running = {name: pid for name, pid in pids.items() if pid is not None}
        processes = []
        for name, pid in running.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                process.send_signal(signal.SIGINT if name == "standalone" else signal.SIGTERM)
                processes.append(process)
        wait_exited(processes, _STOP_TIMEOUT_S)
        for pid in running.values():  # each leads its own group (start_new_session)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        left = self.leftovers()
        end_processes(left, self.settings.kill_grace_s)
        database = self.postgres.stop()
        for name in pids:
            (self.home / f"{name}.pid").unlink(missing_ok=True)
        return {
            "state": "stopped",
            "was_running": bool(running) or database["was_running"],
            "pid": running.get("standalone") or running.get("api-server"),
            "pids": running,
            "leftovers": [process.pid for process in left],
            "postgres": database,
        }

    def leftovers(self) -> list[psutil.Process]:
        """Live processes that this Airflow started and whose component is gone: the
        LocalExecutor workers and tasks of a scheduler that was killed, for instance. They run
        with this `AIRFLOW_HOME`. Streams, which tasks start detached on purpose, are not among
        them (`duality down` stops them first, gracefully)."""
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
        """Whether this Airflow started `process`: it has the environment `environment()`
        gives, or, where Airflow's process title overwrote that (workers, log servers), an
        `airflow ...` title and its working folder in this home."""
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
    """Whether `pid` belongs to the session of a stream (`python -m duality.stream`,
    started in a session of its own, with its JVM and Python workers)."""
    try:
        leader = psutil.Process(os.getsid(pid))
        return "duality.stream" in leader.cmdline()
    except (OSError, psutil.Error):
        return False


def _airflow() -> Path:
    """The `airflow` command of this interpreter's environment."""
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
    """Whether Airflow's health document says every part is healthy and each component in
    `beaten_since` has a heartbeat from that time (seconds since the epoch) on."""
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


def _tail(path: Path, lines: int = 25) -> str:
    if not path.is_file():
        return "(no log output)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
