"""A KRaft cluster of several Kafka nodes on this machine, each a broker and a controller."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path

from duality.config import Settings
from duality.errors import UsageError
from duality.local.broker import (
    STOP_TIMEOUT_S,
    BrokerStatus,
    LocalBroker,
    QuorumNode,
    ephemeral,
    new_cluster_id,
    node_pid,
)
from duality.local.ports import free_port
from duality.local.scram import Scram
from duality.process import stop_group


@dataclasses.dataclass(frozen=True)
class ClusterStatus:
    state: str  # running, degraded (some nodes run), stopped
    bootstrap_servers: str
    nodes: list[BrokerStatus]


@dataclasses.dataclass(frozen=True)
class NodeStopped:
    node: str  # its folder: kafka, kafka-<id>
    pid: int


class LocalKafkaCluster:
    def __init__(
        self,
        settings: Settings,
        quorum: tuple[QuorumNode, ...],
        cluster_id: str,
        *,
        scram: Scram | None = None,
    ):
        addresses = [f"localhost:{node.port}" for node in quorum]
        self.settings = settings.replace(bootstrap_servers=",".join(addresses))
        # Each node's settings reach that node alone.
        self.nodes = [
            LocalBroker(
                settings.replace(bootstrap_servers=address),
                node.node_id,
                quorum,
                cluster_id,
                scram=scram,
            )
            for address, node in zip(addresses, quorum, strict=True)
        ]

    def start(self) -> ClusterStatus:
        """All are launched before any is waited for: a quorum needs a majority."""
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
        return self.status()

    def stop(self) -> None:
        """All at once: one at a time, the last would wait for a quorum already gone."""
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(LocalBroker.stop, self.nodes))

    def node(self, node_id: int) -> LocalBroker:
        return next(n for n in self.nodes if n.node_id == node_id)

    def status(self) -> ClusterStatus:
        nodes = [n.status() for n in self.nodes]
        running = sum(n.state == "running" for n in nodes)
        state = "running" if running == len(nodes) else "degraded" if running else "stopped"
        return ClusterStatus(state, self.settings.bootstrap_servers, nodes)


def local_cluster(
    settings: Settings, brokers: int, *, scram: Scram | None = None
) -> LocalKafkaCluster:
    """Node i (from 1) on the bootstrap and controller ports + 2(i-1), in `kafka-<i>`."""
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


def stop_brokers(settings: Settings) -> list[NodeStopped]:
    """Stop every Kafka node this `local_dir` runs (`kafka/`, `kafka-<i>/`), all at once."""
    folders = [*sorted(settings.local_dir.glob("kafka-*")), settings.local_dir / "kafka"]
    running = [
        NodeStopped(folder.name, pid) for folder in folders if (pid := node_pid(folder)) is not None
    ]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(running))) as pool:
        list(pool.map(lambda node: stop_group(node.pid, STOP_TIMEOUT_S), running))
    for folder in folders:
        (folder / "broker.pid").unlink(missing_ok=True)
    return running


@contextlib.contextmanager
def ephemeral_cluster(
    settings: Settings, brokers: int = 3, *, scram: Scram | None = None, user: str | None = None
) -> Iterator[LocalKafkaCluster]:
    """A throw-away cluster on free ports (`ephemeral_broker`); `.node(i)` to stop and start."""
    root = Path(tempfile.mkdtemp(prefix="duality-cluster-"))
    quorum = tuple(QuorumNode(i + 1, free_port(), free_port()) for i in range(brokers))
    scoped = settings.replace(local_dir=root)
    if scram is not None:
        scoped = scram.login(scoped, user or next(iter(scram.users)))
    cluster = LocalKafkaCluster(scoped, quorum, new_cluster_id(), scram=scram)
    with ephemeral(cluster, root):
        yield cluster
