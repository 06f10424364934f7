"""The query frame: source records classified and aggregated in Spark's state store, its output
the changed rows and bad records as changelog records and dead letters, encoded in the JVM."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from duality import kafka
from duality.config import Settings
from duality.spec import SQL_TYPES, PipelineSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


@dataclasses.dataclass(frozen=True)
class Partial:
    """One partial aggregate kept in the state: `count`, or `sum|min|max` of a field; `name` is
    its key in the changelog's `_state`, `column` its column inside Spark."""

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


def partial_type(spec: PipelineSpec, part: Partial) -> str:
    kind = None if part.field is None else spec.source.fields[part.field]
    # Counts, timestamps (as epoch milliseconds) and sums of integers are longs.
    if kind in (None, "timestamp") or (part.function == "sum" and kind in ("int", "long")):
        return "bigint"
    return SQL_TYPES[kind]


def classify(spec: PipelineSpec, raw: DataFrame) -> DataFrame:
    """Parse the raw Kafka rows into `_p` and name each bad record's reason in `_error`, null
    when good (docs/streams.md#bad-and-late-records); lateness is `ChangelogWriter.write`'s."""
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
    typed = {f: F.col(f"_v.{f}") for f in fields}
    typed = {
        f: F.variant_get(v, "$", "string") if fields[f] == "string" else v for f, v in typed.items()
    }
    frame = frame.withColumn("_p", F.struct(*[v.alias(f) for f, v in typed.items()]))
    limit, size = spec.source.max_record_bytes, F.octet_length("value")
    oversized = F.concat(
        F.lit("oversized: "), size.cast("string"), F.lit(f" bytes, the limit is {limit}")
    )
    checks: list[tuple[Column, Column]] = [
        (F.col("value").isNull(), F.lit("null value")),
        (size > limit, oversized),
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
        absent = F.lit(f"missing field {field}")
        if kind == "string":
            json_type = F.schema_of_variant(F.col(f"_v.{field}"))
            missing = json_type.isNull() | (json_type == "VOID")
            not_string = json_type.isNull() | (json_type != "STRING")
            checks.append((not_string, F.when(missing, absent).otherwise(wrong)))
            continue
        present = F.from_json(text, as_text)[field].isNotNull()
        checks.append((value.isNull(), F.when(present, wrong).otherwise(absent)))
        if kind == "double":
            infinite = F.isnan(value) | (F.abs(value) == F.lit(float("inf")))
            got = F.lit(f"wrong type for {field}: expected a finite double, got ")
            checks.append((infinite, F.concat(got, value.cast("string"))))
    # The first check that holds names the reason; later ones are not evaluated.
    error = F.coalesce(*[F.when(condition, reason) for condition, reason in checks])
    return frame.drop("_parsed").withColumn("_error", _once(error))


def _once(expression: Column) -> Column:
    """`expression`, computed once per row however often later filters and columns use it:
    Spark would paste it into each filter pushed below it, but not past a non-deterministic
    guard (the partition id, always at least 0)."""
    from pyspark.sql import functions as F

    return F.when(F.spark_partition_id() >= 0, expression)


def late_records(settings: Settings, spec: PipelineSpec) -> list[tuple[int, int]]:
    """(partition, offset) of the source records the dead-letter topic holds as late."""
    late = []
    for message in kafka.read_to_end(settings, spec.dlq_topic):
        headers = dict(message.headers() or [])
        reason = headers.get("duality.error") or b""
        if isinstance(reason, bytes) and reason.startswith(b"late event"):
            partition = int(headers["duality.source.partition"] or -1)
            late.append((partition, int(headers["duality.source.offset"] or -1)))
    return late


def _window_end_ms(spec: PipelineSpec) -> Column:
    """The end of the tumbling window holding a record's event time (Spark's `window()`)."""
    from pyspark.sql import functions as F

    assert spec.window is not None and spec.source.event_time is not None
    ts_ms = F.unix_millis(F.col(f"_p.{spec.source.event_time}"))
    size = spec.window.size_seconds * 1000
    return ts_ms - F.pmod(ts_ms, F.lit(size)) + F.lit(size)


def rows_schema(spec: PipelineSpec) -> str:
    """What the aggregation consumes: group fields, event time, one partial per column."""
    columns = [f"`{f}` {SQL_TYPES[spec.source.fields[f]]}" for f in spec.source.key]
    if spec.window is not None:
        columns.append("`_ts` timestamp")
    columns += [f"`{p.column}` {partial_type(spec, p)}" for p in partials_of(spec)]
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
        columns.append(value.cast(partial_type(spec, part)).alias(part.column))
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
        merge[p.function](p.column).cast(partial_type(spec, p)).alias(p.column)
        for p in partials_of(spec)
    ]
    return rows.groupBy(*groups).agg(*columns, F.max("_fresh").alias("_fresh"))


def aggregate_columns(spec: PipelineSpec) -> dict[str, Column]:
    """Each aggregate column of the spec from the partials of `aggregate`'s output."""
    from pyspark.sql import functions as F

    columns = {}
    for column, agg in spec.aggregates.items():
        if agg.function == "avg":
            columns[column] = F.col(f"_sum_{agg.field}") / F.col("_count")
        else:
            columns[column] = F.col(Partial(agg.function, agg.field).column)
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
        F.lit(None).cast("int").alias("_partition"),
        F.lit(None).cast("bigint").alias("_offset"),
        F.lit(None).cast("string").alias("_error"),
        F.lit(None).cast("bigint").alias("_window_end"),
    )


def build_query_frame(spec: PipelineSpec, source: DataFrame, seeds: DataFrame) -> DataFrame:
    """The frame whose micro-batches the driver writes (`_kind, _key, _value` and lineage): the
    source classified once, one shuffle feeding both the aggregation and the dead letters."""
    from pyspark.sql import functions as F

    classified = classify(spec, source)
    good = F.col("_error").isNull()
    lineage = F.struct(*[F.col(c).alias(f"_{c}") for c in ("key", "value", "partition", "offset")])
    window_end = F.lit(None).cast("bigint")
    if spec.window is not None:
        window_end = F.when(good, _window_end_ms(spec)).cast("bigint")
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
    kind = F.when(good, F.lit("candidate")).otherwise(F.lit("dead")).alias("_kind")
    dead = records.select(kind, "_lineage.*", "_error", "_window_end")
    return changelog_records(spec, table).unionByName(dead)


def _shared(frame: DataFrame, partitions: int) -> DataFrame:
    """`frame` behind one shuffle that every reader shares: Spark reuses an exchange only for
    the same plans below it, so the columns are packed into one struct, read back whole through
    a non-deterministic guard, and column pruning finds nothing to push below it."""
    from pyspark.sql import functions as F

    packed = frame.select(F.struct(*frame.columns).alias("_shared")).repartition(partitions)
    return packed.select(_once(F.col("_shared")).alias("_shared")).select("_shared.*")
