"""docker-compose.yml and docker/Dockerfile agree with the code, the Makefile and the poms."""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from duality.config import PREFIX, Settings
from duality.local.airflow import AIRFLOW_COMPONENTS, AIRFLOW_MIGRATE
from duality.local.broker import _DEV_BROKER_CONFIG
from duality.local.postgres import AIRFLOW_DB_DRIVER, AIRFLOW_DB_NAME, AIRFLOW_DB_USER
from duality.spark import CLASS_ARCHIVE, JOIN_JAR, class_archive
from duality.stream import election

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
MAKEFILE = ROOT / "Makefile"
NS = {"m": "http://maven.apache.org/POM/4.0.0"}

KAFKA = ("kafka-1", "kafka-2", "kafka-3")
SPARK_MASTER = "spark-master"
SPARK_WORKERS = ("spark-worker-1", "spark-worker-2")
SPARK = (SPARK_MASTER, *SPARK_WORKERS)
BATCH_SERVER = "batch-server"
AIRFLOW_COMMANDS = {
    "airflow-init": ["db", "migrate"],
    "airflow-apiserver": ["api-server"],
    "airflow-scheduler": ["scheduler"],
    "airflow-dag-processor": ["dag-processor"],
    "airflow-triggerer": ["triggerer"],
}
AIRFLOW = tuple(AIRFLOW_COMMANDS)
POSTGRES = "postgres"
SCHEMA_REGISTRY = "schema-registry"
WAREHOUSE_VOLUME = "warehouse"


@functools.cache
def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def _services() -> dict[str, dict[str, Any]]:
    return dict(_compose()["services"])


def _service(name: str) -> dict[str, Any]:
    services = _services()
    assert name in services, f"docker-compose.yml has no service {name!r}"
    return dict(services[name])


_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with an empty environment: the stack's own defaults."""

    def resolve(match: re.Match[str]) -> str:
        name, operator, default = match.groups()
        assert operator in ("-", ":-"), name
        return default

    return _INTERPOLATION.sub(resolve, value.replace("$$", "\0")).replace("\0", "$")


def _env(name: str) -> dict[str, str]:
    """A service's environment with compose's defaults filled in, every value a string."""
    raw = _service(name).get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    env = {}
    for key, value in raw.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        env[str(key)] = _interpolate(str(value)) if value is not None else ""
    return env


def _command(name: str) -> list[str]:
    command = _service(name).get("command")
    assert command, f"service {name!r} has no command"
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def _volume_mounts(name: str) -> dict[str, str]:
    """Named volume -> container path of one service (short and long syntax)."""
    mounts = {}
    for volume in _service(name).get("volumes") or []:
        if isinstance(volume, dict):
            source, target = volume.get("source"), volume.get("target")
        else:
            source, target, *_ = str(volume).split(":")
        if source and target and not source.startswith((".", "/", "~")):
            mounts[source] = target
    return mounts


def _published_ports(name: str) -> dict[int, int]:
    """Host port -> container port of one service."""
    published = {}
    for port in _service(name).get("ports") or []:
        if isinstance(port, dict):
            host, container = port.get("published"), port.get("target")
        else:
            parts = str(port).split("/")[0].split(":")
            assert len(parts) >= 2, f"{name}: port {port!r} publishes no fixed host port"
            host, container = parts[-2], parts[-1]
        published[int(host)] = int(container)
    return published


def _instructions(text: str) -> list[tuple[str, str]]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not current):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        current = ""
    return instructions


@functools.cache
def _dockerfile() -> list[tuple[str, str]]:
    assert DOCKERFILE.is_file(), f"{DOCKERFILE} is missing"
    return _instructions(DOCKERFILE.read_text())


def _dockerfile_args(keyword: str) -> list[str]:
    return [rest for kw, rest in _dockerfile() if kw == keyword]


def _image_env() -> dict[str, str]:
    env = {}
    for rest in _dockerfile_args("ENV"):
        for item in shlex.split(rest):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def _image_run() -> str:
    """Every RUN instruction, in order, as one shell text."""
    return "\n".join(_dockerfile_args("RUN"))


def _workdir() -> str:
    workdirs = _dockerfile_args("WORKDIR")
    assert workdirs, "docker/Dockerfile sets no WORKDIR"
    return workdirs[-1]


def _copied() -> dict[str, str]:
    """Source -> absolute destination of the Dockerfile's COPY instructions."""
    copied = {}
    for rest in _dockerfile_args("COPY"):
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        *sources, destination = parts
        into_folder = destination.endswith("/") or len(sources) > 1
        if not destination.startswith("/"):
            destination = str(PurePosixPath(_workdir()) / destination)
        for source in sources:
            target = destination
            if into_folder and not source.endswith("/"):
                target = str(PurePosixPath(destination) / PurePosixPath(source).name)
            copied[source.rstrip("/")] = target.rstrip("/")
    return copied


def _mvn_invocation(shell: str) -> tuple[list[str], list[str]]:
    """(parts of the `for part in ...` loop, the mvn command's arguments) of a shell text."""
    loop = re.search(r"for\s+part\s+in\s+([^;]+);\s*do", shell)
    mvn = re.search(r"\bmvn\s[^;|&]*dependency:copy-dependencies[^;|&]*", shell)
    assert loop and mvn, f"no `for part in ...; do mvn ...` loop in:\n{shell}"
    return loop.group(1).split(), shlex.split(mvn.group(0))


def _makefile_rule(target: str) -> tuple[str, str]:
    """(prerequisites, recipe) of one Makefile rule, continuation lines joined."""
    text = MAKEFILE.read_text().replace("\\\n", " ")
    match = re.search(
        rf"^{re.escape(target)}\s*:([^\n]*)\n((?:\t[^\n]*\n?)*)", text, flags=re.MULTILINE
    )
    assert match, f"the Makefile has no {target} rule"
    return match.group(1), match.group(2).replace("$$", "$")


def _makefile_variable(name: str) -> str:
    match = re.search(rf"^{name}\s*:?=\s*(.*)$", MAKEFILE.read_text(), flags=re.MULTILINE)
    assert match, f"the Makefile defines no {name}"
    return match.group(1).strip()


def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _pom(part: str) -> ET.ElementTree:
    return ET.parse(ROOT / "jars" / part / "pom.xml")


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    """`NAME://host:port,...` -> {NAME: (host, port)}."""
    listeners = {}
    for item in value.split(","):
        name, _, address = item.strip().partition("://")
        host, _, port = address.rpartition(":")
        listeners[name] = (host, int(port))
    return listeners


def test_every_service_of_the_stack_is_there():
    assert {*KAFKA, *SPARK, BATCH_SERVER, POSTGRES, *AIRFLOW, SCHEMA_REGISTRY} <= set(_services())


@pytest.mark.parametrize("name", AIRFLOW)
def test_each_airflow_service_runs_its_airflow_command(name: str):
    command = _command(name)
    assert command[0] == "airflow" and command[1:] == AIRFLOW_COMMANDS[name], name


def test_airflow_services_run_the_local_components():
    """One list of Airflow's components, in duality.local: the Airflow services of compose run
    the commands that `duality up` runs on PostgreSQL (the migration and each component)."""
    compose = sorted(tuple(_command(name)[1:]) for name in AIRFLOW)
    local = sorted([AIRFLOW_MIGRATE, *((component,) for component in AIRFLOW_COMPONENTS)])
    assert compose == local, f"compose runs airflow {compose}, duality up airflow {local}"


def test_spark_services_run_master_and_workers_from_pyspark():
    spark_class = _image_env()["SPARK_HOME"] + "/bin/spark-class"
    assert _command(SPARK_MASTER)[:2] == [spark_class, "org.apache.spark.deploy.master.Master"]
    for worker in SPARK_WORKERS:
        worker_class = "org.apache.spark.deploy.worker.Worker"
        assert _command(worker)[:2] == [spark_class, worker_class], worker


def test_dependencies_exist_and_wait_for_health():
    services = _services()
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        if isinstance(depends_on, list):
            depends_on = {target: {"condition": "service_started"} for target in depends_on}
        for target, spec in depends_on.items():
            assert target in services, f"{name} depends on {target!r}, which is no service"
            condition = (spec or {}).get("condition")
            if condition == "service_healthy":
                assert services[target].get("healthcheck"), name
            if target == "airflow-init":
                assert condition == "service_completed_successfully", name
    for name in AIRFLOW:
        depends_on = _service(name).get("depends_on") or {}
        assert depends_on.get(POSTGRES, {}).get("condition") == "service_healthy", name
        if name != "airflow-init":
            assert "airflow-init" in depends_on, f"{name} must wait for airflow-init (db migrate)"
    scheduler = _service("airflow-scheduler")["depends_on"]
    for name in (*KAFKA, SPARK_MASTER):
        assert scheduler.get(name, {}).get("condition") == "service_healthy", name
    for worker in SPARK_WORKERS:
        condition = (_service(worker).get("depends_on") or {}).get(SPARK_MASTER, {})
        assert condition.get("condition") == "service_healthy", f"{worker} must wait for master"


def test_the_batch_server_runs_the_steps_of_airflows_tasks():
    """The service Airflow's tasks send their batch steps to (`DUALITY_BATCH_SERVER`) is the
    batch server, on the port and name that setting gives, with the cluster as its Spark."""
    settings = Settings.from_env(_env("airflow-scheduler"))
    assert settings.batch_server is not None
    host, _, port = settings.batch_server.rpartition(":")
    service = _service(BATCH_SERVER)
    assert host == BATCH_SERVER == service["hostname"]
    command = _command(BATCH_SERVER)
    assert command[:4] == ["python", "-m", "duality.cli", "batch-server"], command
    options = dict(zip(command[4::2], command[5::2], strict=True))
    assert options == {"--host": "0.0.0.0", "--port": port}, options
    assert port in " ".join(service["healthcheck"]["test"]), "the health check probes another port"
    assert Settings.from_env(_env(BATCH_SERVER)).spark_master == _master_url()
    waits = service["depends_on"]
    for name in (*KAFKA, SPARK_MASTER):
        assert waits.get(name, {}).get("condition") == "service_healthy", name
    scheduler = _service("airflow-scheduler")["depends_on"]
    assert scheduler[BATCH_SERVER]["condition"] == "service_healthy"


def test_the_replicas_are_the_ones_query_asks():
    """Two `duality serve` services (docs/serving.md): every address of DUALITY_REPLICAS is a
    service serving on all interfaces at that port, its health check probing it, with a store
    folder on a volume of its own (a folder takes one writer), after the Kafka cluster."""
    asked = Settings.from_env(_env("airflow-scheduler")).replica_urls
    assert len(asked) >= 2, asked
    volumes = set()
    for url in asked:
        parts = urlsplit(url)
        name = str(parts.hostname)
        service = _service(name)
        assert service["hostname"] == name
        assert _command(name) == ["python", "-m", "duality.cli", "serve"]
        settings = Settings.from_env(_env(name))
        assert (settings.serve_host, settings.serve_port) == ("0.0.0.0", parts.port)
        assert f"localhost:{parts.port}/healthz" in " ".join(service["healthcheck"]["test"])
        store = settings.replica_dir
        (volume,) = [v for v, path in _volume_mounts(name).items() if store == Path(path)]
        volumes.add(volume)
        waits = service["depends_on"]
        for broker in KAFKA:
            assert waits.get(broker, {}).get("condition") == "service_healthy", (name, broker)
    assert len(volumes) == len(asked), f"replicas share a store volume: {volumes}"


def test_the_batch_servers_secret_is_a_compose_secret_of_the_server_and_airflow():
    """docs/operations.md, "Securing the batch server": one file-based compose secret, mounted in
    the batch server and every Airflow service, where DUALITY_BATCH_SERVER_SECRET_FILE points;
    the secret itself is in no environment."""
    secrets = _compose().get("secrets") or {}
    assert set(secrets) == {"batch_server_secret", "s3_secret_key"}, secrets
    assert secrets["batch_server_secret"] == {"file": "./secrets/batch-server-secret"}
    assert "secrets/" in (ROOT / ".gitignore").read_text().split()
    assert "secrets/" in (ROOT / ".dockerignore").read_text().split()
    for name in (BATCH_SERVER, *AIRFLOW):
        mounted = [s if isinstance(s, str) else s["source"] for s in _service(name)["secrets"]]
        assert mounted[0] == "batch_server_secret", name
        settings = Settings.from_env(_env(name))
        assert settings.batch_server_secret_file == Path("/run/secrets/batch_server_secret")
        assert settings.batch_server_secret is None, name
    for name in _services():
        assert f"{PREFIX}BATCH_SERVER_SECRET" not in _env(name), name


def test_the_object_store_is_the_one_duality_up_runs():
    """docs/operations.md, "Object storage": the object-store service is SeaweedFS from the
    package and version requirements.lock pins, which `duality up --object-store` runs, with its
    options, answering where
    DUALITY_S3_ENDPOINT points, to the identity of DUALITY_S3_ACCESS_KEY and the compose secret
    s3_secret_key (in no environment), mounted wherever a process reads it; its bucket is made
    by object-store-init before the batch server and Airflow start."""
    from duality.local.object_store import PACKAGE, SERVER_FLAGS

    service = _service("object-store")
    assert service["build"] == {"context": ".", "dockerfile": "docker/seaweedfs.Dockerfile"}
    dockerfile = (ROOT / "docker" / "seaweedfs.Dockerfile").read_text()
    pinned = (ROOT / "requirements.lock").read_text().splitlines()
    assert any(line.startswith(f"{PACKAGE}==") for line in pinned)
    assert "COPY requirements.lock " in dockerfile
    assert f"\"$(grep '^{PACKAGE}==' /tmp/requirements.lock)\"" in dockerfile
    command = _command("object-store")
    assert command[0] == "server" and set(SERVER_FLAGS) <= set(command), command
    options = dict(part.split("=", 1) for part in command[1:] if "=" in part)
    assert options["-s3.config"] == "/tmp/s3.json" and "> /tmp/s3.json" in dockerfile
    settings = Settings.from_env(_env(BATCH_SERVER))
    endpoint = urlsplit(str(settings.s3_endpoint))
    assert (endpoint.hostname, endpoint.port) == ("object-store", int(options["-s3.port"]))
    assert service["hostname"] == "object-store"
    assert _env("object-store")["S3_ACCESS_KEY"] == settings.s3_access_key
    assert (_compose()["secrets"]["s3_secret_key"]) == {"file": "./secrets/s3-secret-key"}
    assert settings.s3_secret_key_file == Path("/run/secrets/s3_secret_key")
    readers = ("object-store", "object-store-init", BATCH_SERVER, *AIRFLOW)
    for name in readers:
        mounted = [s if isinstance(s, str) else s["source"] for s in _service(name)["secrets"]]
        assert "s3_secret_key" in mounted, name
    for name in _services():
        assert f"{PREFIX}S3_SECRET_KEY" not in _env(name), name
    assert _command("object-store-init") == ["python", "-m", "duality.object_store"]
    waits = _service("object-store-init")["depends_on"]
    assert waits["object-store"]["condition"] == "service_healthy"
    for name in (BATCH_SERVER, *(n for n in AIRFLOW if n != "airflow-init")):
        waits = _service(name)["depends_on"]
        assert waits["object-store-init"]["condition"] == "service_completed_successfully", name


def test_every_interpolation_has_a_default():
    # _interpolate asserts on a variable without a default; run it over the whole file.
    for name in _services():
        _env(name)
    for variable in _INTERPOLATION.finditer(COMPOSE.read_text()):
        _interpolate(variable.group(0))


def test_kafka_image_is_the_broker_version_of_the_pom():
    version = _pom("broker").find("m:properties/m:kafka.version", NS)
    assert version is not None and version.text
    assert {_service(name).get("image") for name in KAFKA} == {f"apache/kafka:{version.text}"}


def test_kraft_quorum_lists_exactly_the_three_brokers():
    node_ids = {}
    for name in KAFKA:
        env = _env(name)
        assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}, name
        node_ids[name] = int(env["KAFKA_NODE_ID"])
    assert sorted(node_ids.values()) == [1, 2, 3], f"node ids must be 1..3, got {node_ids}"
    voter_lists = {_env(name)["KAFKA_CONTROLLER_QUORUM_VOTERS"] for name in KAFKA}
    assert len(voter_lists) == 1, f"brokers disagree on the quorum voters: {voter_lists}"
    voters = {}
    for voter in voter_lists.pop().split(","):
        node_id, _, address = voter.partition("@")
        host, _, port = address.rpartition(":")
        voters[int(node_id)] = (host, int(port))
    expected = {}
    for name in KAFKA:
        env = _env(name)
        controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]
        expected[node_ids[name]] = (name, _listeners(env["KAFKA_LISTENERS"])[controller][1])
    assert voters == expected, f"quorum voters {voters} are not the brokers {expected}"


def test_kafka_cluster_id_is_one_valid_id():
    ids = {name: _env(name).get("CLUSTER_ID") for name in KAFKA}
    assert len(set(ids.values())) == 1 and None not in ids.values()
    cluster_id = next(iter(ids.values()))
    assert cluster_id is not None and not cluster_id.startswith("-"), cluster_id
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_advertised_listeners_are_reachable_names():
    published: dict[int, str] = {}
    for name in KAFKA:
        env = _env(name)
        listeners = _listeners(env["KAFKA_LISTENERS"])
        advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
        protocols = dict(
            item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
        )
        assert set(listeners) <= set(protocols), f"{name}: listeners without a protocol"
        assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] not in advertised, name
        internal = env["KAFKA_INTER_BROKER_LISTENER_NAME"]
        assert advertised[internal] == (name, listeners[internal][1]), name
        ports = _published_ports(name)
        for listener, (host, port) in advertised.items():
            if listener == internal:
                continue
            assert host == "localhost" and ports.get(port) == listeners[listener][1], name
            published[port] = name
    assert len(published) == len(KAFKA), f"each broker needs its own host listener: {published}"


def test_kafka_cluster_settings():
    for name in KAFKA:
        env = _env(name)
        assert env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE") == "false", name
        for prefix in ("KAFKA_OFFSETS_TOPIC", "KAFKA_TRANSACTION_STATE_LOG"):
            assert env.get(f"{prefix}_REPLICATION_FACTOR") == str(len(KAFKA)), name
        assert env.get("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR") == "2", name
        # The brokers let a standby's election use its own session timeout, as local ones do.
        session = int(
            env.get("KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS", election.KAFKA_MIN_SESSION_TIMEOUT_MS)
        )
        assert session <= election.SESSION_TIMEOUT_MS, name
    assert int(_DEV_BROKER_CONFIG["group.min.session.timeout.ms"]) <= election.SESSION_TIMEOUT_MS
    data = {name: _volume_mounts(name) for name in KAFKA}
    for name, mounts in data.items():
        log_dir = _env(name)["KAFKA_LOG_DIRS"]
        assert log_dir in mounts.values(), f"{name} keeps its log dir {log_dir} on no volume"
    volumes = [volume for mounts in data.values() for volume in mounts]
    assert len(volumes) == len(set(volumes)) == len(KAFKA), f"one data volume per broker: {data}"


def test_image_base_and_environment():
    base = _dockerfile_args("FROM")
    assert base == ["python:3.11-slim-bookworm"], f"docker/Dockerfile builds FROM {base}"
    env = _image_env()
    assert env.get("DUALITY_HOME") == _workdir() == "/opt/duality"
    assert env.get("SPARK_HOME") == "/usr/local/lib/python3.11/site-packages/pyspark"
    assert env.get("JAVA_HOME"), "the image sets no JAVA_HOME"
    assert "openjdk-17-jdk-headless" in _image_run() and "maven" in _image_run()


def test_image_archives_the_driver_classes_like_the_makefile():
    """Both run `python -m duality.spark` after the packages and the jars, and the archive lands
    where `duality.spark.CLASS_ARCHIVE` looks for it (under the interpreter's prefix)."""
    prerequisites, recipe = _makefile_rule("$(CLASS_ARCHIVE)")
    assert prerequisites.split() == ["$(PY_STAMP)", "$(JAR_STAMP)", "$(JOIN_JAR)"]
    assert "$(PY) -m duality.spark" in recipe
    assert "$(CLASS_ARCHIVE)" in _makefile_rule("setup")[0]
    assert _makefile_variable("CLASS_ARCHIVE") == "$(VENV)/share/duality/spark-driver.jsa"
    assert Path(sys.prefix) / "share" / "duality" / "spark-driver.jsa" == CLASS_ARCHIVE
    shell = _image_run()
    archive, jars = shell.find("python -m duality.spark"), shell.find("copy-dependencies")
    assert 0 <= jars < archive, "the image archives no driver classes after fetching its jars"
    assert "test -f /usr/local/share/duality/spark-driver.jsa" in shell  # python:3.11's prefix
    # And the archive of drivers with S3A, after the S3A jars, where `class_archive` finds it.
    prerequisites, recipe = _makefile_rule("$(S3A_CLASS_ARCHIVE)")
    assert prerequisites.split() == ["$(CLASS_ARCHIVE)"] and "-m duality.spark --s3a" in recipe
    assert "$(S3A_CLASS_ARCHIVE)" in _makefile_rule("object-store")[0]
    cache = Path("/jar-cache")
    s3a_archive = class_archive(
        Settings(home=cache, jar_cache=cache, s3_endpoint="http://127.0.0.1:9")
    ).relative_to(cache)
    assert _makefile_variable("S3A_CLASS_ARCHIVE") == f"$(JAR_CACHE)/{s3a_archive}"
    s3a = shell.find("python -m duality.spark --s3a")
    assert shell.find("s3a_jars(") < s3a and archive < s3a
    assert f"test -f /opt/duality/.cache/jars/{s3a_archive}" in shell


def test_image_compiles_the_join_like_the_makefile():
    """Both compile TableJoin.java for Java 17 against pyspark's jars, into the jar that
    `duality.spark.JOIN_JAR` names (under the interpreter's prefix), before the class archive."""
    prerequisites, recipe = _makefile_rule("$(JOIN_JAR)")
    source = "include/duality/join/TableJoin.java"
    assert prerequisites.split()[0] == source
    assert "javac --release 17" in recipe and "/jars/*" in recipe
    assert _makefile_variable("JOIN_JAR") == "$(VENV)/share/duality/duality-join.jar"
    assert Path(sys.prefix) / "share" / "duality" / "duality-join.jar" == JOIN_JAR
    shell = _image_run()
    compiled = shell.find(
        f'javac --release 17 -d /tmp/join-classes -cp "$SPARK_HOME/jars/*" {source}'
    )
    assert 0 <= compiled < shell.find("python -m duality.spark"), "the image compiles no join"
    assert "jar cf /usr/local/share/duality/duality-join.jar" in shell


def test_image_fetches_jars_like_the_makefile():
    prerequisites, recipe = _makefile_rule("$(JAR_STAMP)")
    make_parts, make_mvn = _mvn_invocation(recipe)
    image_parts, image_mvn = _mvn_invocation(_image_run())
    assert image_parts == make_parts, f"the image fetches {image_parts}, the Makefile {make_parts}"
    assert sorted(prerequisites.split()) == sorted(f"jars/{p}/pom.xml" for p in make_parts)

    def without_cache(args: list[str]) -> list[str]:
        return [a for a in args if not a.startswith("-Djar.cache=")]

    assert without_cache(image_mvn) == without_cache(make_mvn)
    make_cache = [a for a in make_mvn if a.startswith("-Djar.cache=")]
    assert make_cache == ["-Djar.cache=$(JAR_CACHE)"], make_cache
    image_cache = [a.partition("=")[2] for a in image_mvn if a.startswith("-Djar.cache=")]
    assert image_cache == [_image_env()["DUALITY_JAR_CACHE"]]
    assert _copied().get("jars") == _workdir() + "/jars", "jars/ is not copied next to the poms"
    for part in make_parts:
        output = _pom(part).find("m:build/m:plugins/m:plugin/m:configuration/m:outputDirectory", NS)
        assert output is not None and output.text == f"${{jar.cache}}/{part}"


def test_image_and_setup_install_the_lock_less_pyspark_client():
    """Both install exactly the lock's pins, leaving out pyspark-client (decision 32)."""
    run = _image_run()
    assert _copied().get("requirements.lock") == _workdir() + "/requirements.lock"
    leave_out = "grep -v '^pyspark-client==' requirements.lock > "
    image = re.search(re.escape(leave_out) + r"(\S+);", run)
    assert image, "docker/Dockerfile does not leave pyspark-client out of the lock"
    assert f"pip install --no-deps -r {image.group(1)}" in run
    makefile = (ROOT / "Makefile").read_text()
    setup = re.search(re.escape(leave_out) + r"(\S+)\n", makefile)
    assert setup, "the Makefile does not leave pyspark-client out of the lock"
    assert f"pip sync --quiet --python $(PY) {setup.group(1)}" in makefile
    assert "pyspark-client" in _lock_pins() and "pyspark" in _lock_pins()
    assert re.search(r"pip install --no-deps (-e )?\.(\s|;|$)", run)
    pins = _lock_pins()
    for driver in ("psycopg2-binary", "asyncpg"):  # Airflow's sync and async engines
        assert driver in pins, f"requirements.lock must pin {driver}, a driver of Airflow's DB"
    assert "import" in run and "psycopg2, asyncpg" in run, "the image does not import the drivers"


def test_image_holds_the_code_at_duality_home():
    home = _image_env()["DUALITY_HOME"]
    copied = _copied()
    for source in ("pyproject.toml", "include", "jars", "jobs", "dags", "plugins"):
        assert copied.get(source) == f"{home}/{source}", source


def test_spark_and_airflow_run_the_one_built_image():
    images = {}
    for name in (*SPARK, *AIRFLOW):
        service = _service(name)
        build = service.get("build")
        assert isinstance(build, dict), f"{name} is not built from docker/Dockerfile"
        assert build.get("context") in (".", "./"), name
        assert build.get("dockerfile") == "docker/Dockerfile", name
        images[name] = service.get("image")
    assert len(set(images.values())) == 1 and None not in images.values()


def test_every_duality_variable_is_a_setting():
    known = {PREFIX + field.name.upper() for field in dataclasses.fields(Settings)}
    known.add(PREFIX + "HOME")
    sources = {name: _env(name) for name in _services()}
    sources["docker/Dockerfile"] = _image_env()
    for source, env in sources.items():
        unknown = sorted(k for k in env if k.startswith(PREFIX) and k not in known)
        assert not unknown, source


def test_spark_and_airflow_see_the_same_settings():
    image_env = _image_env()
    expected = None
    for name in (*SPARK, BATCH_SERVER, *AIRFLOW):
        env = {k: v for k, v in _env(name).items() if k.startswith(PREFIX)}
        assert env.get("DUALITY_HOME") == image_env["DUALITY_HOME"], name
        assert env.get("DUALITY_JAR_CACHE") == image_env["DUALITY_JAR_CACHE"], name
        expected = expected or env
        assert env == expected, f"{name} has other DUALITY_* settings than the rest: {env}"


def test_data_lies_in_the_bucket_and_local_files_on_the_shared_volume():
    assert WAREHOUSE_VOLUME in (_compose().get("volumes") or {}), "no top-level warehouse volume"
    mount_paths = set()
    for name, env in ((name, _env(name)) for name in _services()):
        if name in (*SPARK, *AIRFLOW):
            assert "DUALITY_WAREHOUSE" in env, f"{name} does not set DUALITY_WAREHOUSE"
        if "DUALITY_WAREHOUSE" not in env:
            continue
        mounts = _volume_mounts(name)
        assert WAREHOUSE_VOLUME in mounts, name
        mount = PurePosixPath(mounts[WAREHOUSE_VOLUME])
        mount_paths.add(mount)
        settings = Settings.from_env(env)
        assert settings.local_dir.is_relative_to(mount) and settings.local_dir != mount, name
        # Tables, checkpoints and reports are in the object store's bucket, not on the volume.
        for field in ("warehouse", "checkpoint_root", "reports"):
            location = str(getattr(settings, field))
            assert location.startswith(f"s3a://{settings.s3_bucket}/"), (name, location)
    assert len(mount_paths) == 1


def test_settings_build_from_each_service_environment():
    for name in (*SPARK, *AIRFLOW):
        env = _env(name)
        settings = Settings.from_env(env)
        assert str(settings.home) == env["DUALITY_HOME"]
        assert str(settings.jar_cache) == env["DUALITY_JAR_CACHE"]
        assert settings.spark_master == env["DUALITY_SPARK_MASTER"]


def _overrides_of(env: dict[str, str]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "plugins"))
    try:
        from duality_airflow.hooks import overrides
    finally:
        sys.path.remove(str(ROOT / "plugins"))
    kafka = json.loads(env["AIRFLOW_CONN_KAFKA_DEFAULT"])
    spark = json.loads(env["AIRFLOW_CONN_SPARK_DEFAULT"])
    assert kafka.get("conn_type") == "kafka", kafka
    assert spark.get("conn_type") == "spark", spark
    return overrides(kafka.get("extra"), (spark.get("host"), spark.get("port")))


def _broker_addresses() -> list[str]:
    addresses = []
    for name in KAFKA:
        env = _env(name)
        host, port = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])[
            env["KAFKA_INTER_BROKER_LISTENER_NAME"]
        ]
        addresses.append(f"{host}:{port}")
    return addresses


def _master_url() -> str:
    command = _command(SPARK_MASTER)
    options = dict(zip(command[2::2], command[3::2], strict=False))
    host = options.get("--host", SPARK_MASTER)
    port = int(options.get("--port", 7077))
    assert host == SPARK_MASTER, f"spark-master binds {host}, not its service name"
    assert port in _published_ports(SPARK_MASTER).values(), f"master port {port} not published"
    return f"spark://{host}:{port}"


@pytest.mark.parametrize("name", AIRFLOW)
def test_connections_name_the_cluster(name: str):
    env = _env(name)
    changes = _overrides_of(env)
    brokers = _broker_addresses()
    assert changes.get("bootstrap_servers", "").split(",") == brokers, name
    assert env["DUALITY_BOOTSTRAP_SERVERS"].split(",") == brokers, name
    assert changes.get("spark_master") == _master_url() == env["DUALITY_SPARK_MASTER"], name
    settings = Settings.from_env(env).replace(**changes)
    assert settings.bootstrap_servers == ",".join(brokers)
    assert settings.spark_master == _master_url()
    assert settings.security_protocol == "PLAINTEXT"


def test_workers_register_with_the_master():
    for worker in SPARK_WORKERS:
        assert _master_url() in _command(worker), worker


def test_airflow_uses_the_postgres_service():
    postgres = _env(POSTGRES)
    assert not _published_ports(POSTGRES), "postgres need not be published on the host"
    assert postgres["POSTGRES_USER"] == AIRFLOW_DB_USER  # the role and database `duality up` uses
    assert postgres["POSTGRES_DB"] == AIRFLOW_DB_NAME
    for name in AIRFLOW:
        url = urlsplit(_env(name)["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
        assert url.scheme == AIRFLOW_DB_DRIVER, f"{name}: {url.scheme}, locally {AIRFLOW_DB_DRIVER}"
        login = (postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], POSTGRES)
        assert (url.username, url.password, url.hostname) == login, name
        assert url.path.lstrip("/") == postgres["POSTGRES_DB"], name
        assert url.port in (None, 5432)


def test_airflow_reads_the_image_dags_and_plugins():
    copied = _copied()
    for name in AIRFLOW:
        env = _env(name)
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == copied["dags"], name
        assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == copied["plugins"], name
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "False", name


def test_airflow_urls_point_at_the_api_server():
    (host_port, container_port), *_ = _published_ports("airflow-apiserver").items()
    for name in AIRFLOW:
        env = _env(name)
        execution = urlsplit(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
        where = ("airflow-apiserver", container_port, "/execution/")
        assert (execution.hostname, execution.port, execution.path) == where, name
        duality_url = urlsplit(env["DUALITY_AIRFLOW_URL"])
        assert (duality_url.hostname, duality_url.port) == ("airflow-apiserver", container_port)
        base = urlsplit(env["AIRFLOW__API__BASE_URL"])
        assert base.port == host_port, f"{name}: BASE_URL {base.geturl()} is not the host's port"
        assert env.get("AIRFLOW__API_AUTH__JWT_SECRET"), f"{name} has no shared JWT secret"


def test_airflow_services_share_one_environment():
    envs = {name: _env(name) for name in AIRFLOW}
    first = envs[AIRFLOW[0]]
    for name, env in envs.items():
        differing = sorted(k for k in set(env) | set(first) if env.get(k) != first.get(k))
        assert not differing, f"{name}'s environment differs from {AIRFLOW[0]}'s in {differing}"
    assert re.search(r"^x-airflow-common:\s*&airflow-common", COMPOSE.read_text(), re.MULTILINE)


def test_published_ports_do_not_collide():
    owners: dict[int, list[str]] = {}
    for name in _services():
        for host in _published_ports(name):
            owners.setdefault(host, []).append(name)
    collisions = {port: names for port, names in owners.items() if len(names) > 1}
    assert not collisions, f"host ports published twice: {collisions}"
    assert 8080 in _published_ports("airflow-apiserver"), "the Airflow UI is not published"


def _option(command: list[str], flag: str) -> str:
    assert flag in command, f"{command} has no {flag}"
    return command[command.index(flag) + 1]


def test_local_topology_has_compose_brokers_and_workers():
    from duality.local.kraft import local_cluster
    from duality.local.spark_cluster import local_spark
    from duality.local.stack import PRODUCTION

    settings = Settings.from_env({"DUALITY_LOCAL_DIR": "/nonexistent/duality-compose-test"})
    assert len(KAFKA) == PRODUCTION.brokers
    assert [n.node_id for n in local_cluster(settings, PRODUCTION.brokers).nodes] == [
        int(_env(name)["KAFKA_NODE_ID"]) for name in KAFKA
    ]
    assert len(SPARK_WORKERS) == PRODUCTION.spark_workers
    spark = local_spark(settings, PRODUCTION.spark_workers)
    for worker in SPARK_WORKERS:
        command = _command(worker)
        assert int(_option(command, "--cores")) == spark.cores, worker
        assert _option(command, "--memory") == spark.memory, worker
    assert PRODUCTION.airflow_db == POSTGRES


# --- monitoring: Prometheus, its Pushgateway, Grafana (docs/monitoring.md) ------------------

PUSHGATEWAY = "pushgateway"
PROMETHEUS = "prometheus"
GRAFANA = "grafana"
MONITORING = ROOT / "monitoring"
ALERTS = MONITORING / "alerts.yml"
DASHBOARDS = MONITORING / "grafana" / "dashboards"
PROVISIONING = MONITORING / "grafana" / "provisioning"


def _bind_mounts(name: str) -> dict[str, Path]:
    """Container path -> file or folder of the checkout, of one service's bind mounts."""
    mounts = {}
    for volume in _service(name).get("volumes") or []:
        source, target, *_ = str(volume).split(":")
        if source.startswith("."):
            mounts[target] = (ROOT / source).resolve()
    return mounts


def _flags(name: str) -> dict[str, str]:
    """A service's `--flag=value` arguments."""
    return dict(part.split("=", 1) for part in _command(name) if part.startswith("--"))


def _compose_prometheus() -> dict[str, Any]:
    mounts = _bind_mounts(PROMETHEUS)
    config = mounts.get(_flags(PROMETHEUS)["--config.file"])
    assert config is not None and config.is_file(), "Prometheus reads no config of the checkout"
    data = yaml.safe_load(config.read_text())
    assert isinstance(data, dict)
    return data


def _address(flag: str) -> int:
    """The port of a `--web.listen-address` value (`:9091`)."""
    host, _, port = flag.rpartition(":")
    assert host in ("", "0.0.0.0"), f"{flag} does not listen on every address of its container"
    return int(port)


def _promtool(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run `make monitoring` (Debian's prometheus)")
    return subprocess.run(
        [promtool, *map(str, arguments)], capture_output=True, text=True, timeout=120
    )


def test_monitoring_services_are_there_and_wait_for_each_other():
    assert {PUSHGATEWAY, PROMETHEUS, GRAFANA} <= set(_services())
    assert _service(PROMETHEUS)["depends_on"][PUSHGATEWAY]["condition"] == "service_healthy"
    assert _service(GRAFANA)["depends_on"][PROMETHEUS]["condition"] == "service_healthy"
    for name in (PUSHGATEWAY, PROMETHEUS):
        port = _address(_flags(name)["--web.listen-address"])
        assert f"localhost:{port}/-/ready" in " ".join(_service(name)["healthcheck"]["test"])
        assert port in _published_ports(name).values(), f"{name}'s port {port} is not published"


def test_prometheus_scrapes_what_the_local_stack_scrapes():
    """The compose config is the local stack's generated one with compose's paths, interval
    and Pushgateway: the streams' target files on the volume they write them to, the alert
    rules of the checkout, the Pushgateway that Airflow's tasks and the batch server push to."""
    from duality.local.monitoring import prometheus_config
    from duality.metrics import targets_folder

    config = _compose_prometheus()
    airflow = Settings.from_env(_env("airflow-scheduler"))
    assert Settings.from_env(_env(BATCH_SERVER)).pushgateway == airflow.pushgateway
    assert airflow.pushgateway is not None
    (rules,) = config["rule_files"]
    assert _bind_mounts(PROMETHEUS).get(rules) == ALERTS, f"{rules} is not {ALERTS}"
    interval = config["global"]["scrape_interval"]
    targets = targets_folder(airflow)
    assert config == prometheus_config(targets, airflow.pushgateway, Path(rules), interval)
    # The streams write their files where Prometheus reads them.
    streams = PurePosixPath(_volume_mounts("airflow-scheduler")[WAREHOUSE_VOLUME])
    assert _volume_mounts(PROMETHEUS).get(WAREHOUSE_VOLUME) == str(streams)
    assert PurePosixPath(targets).is_relative_to(streams), f"{targets} is not on {streams}"
    # The Pushgateway is the service of that name, on the port it listens on.
    host, _, port = airflow.pushgateway.rpartition(":")
    assert host == PUSHGATEWAY == _service(PUSHGATEWAY)["hostname"]
    assert int(port) == _address(_flags(PUSHGATEWAY)["--web.listen-address"])
    prometheus = urlsplit(str(airflow.prometheus_url))
    assert prometheus.hostname == PROMETHEUS == _service(PROMETHEUS)["hostname"]
    assert prometheus.port == _address(_flags(PROMETHEUS)["--web.listen-address"])


def test_the_compose_prometheus_config_is_valid(tmp_path: Path):
    config = _compose_prometheus()
    config["rule_files"] = [str(ALERTS)]  # where the container sees it mounted
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config))
    checked = _promtool("check", "config", copy)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _datasource() -> dict[str, Any]:
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    return dict(datasource)


def _dashboards() -> dict[str, dict[str, Any]]:
    found = {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}
    assert found, f"no dashboard in {DASHBOARDS}"
    return found


def _datasource_uids(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("datasource"), dict):
            yield node["datasource"]["uid"]
        for value in node.values():
            yield from _datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            yield from _datasource_uids(value)


def test_grafana_is_provisioned_with_prometheus_and_the_dashboards():
    mounts = _bind_mounts(GRAFANA)
    assert mounts.get("/etc/grafana/provisioning") == PROVISIONING
    datasource = _datasource()
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == Settings.from_env(_env("airflow-scheduler")).prometheus_url
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "duality.yml").read_text())[
        "providers"
    ]
    assert mounts.get(provider["options"]["path"]) == DASHBOARDS
    for name, dashboard in _dashboards().items():
        assert set(_datasource_uids(dashboard)) == {datasource["uid"]}, name


def _panels_querying(metric: str) -> list[str]:
    return [
        panel["title"]
        for dashboard in _dashboards().values()
        for panel in dashboard["panels"]
        if any(metric in target["expr"] for target in panel.get("targets", []))
    ]


def test_the_dashboard_shows_what_the_issue_asks():
    """Throughput, lag, batch duration (a histogram quantile), dead letters by reason, the
    published snapshot's age."""
    assert _panels_querying("rate(duality_records_read_total")
    assert _panels_querying("duality_consumer_lag_records")
    assert _panels_querying("histogram_quantile(0.95, sum by (pipeline, le) (rate(duality_batch")
    assert _panels_querying("sum by (pipeline, reason) (rate(duality_dead_letters_total")
    assert _panels_querying("time() - max by (pipeline) (duality_snapshot_published_timestamp")


def _exported_metrics() -> set[str]:
    """Every series name duality exports: a stream's and a replica server's registries
    (counters with `_total`, histograms with `_bucket`, `_sum`, `_count`), what batch steps push,
    and Prometheus' `up`."""
    from duality.metrics import PUSHED_METRICS, ServingMetrics, StreamMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = {"up", *PUSHED_METRICS}
    families = [*StreamMetrics("x").registry.collect(), *ServingMetrics().registry.collect()]
    for family in families:
        names |= {family.name + suffix for suffix in suffixes[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or"}
_PROMQL_WORDS |= {"unless", "offset", "bool", "inf", "nan"}


def _metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression (or Grafana's `label_values(metric, label)`) reads:
    its identifiers that are neither functions, keywords, labels, strings nor durations."""
    text = re.sub(r"label_values\(\s*([^,()]+?)\s*,\s*\w+\s*\)", r"\1", expression)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)  # Grafana's variables
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[match.end() :].lstrip().startswith("(") or match.group(0) in _PROMQL_WORDS:
            continue  # a function, or a keyword
        names.add(match.group(0))
    return names


def _queries() -> dict[str, str]:
    """Every PromQL expression of the dashboards and the alert rules, by where it is."""
    queries = {}
    for name, dashboard in _dashboards().items():
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                queries[f"{name}: {panel['title']} {target['refId']}"] = target["expr"]
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable["query"]
            queries[f"{name}: ${variable['name']}"] = query.get("query", query)
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            queries[f"alerts.yml: {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    return queries


def test_the_metric_name_reader_reads_promql():
    assert _metric_names('sum by (a, le) (rate(x_total{a=~"$p", b="c"}[5m])) / on (a) y') == {
        "x_total",
        "y",
    }
    assert _metric_names("deriv(sum(z)[10m:1m]) > 0 and on (p) time() - w offset 5m > 2e3") == {
        "z",
        "w",
    }
    assert _metric_names("label_values(m_total, pipeline)") == {"m_total"}


def test_every_query_names_only_metrics_duality_exports():
    exported = _exported_metrics()
    assert {"duality_records_read_total", "duality_batch_duration_seconds_bucket"} <= exported
    assert "duality_snapshot_published_timestamp_seconds" in exported
    named: set[str] = set()
    for where, expression in _queries().items():
        names = _metric_names(expression)
        assert names, f"{where} names no metric: {expression}"
        assert names <= exported, f"{where} names {sorted(names - exported)}, which no code exports"
        named |= names
    # Each alert's metrics are read: the reader did not skip them.
    assert {"up", "duality_validation_success", "duality_dead_letters_total"} <= named


def test_the_schema_registry_is_the_one_avro_sources_ask():
    """Avro sources' registry (issue 50): the release the local stack runs, at the URL every
    duality process's settings name, its schemas in a topic of the cluster, and healthy only
    once it answers, after the brokers."""
    from duality.local.schema_registry import CONFLUENT_API, VERSION

    service = _service(SCHEMA_REGISTRY)
    assert service["image"] == f"apicurio/apicurio-registry:{VERSION}"
    env = _env(SCHEMA_REGISTRY)
    assert env["APICURIO_STORAGE_KIND"] == "kafkasql", "a restart would lose the schemas' ids"
    settings = Settings.from_env(_env("airflow-scheduler"))
    assert env["APICURIO_KAFKASQL_BOOTSTRAP_SERVERS"] == settings.bootstrap_servers
    url = urlsplit(str(settings.schema_registry_url))
    assert (url.hostname, url.path) == (service["hostname"], CONFLUENT_API)
    assert url.hostname == SCHEMA_REGISTRY
    assert f"http://localhost:{url.port}/health/ready" in " ".join(service["healthcheck"]["test"])
    assert any(p.endswith(f":{url.port}") for p in service["ports"]), service["ports"]
    for broker in KAFKA:
        assert service["depends_on"][broker]["condition"] == "service_healthy", broker
    for name in (*SPARK, BATCH_SERVER, *AIRFLOW):
        assert Settings.from_env(_env(name)).schema_registry_url == url.geturl(), name
