"""The stream engine: source topic -> a table in Spark's state store -> the changelog topic.

One Structured Streaming query per pipeline. Spark parses and classifies every source record;
the good ones feed a built-in streaming aggregation (Update mode) whose state lives in the
RocksDB state store, partitioned by group key over the executors. The query's output is the
union of the rows that aggregation changed in the micro-batch and the bad records, already
encoded as Kafka keys and values in the JVM. The driver only copies that output into one Kafka
transaction per micro-batch: changelog records, dead letters, and the source offsets the batch
covers, committed to the pipeline's consumer group
(docs/decisions/0008-state-in-spark-state-store.md).

Without a checkpoint the state is seeded from the changelog: the latest `_state` partials per
key are written as Parquet files that a file source feeds into the same aggregation, beside the
source topic read from the committed offsets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from duality import changelog, kafka
from duality.config import Settings
from duality.errors import UsageError
from duality.spec import SQL_TYPES, PipelineSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger("duality.stream")

# A dead letter's headers and key get this much room when its value has to be cut to fit.
_DEAD_LETTER_MARGIN = 16_384
# Marks a checkpoint written by this engine, with the fingerprint of the state's layout.
_ENGINE_FILE = "duality-engine.json"
_ENGINE = "state-store-1"


# -- partial aggregates ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Partial:
    """One partial aggregate kept in the state: `count`, or `sum|min|max` of a field.

    `name` is its key in the changelog's `_state`; `column` its column inside Spark.
    """

    function: str
    field: str | None

    @property
    def name(self) -> str:
        return "count" if self.field is None else f"{self.function}.{self.field}"

    @property
    def column(self) -> str:
        return "_count" if self.field is None else f"_{self.function}_{self.field}"


def partials_of(spec: PipelineSpec) -> list[Partial]:
    """The partial aggregates from which every aggregate column is computed exactly."""
    needed = [Partial("count", None)]
    for aggregate in spec.aggregates.values():
        if aggregate.field is None:
            continue
        function = "sum" if aggregate.function == "avg" else aggregate.function
        part = Partial(function, aggregate.field)
        if part not in needed:
            needed.append(part)
    return needed


def _partial_type(spec: PipelineSpec, part: Partial) -> str:
    if part.field is None:
        return "bigint"
    kind = spec.source.fields[part.field]
    if kind == "timestamp":
        return "bigint"  # epoch milliseconds
    if part.function == "sum" and kind in ("int", "long"):
        return "bigint"
    return SQL_TYPES[kind]


# -- classification (stateless, in the JVM) -------------------------------------------------


def classify(spec: PipelineSpec, raw: DataFrame) -> DataFrame:
    """Parse the raw Kafka rows and name each bad record's reason in `_error` (null when good).

    Adds `_p`, the parsed struct. Stateless, so it runs inside the streaming query. A record is
    good when it is one JSON object and nothing else, every field the pipeline uses is present
    with its type, and every double is finite. Lateness is decided later, against the query's
    watermark (`ChangelogWriter.write`).
    """
    from pyspark.sql import functions as F

    fields = spec.source.fields
    # String fields are read as variants, which keep the JSON type: `5` or `{...}` is no string.
    ddl = ", ".join(
        f"`{f}` {'variant' if k == 'string' else SQL_TYPES[k]}" for f, k in fields.items()
    )
    text = F.col("value").cast("string")
    # Spark's JSON readers stop after the first value, so `{..} tail` or `{..}{..}` would read
    # as one object. Text with anything after its first value cannot be both the only value of
    # `{"v": ...}` and the only element of `[...]`; the second parse is also the typed one.
    one_value = F.size(F.json_object_keys(F.concat(F.lit('{"v":'), text, F.lit("}")))) == 1
    parsed = F.from_json(F.concat(F.lit("["), text, F.lit("]")), f"array<struct<{ddl}>>")
    frame = raw.withColumn("_parsed", _once(parsed))
    frame = frame.withColumn("_v", F.when(F.size("_parsed") == 1, F.col("_parsed")[0]))
    frame = frame.withColumn(
        "_p",
        F.struct(
            *[
                (
                    F.variant_get(F.col(f"_v.{f}"), "$", "string")
                    if kind == "string"
                    else F.col(f"_v.{f}")
                ).alias(f)
                for f, kind in fields.items()
            ]
        ),
    )
    limit = spec.source.max_record_bytes
    checks: list[tuple[Column, Column]] = [
        (F.col("value").isNull(), F.lit("null value")),
        (
            F.octet_length("value") > limit,
            F.concat(
                F.lit("oversized: "),
                F.octet_length("value").cast("string"),
                F.lit(f" bytes, the limit is {limit}"),
            ),
        ),
        (~F.coalesce(one_value, F.lit(False)), F.lit("malformed JSON: not one JSON value")),
        (~F.ltrim(text).startswith("{"), F.lit("not a JSON object")),
        (F.col("_v").isNull(), F.lit("malformed JSON: text after the object")),
    ]
    # Every JSON value reads as a string, so this parse tells a missing field from one of the
    # wrong type; only records with a null typed field get that far.
    as_text = ", ".join(f"`{f}` string" for f in spec.required_fields)
    for field in spec.required_fields:
        kind = fields[field]
        value = F.col(f"_p.{field}")
        wrong = F.lit(f"wrong type for {field}: expected {kind}")
        if kind == "string":
            json_type = F.schema_of_variant(F.col(f"_v.{field}"))
            missing = json_type.isNull() | (json_type == "VOID")
            checks.append(
                (
                    json_type.isNull() | (json_type != "STRING"),
                    F.when(missing, F.lit(f"missing field {field}")).otherwise(wrong),
                )
            )
            continue
        present = F.from_json(text, as_text)[field].isNotNull()
        checks.append(
            (value.isNull(), F.when(present, wrong).otherwise(F.lit(f"missing field {field}")))
        )
        if kind == "double":
            checks.append(
                (
                    F.isnan(value) | (F.abs(value) == F.lit(float("inf"))),
                    F.concat(
                        F.lit(f"wrong type for {field}: expected a finite double, got "),
                        value.cast("string"),
                    ),
                )
            )
    # The first check that holds names the reason; later ones are not evaluated.
    error = F.coalesce(*[F.when(condition, reason) for condition, reason in checks])
    return frame.drop("_parsed").withColumn("_error", _once(error))


def _once(expression: Column) -> Column:
    """`expression`, computed once per row however often later filters and columns use it.

    Spark's optimizer pushes filters below projections by pasting the projected expressions
    into them, which would parse each record once per check. A non-deterministic guard (the
    partition id, always at least 0) keeps the projection where it is.
    """
    from pyspark.sql import functions as F

    return F.when(F.spark_partition_id() >= 0, expression)


def late_records(settings: Settings, spec: PipelineSpec) -> list[tuple[int, int]]:
    """(partition, offset) of the source records the dead-letter topic holds as late."""
    late = []
    for message in kafka.read_to_end(settings, spec.dlq_topic):
        headers = dict(message.headers() or [])
        reason = headers.get("duality.error") or b""
        if isinstance(reason, bytes) and reason.startswith(b"late event"):
            late.append(
                (
                    int(headers["duality.source.partition"] or -1),
                    int(headers["duality.source.offset"] or -1),
                )
            )
    return late


# -- the stateful aggregation ---------------------------------------------------------------


def _event_time_ms(spec: PipelineSpec) -> Column:
    from pyspark.sql import functions as F

    assert spec.source.event_time is not None
    return F.unix_millis(F.col(f"_p.{spec.source.event_time}"))


def _window_end_ms(spec: PipelineSpec, ts_ms: Column) -> Column:
    """The end of the tumbling window holding `ts_ms` (Spark's `window()` for these)."""
    from pyspark.sql import functions as F

    assert spec.window is not None
    size = spec.window.size_seconds * 1000
    return ts_ms - F.pmod(ts_ms, F.lit(size)) + F.lit(size)


def _rows_schema(spec: PipelineSpec) -> str:
    """What the aggregation consumes: group fields, event time, one partial per column."""
    columns = [f"`{f}` {SQL_TYPES[spec.source.fields[f]]}" for f in spec.source.key]
    if spec.window is not None:
        columns.append("`_ts` timestamp")
    columns += [f"`{p.column}` {_partial_type(spec, p)}" for p in partials_of(spec)]
    columns.append("`_fresh` int")
    return ", ".join(columns)


def partial_columns(spec: PipelineSpec) -> list[Column]:
    """A good record's row of partials: group fields, event time, count 1, its own values."""
    from pyspark.sql import functions as F

    columns = [F.col(f"_p.{f}").alias(f) for f in spec.source.key]
    if spec.window is not None:
        columns.append(F.col(f"_p.{spec.source.event_time}").alias("_ts"))
    for part in partials_of(spec):
        if part.field is None:
            value = F.lit(1).cast("bigint")
        else:
            value = F.col(f"_p.{part.field}")
            if spec.source.fields[part.field] == "timestamp":
                value = F.unix_millis(value)
        columns.append(value.cast(_partial_type(spec, part)).alias(part.column))
    columns.append(F.lit(1).alias("_fresh"))
    return columns


def source_rows(spec: PipelineSpec, classified: DataFrame) -> DataFrame:
    """Each good record as one row of partials (`partial_columns`)."""
    from pyspark.sql import functions as F

    return classified.where(F.col("_error").isNull()).select(*partial_columns(spec))


def aggregate(spec: PipelineSpec, rows: DataFrame) -> DataFrame:
    """The streaming aggregation (its state is the table); `_fresh` is 1 for a key that source
    records touched, 0 for one only seeded from the changelog."""
    from pyspark.sql import functions as F

    groups: list[Column | str] = list(spec.source.key)
    if spec.window is not None:
        rows = rows.withWatermark("_ts", f"{spec.window.watermark_seconds} seconds")
        groups.append(F.window("_ts", f"{spec.window.size_seconds} seconds").alias("_window"))
    merge = {"count": F.sum, "sum": F.sum, "min": F.min, "max": F.max}
    columns = [
        merge[p.function](p.column).cast(_partial_type(spec, p)).alias(p.column)
        for p in partials_of(spec)
    ]
    return rows.groupBy(*groups).agg(*columns, F.max("_fresh").alias("_fresh"))


def aggregate_columns(spec: PipelineSpec) -> dict[str, Column]:
    """Each aggregate column of the spec from the partials of `aggregate`'s output."""
    from pyspark.sql import functions as F

    columns = {}
    for column, agg in spec.aggregates.items():
        if agg.function == "count":
            columns[column] = F.col("_count")
        elif agg.function == "avg":
            columns[column] = F.col(f"_sum_{agg.field}") / F.col("_count")
        else:
            columns[column] = F.col(f"_{agg.function}_{agg.field}")
    return columns


def changelog_records(spec: PipelineSpec, table: DataFrame) -> DataFrame:
    """The changed rows as changelog records (DESIGN §6), encoded in the JVM."""
    from pyspark.sql import functions as F

    keys: list[Column] = [F.col(f) for f in spec.source.key]
    if spec.window is not None:
        keys.append(
            F.date_format("_window.start", "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'").alias("window_start")
        )
    if len(keys) == 1:
        key = keys[0].cast("string")
    else:
        key = F.to_json(F.array(*[k.cast("variant") for k in keys]))
    aggregates = [value.alias(column) for column, value in aggregate_columns(spec).items()]
    state = F.struct(*[F.col(p.column).alias(p.name) for p in partials_of(spec)])
    document = F.struct(
        *[k.alias(name) for k, name in zip(keys, spec.key_columns, strict=True)],
        *aggregates,
        F.unix_millis(F.current_timestamp()).alias("_updated_at"),
        state.alias("_state"),
    )
    return table.where(F.col("_fresh") == 1).select(
        F.lit("update").alias("_kind"),
        key.cast("binary").alias("_key"),
        F.to_json(document).cast("binary").alias("_value"),
        *_no_lineage(),
    )


def _no_lineage() -> list[Column]:
    from pyspark.sql import functions as F

    return [
        F.lit(None).cast("int").alias("_partition"),
        F.lit(None).cast("bigint").alias("_offset"),
        F.lit(None).cast("string").alias("_error"),
        F.lit(None).cast("bigint").alias("_window_end"),
    ]


def build_query_frame(spec: PipelineSpec, source: DataFrame, seeds: DataFrame) -> DataFrame:
    """The streaming DataFrame whose micro-batches the driver writes: changed rows and bad
    records (plus late-event candidates), all as `_kind, _key, _value` and lineage.

    The source is read and classified once: each record becomes its row of partials when good
    and its lineage when bad (windowed pipelines: always, with its window's end, as a late-event
    candidate), and one shuffle of those narrow rows feeds both the aggregation and the dead
    letters, Spark reusing the exchange for the second reader.
    """
    from pyspark.sql import functions as F

    classified = classify(spec, source)
    good = F.col("_error").isNull()
    lineage = F.struct(
        F.col("key").alias("_key"),
        F.col("value").alias("_value"),
        F.col("partition").alias("_partition"),
        F.col("offset").alias("_offset"),
    )
    window_end = F.lit(None).cast("bigint")
    if spec.window is not None:
        window_end = F.when(good, _window_end_ms(spec, _event_time_ms(spec))).cast("bigint")
    else:
        lineage = F.when(~good, lineage)
    narrow = classified.select(
        F.col("_error"),
        F.when(good, F.struct(*partial_columns(spec))).alias("_row"),
        lineage.alias("_lineage"),
        window_end.alias("_window_end"),
    )
    shared = _shared(narrow, source.sparkSession.sparkContext.defaultParallelism)
    rows = shared.where(good).select("_row.*").unionByName(seeds)
    table = aggregate(spec, rows)
    records = shared if spec.window is not None else shared.where(~good)
    dead = records.select(
        F.when(good, F.lit("candidate")).otherwise(F.lit("dead")).alias("_kind"),
        "_lineage.*",
        "_error",
        "_window_end",
    )
    return changelog_records(spec, table).unionByName(dead)


def _shared(frame: DataFrame, partitions: int) -> DataFrame:
    """`frame` behind one shuffle that every reader of the result shares.

    Spark reuses an exchange only for readers whose plans below it are the same, but column
    pruning pushes each reader's own projection below it. Packing the columns into one struct,
    read back whole through a non-deterministic guard, leaves nothing to prune.
    """
    from pyspark.sql import functions as F

    packed = frame.select(F.struct(*frame.columns).alias("_shared")).repartition(partitions)
    return packed.select(_once(F.col("_shared")).alias("_shared")).select("_shared.*")


# -- seeding the state from the changelog ----------------------------------------------------


def seed_dir(checkpoint: Path) -> Path:
    return checkpoint / "seed"


def seeds_stream(spark: SparkSession, spec: PipelineSpec, checkpoint: Path) -> DataFrame:
    folder = seed_dir(checkpoint)
    folder.mkdir(parents=True, exist_ok=True)
    return spark.readStream.schema(_rows_schema(spec)).parquet(str(folder))


def write_seed(
    spark: SparkSession, settings: Settings, spec: PipelineSpec, checkpoint: Path
) -> int:
    """The changelog's latest `_state` per key, read_committed, as Parquet seed files; returns
    the number of keys. Tombstones remove their key."""
    from pyspark.sql import functions as F

    folder = seed_dir(checkpoint)
    shutil.rmtree(folder, ignore_errors=True)
    raw = (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_source_options())
        .option("subscribe", spec.changelog_topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    latest = raw.groupBy("key").agg(F.max_by("value", "offset").alias("value"))
    state_ddl = ", ".join(f"`{p.name}` {_partial_type(spec, p)}" for p in partials_of(spec))
    fields = ", ".join(f"`{f}` {SQL_TYPES[spec.source.fields[f]]}" for f in spec.source.key) + (
        ", `window_start` string" if spec.window is not None else ""
    )
    parsed = latest.where(F.col("value").isNotNull()).select(
        F.from_json(F.col("value").cast("string"), f"{fields}, `_state` struct<{state_ddl}>").alias(
            "v"
        )
    )
    columns: list[Column] = [F.col(f"v.{f}").alias(f) for f in spec.source.key]
    if spec.window is not None:
        columns.append(F.to_timestamp("v.window_start").alias("_ts"))
    columns += [F.col(f"v._state.`{p.name}`").alias(p.column) for p in partials_of(spec)]
    columns.append(F.lit(0).alias("_fresh"))
    seeds = parsed.select(*columns)
    staging = folder.with_name("seed.staging")
    shutil.rmtree(staging, ignore_errors=True)
    seeds.write.parquet(str(staging))
    count = spark.read.parquet(str(staging)).count()
    staging.rename(folder)
    return count


# -- the checkpoint ----------------------------------------------------------------------------


def state_layout(spec: PipelineSpec) -> str:
    """What the state's schema depends on; a checkpoint of another layout cannot be resumed."""
    layout = {
        "key": spec.source.key,
        "types": [spec.source.fields[f] for f in spec.source.key],
        "window": spec.window.model_dump() if spec.window else None,
        "partials": _rows_schema(spec),
    }
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_usable(spec: PipelineSpec, checkpoint: Path) -> bool:
    """True when the query can resume from `checkpoint`; False when it must be (re)built from
    the changelog (no checkpoint, or one the query never got going with, or one of the older
    driver-side engine). A checkpoint of another state layout is a usage error."""
    offsets = checkpoint / "offsets"
    if not offsets.is_dir() or not any(offsets.iterdir()):
        return False
    marker = checkpoint / _ENGINE_FILE
    if not marker.is_file():
        log.warning(
            "%s: checkpoint %s was written by an older engine; rebuilding the state from %s",
            spec.name,
            checkpoint,
            spec.changelog_topic,
        )
        return False
    recorded = json.loads(marker.read_text())
    if recorded.get("layout") != state_layout(spec):
        raise UsageError(
            f"pipeline {spec.name}: its key, window or aggregates changed since the checkpoint "
            f"{checkpoint} was written, so neither it nor the changelog can be resumed: run "
            f"`duality reset {spec.name}` to recompute the table from the source"
        )
    return True


def prepare_checkpoint(spec: PipelineSpec, checkpoint: Path) -> None:
    """Empty the checkpoint folder and mark it as this engine's."""
    shutil.rmtree(checkpoint, ignore_errors=True)
    checkpoint.mkdir(parents=True)
    (checkpoint / _ENGINE_FILE).write_text(
        json.dumps({"engine": _ENGINE, "layout": state_layout(spec)})
    )


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """What Spark's offset log says of one micro-batch: source end offsets and watermark."""

    end_offsets: dict[int, int]
    watermark_ms: int


def planned_batch(checkpoint: Path, topic: str, batch_id: int) -> PlannedBatch:
    """Read `offsets/<batch_id>` of the checkpoint, which Spark writes before it runs the batch.

    Lines: a version, the batch's metadata (with `batchWatermarkMs`), then one offset per
    source; the Kafka source's is `{topic: {partition: offset}}`.
    """
    path = checkpoint / "offsets" / str(batch_id)
    lines = path.read_text().splitlines()
    metadata = json.loads(lines[1])
    for line in lines[2:]:
        if line.startswith("{"):
            document = json.loads(line)
            if topic in document:
                ends = {int(p): int(o) for p, o in document[topic].items()}
                return PlannedBatch(ends, int(metadata.get("batchWatermarkMs", 0)))
    raise AssertionError(f"{path} holds no offsets of {topic}: {lines}")


# -- writing a micro-batch exactly once -----------------------------------------------------


@dataclasses.dataclass
class BatchResult:
    batch_id: int
    records: int  # source offsets the batch covers
    dead_lettered: int
    late: int
    updated_keys: int
    replayed: bool = False  # its offsets were committed already: a replay, or no new records
    seconds: float = 0.0  # the whole batch in the driver


class ChangelogWriter:
    """Writes each micro-batch's output in one Kafka transaction with the source offsets."""

    def __init__(self, settings: Settings, spec: PipelineSpec, checkpoint: Path):
        self.settings = settings
        self.spec = spec
        self.checkpoint = checkpoint
        self.dead_letter_limit = kafka.max_message_bytes(settings, spec.dlq_topic)
        # The transactional id is the pipeline's: a new driver fences any older one still alive,
        # and its open transaction is aborted before anything is read.
        self.producer = kafka.transactional_producer(
            settings,
            f"duality-{spec.name}",
            transaction_timeout_ms=300_000,
            queue_buffering_max_messages=1_000_000,
            # A micro-batch's records wait for room rather than all sit in the producer's queue
            # (1 GB by default): the driver's memory does not follow the keys a batch changes.
            queue_buffering_max_kbytes=32_768,
            linger_ms=20,
            message_max_bytes=self.dead_letter_limit + _DEAD_LETTER_MARGIN,
        )
        self.committed = {
            p: offset
            for p, (offset, _) in kafka.committed_offsets(
                settings, spec.consumer_group, spec.source.topic
            ).items()
        }
        # The group the offsets are committed to; it never subscribes, so it never rebalances.
        group = kafka.consumer(settings, spec.consumer_group)
        self._group_metadata = group.consumer_group_metadata()
        group.close()

    def starting_offsets(self) -> str:
        """Spark's startingOffsets for a query without checkpoint: the committed offsets."""
        partitions = kafka.partition_count(self.settings, self.spec.source.topic)
        # -2 is Spark's "earliest" for a partition the changelog does not cover yet.
        offsets = {str(p): self.committed.get(p, -2) for p in range(partitions)}
        return json.dumps({self.spec.source.topic: offsets})

    def write(self, batch: DataFrame, batch_id: int) -> BatchResult:
        from pyspark.sql import functions as F

        started = time.perf_counter()
        planned = planned_batch(self.checkpoint, self.spec.source.topic, batch_id)
        records = sum(
            max(0, end - self.committed.get(p, 0)) for p, end in planned.end_offsets.items()
        )
        if all(self.committed.get(p, 0) >= end for p, end in planned.end_offsets.items()):
            # Spark replays a batch whose transaction had committed (the driver died between
            # the commit and Spark's own commit log). Run it for its state, write nothing.
            batch.write.format("noop").mode("overwrite").save()
            return BatchResult(batch_id, 0, 0, 0, 0, replayed=True)
        wanted = F.col("_kind") != "candidate"
        if self.spec.window is not None:
            # Spark drops a windowed row whose window ended at or before the batch's watermark.
            wanted = wanted | (F.col("_window_end") <= F.lit(planned.watermark_ms))
        result = self._commit(_rows(batch.where(wanted)), batch_id, planned)
        result.records = records
        result.seconds = round(time.perf_counter() - started, 2)
        return result

    def _commit(self, rows: Iterable[Any], batch_id: int, planned: PlannedBatch) -> BatchResult:
        spec, producer = self.spec, self.producer
        result = BatchResult(batch_id, 0, 0, 0, 0)
        source = spec.source.topic.encode()
        watermark = changelog.window_iso(planned.watermark_ms)
        delay = spec.window.watermark if spec.window is not None else ""
        producer.begin_transaction()
        try:
            for row in rows:
                kind = row["_kind"]
                if kind == "update":
                    kafka.send(producer, spec.changelog_topic, row["_key"], row["_value"])
                    result.updated_keys += 1
                    continue
                if kind == "candidate":
                    ended = changelog.window_iso(row["_window_end"])
                    reason = (
                        f"late event: its window ended at {ended}, not after the watermark "
                        f"{watermark} (the latest event time of earlier micro-batches minus "
                        f"{delay})"
                    )
                    result.late += 1
                else:
                    reason = row["_error"]
                result.dead_lettered += 1
                self._dead_letter(row, reason, source)
            offsets = [
                kafka.TopicPartition(spec.source.topic, p, end)
                for p, end in sorted(planned.end_offsets.items())
            ]
            producer.send_offsets_to_transaction(
                offsets, self._group_metadata, self.settings.connect_timeout_s * 3
            )
            producer.commit_transaction(self.settings.connect_timeout_s * 6)
        except BaseException:
            try:
                producer.abort_transaction(self.settings.connect_timeout_s)
            except Exception:
                log.warning("%s: aborting the transaction failed too", spec.name)
            raise
        self.committed.update(planned.end_offsets)
        return result

    def _dead_letter(self, row: Any, reason: str, source: bytes) -> None:
        key = _bytes(row["_key"])
        value = _bytes(row["_value"])
        room = self.dead_letter_limit - _DEAD_LETTER_MARGIN - len(key or b"")
        if value is not None and len(value) > room:
            kept = max(0, room)
            reason += (
                f"; the value was cut to its first {kept} of {len(value)} bytes, the most the "
                f"dead-letter topic {self.spec.dlq_topic} accepts (max.message.bytes "
                f"{self.dead_letter_limit})"
            )
            value = value[:kept]
        headers: list[tuple[str, str | bytes | None]] = [
            ("duality.error", reason.encode()),
            ("duality.source.topic", source),
            ("duality.source.partition", str(row["_partition"]).encode()),
            ("duality.source.offset", str(row["_offset"]).encode()),
        ]
        kafka.send(self.producer, self.spec.dlq_topic, key, value, headers)

    def close(self) -> None:
        self.producer.flush(10)


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def _rows(output: DataFrame) -> Iterator[dict[str, Any]]:
    """The rows of a micro-batch's output, one Arrow batch at a time as Spark sends them.

    `toArrow()` reads the same stream of Arrow batches but keeps them all, and the rows' order,
    for one table; a micro-batch's output has each key once, so its order does not matter, and
    the driver then holds one Arrow batch (`spark.sql.execution.arrow.maxRecordsPerBatch` rows)
    however many keys the micro-batch changed. The calls are PySpark's own, of the pinned
    version, that `toArrow()` makes.
    """
    import pyarrow as pa
    from pyspark.errors.exceptions.captured import unwrap_spark_exception
    from pyspark.sql.pandas.serializers import ArrowCollectSerializer
    from pyspark.util import _load_from_socket

    port, secret, server = output._jdf.collectAsArrowToPython()
    stream = cast(Generator[Any], _load_from_socket((port, secret), ArrowCollectSerializer()))
    finished = False
    try:
        for item in stream:
            # The last item is the batches' order: not needed.
            if isinstance(item, pa.RecordBatch):
                yield from item.to_pylist()
        finished = True
    finally:
        stream.close()
        if finished:
            # The JVM's error, if the job failed after sending what it had.
            with unwrap_spark_exception():
                server.getResult()
