"""The one settings object, read from `DUALITY_*` variables: every host, port and path duality
uses (in Airflow, its connections override them through `Settings.replace`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from duality import storage
from duality.errors import UsageError
from duality.kafka import failover
from duality.secret_files import first_line
from duality.storage import Location

PREFIX = "DUALITY_"

_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# SASL mechanisms that log in with a user name and password, and their Java login modules.
LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
# The shortest batch server secret taken (`duality up` makes one of 43 characters).
MIN_SECRET_LENGTH = 16
# What the local stack runs Airflow on: standalone on SQLite, or its components on PostgreSQL.
AIRFLOW_DBS = ("sqlite", "postgres")
# The pipelines shipped in the package (the demo's), whether installed or checked out.
SHIPPED_PIPELINES = Path(__file__).parent / "pipelines"


def _checkout_root() -> Path:
    """The checkout this package was installed from (editable install), else the current folder."""
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").is_file() and (here / "include" / "duality").is_dir():
        return here
    return Path.cwd()


@dataclasses.dataclass(frozen=True)
class Settings:
    """Where duality finds Kafka, Spark, Airflow and its folders (relative to `home`)."""

    home: Path
    bootstrap_servers: str = "localhost:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    # Never shown: not in repr(), and no command prints it (tests scan their output for it).
    sasl_password: str | None = dataclasses.field(default=None, repr=False)
    # Replicas of every topic duality creates, and how many must be in sync for a write with
    # acks=all to succeed. Unset: 3 and 2 on a cluster of at least three brokers, else 1 and 1.
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    # The dev broker's KRaft controller listener (`duality up` only).
    controller_port: int = 9093
    spark_master: str = "local[2]"
    spark_driver_memory: str = "2g"
    # A stream's driver holds no keys (they are in RocksDB, off the heap) and only a micro-batch's
    # output, so its heap is kept small: the JVM grows to whatever heap it is allowed.
    stream_driver_memory: str = "1g"
    # The scheduling priority (nice, 0-19) of a stream's driver and its Spark (in local mode,
    # its executors too): higher yields the cores to what needs answers in milliseconds on the
    # same machine (a serving replica, a broker) while a micro-batch runs (docs/serving.md).
    stream_nice: int = 0
    # Cores one application takes on a Spark cluster (`spark.cores.max`); unset, all free ones,
    # which leaves none for a batch job beside a stream.
    spark_cores_max: int | None = None
    # The batch server (`host:port`, `duality batch-server`) that the batch steps (snapshot,
    # validate, publish, read, repartition) run on; unset, each starts a Spark of its own.
    batch_server: str | None = None
    # How long a batch step waits for a server that does not answer yet (one being restarted
    # takes its Spark's start, over a minute on a busy machine) before it fails.
    batch_server_wait_s: float = 180.0
    # The batch server's shared secret, which every request carries (docs/operations.md,
    # "Securing the batch server"): the value, or a file that holds it. Never shown: not in
    # repr(), not in the settings a client sends with a step, in no log or error.
    batch_server_secret: str | None = dataclasses.field(default=None, repr=False)
    batch_server_secret_file: Path | None = None
    # TLS: the certificate the server presents and its clients trust, and the server's key.
    batch_server_tls_cert: Path | None = None
    batch_server_tls_key: Path | None = None
    # State partitions of a stream whose spec sets no `parallelism`; unset, one per core of a
    # local master, 4 on a cluster.
    stream_partitions: int | None = None
    # A stream's Prometheus endpoint (docs/monitoring.md): 0 = a free port, -1 = none.
    metrics_port: int = 0
    # The Prometheus Pushgateway (`host:port`) that batch steps push their figures to; unset,
    # they push nowhere. Prometheus' HTTP API (`http://host:port`) that the pipelines page reads.
    pushgateway: str | None = None
    prometheus_url: str | None = None
    # `duality serve` (docs/serving.md): where its API listens (port 0: a free one), the folder
    # of its replicas' stores, the bearer token its API asks for (never shown: not in repr(),
    # in no log or error), and the replicas (`http://host:port`, comma-separated) that
    # `duality query` asks; unset, the one at serve_host:serve_port. A replica's writer applies
    # at most serve_write_records changelog records in one transaction.
    serve_host: str = "127.0.0.1"
    serve_port: int = 7080
    serve_dir: Path | None = None
    serve_token: str | None = dataclasses.field(default=None, repr=False)
    replicas: str | None = None
    serve_write_records: int = 5_000
    # The schema registry (Confluent API) of Avro sources (docs/streams.md#formats): its URL
    # and basic-auth user and password (never shown: not in repr(), in no log or error).
    schema_registry_url: str | None = None
    schema_registry_user: str | None = None
    schema_registry_password: str | None = dataclasses.field(default=None, repr=False)
    # Object storage through the S3 API (docs/operations.md "Object storage"): the endpoint
    # (`http://host:port`), the bucket `duality up --object-store` creates, the region requests
    # are signed for, the access key and its secret (never shown: not in repr(), in no log or
    # error; or a file that holds it).
    s3_endpoint: str | None = None
    s3_bucket: str = "duality"
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: str | None = dataclasses.field(default=None, repr=False)
    s3_secret_key_file: Path | None = None
    # Local folders or object storage locations (`s3a://bucket/prefix`, decision 41).
    warehouse: Location = Path(".local/warehouse")
    checkpoint_root: Location = Path(".local/checkpoints")
    jar_cache: Path = Path(".cache/jars")
    pipelines: Path = SHIPPED_PIPELINES
    repartition_config: Path = Path("include/repartition.yaml")
    local_dir: Path = Path(".local")
    reports: Location = Path(".local/reports")
    airflow_url: str = "http://localhost:8080"
    # The local stack's Airflow: `sqlite` (standalone) or `postgres` (components on PostgreSQL).
    airflow_db: str = "sqlite"
    # How long a command waits for the broker before it gives up with a clear error.
    connect_timeout_s: float = 10.0
    # Airflow: the execution timeout of each kind of task (DAG files read these when parsed).
    supervise_timeout_s: float = 600.0
    snapshot_timeout_s: float = 1800.0
    validate_timeout_s: float = 1800.0
    publish_timeout_s: float = 600.0
    repartition_timeout_s: float = 21600.0
    reset_timeout_s: float = 1800.0
    # Airflow: seconds between SIGTERM and SIGKILL when a task stops its child's process group;
    # below Airflow's own 5 s between the SIGTERM and the SIGKILL of a task being stopped.
    kill_grace_s: float = 3.0

    def __post_init__(self) -> None:
        if self.security_protocol not in _SECURITY_PROTOCOLS:
            raise UsageError(
                f"{PREFIX}SECURITY_PROTOCOL={self.security_protocol!r} is not a Kafka security "
                f"protocol: use one of {', '.join(_SECURITY_PROTOCOLS)}"
            )
        self._check_sasl()
        if self.airflow_db not in AIRFLOW_DBS:
            raise UsageError(
                f"{PREFIX}AIRFLOW_DB={self.airflow_db!r} is not a database the local stack runs "
                "Airflow on: use sqlite (Airflow standalone, the default) or postgres "
                "(PostgreSQL, with Airflow's api-server, scheduler, dag-processor and triggerer "
                "as separate processes)"
            )
        if not self.bootstrap_servers.strip():
            raise UsageError(f"{PREFIX}BOOTSTRAP_SERVERS is empty: set it to host:port[,host:port]")
        for server in self.bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise UsageError(
                    f"{PREFIX}BOOTSTRAP_SERVERS={self.bootstrap_servers!r}: {server.strip()!r} "
                    "is not host:port; write it like localhost:9092"
                )
        if self.batch_server is not None and not re.fullmatch(r"[^\s:/]+:\d+", self.batch_server):
            raise UsageError(
                f"{PREFIX}BATCH_SERVER={self.batch_server!r} is not host:port: write it like "
                "127.0.0.1:7078, or unset it to run each step in a Spark of its own"
            )
        self._check_batch_server_security()
        if self.pushgateway is not None and not re.fullmatch(r"[^\s:/]+:\d+", self.pushgateway):
            raise UsageError(
                f"{PREFIX}PUSHGATEWAY={self.pushgateway!r} is not host:port: write it like "
                "127.0.0.1:9091, or unset it to push no batch metrics"
            )
        self._check_serving()
        if self.schema_registry_url is not None and not re.fullmatch(
            r"https?://[^\s/]+(/\S*)?", self.schema_registry_url
        ):
            raise UsageError(
                f"{PREFIX}SCHEMA_REGISTRY_URL={self.schema_registry_url!r} is not an http(s) URL: "
                "write it like http://127.0.0.1:8081 (Apicurio: .../apis/ccompat/v7)"
            )
        if (self.schema_registry_user is None) != (self.schema_registry_password is None):
            raise UsageError(
                f"the schema registry's basic auth needs both {PREFIX}SCHEMA_REGISTRY_USER and "
                f"{PREFIX}SCHEMA_REGISTRY_PASSWORD, or neither"
            )
        self._check_object_store()
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise UsageError(
                f"{PREFIX}METRICS_PORT={self.metrics_port}: use a port, 0 for a free one, or -1 "
                "for no metrics endpoint"
            )
        for name in (
            "replication_factor",
            "min_insync_replicas",
            "spark_cores_max",
            "stream_partitions",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{PREFIX}{name.upper()}={value!r}: set it to 1 or more")
        if (
            self.replication_factor is not None
            and self.min_insync_replicas is not None
            and self.min_insync_replicas > self.replication_factor
        ):
            raise UsageError(
                f"{PREFIX}MIN_INSYNC_REPLICAS={self.min_insync_replicas} is more than "
                f"{PREFIX}REPLICATION_FACTOR={self.replication_factor}: no write could succeed; "
                "lower it to the replication factor or less"
            )
        for name in (f.name for f in dataclasses.fields(self) if f.name.endswith("_s")):
            if not getattr(self, name) > 0:
                raise UsageError(
                    f"{PREFIX}{name.upper()}={getattr(self, name)!r}: set it to a number of "
                    "seconds above zero"
                )
        # Paths are made absolute once, here, so no other module resolves them.
        for field in (
            "warehouse",
            "checkpoint_root",
            "jar_cache",
            "pipelines",
            "repartition_config",
            "local_dir",
            "reports",
            "serve_dir",
            "batch_server_secret_file",
            "s3_secret_key_file",
            "batch_server_tls_cert",
            "batch_server_tls_key",
        ):
            value = getattr(self, field)
            if isinstance(value, str):  # given as text (tests, Airflow connections)
                value = storage.parse(value)
            if isinstance(value, storage.ObjectPath):
                # Bound to this object store's endpoint and credentials.
                object.__setattr__(self, field, value.on(self.store()))
            elif value is not None and not value.is_absolute():
                object.__setattr__(self, field, (self.home / value).resolve())

    def _check_serving(self) -> None:
        if not 0 <= self.stream_nice <= 19:
            raise UsageError(
                f"{PREFIX}STREAM_NICE={self.stream_nice}: use a priority from 0 (the default) "
                "to 19 (the lowest)"
            )
        if not 0 <= self.serve_port <= 65535:
            raise UsageError(
                f"{PREFIX}SERVE_PORT={self.serve_port}: use a port, or 0 for a free one"
            )
        if self.serve_write_records < 1:
            raise UsageError(
                f"{PREFIX}SERVE_WRITE_RECORDS={self.serve_write_records}: use at least 1"
            )
        if self.serve_token is not None and len(self.serve_token.strip()) < MIN_SECRET_LENGTH:
            raise UsageError(
                f"{PREFIX}SERVE_TOKEN is shorter than {MIN_SECRET_LENGTH} characters: use a long "
                "random one, or unset it for an API without a token"
            )
        for url in self.replica_urls:
            if not re.fullmatch(r"https?://[^\s/]+(:\d+)?", url):
                raise UsageError(
                    f"{PREFIX}REPLICAS={self.replicas!r}: {url!r} is not a replica's address; "
                    "write them like http://127.0.0.1:7080,http://10.0.0.2:7080"
                )

    @property
    def replica_dir(self) -> Path:
        """The folder of `duality serve`'s stores: `serve_dir`, else `<local_dir>/serve`."""
        return self.serve_dir or self.local_dir / "serve"

    @property
    def replica_urls(self) -> list[str]:
        """The replicas `duality query` asks: those of `replicas`, else the one this machine's
        `duality serve` answers on."""
        if self.replicas:
            return [u.strip().rstrip("/") for u in self.replicas.split(",") if u.strip()]
        return [f"http://{self.serve_host}:{self.serve_port}"]

    def _check_batch_server_security(self) -> None:
        secret, secret_file = self.batch_server_secret, self.batch_server_secret_file
        if secret is not None and secret_file is not None:
            raise UsageError(
                f"both {PREFIX}BATCH_SERVER_SECRET and {PREFIX}BATCH_SERVER_SECRET_FILE are set: "
                "set one of them (the file keeps the secret out of the environment)"
            )
        if secret is not None and len(secret.strip()) < MIN_SECRET_LENGTH:
            raise UsageError(
                f"{PREFIX}BATCH_SERVER_SECRET is shorter than {MIN_SECRET_LENGTH} characters: "
                "use a long random one (`duality up` makes one for the local stack)"
            )
        if self.batch_server_tls_key is not None and self.batch_server_tls_cert is None:
            raise UsageError(
                f"{PREFIX}BATCH_SERVER_TLS_KEY is set without {PREFIX}BATCH_SERVER_TLS_CERT: set "
                "the certificate too, or unset the key"
            )

    def read_batch_server_secret(self) -> str | None:
        """The batch server's shared secret: the setting's, else the first line of its file;
        None when neither is set. A file that cannot be read, or holds too short a secret, is a
        UsageError naming the setting (never the secret)."""
        if self.batch_server_secret is not None:
            return self.batch_server_secret.strip()
        if self.batch_server_secret_file is None:
            return None
        setting = f"{PREFIX}BATCH_SERVER_SECRET_FILE={self.batch_server_secret_file}"
        secret = first_line(self.batch_server_secret_file, setting, "the batch server's secret")
        if len(secret) < MIN_SECRET_LENGTH:
            raise UsageError(
                f"{setting} holds no secret of at least {MIN_SECRET_LENGTH} characters: write a "
                "long random one into it (`duality up` makes one for the local stack)"
            )
        return secret

    def _check_object_store(self) -> None:
        if self.s3_endpoint is not None and not re.fullmatch(
            r"https?://[^\s/]+/?", self.s3_endpoint
        ):
            raise UsageError(
                f"{PREFIX}S3_ENDPOINT={self.s3_endpoint!r} is not an http(s) URL of a host: write "
                "it like http://127.0.0.1:8333 (no bucket or path; buckets are in the locations)"
            )
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", self.s3_bucket):
            raise UsageError(
                f"{PREFIX}S3_BUCKET={self.s3_bucket!r} is not a bucket name: use 3-63 lower-case "
                "letters, digits, dots and hyphens"
            )
        if self.s3_secret_key is not None and self.s3_secret_key_file is not None:
            raise UsageError(
                f"both {PREFIX}S3_SECRET_KEY and {PREFIX}S3_SECRET_KEY_FILE are set: set one of "
                "them (the file keeps the secret out of the environment)"
            )
        has_secret = self.s3_secret_key is not None or self.s3_secret_key_file is not None
        if (self.s3_access_key is None) != (not has_secret):
            raise UsageError(
                f"the object store's credentials need both {PREFIX}S3_ACCESS_KEY and "
                f"{PREFIX}S3_SECRET_KEY (or {PREFIX}S3_SECRET_KEY_FILE), or neither"
            )

    def location(self, text: str | Path) -> Location:
        """A folder named by a setting or a spec: on object storage (`s3a://…`, reached with
        these settings' endpoint and credentials) or local (relative to `home`)."""
        value = storage.parse(str(text))
        if isinstance(value, storage.ObjectPath):
            return value.on(self.store())
        return value if value.is_absolute() else (self.home / value).resolve()

    def store(self) -> storage.Store:
        """The object store's endpoint and credentials, as locations on it are reached with."""
        return storage.Store(
            self.s3_endpoint,
            self.s3_region,
            self.s3_access_key,
            self.s3_secret_key,
            self.s3_secret_key_file,
        )

    def read_s3_secret_key(self) -> str | None:
        """The object store's secret key (`Store.secret`)."""
        return self.store().secret()

    def _check_sasl(self) -> None:
        sasl = self.security_protocol.startswith("SASL_")
        mechanism = self.sasl_mechanism
        if mechanism is not None and mechanism not in LOGIN_MODULES:
            raise UsageError(
                f"{PREFIX}SASL_MECHANISM={mechanism!r} is not supported: use one of "
                f"{', '.join(LOGIN_MODULES)} (spelled in capitals)"
            )
        if mechanism is not None and not sasl:
            raise UsageError(
                f"{PREFIX}SASL_MECHANISM={mechanism} needs a SASL security protocol, but "
                f"{PREFIX}SECURITY_PROTOCOL={self.security_protocol}: set it to SASL_PLAINTEXT "
                f"or SASL_SSL, or unset {PREFIX}SASL_MECHANISM"
            )
        if sasl and mechanism is None:
            raise UsageError(
                f"{PREFIX}SECURITY_PROTOCOL={self.security_protocol} needs "
                f"{PREFIX}SASL_MECHANISM: set it to one of {', '.join(LOGIN_MODULES)}"
            )
        if sasl:
            missing = [
                f"{PREFIX}{name.upper()}"
                for name in ("sasl_username", "sasl_password")
                if not getattr(self, name)
            ]
            if missing:
                raise UsageError(
                    f"{PREFIX}SECURITY_PROTOCOL={self.security_protocol} with "
                    f"{PREFIX}SASL_MECHANISM={mechanism} logs in with a user name and a password: "
                    f"set {' and '.join(missing)}"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings of the environment; where it is silent, those that `duality up` recorded
        for the local stack it started (`<local_dir>/stack.json`), then the defaults."""
        env = os.environ if environ is None else environ
        home = Path(env.get(f"{PREFIX}HOME") or _checkout_root()).resolve()
        local_dir = Path(env.get(f"{PREFIX}LOCAL_DIR") or cls.local_dir).expanduser()
        recorded = stack_settings(home / local_dir)
        # The batch server's secret and its file are one setting in two forms: either, given in
        # the environment (an Airflow connection's secret, say), takes the place of the other
        # form that the stack recorded.
        for given, other in _ONE_SETTING_TWO_FORMS:
            if env.get(PREFIX + given):
                recorded.pop(PREFIX + other, None)
        env = {**recorded, **env}
        values: dict[str, object] = {"home": home}
        for field in dataclasses.fields(cls):
            if field.name == "home":
                continue
            raw = env.get(PREFIX + field.name.upper())
            if raw is None or raw == "":
                continue
            values[field.name] = _convert(field.name, field.type, raw)
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> Settings:
        """A copy with some fields changed (Airflow connections, tests)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def as_env(self) -> dict[str, str]:
        """These settings as `DUALITY_*` variables, for the processes duality starts."""
        env = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                env[PREFIX + field.name.upper()] = str(value)
        return env

    def process_env(self) -> dict[str, str]:
        """The environment of a process duality starts: this one's, its `DUALITY_*` variables
        replaced by these settings, so that a setting they leave unset (the secret's file,
        when an Airflow connection gives the secret) is not inherited beside them."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        return {**inherited, **self.as_env()}

    @property
    def first_bootstrap(self) -> tuple[str, int]:
        host, _, port = self.bootstrap_servers.split(",")[0].strip().rpartition(":")
        return host, int(port)

    def kafka_client_config(self) -> dict[str, str]:
        """librdkafka properties for connecting and authenticating; no behaviour settings."""
        config = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            config["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None:
            config["sasl.username"] = self.sasl_username
        if self.sasl_password is not None:
            config["sasl.password"] = self.sasl_password
        return config

    def jaas_config(self) -> str | None:
        """The Java client's `sasl.jaas.config` for this login, its values quoted and escaped so
        that any user name or password reads back unchanged; None without SASL."""
        if self.sasl_mechanism is None:
            return None
        return (
            f"{LOGIN_MODULES[self.sasl_mechanism]} required "
            f"username={jaas_quote(self.sasl_username or '')} "
            f"password={jaas_quote(self.sasl_password or '')};"
        )

    def java_client_config(self) -> dict[str, str]:
        """The same connection as properties of Kafka's Java client (Kafka's tools, Spark)."""
        config = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
        }
        jaas = self.jaas_config()
        if jaas is not None:
            config["sasl.mechanism"] = str(self.sasl_mechanism)
            config["sasl.jaas.config"] = jaas
        return config

    def spark_kafka_options(self) -> dict[str, str]:
        """The same connection as options of Spark's Kafka source and sink (Java client names),
        with the timeouts that let them ride through a broker's loss (`duality.kafka.failover`)."""
        config = {**self.java_client_config(), **failover.JAVA_CLIENT}
        return {f"kafka.{key}": value for key, value in config.items()}

    def spark_kafka_source_options(self) -> dict[str, str]:
        """`spark_kafka_options` for reading: a task's consumer that reaches the end of a
        partition is answered within 10 ms instead of the broker holding its fetch for Kafka's
        default 500 ms, which a micro-batch or a read to the end paid once per partition wave
        (docs/decisions/0018-stream-latency.md)."""
        return {
            **self.spark_kafka_options(),
            **failover.SPARK_SOURCE,
            "kafka.fetch.max.wait.ms": "10",
        }


def jaas_quote(value: str) -> str:
    """`value` as a quoted JAAS option value. Kafka reads `sasl.jaas.config` with Java's
    StreamTokenizer, which ends a quoted string at a quote or a line end and reads backslash
    escapes inside it; so backslash, quote, newline and carriage return are escaped."""
    escaped = (
        value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    )
    return f'"{escaped}"'


def java_properties(config: Mapping[str, str]) -> str:
    """`config` as the text of a Java properties file that `Properties.load` reads back exactly
    (Kafka's tools read `--command-config` files so: ISO-8859-1, backslash escapes)."""

    def escape(text: str, key: bool) -> str:
        out = []
        for i, char in enumerate(text):
            if char == "\\":
                out.append("\\\\")
            elif char in "\t\n\r\f":
                out.append({"\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f"}[char])
            elif char in "=:#!" or (char == " " and (key or i == 0)):
                out.append("\\" + char)
            elif " " <= char <= "~":
                out.append(char)
            else:  # outside printable ASCII: UTF-16 code units as \uXXXX
                units = char.encode("utf-16-be")
                out.extend(
                    f"\\u{int.from_bytes(units[j : j + 2], 'big'):04x}"
                    for j in range(0, len(units), 2)
                )
        return "".join(out)

    return "".join(f"{escape(k, True)}={escape(v, False)}\n" for k, v in config.items())


STACK_FILE = "stack.json"
_ONE_SETTING_TWO_FORMS = (
    ("BATCH_SERVER_SECRET", "BATCH_SERVER_SECRET_FILE"),
    ("S3_SECRET_KEY", "S3_SECRET_KEY_FILE"),
    ("S3_SECRET_KEY_FILE", "S3_SECRET_KEY"),
    ("BATCH_SERVER_SECRET_FILE", "BATCH_SERVER_SECRET"),
)


def stack_settings(local_dir: Path) -> dict[str, str]:
    """The `DUALITY_*` settings that `duality up` recorded for the stack it runs in `local_dir`
    (the brokers' addresses, the Spark master); none when no stack was started there."""
    path = local_dir / STACK_FILE
    try:
        recorded = json.loads(path.read_text())["settings"]
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError):
        raise UsageError(
            f"{path} is not a stack record of `duality up`: run `duality down`, or delete it"
        ) from None
    return {str(k): str(v) for k, v in recorded.items() if str(k).startswith(PREFIX)}


def _convert(name: str, kind: object, raw: str) -> object:
    env_name = PREFIX + name.upper()
    kind_text = str(kind)
    if "Location" in kind_text:
        return storage.parse(raw)
    if "Path" in kind_text:
        return Path(raw).expanduser()
    if kind_text in ("int", "float", "int | None"):
        try:
            return float(raw) if kind_text == "float" else int(raw)
        except ValueError:
            raise UsageError(
                f"{env_name}={raw!r} is not a number: set it to a "
                f"{'number' if kind_text == 'float' else 'whole number'}"
            ) from None
    return raw


def describe() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for the README table and `duality status`."""
    meanings = {
        "home": "folder that relative paths below are taken from (default: the checkout)",
        "bootstrap_servers": "Kafka bootstrap servers, host:port[,host:port]",
        "security_protocol": "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL",
        "sasl_mechanism": "SASL mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512); required with a "
        "SASL_* protocol",
        "sasl_username": "SASL user name; required with a SASL mechanism",
        "sasl_password": "SASL password; required with a SASL mechanism, never printed or logged",
        "replication_factor": "replicas of every topic duality creates (unset: 3 on a cluster "
        "of at least three brokers, else 1)",
        "min_insync_replicas": "`min.insync.replicas` of every topic duality creates (unset: 2 "
        "when the replication factor is 3 or more, else 1)",
        "controller_port": "KRaft controller port of the dev broker started by `duality up`",
        "spark_master": "Spark master URL (`local[N]`, `spark://host:7077`)",
        "spark_driver_memory": "memory of the Spark driver of batch jobs (snapshot, validate, "
        "repartition, reset)",
        "stream_driver_memory": "memory of a stream's Spark driver (its state is in RocksDB, off "
        "this heap)",
        "stream_nice": "scheduling priority (nice, 0-19) of a stream's driver and its Spark in "
        "local mode, and of its session's autogroup: raise it where a serving replica or a "
        "broker shares the stream's cores",
        "spark_cores_max": "cores each application may take on a Spark cluster (unset: all free "
        "ones; `duality up --spark-workers N` sets N, so streams and batch jobs fit side by side)",
        "batch_server": "batch server (`host:port`) that batch steps run on, in its warm Spark "
        "(`duality up` starts one); unset: each step starts a Spark of its own",
        "batch_server_wait_s": "seconds a batch step waits for a batch server that does not "
        "answer yet (starting or restarting) before it fails",
        "batch_server_secret": "the batch server's shared secret, sent with every request "
        "(in Airflow, the `spark_default` connection's password); never printed or logged",
        "batch_server_secret_file": "a file holding the batch server's secret, instead of "
        "`DUALITY_BATCH_SERVER_SECRET` (`duality up` makes one)",
        "batch_server_tls_cert": "the batch server's TLS certificate: the server presents it, "
        "its clients trust it; unset: no TLS (`duality up` makes one)",
        "batch_server_tls_key": "the private key of `DUALITY_BATCH_SERVER_TLS_CERT` (the "
        "batch server only)",
        "stream_partitions": "state partitions of a stream whose spec sets no `parallelism` "
        "(unset: one per core of a local master, 4 on a cluster); fixed in its checkpoint, "
        "changed by `duality stream rescale`",
        "metrics_port": "port of each stream's Prometheus endpoint (0: a free one, written into "
        "its heartbeat and `stream status`; -1: none)",
        "pushgateway": "Prometheus Pushgateway (`host:port`) that batch steps push their figures "
        "to (`duality up --monitoring` starts one); unset: none",
        "prometheus_url": "Prometheus' address (`http://host:port`) for the pipelines page's "
        "charts (`duality up --monitoring` sets it); unset: charts from heartbeats",
        "serve_host": "address `duality serve` answers its HTTP API on (`0.0.0.0`: every "
        "interface; the default keeps it to this machine)",
        "serve_port": "port of `duality serve`'s API, `/healthz` and `/metrics` (0: a free one, "
        "written into `<serve_dir>/serve.json`)",
        "serve_dir": "folder of `duality serve`'s replicas, a SQLite file per pipeline (unset: "
        "`<local_dir>/serve`)",
        "serve_token": "bearer token `duality serve`'s API asks for and `duality query` sends; "
        "unset: none. Never printed or logged",
        "replicas": "URLs of the replicas `duality query` asks, comma-separated (unset: "
        "`http://<serve_host>:<serve_port>`)",
        "serve_write_records": "changelog records a replica's writer applies in one transaction "
        "at most: fewer make each write visible sooner, more apply a backlog faster",
        "schema_registry_url": "schema registry (Confluent API, `http://host:port/path`) that "
        "Avro sources' schemas come from (`duality up --schema-registry` starts one and sets it)",
        "schema_registry_user": "basic-auth user of the schema registry; unset: none",
        "schema_registry_password": "basic-auth password of the schema registry; never printed "
        "or logged",
        "s3_endpoint": "the S3 API's URL (`http://host:port`) of the object store that "
        "`s3a://` locations are on (`duality up --object-store` starts one and sets it)",
        "s3_bucket": "the bucket `duality up --object-store` creates",
        "s3_region": "the region requests to the object store are signed for",
        "s3_access_key": "access key of the object store (in Airflow, the `aws_default` "
        "connection's login)",
        "s3_secret_key": "secret key of the object store (in Airflow, the `aws_default` "
        "connection's password); never printed or logged",
        "s3_secret_key_file": "a file holding the object store's secret key, instead of "
        "`DUALITY_S3_SECRET_KEY` (`duality up --object-store` makes one)",
        "warehouse": "folder of Delta tables: a local path or `s3a://bucket/prefix`",
        "checkpoint_root": "folder of streaming checkpoints: a local path or `s3a://bucket/prefix`",
        "jar_cache": "folder the Maven-fetched jars are copied into",
        "pipelines": "folder of pipeline specs (default: the shipped ones, in the package)",
        "repartition_config": "topics the scheduled repartition DAG checks and copies",
        "local_dir": (
            "data, logs and pid files of the local stack; the temporary files of Spark's JVMs "
            "(`jvm-tmp/`)"
        ),
        "reports": (
            "validation reports: JSON and Great Expectations Data Docs per pipeline; a local "
            "path or `s3a://bucket/prefix`"
        ),
        "airflow_url": "Airflow UI and API address",
        "airflow_db": "what `duality up` runs Airflow on: `sqlite` (Airflow standalone) or "
        "`postgres` (a PostgreSQL server of its own, and the api-server, scheduler, dag-processor "
        "and triggerer as separate processes)",
        "connect_timeout_s": "seconds a command waits for the broker before it gives up",
        "supervise_timeout_s": "Airflow: execution timeout (s) of a stream DAG task (one look of "
        "the supervisor; waiting for the stream to report running)",
        "snapshot_timeout_s": "Airflow: execution timeout (s) of the snapshot DAG's `snapshot`",
        "validate_timeout_s": "Airflow: execution timeout (s) of the snapshot DAG's `validate`",
        "publish_timeout_s": "Airflow: execution timeout (s) of the snapshot DAG's `publish`",
        "repartition_timeout_s": "Airflow: execution timeout (s) of a repartition DAG task (the "
        "plan; the skew check and copy of one topic)",
        "reset_timeout_s": "Airflow: execution timeout (s) of the reset DAG's task",
        "kill_grace_s": "Airflow: seconds between SIGTERM and SIGKILL when a task that is stopped "
        "or timed out ends its child's process group (keep it below Airflow's 5)",
    }
    rows = []
    for field in dataclasses.fields(Settings):
        default = "" if field.default is dataclasses.MISSING else str(field.default)
        if isinstance(field.default, Path) and field.default.is_absolute():  # in the package
            default = f"duality/{field.default.relative_to(Path(__file__).parent)}"
        rows.append((PREFIX + field.name.upper(), default, meanings[field.name]))
    return rows
