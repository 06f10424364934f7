"""One Kafka node (KRaft broker and controller) of this machine, run from the Maven-fetched jars."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from duality.config import Settings, jaas_quote, java_properties
from duality.errors import BrokerUnavailable, DualityError, LocalStackError, UsageError
from duality.kafka import client
from duality.local.ports import LOCAL_HOSTS, free_port, port_in_use
from duality.local.scram import BROKER_USER, SCRAM_MECHANISM, Scram, scram_argument
from duality.local.startup import wait_started
from duality.process import live_pid, start_daemon, stop_group

if TYPE_CHECKING:
    from duality.local.kraft import LocalKafkaCluster

_MAIN_CLASS = "kafka.Kafka"
STOP_TIMEOUT_S = 30.0

# Tuned so that compaction is visible within seconds: short segments, an eager cleaner.
_DEV_BROKER_CONFIG = {
    "num.partitions": "1",
    "auto.create.topics.enable": "false",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.num.partitions": "8",
    "group.initial.rebalance.delay.ms": "0",
    # A warm standby takes over after 3 s of silence, not Kafka's default 6 (decision 29).
    "group.min.session.timeout.ms": "3000",
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


@dataclasses.dataclass(frozen=True)
class QuorumNode:
    node_id: int
    port: int
    controller_port: int


@dataclasses.dataclass(frozen=True)
class BrokerStatus:
    state: str  # running, stopped
    pid: int | None
    bootstrap_servers: str  # where it listens, which the settings may no longer say
    reachable: bool
    data_dir: Path
    log: Path
    node_id: int = 1
    # Set by `start()`: whether the node ran before it was asked to.
    already_running: bool | None = None


class LocalBroker:
    """The broker of `<local_dir>/kafka` on `settings.bootstrap_servers`, or node `node_id` of a
    `quorum` in `kafka-<id>`; with `scram`, `settings` must log in as one of its users."""

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

    @property
    def log_file(self) -> Path:
        return self.logs_dir / "server.log"

    def pid(self) -> int | None:
        return node_pid(self.root)

    def _listening(self) -> str | None:
        if self.pid() is None or not self.config_file.is_file():
            return None
        for line in self.config_file.read_text().splitlines():
            if line.startswith("advertised.listeners="):
                # Written by `java_properties`: ':' and '=' escaped with a backslash.
                return re.sub(r"\\(.)", r"\1", line).split("://", 1)[1]
        return None

    def status(self) -> BrokerStatus:
        pid = self.pid()
        address = self._listening() or self.settings.bootstrap_servers
        reachable = False
        if pid is not None:
            with contextlib.suppress(DualityError):  # no answer, or a refused login
                client.ensure_reachable(self.settings.replace(bootstrap_servers=address), timeout=3)
                reachable = True
        return BrokerStatus(
            state="running" if pid is not None else "stopped",
            pid=pid,
            bootstrap_servers=address,
            reachable=reachable,
            data_dir=self.data_dir,
            log=self.log_file,
            node_id=self.node_id,
        )

    def start(self) -> BrokerStatus:
        already_running = self.pid() is not None
        if not already_running:
            self._check_can_start()
            self._wait_until_ready(self._prepare_and_launch())
        return dataclasses.replace(self.status(), already_running=already_running)

    def _prepare_and_launch(self) -> subprocess.Popen[bytes]:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir()
        self._write_config()
        if not (self.data_dir / "meta.properties").is_file():
            self._format_storage()
        return start_daemon(
            self._java(_MAIN_CLASS, str(self.config_file), heap="1g"),
            self.logs_dir / "stdout.log",
            self.pid_file,
            cwd=self.root,
        )

    def _check_can_start(self) -> None:
        host = self.settings.first_bootstrap[0]
        if host not in LOCAL_HOSTS or "," in self.settings.bootstrap_servers:
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
            if port_in_use(host, busy):
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
        command = ["java", f"-Xmx{heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true"]
        command += [f"-Djava.io.tmpdir={self.tmp_dir}"]
        command += [f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}"]
        command += [f"-Dkafka.logs.dir={self.logs_dir}", "-cp", f"{self.jar_dir}/*", main]
        return [*command, *args]

    def _format_storage(self) -> None:
        cluster_id = self.cluster_id or new_cluster_id()
        options = ["--cluster-id", cluster_id, "--config", str(self.config_file)]
        options += ["--ignore-formatted", *self._scram_arguments()]
        command = self._java("kafka.tools.StorageTool", "format", *options)
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
            for part in ("--add-scram", scram_argument(user, password))
        ]

    def _wait_until_ready(self, process: subprocess.Popen[bytes]) -> None:
        wait_started(
            {"the broker": process},
            [self.log_file, self.logs_dir / "stdout.log"],
            self._answers,
            failure=f"the broker did not answer on {self.settings.bootstrap_servers}",
            timeout=90.0,
            stop=self.stop,
            interval=0,  # each try waits for an answer
        )

    def _answers(self) -> bool:
        try:
            client.ensure_reachable(self.settings, timeout=2)
            return True
        except (BrokerUnavailable, UsageError):
            # A login refused while the broker loads its SCRAM users is not the last word.
            return False

    def stop(self) -> int | None:
        """Idempotent; returns the pid it stopped, if it ran."""
        pid = self.pid()
        if pid is not None:
            stop_group(pid, STOP_TIMEOUT_S)
        self.pid_file.unlink(missing_ok=True)
        return pid


def new_cluster_id() -> str:
    """A random UUID in URL-safe base64; not starting with '-', which reads as an option."""
    while True:
        candidate = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not candidate.startswith("-"):
            return candidate


@contextlib.contextmanager
def ephemeral_broker(
    settings: Settings, *, scram: Scram | None = None, user: str | None = None
) -> Iterator[Settings]:
    """A throw-away broker on free ports; yields settings that reach it (as `user` of `scram`)."""
    root = Path(tempfile.mkdtemp(prefix="duality-broker-"))
    scoped = settings.replace(
        bootstrap_servers=f"localhost:{free_port()}", controller_port=free_port(), local_dir=root
    )
    if scram is not None:
        scoped = scram.login(scoped, user or next(iter(scram.users)))
    with ephemeral(LocalBroker(scoped, scram=scram), root):
        yield scoped


@contextlib.contextmanager
def ephemeral(kafka_nodes: LocalBroker | LocalKafkaCluster, root: Path) -> Iterator[None]:
    """Start, then stop, and delete `root` unless the block raised an Exception (logs kept)."""
    try:
        kafka_nodes.start()
        yield
    finally:
        kafka_nodes.stop()
        client.forget(kafka_nodes.settings)
        if not isinstance(sys.exc_info()[1], Exception):
            shutil.rmtree(root, ignore_errors=True)


def node_pid(root: Path) -> int | None:
    config = str(root / "server.properties")
    return live_pid(
        root / "broker.pid", lambda cmdline: _MAIN_CLASS in cmdline and config in cmdline
    )
