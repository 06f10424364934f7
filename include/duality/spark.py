"""The one Spark session builder: local jars, Delta, RocksDB state with changelog checkpointing.

Jars come from the Maven-fetched cache through `spark.jars`; nothing is resolved with Ivy when a
session starts, so sessions start quickly and work offline.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from duality.config import Settings
from duality.errors import UsageError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Every jar the Spark sessions need must be in the cache; these name the essential ones.
REQUIRED_JARS = ("spark-sql-kafka-0-10_2.13-", "delta-spark_4.1_2.13-", "kafka-clients-")

T = TypeVar("T")

_ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


def spark_jars(settings: Settings) -> list[Path]:
    """The jar files every session loads, or a UsageError naming the fix when one is missing."""
    folder = settings.jar_cache / "spark"
    jars = sorted(folder.glob("*.jar"))
    names = [jar.name for jar in jars]
    missing = [prefix for prefix in REQUIRED_JARS if not any(n.startswith(prefix) for n in names)]
    if missing:
        raise UsageError(
            f"the jar cache {folder} lacks {', '.join(p.rstrip('-') for p in missing)}: "
            "run `make setup` (or set DUALITY_JAR_CACHE to the folder that holds them)"
        )
    return jars


def session_config(settings: Settings, app_name: str) -> dict[str, str]:
    """Every setting the builder applies; also what the compose stack's jobs are given."""
    local = settings.spark_master.startswith("local")
    config = {
        "spark.app.name": app_name,
        "spark.master": settings.spark_master,
        "spark.jars": ",".join(str(jar) for jar in spark_jars(settings)),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.streaming.stateStore.providerClass": _ROCKSDB_PROVIDER,
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        "spark.sql.warehouse.dir": str(settings.warehouse),
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.memory": settings.spark_driver_memory,
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.debug.maxToStringFields": "200",
    }
    if local:
        # Modest defaults for a laptop-sized local mode: few shuffle partitions, no UI port.
        config.update(
            {
                "spark.sql.shuffle.partitions": "4",
                "spark.default.parallelism": "4",
                "spark.ui.enabled": "false",
                "spark.sql.adaptive.enabled": "true",
                # Delta rebuilds a table's state from its log in this many tasks (default 50).
                "spark.databricks.delta.snapshotPartitions": "2",
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
            }
        )
    return config


def session(
    settings: Settings,
    app_name: str = "duality",
    extra: Mapping[str, str] | None = None,
) -> SparkSession:
    """The SparkSession for this process (created on first call, then reused)."""
    from pyspark.sql import SparkSession

    # Driver and executors must run the interpreter that has duality installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    config = session_config(settings, app_name)
    config.update(extra or {})
    builder = SparkSession.builder
    for key, value in config.items():
        builder = builder.config(key, value)
    spark = _with_stdout_to_stderr(builder.getOrCreate)
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _with_stdout_to_stderr(start: Callable[[], T]) -> T:
    """Run `start` with file descriptor 1 pointing at stderr.

    The JVM that a first session launches inherits it, so what Spark and Delta print (VACUUM
    prints its counts) goes to stderr, and stdout stays for results (`--json`, job output).
    """
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        return start()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
