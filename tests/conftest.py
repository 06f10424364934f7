"""Session fixtures: one broker (or the cluster DUALITY_BOOTSTRAP_SERVERS names), one Spark."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from duality import kafka
from duality.config import Settings
from duality.local import ephemeral_broker
from tests.harness import unique_name

_MARK_BY_FOLDER = {"unit": "unit", "integration": "integration", "e2e": "e2e", "dags": "unit"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test is marked by its folder, so `-m unit` and `-m integration` select by kind."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _MARK_BY_FOLDER:
            item.add_marker(_MARK_BY_FOLDER[folder])


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
        kafka.ensure_reachable(base_settings)
        yield base_settings
        return
    with ephemeral_broker(base_settings) as scoped:
        yield scoped


@pytest.fixture
def topic(request: pytest.FixtureRequest) -> str:
    """A topic name unique to this test; the test creates the topic with the configs it needs."""
    return unique_name(request.node.name)


@pytest.fixture(scope="session")
def spark(settings: Settings):  # type: ignore[no-untyped-def]
    from duality.spark import session

    spark = session(settings, "duality-tests")
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
