"""The local stack as a whole: its recorded topology, and `up`, `down` and `status`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from duality import spec
from duality.config import STACK_FILE, Settings
from duality.errors import CheckFailed, DualityError, UsageError
from duality.kafka import client, topics
from duality.local.airflow import AirflowStatus, AirflowStopped, LocalAirflow
from duality.local.batch_server import BatchServerStatus, BatchServerStopped, LocalBatchServer
from duality.local.broker import BrokerStatus, LocalBroker
from duality.local.kraft import (
    ClusterStatus,
    LocalKafkaCluster,
    NodeStopped,
    local_cluster,
    stop_brokers,
)
from duality.local.monitoring import LocalMonitoring, MonitoringStatus, MonitoringStopped
from duality.local.object_store import LocalObjectStore, ObjectStoreStatus
from duality.local.schema_registry import LocalSchemaRegistry, RegistryStatus
from duality.local.scram import Scram
from duality.local.serving import LocalServing
from duality.local.spark_cluster import SparkStatus, SparkStopped, local_spark
from duality.object_store import preflight
from duality.serve.control import ServingStatus, ServingStopped
from duality.spark import sweep_scratch
from duality.stream import control
from duality.stream.control import StoppedStream


@dataclasses.dataclass(frozen=True)
class Topology:
    brokers: int = 1
    spark_workers: int = 0  # 0: Spark in local mode
    airflow_db: str = "sqlite"
    sasl: bool = False  # clients log in with SCRAM-SHA-512 as the settings' user
    monitoring: bool = False  # Prometheus and its Pushgateway run too
    schema_registry: bool = False  # Apicurio Registry runs too (Avro sources)
    object_store: bool = False  # an S3 server (SeaweedFS) runs too, with its bucket

    def __post_init__(self) -> None:
        if self.brokers < 1:
            raise UsageError(f"--brokers {self.brokers}: a stack needs at least one broker")
        if self.spark_workers < 0:
            raise UsageError(f"--spark-workers {self.spark_workers}: use 0 (local mode) or more")


# What `duality up --brokers 3 --spark-workers 2 --airflow-db postgres` runs: docker-compose.yml's
# topology (tests/unit/test_compose.py compares them).
PRODUCTION = Topology(brokers=3, spark_workers=2, airflow_db="postgres")


def recorded_stack(settings: Settings) -> Topology | None:
    path = settings.local_dir / STACK_FILE
    if not path.is_file():
        return None
    return Topology(**json.loads(path.read_text())["topology"])


def _describe(topology: Topology) -> str:
    return (
        f"--brokers {topology.brokers} --spark-workers {topology.spark_workers} "
        f"--airflow-db {topology.airflow_db}" + (" --sasl" if topology.sasl else "")
    )


def _kafka(
    settings: Settings, topology: Topology, scram: Scram | None = None
) -> LocalBroker | LocalKafkaCluster:
    if topology.brokers == 1:
        return LocalBroker(settings, scram=scram)
    return local_cluster(settings, topology.brokers, scram=scram)


@dataclasses.dataclass(frozen=True)
class StackUp:
    topology: Topology
    broker: BrokerStatus | ClusterStatus
    airflow: AirflowStatus
    batch: BatchServerStatus
    spark: SparkStatus | None = None
    monitoring: MonitoringStatus | None = None
    serving: ServingStatus | None = None
    schema_registry: RegistryStatus | None = None
    object_store: ObjectStoreStatus | None = None


def up(
    settings: Settings,
    *,
    brokers: int | None = None,
    spark_workers: int | None = None,
    airflow_db: str | None = None,
    sasl: bool = False,
    monitoring: bool = False,
    schema_registry: bool = False,
    object_store: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> StackUp:
    """Start what does not run: Kafka, Prometheus and its Pushgateway (with `monitoring`),
    Spark (the cluster, if any, and the batch server the batch steps run on), the replicas of
    the pipelines' tables (`duality serve`), then Airflow (whose tasks need Kafka and Spark);
    what is not given is what runs, else the default, and another topology than what runs is
    refused (monitoring, the schema registry and the object store can be added to a running
    stack). Locations on object storage are checked first: a missing bucket, refused credentials
    or an endpoint that does not answer stop it before anything starts (but for the object store
    it starts itself, whose bucket it creates)."""
    recorded = recorded_stack(settings)
    base = recorded or Topology(airflow_db=settings.airflow_db)
    topology = Topology(
        brokers=base.brokers if brokers is None else brokers,
        spark_workers=base.spark_workers if spark_workers is None else spark_workers,
        airflow_db=base.airflow_db if airflow_db is None else airflow_db,
        sasl=base.sasl or sasl,
        monitoring=base.monitoring or monitoring,
        schema_registry=base.schema_registry or schema_registry,
        object_store=base.object_store or object_store,
    )

    def fixed(of: Topology) -> Topology:  # what a running stack cannot have added
        return dataclasses.replace(of, monitoring=False, schema_registry=False, object_store=False)

    if recorded is not None and fixed(topology) != fixed(recorded):
        raise UsageError(
            f"the local stack in {settings.local_dir} runs {_describe(recorded)}; "
            f"`duality down` first, then `duality up` with {_describe(topology)}"
        )
    if not topology.object_store:
        preflight(settings)
    scram = Scram.from_settings(settings) if topology.sasl else None
    nodes = _kafka(settings, topology, scram)
    where = nodes.settings.bootstrap_servers
    many = f"{topology.brokers} Kafka brokers" if topology.brokers > 1 else "the Kafka broker"
    progress(f"starting {many} on {where}")
    broker = nodes.start()
    chosen = {"DUALITY_BOOTSTRAP_SERVERS": where}
    if scram is not None:
        # Who logs in, and how; the password stays in the environment, never on disk.
        chosen["DUALITY_SECURITY_PROTOCOL"] = settings.security_protocol
        chosen["DUALITY_SASL_MECHANISM"] = str(settings.sasl_mechanism)
        chosen["DUALITY_SASL_USERNAME"] = str(settings.sasl_username)
    watching = None
    if topology.monitoring:
        # Before the batch server and Airflow: the steps they run push to the Pushgateway.
        monitor = LocalMonitoring(settings)
        progress("starting Prometheus and its Pushgateway")
        watching = monitor.start()
        chosen["DUALITY_PUSHGATEWAY"] = monitor.pushgateway_address
        chosen["DUALITY_PROMETHEUS_URL"] = monitor.prometheus_url
    registry = None
    if topology.schema_registry:
        # Before the streams' processes and Airflow: Avro specs load their columns from it.
        local_registry = LocalSchemaRegistry(settings)
        progress("starting the schema registry (Apicurio Registry)")
        registry = local_registry.start()
        chosen |= local_registry.client_settings()
    bucket = None
    if topology.object_store:
        # Before Spark's batch server and Airflow: their steps read and write its locations.
        local_store = LocalObjectStore(settings)
        progress("starting the S3 server (SeaweedFS)")
        bucket = local_store.start()
        chosen |= local_store.client_settings()
        chosen |= local_store.locations(settings)
        preflight(Settings.from_env({**settings.as_env(), **chosen}))
    spark = None
    if topology.spark_workers:
        cluster = local_spark(settings, topology.spark_workers)
        progress(f"starting a Spark master and {topology.spark_workers} workers")
        spark = cluster.start()
        chosen["DUALITY_SPARK_MASTER"] = cluster.master_url
        # An executor per worker for each application: a stream leaves room for batch jobs.
        chosen["DUALITY_SPARK_CORES_MAX"] = str(topology.spark_workers)
    server = LocalBatchServer(Settings.from_env({**settings.as_env(), **chosen}))
    progress("starting the batch server (a warm Spark for the batch steps)")
    batch = server.start()
    # Its address, and the secret and certificate its clients need (made by `start`).
    chosen |= {f"DUALITY_{k.upper()}": str(v) for k, v in server.client_settings().items()}
    chosen["DUALITY_AIRFLOW_DB"] = topology.airflow_db
    replicas = LocalServing(Settings.from_env({**settings.as_env(), **chosen}))
    chosen |= replicas.client_settings(replicas.port())
    # Later commands (and Airflow's tasks) find the stack through the record: `Settings.from_env`.
    settings.local_dir.mkdir(parents=True, exist_ok=True)
    document = {"topology": dataclasses.asdict(topology), "settings": chosen}
    (settings.local_dir / STACK_FILE).write_text(json.dumps(document, indent=2) + "\n")
    stacked = Settings.from_env({**settings.as_env(), **chosen})
    progress("starting the replicas of the pipelines' tables (duality serve)")
    serving = LocalServing(stacked).start()
    progress(f"starting Airflow on {settings.airflow_url}")
    airflow = LocalAirflow(stacked).start(progress=progress)
    return StackUp(topology, broker, airflow, batch, spark, watching, serving, registry, bucket)


@dataclasses.dataclass(frozen=True)
class StackDown:
    brokers: list[NodeStopped]
    spark: SparkStopped
    airflow: AirflowStopped
    streams: list[StoppedStream]
    batch: BatchServerStopped
    monitoring: MonitoringStopped
    serving: ServingStopped | None = None
    schema_registry: int | None = None  # the pid of the schema registry it stopped
    object_store: int | None = None  # the pid of the S3 server it stopped


def down(settings: Settings) -> StackDown:
    """Airflow first (a supervisor run could start a stream again), the streams, the
    replicas, the batch server, Prometheus and its Pushgateway, the schema registry, the S3
    server, Spark, Kafka."""
    airflow = LocalAirflow(settings).stop()
    streams = control.stop_all(settings)
    serving = LocalServing(settings).stop()
    batch = LocalBatchServer(settings).stop()
    monitoring = LocalMonitoring(settings).stop()
    registry = LocalSchemaRegistry(settings).stop()
    store = LocalObjectStore(settings).stop()
    # What the stopped (or once killed) drivers' JVMs left in their temporary folders.
    sweep_scratch(settings)
    topology = recorded_stack(settings) or Topology()
    workers = max(
        topology.spark_workers, len(list((settings.local_dir / "spark").glob("worker-*")))
    )
    spark = local_spark(settings, max(1, workers)).stop()
    brokers = stop_brokers(settings)
    (settings.local_dir / STACK_FILE).unlink(missing_ok=True)
    return StackDown(brokers, spark, airflow, streams, batch, monitoring, serving, registry, store)


@dataclasses.dataclass(frozen=True)
class TopicStatus(topics.TopicReplication):
    # Created before the settings (or the cluster) asked for more replicas, or by hand.
    below_configured: bool


@dataclasses.dataclass(frozen=True)
class KafkaStatus:  # the cluster the settings name, and the local nodes behind it
    # running, degraded, stopped; external: it answers, but no local node runs.
    state: str
    bootstrap_servers: str
    reachable: bool
    nodes: list[BrokerStatus]
    # A single broker's pid and log (a cluster's are its nodes').
    pid: int | None = None
    log: Path | None = None
    brokers: int | None = None  # as the cluster answers
    error: str | None = None  # why it does not answer
    durability: topics.Durability | None = None
    topics: list[TopicStatus] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StackStatus:
    topology: Topology
    broker: KafkaStatus
    airflow: AirflowStatus
    batch: BatchServerStatus
    spark: SparkStatus | None = None
    monitoring: MonitoringStatus | None = None  # when it runs, or the stack was started with it
    serving: ServingStatus | None = None
    object_store: ObjectStoreStatus | None = None  # when it runs, or the stack was started with it


def status(settings: Settings) -> StackStatus:
    """What runs, and whether the cluster the settings name answers, with its topics' replicas."""
    topology = recorded_stack(settings) or Topology()
    local = _kafka(settings, topology).status()
    if isinstance(local, ClusterStatus):
        nodes, pid, log = local.nodes, None, None
    else:
        nodes, pid, log = [local], local.pid, local.log
    try:
        brokers, error = client.ensure_reachable(settings, timeout=5), None
    except DualityError as failure:
        brokers, error = None, str(failure)
    durability, replicated = None, []
    if error is None:
        durability = topics.durability(settings)
        replicated = [
            TopicStatus(
                **dataclasses.asdict(t),
                below_configured=t.replication_factor < durability.replication_factor
                or t.min_insync_replicas < durability.min_insync_replicas,
            )
            for t in topics.replication(settings, _duality_topics(settings))
        ]
    broker = KafkaStatus(
        state="external" if error is None and local.state == "stopped" else local.state,
        bootstrap_servers=settings.bootstrap_servers,
        reachable=error is None,
        nodes=nodes,
        pid=pid,
        log=log,
        brokers=brokers,
        error=error,
        durability=durability,
        topics=replicated,
    )
    spark = (
        local_spark(settings, topology.spark_workers).status() if topology.spark_workers else None
    )
    airflow = LocalAirflow(settings).status()
    monitoring = LocalMonitoring(settings).status()
    shown = monitoring if topology.monitoring or monitoring.state != "stopped" else None
    batch = LocalBatchServer(settings).status()
    serving = LocalServing(settings).status()
    store = LocalObjectStore(settings).status()
    store_shown = store if topology.object_store or store.state != "stopped" else None
    return StackStatus(topology, broker, airflow, batch, spark, shown, serving, store_shown)


def require_sound(stack: StackStatus) -> None:
    """Raise CheckFailed when topics have fewer replicas than configured, or no cluster answers."""
    broker = stack.broker
    short = [t for t in broker.topics if t.below_configured]
    if short and broker.durability is not None:
        names = ", ".join(
            f"{t.topic} ({t.replication_factor} replicas, min.insync.replicas "
            f"{t.min_insync_replicas})"
            for t in short
        )
        raise CheckFailed(
            f"topics replicated less than configured (replication factor "
            f"{broker.durability.replication_factor}, min.insync.replicas "
            f"{broker.durability.min_insync_replicas}): {names}; add replicas with Kafka's "
            "kafka-reassign-partitions and raise min.insync.replicas with kafka-configs, or "
            "recreate the topics (`duality reset` recreates a pipeline's changelog)",
            dataclasses.asdict(stack),
        )
    if broker.error is not None:
        # The error names the address and says what to do: a refused login or a missing ACL
        # as such, a cluster that does not answer how to start one.
        raise CheckFailed(broker.error, dataclasses.asdict(stack))


def _duality_topics(settings: Settings) -> list[str]:
    """The pipelines', the heartbeats' and the repartition DAG's topics."""
    from duality.stream.heartbeat import STATUS_TOPIC

    topics = [STATUS_TOPIC]
    for path in spec.spec_files(settings):
        try:
            pipeline = spec.load_spec(path)
        except UsageError:
            continue  # `duality spec validate` names what is wrong with it
        topics += [pipeline.changelog_topic, pipeline.dlq_topic]
    topics += [t.target for t in spec.load_repartition_config(settings).topics]
    return topics
