"""Delta snapshots of a pipeline's table, rebuilt from its compacted changelog (DESIGN §7).

A snapshot version is the changelog's latest live value per key at offsets fixed when the run
starts (read_committed). Every version duality writes carries, in its commit's userMetadata,
what it covers: the changelog's offsets (and topic id) and the source offsets the stream had
committed with them. `--incremental` reads only the changelog records after those offsets and
MERGEs them; it rebuilds in full, and says why, when the table has no such record, the
changelog was recreated or truncated, the table was changed outside duality, or its columns no
longer match the spec. Each run is one Delta commit, so an interrupted run leaves the previous
version as it was.

Write, audit, publish: `duality validate` checks a version and records its verdict in the table
(a metadata-only commit whose userMetadata holds it, `record_validation`); publishing a version
(`publish`, or the same commit when validation publishes) sets the table properties
`duality.published.*`, and only a version whose recorded verdict passed is published. `read()`
returns the published version, never a newer unvalidated one
(docs/decisions/0004-snapshots-write-audit-publish.md, 0010-publish-gate-in-delta.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from duality import kafka
from duality.config import Settings
from duality.errors import CheckFailed, UsageError
from duality.spec import SQL_TYPES, PipelineSpec

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, SparkSession

Mode = Literal["auto", "full", "incremental"]
Progress = Callable[[str], None]

METADATA_KEY = "duality"
PUBLISHED_VERSION = "duality.published.version"
PUBLISHED_COVERAGE = "duality.published.coverage"
VALIDATION = "duality.validation"  # the latest verdict, for people reading the properties
# An incremental run that reads at most this many changelog records reads them in the driver.
SMALL_CHANGE = 200_000
# Commits that do not change the table's rows; an incremental run may build on top of them.
_ROW_PRESERVING = {"OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES"}


def quiet(_: str) -> None:
    """The default progress callback: says nothing."""


# -- what a version covers ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Coverage:
    """The changelog offsets a snapshot version covers, and the source offsets that match them.

    `source` holds the offsets the stream had committed (in the same Kafka transactions as the
    changelog records) at the moment the changelog offsets were taken.
    """

    changelog_topic: str
    changelog_topic_id: str
    changelog: dict[int, int]
    source_topic: str
    source: dict[int, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "changelog_topic": self.changelog_topic,
            "changelog_topic_id": self.changelog_topic_id,
            "changelog": {str(p): o for p, o in sorted(self.changelog.items())},
            "source_topic": self.source_topic,
            "source": {str(p): o for p, o in sorted(self.source.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Coverage:
        return cls(
            changelog_topic=data["changelog_topic"],
            changelog_topic_id=data["changelog_topic_id"],
            changelog={int(p): int(o) for p, o in data["changelog"].items()},
            source_topic=data["source_topic"],
            source={int(p): int(o) for p, o in data["source"].items()},
        )


def capture_coverage(settings: Settings, spec: PipelineSpec, attempts: int = 20) -> Coverage:
    """The changelog's stable end offsets and the stream's committed source offsets, as a pair.

    The stream commits changelog records and source offsets in one transaction, but the two
    become visible separately. Reading source, changelog, source, changelog until both repeat
    (with stable offsets, which wait out a committing transaction) gives a matching pair.
    """
    info = kafka.describe_topic(settings, spec.changelog_topic)
    group, source_topic = spec.consumer_group, spec.source.topic
    for _ in range(attempts):
        source_before = _source_offsets(settings, group, source_topic)
        changelog_before = kafka.end_offsets(settings, spec.changelog_topic)
        source_after = _source_offsets(settings, group, source_topic)
        changelog_after = kafka.end_offsets(settings, spec.changelog_topic)
        if source_before == source_after and changelog_before == changelog_after:
            return Coverage(
                spec.changelog_topic, info.topic_id, changelog_after, source_topic, source_after
            )
    raise CheckFailed(
        f"the changelog {spec.changelog_topic} kept moving while its offsets were read "
        f"({attempts} tries): run the snapshot again"
    )


def _source_offsets(settings: Settings, group: str, topic: str) -> dict[int, int]:
    committed = kafka.committed_offsets(settings, group, topic)
    return {partition: offset for partition, (offset, _) in committed.items()}


# -- the snapshot's shape -------------------------------------------------------------------


def column_types(spec: PipelineSpec) -> dict[str, str]:
    """The snapshot's columns and their Spark SQL types, in table order."""
    fields = spec.source.fields
    types = {name: SQL_TYPES[fields[name]] for name in spec.source.key}
    if spec.window is not None:
        types["window_start"] = "timestamp"
    for column, aggregate in spec.aggregates.items():
        if aggregate.function == "count":
            types[column] = "bigint"
        elif aggregate.function == "avg":
            types[column] = "double"
        else:
            kind = fields[aggregate.field or ""]
            types[column] = "bigint" if kind in ("long", "int") else SQL_TYPES[kind]
            if aggregate.function == "sum" and kind == "int":
                types[column] = "bigint"
    types["_updated_at"] = "timestamp"
    return types


def _changelog_rows(spec: PipelineSpec, latest: DataFrame) -> DataFrame:
    """Typed snapshot rows (plus `_deleted`) from the latest (key, value) of each changelog key.

    Key columns come from the record key, so tombstones (null values) still name their row.
    """
    from pyspark.sql import functions as F

    types = column_types(spec)
    key_text = F.col("key").cast("string")
    keys: list[Column] = []
    if len(spec.key_columns) == 1:
        keys.append(key_text.alias("_k0"))
    else:
        parts = F.from_json(key_text, "array<string>")
        keys.extend(parts.getItem(i).alias(f"_k{i}") for i in range(len(spec.key_columns)))
    # Timestamps travel as epoch milliseconds in the value (window starts as ISO text in keys).
    value_ddl = ", ".join(
        f"`{column}` {'bigint' if kind == 'timestamp' else kind}"
        for column, kind in types.items()
        if column not in spec.key_columns
    )
    parsed = latest.select(
        *keys,
        F.col("value").isNull().alias("_deleted"),
        F.from_json(F.col("value").cast("string"), value_ddl).alias("_v"),
    )
    columns: list[Column] = []
    for index, column in enumerate(spec.key_columns):
        raw = F.col(f"_k{index}")
        if column == "window_start":
            columns.append(F.to_timestamp(raw).alias(column))
        else:
            columns.append(raw.cast(types[column]).alias(column))
    for column, kind in types.items():
        if column in spec.key_columns:
            continue
        value = F.col(f"_v.{column}")
        if kind == "timestamp":
            value = F.timestamp_millis(value)
        columns.append(value.alias(column))
    return parsed.select(*columns, "_deleted")


def _read_changelog(
    spark: SparkSession,
    settings: Settings,
    topic: str,
    start: dict[int, int] | None,
    end: dict[int, int],
) -> DataFrame:
    """The changelog's records from `start` (None: the beginning) up to `end`, read_committed."""
    wanted = [p for p, stop in sorted(end.items()) if stop > (start or {}).get(p, 0)]
    if not wanted:
        return spark.createDataFrame([], "key binary, value binary, partition int, offset bigint")
    starting = {str(p): (start[p] if start is not None else -2) for p in wanted}
    ending = {str(p): end[p] for p in wanted}
    return (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_source_options())
        .option("assign", json.dumps({topic: wanted}))
        .option("startingOffsets", json.dumps({topic: starting}))
        .option("endingOffsets", json.dumps({topic: ending}))
        .option("kafka.isolation.level", "read_committed")
        # Compaction and transaction markers leave gaps in the offsets; truncation before
        # `start` is checked by the caller, which then rebuilds in full.
        .option("failOnDataLoss", "false")
        .load()
        .select("key", "value", "partition", "offset")
    )


def _latest_changes(
    settings: Settings, topic: str, start: dict[int, int], end: dict[int, int]
) -> pa.Table:
    """What `_latest_per_key` computes, for the changelog's records from `start` up to `end`,
    read in this process (read_committed): a key lives in one partition, so its last record
    read is its latest."""
    import pyarrow as pa

    latest: dict[bytes, tuple[bytes | None, int]] = {}
    for message in kafka.read_to_end(settings, topic, start=start, end=end):
        key = message.key()
        if key is not None:
            latest[key] = (message.value(), latest.get(key, (None, 0))[1] + 1)
    return pa.table(
        {
            "key": pa.array(list(latest), pa.binary()),
            "value": pa.array([value for value, _ in latest.values()], pa.binary()),
            "_records": pa.array([count for _, count in latest.values()], pa.int64()),
        }
    )


def _latest_per_key(raw: DataFrame) -> DataFrame:
    """The last record of each key (offset order) and how many records each key had."""
    from pyspark.sql import functions as F

    latest = raw.where(F.col("key").isNotNull()).groupBy("key")
    return latest.agg(
        F.max(F.struct("offset", "value")).getField("value").alias("value"),
        F.count(F.lit(1)).alias("_records"),
    )


# -- the table's log, read without Spark -----------------------------------------------------


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
        if info.get("userMetadata"):
            try:
                metadata = json.loads(info["userMetadata"]).get(METADATA_KEY)
            except (json.JSONDecodeError, AttributeError):
                metadata = None
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


def current(versions: list[Version]) -> tuple[Coverage | None, str | None]:
    """The coverage an incremental run can build on (from `history()`), or why it cannot."""
    for version in versions:
        if version.metadata is not None and "coverage" in version.metadata:
            return Coverage.from_dict(version.metadata["coverage"]), None
        if version.operation not in _ROW_PRESERVING:
            written = f"version {version.version} ({version.operation})"
            return None, f"{written} was written outside duality"
    return None, "no version records the changelog offsets it covers"


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
    """Every Delta commit made inside carries `metadata` as its userMetadata."""
    text = json.dumps({METADATA_KEY: metadata}, separators=(",", ":"))
    return session_conf(spark, {"spark.databricks.delta.commitInfo.userMetadata": text})


# -- building a version -------------------------------------------------------------------


@dataclasses.dataclass
class SnapshotResult:
    pipeline: str
    path: str
    mode: str  # what ran: full or incremental ("none" when nothing changed)
    requested: str
    fallback_reason: str | None
    version: int | None  # the new version; None when nothing changed
    previous_version: int | None
    coverage: dict[str, Any]
    read_ranges: dict[str, list[int]]  # changelog partition -> [first offset read, end]
    records_read: int
    keys_read: int
    rows: int
    inserted: int
    updated: int
    deleted: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build(
    settings: Settings,
    spec: PipelineSpec,
    mode: Mode = "auto",
    *,
    spark: SparkSession | None = None,
    progress: Progress = quiet,
) -> SnapshotResult:
    """Write one new snapshot version (or none when the changelog has not moved).

    Whether there is anything to do is decided from Kafka's offsets and the table's log alone:
    a run that finds nothing new starts no Spark session and no Spark job.
    """
    started = time.monotonic()
    if not kafka.topic_exists(settings, spec.changelog_topic, wait_if_missing=True):
        raise UsageError(
            f"pipeline {spec.name} has no changelog topic {spec.changelog_topic} yet: start its "
            f"stream first (`duality stream start {spec.name}`)"
        )
    progress(f"reading the offsets of {spec.changelog_topic}")
    coverage = capture_coverage(settings, spec)
    path = spec.snapshot_path(settings)
    sessions: list[SparkSession] = [spark] if spark is not None else []

    def spark_session() -> SparkSession:
        if not sessions:
            from duality.spark import session

            progress("starting Spark")
            sessions.append(session(settings, f"duality-snapshot-{spec.name}"))
        return sessions[0]

    base: Coverage | None = None
    previous: int | None = None
    reason: str | None = None
    state: TableState | None = None
    if is_table(path):
        versions = history(path)
        previous = versions[0].version
        state = table_state(path, previous)
        base, reason = current(versions)
        if base is not None:
            columns = state.columns if state else load(spark_session(), path).columns
            reason = _incremental_blocker(settings, spec, columns, base, coverage)
            if reason is not None:
                base = None
    else:
        reason = "the table does not exist yet"
    if mode == "full":
        base, reason = None, None
    elif base is None:
        progress(f"incremental refresh not possible: {reason}; rebuilding in full")

    if base is not None and base.changelog == coverage.changelog:
        progress(f"{spec.changelog_topic} has not moved since version {previous}: nothing to do")
        known = state.rows if state is not None else None
        return SnapshotResult(
            spec.name,
            str(path),
            "none",
            mode,
            None,
            None,
            previous,
            base.as_dict(),
            {},
            0,
            0,
            known if known is not None else _row_count(spark_session(), path),
            0,
            0,
            0,
            round(time.monotonic() - started, 2),
        )

    spark = spark_session()
    start = base.changelog if base is not None else None
    ran = "incremental" if base is not None else "full"
    metadata = {
        "kind": "snapshot",
        "mode": ran,
        "coverage": coverage.as_dict(),
        "base_version": previous if base is not None else None,
    }
    progress(f"{'merging changes from' if base else 'rebuilding from'} {spec.changelog_topic}")
    ranges = {
        str(p): [(start or {}).get(p, 0), end]
        for p, end in sorted(coverage.changelog.items())
        if end > (start or {}).get(p, 0)
    }
    if base is not None and sum(end - first for first, end in ranges.values()) <= SMALL_CHANGE:
        # A small change is read by a plain consumer, without a Spark job; the MERGE's source is
        # then a local relation, which it need not materialize first.
        changes = _latest_changes(
            settings, spec.changelog_topic, base.changelog, coverage.changelog
        )
        keys_read = changes.num_rows
        records_read = sum(changes.column("_records").to_pylist())
        # Typed once here: the MERGE then reads a plain local relation in each of its passes.
        typed = _changelog_rows(spec, spark.createDataFrame(changes)).toArrow()
        _merge(spark, spec, path, spark.createDataFrame(typed), metadata, local=True)
    else:
        raw = _read_changelog(spark, settings, spec.changelog_topic, start, coverage.changelog)
        latest = _latest_per_key(raw).persist()
        try:
            counts = latest.selectExpr("count(*) AS keys", "coalesce(sum(_records), 0) AS records")
            first = counts.first()
            keys_read, records_read = (first[0], first[1]) if first is not None else (0, 0)
            rows = _changelog_rows(spec, latest)
            if base is None:
                _overwrite(spark, spec, path, rows, metadata)
            else:
                _merge(spark, spec, path, rows, metadata)
        finally:
            latest.unpersist()
    written = history(path)[0]
    progress(f"version {written.version} of {path} written ({ran})")
    if written.operation == "MERGE":
        inserted, updated, deleted = (
            written.metrics.get(f"numTargetRows{kind}", 0)
            for kind in ("Inserted", "Updated", "Deleted")
        )
    else:
        inserted, updated, deleted = written.metrics.get("numOutputRows", 0), 0, 0
    after = table_state(path, written.version)
    return SnapshotResult(
        pipeline=spec.name,
        path=str(path),
        mode=ran,
        requested=mode,
        fallback_reason=reason if base is None and mode != "full" else None,
        version=written.version,
        previous_version=previous,
        coverage=coverage.as_dict(),
        read_ranges=ranges,
        records_read=int(records_read),
        keys_read=int(keys_read),
        rows=after.rows if after and after.rows is not None else _row_count(spark, path),
        inserted=inserted,
        updated=updated,
        deleted=deleted,
        seconds=round(time.monotonic() - started, 2),
    )


def _incremental_blocker(
    settings: Settings,
    spec: PipelineSpec,
    table_columns: list[str],
    base: Coverage,
    now: Coverage,
) -> str | None:
    """Why the changelog records after `base` cannot simply be merged, or None when they can."""
    if base.changelog_topic != now.changelog_topic:
        return f"the changelog topic changed from {base.changelog_topic} to {now.changelog_topic}"
    if base.changelog_topic_id != now.changelog_topic_id:
        return f"{now.changelog_topic} was recreated (reset) since the last snapshot"
    if set(base.changelog) != set(now.changelog):
        return f"{now.changelog_topic} has a different number of partitions"
    behind = [p for p, offset in base.changelog.items() if now.changelog[p] < offset]
    if behind:
        return f"{now.changelog_topic} ends before the recorded offsets (partitions {behind})"
    beginning = kafka.beginning_offsets(settings, spec.changelog_topic)
    truncated = [p for p, offset in base.changelog.items() if beginning[p] > offset]
    if truncated:
        return (
            f"records of {now.changelog_topic} after the recorded offsets were deleted "
            f"(partitions {truncated})"
        )
    if table_columns != list(column_types(spec)):
        return "the table's columns differ from the spec's"
    return None


def _overwrite(
    spark: SparkSession, spec: PipelineSpec, path: Path, rows: DataFrame, metadata: dict[str, Any]
) -> None:
    """The whole table replaced by the live rows, in one commit."""
    with commit_metadata(spark, metadata):
        (
            rows.where("NOT _deleted")
            .select(*column_types(spec))
            .write.format("delta")
            .mode("overwrite")
            .option("overwriteSchema", "true")
            # Set when the table is created: a MERGE then marks changed rows in deletion
            # vectors instead of rewriting every file a change touches.
            .option("delta.enableDeletionVectors", "true")
            .save(str(path))
        )


def _merge(
    spark: SparkSession,
    spec: PipelineSpec,
    path: Path,
    rows: DataFrame,
    metadata: dict[str, Any],
    *,
    local: bool = False,
) -> None:
    """The changed keys' rows updated, inserted or deleted, in one commit.

    Delta materializes a source that could change between the MERGE's passes over it; a local
    relation (`local=True`) cannot, and its MERGE runs without adaptive execution, which would
    plan each of the MERGE's stages as a Spark job of its own for nothing to adapt to."""
    from delta.tables import DeltaTable

    columns = list(column_types(spec))
    on = " AND ".join(f"t.`{c}` = s.`{c}`" for c in spec.key_columns)
    values: dict[str, str | Column] = {f"`{c}`": f"s.`{c}`" for c in columns}
    changed = {k: v for k, v in values.items() if k.strip("`") not in spec.key_columns}
    small = {
        "spark.databricks.delta.merge.materializeSource": "none",
        "spark.sql.adaptive.enabled": "false",
    }
    with session_conf(spark, small if local else {}), commit_metadata(spark, metadata):
        (
            DeltaTable.forPath(spark, str(path))
            .alias("t")
            .merge(rows.alias("s"), on)
            .whenMatchedDelete(condition="s._deleted")
            .whenMatchedUpdate(set=changed)
            .whenNotMatchedInsert(condition="NOT s._deleted", values=values)
            .execute()
        )


def _row_count(spark: SparkSession, path: Path, version: int | None = None) -> int:
    return load(spark, path, version).count()


def load(spark: SparkSession, path: Path, version: int | None = None) -> DataFrame:
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(str(path))


# -- publish and read ---------------------------------------------------------------------


def require_table(spec: PipelineSpec, path: Path) -> None:
    if not is_table(path):
        raise UsageError(
            f"pipeline {spec.name} has no snapshot at {path}: build one with "
            f"`duality snapshot {spec.name}`"
        )


def published_size(spec: PipelineSpec, path: Path) -> tuple[int, Coverage, int] | None:
    """The published version, what it covers and its row count from the checksum files alone,
    without Spark; None when they do not say (no checksum, none published: `read` then asks)."""
    require_table(spec, path)
    latest = table_state(path, history(path)[0].version)
    found = _published_in(latest.properties) if latest is not None else None
    state = table_state(path, found[0]) if found is not None else None
    if found is None or state is None or state.rows is None:
        return None
    return *found, state.rows


def published(spark: SparkSession, path: Path) -> tuple[int, Coverage] | None:
    """The published version and what it covers, from the table's properties (read from the
    latest version's checksum file; from Spark when there is none)."""
    state = table_state(path, history(path)[0].version)
    if state is not None:
        return _published_in(state.properties)
    from delta.tables import DeltaTable

    row = DeltaTable.forPath(spark, str(path)).detail().select("properties").first()
    return _published_in((row["properties"] if row else None) or {})


def _published_in(properties: dict[str, str]) -> tuple[int, Coverage] | None:
    if PUBLISHED_VERSION not in properties:
        return None
    coverage = Coverage.from_dict(json.loads(properties[PUBLISHED_COVERAGE]))
    return int(properties[PUBLISHED_VERSION]), coverage


def publish(spark: SparkSession, path: Path, version: int, coverage: Coverage) -> int:
    """Make `version` the one readers get; returns the metadata-only commit that says so.

    Callers check first that the table records a passing verdict for it (`validation`)."""
    return _metadata_commit(
        spark,
        path,
        _published_properties(version, coverage),
        {"kind": "publish", "published": {"version": version, "coverage": coverage.as_dict()}},
    )


def record_validation(
    spark: SparkSession, path: Path, verdict: dict[str, Any], publish: Coverage | None = None
) -> int:
    """Record the verdict of a version's validation in the table: a metadata-only commit whose
    userMetadata holds it (`validation` finds it there); with `publish`, the same commit also
    publishes that version. Returns the commit's version."""
    properties = {VALIDATION: _json(verdict)}
    metadata: dict[str, Any] = {"kind": "validation", "validation": verdict}
    if publish is not None:
        properties.update(_published_properties(verdict["version"], publish))
        metadata["published"] = {"version": verdict["version"], "coverage": publish.as_dict()}
    return _metadata_commit(spark, path, properties, metadata)


def validation(versions: list[Version], version: int) -> dict[str, Any] | None:
    """The newest verdict the table records for `version` (from `history()`), with `commit`,
    the commit that records it; None when it was never validated."""
    for entry in versions:
        verdict = (entry.metadata or {}).get("validation")
        if isinstance(verdict, dict) and verdict.get("version") == version:
            return {**verdict, "commit": entry.version}
    return None


def latest_data_version(versions: list[Version]) -> int:
    """The newest version that is not one of duality's validation or publish commits."""
    for entry in versions:
        if (entry.metadata or {}).get("kind") not in ("validation", "publish"):
            return entry.version
    return versions[-1].version


def _published_properties(version: int, coverage: Coverage) -> dict[str, str]:
    return {PUBLISHED_VERSION: str(version), PUBLISHED_COVERAGE: _json(coverage.as_dict())}


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


def _metadata_commit(
    spark: SparkSession, path: Path, properties: dict[str, str], metadata: dict[str, Any]
) -> int:
    """One commit that sets table properties (no data change) with `metadata` as its
    userMetadata; returns its version."""

    def literal(text: str) -> str:
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"

    assignments = ", ".join(f"{literal(k)} = {literal(v)}" for k, v in properties.items())
    with commit_metadata(spark, metadata):
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({assignments})")
    return history(path)[0].version


def version_coverage(versions: list[Version], version: int) -> Coverage | None:
    """What a given version covers (from `history()`): its commit's record, or the one it
    was built on."""
    for entry in versions:
        if entry.version > version:
            continue
        if entry.metadata is not None and "coverage" in entry.metadata:
            return Coverage.from_dict(entry.metadata["coverage"])
        if entry.operation not in _ROW_PRESERVING:
            return None
    return None


def read(
    settings: Settings,
    spec: PipelineSpec,
    *,
    spark: SparkSession | None = None,
) -> tuple[DataFrame, int, Coverage]:
    """The published snapshot (time travel to the validated version)."""
    path = spec.snapshot_path(settings)
    require_table(spec, path)
    if spark is None:
        from duality.spark import session

        spark = session(settings, f"duality-read-{spec.name}")
    found = published(spark, path)
    if found is None:
        raise CheckFailed(
            f"no version of {spec.name}'s snapshot has passed validation yet: run "
            f"`duality validate {spec.name}`"
        )
    version, coverage = found
    return load(spark, path, version), version, coverage


# -- maintenance --------------------------------------------------------------------------


def maintain(
    settings: Settings,
    spec: PipelineSpec,
    *,
    retain_hours: float = 168.0,
    spark: SparkSession | None = None,
    progress: Progress = quiet,
) -> dict[str, Any]:
    """OPTIMIZE (compact small files) and VACUUM, keeping the published version readable.

    VACUUM deletes files no version within the retention needs, and files no commit ever
    referenced (left by interrupted runs) once they are older than it. Delta counts the
    retention in whole hours (it rounds), so the retention used is the requested one rounded up,
    and never less than the published version's age: every file it reads stays.
    """
    from delta.tables import DeltaTable

    if retain_hours < 0:
        raise UsageError(f"--retain-hours {retain_hours:g}: must be zero or more")
    path = spec.snapshot_path(settings)
    require_table(spec, path)
    if spark is None:
        from duality.spark import session

        spark = session(settings, f"duality-maintain-{spec.name}")
    versions = history(path)
    found = published(spark, path)
    needed = 0.0
    if found is not None:
        published_at = next(v.timestamp_ms for v in versions if v.version == found[0])
        # Files the published version reads are removed, if at all, by later commits.
        needed = (time.time() * 1000 - published_at) / 3_600_000
    retention = max(math.ceil(retain_hours), math.ceil(needed))
    if found is not None:
        retention = max(retention, 1)
    table = DeltaTable.forPath(spark, str(path))
    coverage = version_coverage(versions, versions[0].version)
    metadata: dict[str, Any] = {"kind": "maintain"}
    if coverage is not None:
        metadata["coverage"] = coverage.as_dict()
    progress(f"compacting the files of {path}")
    started = time.monotonic()
    with commit_metadata(spark, metadata):
        optimized = table.optimize().executeCompaction().first()
        progress(f"removing files older than {retention} hours")
        before = _data_files(path)
        spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
        try:
            table.vacuum(retention)
        finally:
            spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
        after = _data_files(path)
    opt_metrics = (optimized["metrics"].asDict() if optimized is not None else {}) or {}
    return {
        "pipeline": spec.name,
        "path": str(path),
        "files_added_by_optimize": int(opt_metrics.get("numFilesAdded", 0)),
        "files_removed_by_optimize": int(opt_metrics.get("numFilesRemoved", 0)),
        "retention_hours": round(retention, 4),
        "requested_retention_hours": retain_hours,
        "files_deleted_by_vacuum": len(before - after),
        "published_version": found[0] if found else None,
        "seconds": round(time.monotonic() - started, 2),
    }


def _data_files(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*.parquet")}
