"""Building a snapshot version: a full rebuild or an incremental MERGE (docs/snapshots.md#write)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import offsets, records, topics
from duality.schema import SQL_TYPES
from duality.snapshot import delta_log, dv_commit, publish
from duality.snapshot.coverage import Coverage, capture_coverage
from duality.snapshot.outage import reported
from duality.spark import session
from duality.spec import PipelineSpec
from duality.storage import Location, s3

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, SparkSession

Mode = Literal["auto", "full", "incremental"]
Progress = Callable[[str], None]

# An incremental run that reads at most this many changelog records reads them in the driver.
SMALL_CHANGE = 200_000


def quiet(_: str) -> None:
    """The default progress callback: says nothing."""


def column_types(spec: PipelineSpec) -> dict[str, str]:
    """The snapshot's columns and their Spark SQL types, in table order."""
    types = {name: SQL_TYPES[spec.field_type(name)] for name in spec.source.key}
    if spec.window is not None:
        types["window_start"] = "timestamp"
    for column, aggregate in spec.aggregates.items():
        # Integers widen to bigint: sums and counts are longs, and min and max keep one type.
        kind = aggregate.type
        types[column] = "bigint" if kind in ("long", "int") else SQL_TYPES[kind]
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


def read_changelog(
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
    for message in records.read_to_end(settings, topic, start=start, end=end):
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


@dataclasses.dataclass
class SnapshotResult:
    pipeline: str
    path: str
    mode: str  # what ran: full or incremental ("none" when nothing changed)
    requested: str
    fallback_reason: str | None
    version: int | None  # the new version; None when nothing changed
    previous_version: int | None
    coverage: Coverage
    # Who wrote an incremental version's commit: "duality" (deletion vectors and an appended
    # file, docs/snapshots.md#write) or "delta" (its MERGE); None for a full or no rebuild.
    merged_by: str | None
    read_ranges: dict[str, list[int]]  # changelog partition -> [first offset read, end]
    records_read: int
    keys_read: int
    rows: int
    inserted: int
    updated: int
    deleted: int
    seconds: float
    # When nothing changed: the newest version written from the changelog if no validation
    # names it yet (an earlier run built it and was interrupted before its validation), which
    # the snapshot DAG then validates and publishes rather than skip.
    unvalidated_version: int | None = None


@reported("snapshot")
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
    if not topics.topic_exists(settings, spec.changelog_topic, wait_if_missing=True):
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
            progress("starting Spark")
            sessions.append(session(settings, f"duality-snapshot-{spec.name}"))
        return sessions[0]

    base: Coverage | None = None
    previous: int | None = None
    reason: str | None = None
    state: delta_log.TableState | None = None
    if delta_log.is_table(path):
        versions = delta_log.history(path)
        previous = versions[0].version
        state = delta_log.table_state(path, previous)
        base, reason = delta_log.version_coverage(versions, previous)
        if base is not None:
            columns = state.columns if state else delta_log.load(spark_session(), path).columns
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
        count = known if known is not None else delta_log.load(spark_session(), path).count()
        now = round(time.monotonic() - started, 2)
        built = delta_log.latest_data_version(versions)
        verdict = publish.validation(versions, built)
        return SnapshotResult(
            spec.name,
            str(path),
            "none",
            mode,
            None,
            None,
            previous,
            base,
            None,
            {},
            0,
            0,
            count,
            0,
            0,
            0,
            now,
            None if verdict is not None else built,
        )

    spark = spark_session()
    start = base.changelog if base is not None else None
    ran = "incremental" if base is not None else "full"
    merged_by = "delta" if base is not None else None
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
        typed = _changelog_rows(spec, spark.createDataFrame(changes)).toArrow()
        why = dv_commit.blocker(state) if state is not None else "its log cannot be replayed"
        if state is not None and why is None:
            try:
                done = dv_commit.write(path, state, typed, list(spec.key_columns), metadata)
                if done is None:
                    why = f"version {state.version + 1} was committed by another writer meanwhile"
                else:
                    merged_by = "duality"
            except s3.ConditionRefused as refused:
                # No safe commit of duality's own on this store (issue #49): Delta's MERGE.
                why = str(refused)
        if why is not None:
            progress(f"duality cannot write this commit itself ({why}): Delta's MERGE writes it")
            # A local relation: the MERGE reads it in each of its passes without recomputing it.
            _merge(spark, spec, path, spark.createDataFrame(typed), metadata, local=True)
    else:
        raw = read_changelog(spark, settings, spec.changelog_topic, start, coverage.changelog)
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
    written = delta_log.history(path)[0]
    progress(f"version {written.version} of {path} written ({ran})")
    if written.operation == "MERGE":
        inserted, updated, deleted = (
            written.metrics.get(f"numTargetRows{kind}", 0)
            for kind in ("Inserted", "Updated", "Deleted")
        )
    else:
        inserted, updated, deleted = written.metrics.get("numOutputRows", 0), 0, 0
    after = delta_log.table_state(path, written.version)
    known = after.rows if after is not None else None
    return SnapshotResult(
        pipeline=spec.name,
        path=str(path),
        mode=ran,
        requested=mode,
        fallback_reason=reason if base is None and mode != "full" else None,
        version=written.version,
        previous_version=previous,
        coverage=coverage,
        merged_by=merged_by,
        read_ranges=ranges,
        records_read=int(records_read),
        keys_read=int(keys_read),
        rows=known if known is not None else delta_log.load(spark, path).count(),
        inserted=inserted,
        updated=updated,
        deleted=deleted,
        seconds=round(time.monotonic() - started, 2),
    )


def _incremental_blocker(
    settings: Settings, spec: PipelineSpec, table_columns: list[str], base: Coverage, now: Coverage
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
    beginning = offsets.beginning_offsets(settings, spec.changelog_topic)
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
    spark: SparkSession,
    spec: PipelineSpec,
    path: Location,
    rows: DataFrame,
    metadata: dict[str, Any],
) -> None:
    """The whole table replaced by the live rows, in one commit."""
    again = f"run `duality snapshot {spec.name}` again"
    with (
        delta_log.commit_metadata(spark, metadata),
        delta_log.lost_race(path, "the full rebuild", again),
    ):
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
    path: Location,
    rows: DataFrame,
    metadata: dict[str, Any],
    *,
    local: bool = False,
) -> None:
    """The changed keys' rows updated, inserted or deleted, in one commit.

    Delta materializes a source that could change between the MERGE's passes over it; a local
    relation (`local=True`) cannot, and its MERGE runs without adaptive execution, which would
    plan each of the MERGE's stages as a Spark job of its own for nothing to adapt to."""
    columns = [f"`{c}`" for c in column_types(spec)]
    on = " AND ".join(f"t.`{c}` = s.`{c}`" for c in spec.key_columns)
    keys = {f"`{c}`" for c in spec.key_columns}
    changed = ", ".join(f"{c} = s.{c}" for c in columns if c not in keys)
    small = {
        "spark.databricks.delta.merge.materializeSource": "none",
        "spark.sql.adaptive.enabled": "false",
    }
    conf = small if local else {}
    # SQL, not `DeltaTable.merge`: the statement needs no Delta Python API, which a Spark
    # Connect client lacks (docs/decisions/0026-warm-spark-for-batch-steps.md).
    source = f"duality_merge_source_{uuid.uuid4().hex}"  # a view of this session only
    rows.createOrReplaceTempView(source)
    statement = (
        f"MERGE INTO {delta_log.sql_name(path)} AS t USING {source} AS s ON {on} "
        "WHEN MATCHED AND s._deleted THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {changed} "
        f"WHEN NOT MATCHED AND NOT s._deleted THEN INSERT ({', '.join(columns)}) "
        f"VALUES ({', '.join(f's.{c}' for c in columns)})"
    )
    try:
        with (
            delta_log.session_conf(spark, conf),
            delta_log.commit_metadata(spark, metadata),
            # A conflicting commit (OPTIMIZE's, another snapshot's) may take the version first:
            # the step fails saying so, and run again it merges on the version that won.
            delta_log.lost_race(path, "MERGE", f"run `duality snapshot {spec.name}` again"),
        ):
            spark.sql(statement)
    finally:
        spark.catalog.dropTempView(source)
