"""The table's Delta log as duality reads and writes it: commits and the records duality keeps
in their userMetadata, versions' checksum files read without Spark, a version by time travel."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duality.errors import UsageError
from duality.snapshot.coverage import Coverage
from duality.spec import PipelineSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

METADATA_KEY = "duality"
# Commits that do not change the table's rows; an incremental run may build on top of them.
_ROW_PRESERVING = {"OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES"}


@dataclasses.dataclass(frozen=True)
class Version:
    version: int
    timestamp_ms: int
    operation: str
    metadata: dict[str, Any] | None  # duality's userMetadata, None for a foreign commit
    metrics: dict[str, int] = dataclasses.field(default_factory=dict)  # operationMetrics


def history(path: Path) -> list[Version]:
    """The table's commits, newest first: the `commitInfo` of each JSON commit in its log (what
    Delta's own history reads), without a Spark job."""
    versions = []
    for file in (path / "_delta_log").glob("*.json"):
        if not file.stem.isdigit():
            continue
        info: dict[str, Any] = {}
        with file.open() as lines:
            for line in lines:
                if line.startswith('{"commitInfo"'):
                    info = json.loads(line)["commitInfo"]
                    break
        metadata = None
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            metadata = json.loads(info.get("userMetadata") or "{}").get(METADATA_KEY)
        metrics = {k: int(v) for k, v in (info.get("operationMetrics") or {}).items()}
        versions.append(
            Version(
                int(file.stem),
                int(info.get("timestamp", file.stat().st_mtime * 1000)),
                str(info.get("operation", "UNKNOWN")),
                metadata,
                metrics,
            )
        )
    return sorted(versions, key=lambda v: -v.version)


@dataclasses.dataclass(frozen=True)
class TableState:
    """What a version's checksum file (Delta's `_delta_log/<version>.crc`) says of it."""

    version: int
    columns: list[str]
    properties: dict[str, str]
    rows: int | None  # None when the checksum does not list the table's files


def table_state(path: Path, version: int) -> TableState | None:
    """A version's columns, table properties and row count from its checksum file, or None
    when Delta wrote none (the callers then ask Spark)."""
    try:
        checksum = json.loads((path / "_delta_log" / f"{version:020d}.crc").read_text())
        metadata = checksum["metadata"]
        columns = [field["name"] for field in json.loads(metadata["schemaString"])["fields"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    rows: int | None = None
    if isinstance(checksum.get("allFiles"), list):
        try:
            rows = sum(
                json.loads(entry["stats"])["numRecords"]
                - (entry.get("deletionVector") or {}).get("cardinality", 0)
                for entry in checksum["allFiles"]
            )
        except (ValueError, KeyError, TypeError):
            rows = None
    return TableState(version, columns, dict(metadata.get("configuration") or {}), rows)


def is_table(path: Path) -> bool:
    return (path / "_delta_log").is_dir()


def require_table(spec: PipelineSpec, path: Path) -> Path:
    if not is_table(path):
        raise UsageError(
            f"pipeline {spec.name} has no snapshot at {path}: build one with "
            f"`duality snapshot {spec.name}`"
        )
    return path


def version_coverage(versions: list[Version], version: int) -> tuple[Coverage | None, str | None]:
    """What `version` covers (from `history()`): its commit's record, or that of the version it
    was built on through row-preserving commits; else None and why."""
    for entry in versions:
        if entry.version > version:
            continue
        if entry.metadata is not None and "coverage" in entry.metadata:
            return Coverage.from_dict(entry.metadata["coverage"]), None
        if entry.operation not in _ROW_PRESERVING:
            return None, f"version {entry.version} ({entry.operation}) was written outside duality"
    return None, "no version records the changelog offsets it covers"


def latest_data_version(versions: list[Version]) -> int:
    """The newest version that is not one of duality's validation or publish commits."""
    for entry in versions:
        if (entry.metadata or {}).get("kind") not in ("validation", "publish"):
            return entry.version
    return versions[-1].version


@contextmanager
def session_conf(spark: SparkSession, values: dict[str, str]) -> Iterator[None]:
    """The Spark session's `values` inside, what they were before after."""
    before = {key: spark.conf.get(key, None) for key in values}
    for key, value in values.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def commit_metadata(spark: SparkSession, metadata: dict[str, Any]) -> AbstractContextManager[None]:
    """Every Delta commit made inside carries `metadata` as its userMetadata (`history()` reads
    it back)."""
    text = json.dumps({METADATA_KEY: metadata}, separators=(",", ":"))
    return session_conf(spark, {"spark.databricks.delta.commitInfo.userMetadata": text})


def sql_name(path: Path) -> str:
    """The table at `path` as SQL names it (`delta.`/a/path``)."""
    return "delta.`" + str(path).replace("`", "``") + "`"


def load(spark: SparkSession, path: Path, version: int | None = None) -> DataFrame:
    """The table at `version` (time travel; default: the newest)."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(str(path))
