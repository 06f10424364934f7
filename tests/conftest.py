"""Session fixtures: one broker (or the cluster DUALITY_BOOTSTRAP_SERVERS names), one Spark."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from duality.config import Settings
from duality.kafka import client
from duality.local.broker import ephemeral_broker
from tests.harness import AIRFLOW_HOMES, assert_eventually, unique_name

# Every JVM the tests start (brokers, Spark drivers and workers, spark-submit's launcher) compiles
# with C1 only: most live for seconds, and C2 compiling Spark costs them more CPU than it saves
# (docs/testing.md). Semantics do not change; `make bench` and users' processes never set it.
os.environ.setdefault("JDK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1")

_MARK_BY_FOLDER = {"unit": "unit", "integration": "integration", "e2e": "e2e", "dags": "unit"}
# What a process the tests start would leave in the system's temporary folder if it were not
# given a folder of its own: the JVM's native libraries and Spark's block manager and
# artifact folders, Chromium's socket folders, and duality's own temporary folders.
_LEFTOVERS = ("librocksdbjni*", "liblz4-java*", "snappy-*", "blockmgr-*", "artifacts-*", "spark-*")
_LEFTOVERS += ("org.chromium.Chromium.*", "duality-*")
_LEFTOVERS_AT_START = pytest.StashKey[set[str]]()
# Folders whose conftest.py starts a stack that their modules share, run by one worker.
_SHARED_STACKS = {"tests/e2e", "tests/integration/system/three_nodes"}


def _temp_leftovers() -> set[str]:
    root = Path(tempfile.gettempdir())
    return {path.name for pattern in _LEFTOVERS for path in root.glob(pattern)}


def _xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is one of pytest-xdist's workers (`make test` runs two)."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _xdist_worker(session.config):
        session.config.stash[_LEFTOVERS_AT_START] = _temp_leftovers()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The run fails when it left files in the system's temporary folder: every process a test
    starts, and every folder it makes, is its own to clean up. Judged once, by the process that
    ran the tests or started the workers, after they all ended (a worker's own Airflow home goes
    when the worker exits, so its departure is waited for)."""
    if _xdist_worker(session.config):
        return
    ours = {Path(home.name).name for home in AIRFLOW_HOMES}  # removed when the process exits

    def left_over() -> list[str]:
        return sorted(_temp_leftovers() - session.config.stash[_LEFTOVERS_AT_START] - ours)

    with contextlib.suppress(AssertionError):
        assert_eventually(lambda: not left_over(), timeout=30)
    left = left_over()
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the tests left {len(left)} entries in {tempfile.gettempdir()}: {left[:20]}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The longest units of `make test` (a module, or a folder sharing a stack), longest first, from
# `--durations=0` of a CI run (docs/testing.md). They start first, so that the workers end
# together instead of one running the last long unit alone; the rest follow in their order.
_LONGEST_FIRST = (
    "tests/integration/system/three_nodes",
    "tests/e2e",
    "tests/integration/spark/test_stream.py",
    "tests/integration/snapshot/test_snapshot.py",
    "tests/integration/system/test_spark_cluster.py",
    "tests/integration/snapshot/test_snapshot_object_store.py",
    "tests/integration/airflow/test_batch_server.py",
    "tests/integration/system/test_local_topology.py",
    "tests/integration/spark/test_standby.py",
    "tests/integration/spark/test_stream_object_store.py",
    "tests/integration/spark/test_rich_pipeline.py",
    "tests/integration/spark/test_join.py",
    "tests/integration/spark/test_repartition.py",
    "tests/integration/airflow/test_airflow_dags.py",
    "tests/integration/airflow/test_airflow_task_processes.py",
    "tests/integration/system/test_local_monitoring.py",
    "tests/integration/spark/test_avro.py",
    "tests/integration/system/test_local_stack.py",
    "tests/integration/spark/test_sasl.py",
    "tests/integration/system/test_bench.py",
)


def _unit(nodeid: str) -> str:
    """The unit of `make test`'s scheduling a test belongs to (see StackScheduling)."""
    module = nodeid.split("::", 1)[0]
    folder = module.rpartition("/")[0]
    return folder if folder in _SHARED_STACKS else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test is marked by its folder under tests/ (tests/integration/kafka/ is
    `integration`), so `-m unit` and `-m integration` select by kind; the longest units go
    first."""
    for item in items:
        folder = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts[0]
        if folder in _MARK_BY_FOLDER:
            item.add_marker(_MARK_BY_FOLDER[folder])
    rank = {unit: n for n, unit in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: in order


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test`'s workers each run whole units: a module (its module-scoped stack), or a
    folder whose conftest.py starts a package-scoped stack its modules share."""
    from xdist.scheduler import LoadScopeScheduling

    # xdist would send the units with the most tests first; ours go in _LONGEST_FIRST's order.
    config.option.loadscopereorder = False

    class StackScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return StackScheduling(config, log)


@pytest.fixture(scope="session")
def base_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings from the environment, with warehouse and checkpoints in a temporary folder."""
    root = tmp_path_factory.mktemp("duality")
    return Settings.from_env().replace(
        warehouse=root / "warehouse",
        checkpoint_root=root / "checkpoints",
        local_dir=root / "local",
    )


@pytest.fixture(scope="session")
def settings(base_settings: Settings) -> Iterator[Settings]:
    """Settings pointing at a running broker: the named cluster, or a broker of our own."""
    if os.environ.get("DUALITY_BOOTSTRAP_SERVERS"):
        client.ensure_reachable(base_settings)
        yield base_settings
        return
    with ephemeral_broker(base_settings) as scoped:
        yield scoped


@pytest.fixture(scope="session")
def registry_settings(settings: Settings) -> Iterator[Settings]:
    """`settings` with a schema registry (Apicurio, as `duality up --schema-registry` runs it)
    started once for the session, and stopped after it; DUALITY_SCHEMA_REGISTRY_URL names one
    of the environment's instead."""
    if os.environ.get("DUALITY_SCHEMA_REGISTRY_URL"):
        yield settings
        return
    from duality.local.schema_registry import LocalSchemaRegistry

    registry = LocalSchemaRegistry(settings)
    status = registry.start()
    try:
        yield settings.replace(schema_registry_url=status.url)
    finally:
        registry.stop()


@pytest.fixture(scope="session")
def object_store_settings(base_settings: Settings) -> Iterator[Settings]:
    """`base_settings` with an S3 server (SeaweedFS, as `duality up --object-store` runs it,
    built into the jar cache the first time) and its bucket, started once for the session and
    stopped after it."""
    from duality.local.object_store import LocalObjectStore

    store = LocalObjectStore(base_settings)
    store.start()
    try:
        yield Settings.from_env({**base_settings.as_env(), **store.client_settings()})
    finally:
        store.stop()


@pytest.fixture
def topic(request: pytest.FixtureRequest) -> str:
    """A topic name unique to this test; the test creates the topic with the configs it needs."""
    return unique_name(request.node.name)


@pytest.fixture(scope="session")
def spark(settings: Settings, local_spark):  # type: ignore[no-untyped-def]
    """The session's Spark with the session's broker running (set up first, so it stops last)."""
    return local_spark


@pytest.fixture(scope="session")
def local_spark(base_settings: Settings):  # type: ignore[no-untyped-def]
    """Spark in local mode for tests that need no broker; `spark` is the same session."""
    from duality.spark import session

    spark = session(base_settings, "duality-tests")
    yield spark
    spark.stop()
    # stop() leaves the JVM running until this process exits, with Spark's cached Kafka
    # producers calling a broker that is stopped next. The JVM exits when its stdin closes.
    from pyspark import SparkContext

    process = getattr(SparkContext._gateway, "proc", None)
    if process is not None and process.stdin is not None:
        process.stdin.close()
        process.wait(timeout=60)
    # py4j logs each connection it closes at INFO, at exit too, when pytest's streams are closed.
    logging.getLogger("py4j").setLevel(logging.WARNING)
