"""The query frame: source records classified and aggregated in Spark's state store, its output
the changed rows and bad records as changelog records and dead letters, encoded in the JVM."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

from duality.config import Settings
from duality.expressions.columns import once, to_column
from duality.expressions.tree import Expression
from duality.join.frame import BAD, EVENT, KAFKA_COLUMNS, TABLE, join_stream, table_scope
from duality.kafka import records
from duality.schema import SQL_TYPES
from duality.spec import Aggregate, PipelineSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


@dataclasses.dataclass(frozen=True)
class Partial:
    """One partial aggregate kept in the state (docs/decisions/0025): `count` of records, or a
    function of an aggregate argument: `sum`, `min`, `max`, `n` (non-null values), `sumsq`
    (sum of squares), `count_if`, `count_distinct` (an HLL sketch), `latest`, `earliest`.
    `name` is its key in the changelog's `_state`, `column` its column inside Spark."""

    function: str
    argument: Expression | None = None
    type: str = "bigint"

    @property
    def name(self) -> str:
        return "count" if self.argument is None else f"{self.function}.{self.argument.text}"

    @property
    def column(self) -> str:
        return "_count" if self.argument is None else f"_{self.function}_{_label(self.argument)}"


def _label(argument: Expression) -> str:
    """A column-safe name of an aggregate argument: the field (a joined table's `customers.tier`
    as `customers__tier`: a dot would name a struct's field), or a digest of its text."""
    if argument.field:
        return argument.field.replace(".", "__")
    return hashlib.sha256(argument.text.encode()).hexdigest()[:12]


def _parts(spec: PipelineSpec, aggregate: Aggregate) -> list[Partial]:
    """The partials an aggregate column is computed from."""
    function, argument = aggregate.function, aggregate.argument
    if argument is None:
        return [Partial("count")]
    kind = argument.type
    value = "bigint" if kind == "timestamp" else SQL_TYPES[kind]
    if function in ("avg", "stddev"):
        # A required source field is never null: its values are counted by `count`.
        counted = (
            Partial("count") if argument.field in spec.source.fields else Partial("n", argument)
        )
        total = Partial("sum", argument, "bigint" if kind in ("int", "long") else "double")
        squares = [Partial("sumsq", argument, "double")] if function == "stddev" else []
        return [total, counted, *squares]
    if function == "sum":
        return [Partial("sum", argument, "bigint" if kind in ("int", "long") else "double")]
    if function == "count_if":
        return [Partial("count_if", argument)]
    if function == "count_distinct":
        return [Partial("count_distinct", argument, "binary")]
    if function in ("latest", "earliest"):
        ordered = f"struct<`ts`:bigint,`partition`:int,`offset`:bigint,`value`:{value}>"
        return [Partial(function, argument, ordered)]
    return [Partial(function, argument, value)]  # min, max


def partials_of(spec: PipelineSpec) -> list[Partial]:
    """The partial aggregates from which every aggregate column is computed exactly."""
    needed = {"count": Partial("count")}
    for aggregate in spec.aggregates.values():
        for part in _parts(spec, aggregate):
            needed.setdefault(part.name, part)
    return list(needed.values())


def _sketch_input(part: Partial) -> str:
    """The column of a `count_distinct` partial's raw values (its `column` holds sketches)."""
    return f"{part.column}_value"


def _sketched_type(argument: Expression) -> str:
    return "bigint" if argument.type in ("int", "long") else "string"


def row_types(spec: PipelineSpec) -> dict[str, str]:
    """What the aggregation consumes, and its Spark SQL types: group fields, event time, the
    partials (a raw value beside each sketch), `_fresh`."""
    types = {f: SQL_TYPES[spec.field_type(f)] for f in spec.source.key}
    if spec.window is not None:
        types["_ts"] = "timestamp"
    for part in partials_of(spec):
        types[part.column] = part.type
        if part.function == "count_distinct":
            assert part.argument is not None
            types[_sketch_input(part)] = _sketched_type(part.argument)
    types["_fresh"] = "int"
    return types


def rows_schema(spec: PipelineSpec) -> str:
    return ", ".join(f"`{c}` {t}" for c, t in row_types(spec).items())


def classify(spec: PipelineSpec, raw: DataFrame) -> DataFrame:
    """Parse the raw Kafka rows into `_p` and name each bad record's reason in `_error`, null
    when good (docs/streams.md#bad-and-late-records); lateness is `ChangelogWriter.write`'s."""
    frame, error = parse(spec, raw)
    return _evaluate(spec, frame, error)


def parse(
    spec: PipelineSpec, raw: DataFrame, only: Column | None = None
) -> tuple[DataFrame, Column]:
    """The raw Kafka rows with `_p`, their source fields typed, and why a record does not
    parse (null when it does): `classify`'s first step, before a join. Rows for which `only`
    is false are not parsed (their `_p` is null, their reason nonsense). A JSON record is
    parsed by Spark's JSON reader, an Avro record decoded by `ConfluentAvro.java` straight into
    the same typed `_p` (decision 38); the checks of its fields below are the same."""
    from pyspark.sql import functions as F

    fields = spec.source.fields
    limit, size = spec.source.max_record_bytes, F.octet_length("value")
    oversized = F.concat(
        F.lit("oversized: "), size.cast("string"), F.lit(f" bytes, the limit is {limit}")
    )
    checks: list[tuple[Column, Column]] = [
        (F.col("value").isNull(), F.lit("null value")),
        (size > limit, oversized),
    ]
    avro = spec.source.avro
    if avro is not None:
        from duality.avro.frame import decode

        # Only the fields the pipeline uses are decoded (the reader schema projected on them:
        # Avro skips the others without building them), as Spark prunes a JSON parse's; the
        # others are null in `_p`, which nothing reads.
        used = {f: fields[f] for f in spec.required_fields}
        decoded = decode(raw.sparkSession, avro, used, F.col("value"))
        frame = raw.withColumn("_avro", once(decoded if only is None else F.when(only, decoded)))
        typed = {f: F.col(f"_avro.p.{f}") if f in used else F.lit(None) for f in fields}
        frame = frame.withColumn(
            "_p",
            F.struct(*[v.cast(SQL_TYPES[fields[f]]).alias(f) for f, v in typed.items()]),
        )
        checks.append((F.col("_avro.error").isNotNull(), F.col("_avro.error")))
    else:
        frame, text, one_value = _parse_json(spec, raw, only)
        checks += [
            (~F.coalesce(one_value, F.lit(False)), F.lit("malformed JSON: not one JSON value")),
            (~F.ltrim(text).startswith("{"), F.lit("not a JSON object")),
            (F.col("_v").isNull(), F.lit("malformed JSON: text after the object")),
        ]
        # Every JSON value reads as a string, so this parse tells a missing field from one of
        # the wrong type; only records with a null typed field get that far.
        as_text = ", ".join(f"`{f}` string" for f in spec.required_fields)
    for field in spec.required_fields:
        kind = fields[field]
        value = F.col(f"_p.{field}")
        wrong = F.lit(f"wrong type for {field}: expected {kind}")
        absent = F.lit(f"missing field {field}")
        if avro is not None:
            # The decoder gives each field its column's type (the reader schema, checked
            # against every version when the spec loaded): a null is a missing field, as a JSON
            # null is.
            checks.append((value.isNull(), absent))
        elif kind == "string":
            json_type = F.schema_of_variant(F.col(f"_v.{field}"))
            missing = json_type.isNull() | (json_type == "VOID")
            not_string = json_type.isNull() | (json_type != "STRING")
            checks.append((not_string, F.when(missing, absent).otherwise(wrong)))
        else:
            present = F.from_json(text, as_text)[field].isNotNull()
            checks.append((value.isNull(), F.when(present, wrong).otherwise(absent)))
        if kind == "double":
            infinite = F.isnan(value) | (F.abs(value) == F.lit(float("inf")))
            got = F.lit(f"wrong type for {field}: expected a finite double, got ")
            checks.append((infinite, F.concat(got, value.cast("string"))))
    # The first check that holds names the reason; later ones are not evaluated.
    error = F.coalesce(*[F.when(condition, reason) for condition, reason in checks])
    return frame, error


def _parse_json(
    spec: PipelineSpec, raw: DataFrame, only: Column | None
) -> tuple[DataFrame, Column, Column]:
    """The JSON records parsed: `_v` (the object, its string fields as variants) and `_p` (its
    fields typed); the text, and whether it is one JSON value."""
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
    frame = raw.withColumn("_parsed", once(parsed if only is None else F.when(only, parsed)))
    frame = frame.withColumn("_v", F.when(F.size("_parsed") == 1, F.col("_parsed")[0]))
    typed = {f: F.col(f"_v.{f}") for f in fields}
    typed = {
        f: F.variant_get(v, "$", "string") if fields[f] == "string" else v for f, v in typed.items()
    }
    frame = frame.withColumn("_p", F.struct(*[v.alias(f) for f, v in typed.items()]))
    return frame.drop("_parsed"), text, one_value


def _evaluate(spec: PipelineSpec, frame: DataFrame, error: Column) -> DataFrame:
    """A parsed record's computed fields (added to `_p`), key, filter and aggregate arguments
    (`_a`, by `_label`), in that order (docs/decisions/0025): the first run-time error or null
    computed key is the record's `_error`; `_filtered` when good but `where` is not true."""
    from pyspark.sql import functions as F

    scope = {f: F.col(f"_p.{f}") for f in spec.source.fields} | table_scope(spec)
    stages = [error]
    for name, expression in spec.computed_fields.items():
        scope[name], failed = to_column(expression, scope)
        stages.append(failed)
    for name in spec.source.key:
        if name in spec.computed_fields:
            stages.append(F.when(scope[name].isNull(), F.lit(f"null key field {name}")))
    kept = F.lit(True)
    if spec.where_expression is not None:
        kept, failed = to_column(spec.where_expression, scope)
        stages.append(failed)
    arguments, failures = {}, []
    for argument in _arguments(spec):
        arguments[_label(argument)], failed = to_column(argument, scope)
        failures.append(failed)
    if failures:
        stages.append(F.when(kept, F.coalesce(*failures)))
    # An inner join's event without a row is unmatched, whatever its fields would have given
    # (a key from the table's columns is null then); a record that does not parse is bad.
    joined = spec.joined
    unmatched = F.col("_t").isNull() if joined is not None and joined.type == "inner" else None
    if unmatched is not None and len(stages) > 1:
        stages = [stages[0], F.when(~unmatched, F.coalesce(*stages[1:]))]
    stage = F.struct(
        F.coalesce(*stages).alias("error"),
        F.coalesce(kept, F.lit(False)).alias("kept"),
        # Empty structs are not allowed: a placeholder when there is nothing to hold.
        F.struct(*[scope[n].alias(n) for n in spec.computed_fields] or [F.lit(0)]).alias("fields"),
        F.struct(*[v.alias(label) for label, v in arguments.items()] or [F.lit(0)]).alias("args"),
    )
    frame = frame.withColumn("_x", once(stage))
    computed = [F.col(f"_x.fields.{n}").alias(n) for n in spec.computed_fields]
    # An inner join's event without a row is counted as unmatched, and not aggregated.
    if unmatched is None:
        unmatched = F.lit(False)
    fine = F.col("_x.error").isNull()
    return frame.select(
        *[c for c in frame.columns if c not in ("_p", "_x", "_t")],
        F.struct("_p.*", *computed).alias("_p"),
        F.col("_x.args").alias("_a"),
        F.col("_x.error").alias("_error"),
        (fine & (~F.col("_x.kept") | unmatched)).alias("_filtered"),
        (fine & unmatched).alias("_unmatched"),
    )


def _arguments(spec: PipelineSpec) -> list[Expression]:
    """The aggregate arguments, each once."""
    found: dict[str, Expression] = {}
    for aggregate in spec.aggregates.values():
        if aggregate.argument is not None:
            found.setdefault(_label(aggregate.argument), aggregate.argument)
    return list(found.values())


def late_records(settings: Settings, spec: PipelineSpec) -> list[tuple[int, int]]:
    """(partition, offset) of the source records the dead-letter topic holds as late."""
    late = []
    for message in records.read_to_end(settings, spec.dlq_topic):
        headers = dict(message.headers() or [])
        reason = headers.get("duality.error") or b""
        if isinstance(reason, bytes) and reason.startswith(b"late event"):
            partition = int(headers["duality.source.partition"] or -1)
            late.append((partition, int(headers["duality.source.offset"] or -1)))
    return late


def _window_ends_ms(spec: PipelineSpec) -> tuple[Column, Column]:
    """The ends of the first and of the last window holding a record's event time (Spark's
    `window()`: starts at multiples of the slide); the same for tumbling windows."""
    from pyspark.sql import functions as F

    assert spec.window is not None and spec.source.event_time is not None
    ts_ms = F.unix_millis(F.col(f"_p.{spec.source.event_time}"))
    slide = spec.window.slide_seconds * 1000
    start = ts_ms - F.pmod(ts_ms, F.lit(slide))
    return start + F.lit(slide), start + F.lit(spec.window.size_seconds * 1000)


def partial_columns(spec: PipelineSpec) -> list[Column]:
    """A good record's row of partials (`row_types`): group fields, event time, count 1, and
    each partial of its aggregate arguments."""
    from pyspark.sql import functions as F

    columns = [F.col(f"_p.{f}").alias(f) for f in spec.source.key]
    if spec.window is not None:
        columns.append(F.col(f"_p.{spec.source.event_time}").alias("_ts"))
    event_time = F.col(f"_p.{spec.source.event_time}" if spec.source.event_time else "timestamp")
    for part in partials_of(spec):
        if part.argument is None:
            columns.append(F.lit(1).cast("bigint").alias(part.column))
            continue
        value = F.col(f"_a.{_label(part.argument)}")
        present = value.isNotNull()
        if part.argument.type == "timestamp":
            value = F.unix_millis(value)
        if part.function in ("n", "count_if"):
            value = F.when(present if part.function == "n" else value, 1).otherwise(0)
        elif part.function == "sumsq":
            value = value.cast("double") * value.cast("double")
        elif part.function in ("latest", "earliest"):
            ordered = {"ts": F.unix_millis(event_time), "partition": F.col("partition")}
            ordered |= {"offset": F.col("offset"), "value": value}
            value = F.when(present, F.struct(*[c.alias(n) for n, c in ordered.items()]))
        elif part.function == "count_distinct":
            raw = value.cast(_sketched_type(part.argument))
            columns.append(raw.alias(_sketch_input(part)))
            value = F.lit(None)
        columns.append(value.cast(part.type).alias(part.column))
    columns.append(F.lit(1).alias("_fresh"))
    return columns


def source_rows(spec: PipelineSpec, classified: DataFrame, *more: str) -> DataFrame:
    """Each good record that the filter keeps as one row of partials (`partial_columns`), and
    the columns `more` of `classified`."""
    from pyspark.sql import functions as F

    good = F.col("_error").isNull() & ~F.col("_filtered")
    return classified.where(good).select(*partial_columns(spec), *more)


# HyperLogLog sketches of `count_distinct`: 2^12 registers, a relative standard error of
# 1.04 / sqrt(4096), about 1.6%.
HLL_LG_CONFIG_K = 12

_MERGE = {"count": "sum", "n": "sum", "sum": "sum", "sumsq": "sum", "count_if": "sum"}
_MERGE |= {"min": "min", "earliest": "min", "max": "max", "latest": "max"}


def aggregate(spec: PipelineSpec, rows: DataFrame, through: DataFrame | None = None) -> DataFrame:
    """The streaming aggregation (its state is the table); `_fresh` is 1 for a key that source
    records touched, 0 for one only seeded from the changelog. Rows seeded from the changelog
    fall into their own window only; a source row into each of its windows. Reconciling
    hopping windows in batch, `through` (`seeding.through_rows`) keeps the (record, window)
    pairs the stream counted: records of `rows` (with `partition` and `offset`) before the end
    offsets of the micro-batch that last updated the window."""
    from pyspark.sql import functions as F

    groups: list[Column | str] = list(spec.source.key)
    window = spec.window
    if window is not None:
        rows = rows.withWatermark("_ts", f"{window.watermark_seconds} seconds")
        if window.slide_seconds == window.size_seconds:
            groups.append(F.window("_ts", f"{window.size_seconds} seconds").alias("_window"))
        else:
            hopping = F.window(
                "_ts", f"{window.size_seconds} seconds", f"{window.slide_seconds} seconds"
            )
            rows = rows.select("*", hopping.alias("_window"))
            rows = rows.where((F.col("_fresh") == 1) | (F.col("_window.start") == F.col("_ts")))
            if through is not None:
                ends = through.select(
                    *[F.col(f).alias(f"_through_{f}") for f in spec.source.key],
                    F.col("_ts").alias("_through_ts"),
                    "_through",
                )
                same = [F.col(f) == F.col(f"_through_{f}") for f in spec.source.key]
                same.append(F.col("_window.start") == F.col("_through_ts"))
                before = F.col("offset") < F.col("_through")[F.col("partition").cast("string")]
                rows = rows.join(ends, same).where(before).select(*rows.columns)
            groups.append("_window")
    columns = []
    sketches = [p for p in partials_of(spec) if p.function == "count_distinct"]
    for part in partials_of(spec):
        if part in sketches:
            # Source values are sketched, seeded sketches unioned; the two are one below.
            raw = F.hll_sketch_agg(_sketch_input(part), HLL_LG_CONFIG_K)
            columns += [
                raw.alias(_sketch_input(part)),
                F.hll_union_agg(part.column).alias(part.column),
            ]
        else:
            merged = getattr(F, _MERGE[part.function])(part.column)
            columns.append(merged.cast(part.type).alias(part.column))
    table = rows.groupBy(*groups).agg(*columns, F.max("_fresh").alias("_fresh"))
    for part in sketches:
        raw, seeded = F.col(_sketch_input(part)), F.col(part.column)
        table = table.withColumn(
            part.column, F.when(seeded.isNull(), raw).otherwise(F.hll_union(raw, seeded))
        ).drop(_sketch_input(part))
    return table


def aggregate_columns(spec: PipelineSpec) -> dict[str, Column]:
    """Each aggregate column of the spec from the partials of `aggregate`'s output."""
    from pyspark.sql import functions as F

    columns = {}
    for column, agg in spec.aggregates.items():
        parts = [F.col(p.column) for p in _parts(spec, agg)]
        if agg.function == "avg":
            columns[column] = F.try_divide(parts[0].cast("double"), parts[1])
        elif agg.function == "stddev":
            total, n, squares = (p.cast("double") for p in parts)
            # Sample variance from the sums; rounding can leave it a little below zero.
            variance = (squares - total * total / n) / (n - 1)
            columns[column] = F.when(n >= 2, F.sqrt(F.greatest(variance, F.lit(0.0))))
        elif agg.function == "count_distinct":
            columns[column] = F.hll_sketch_estimate(parts[0])
        elif agg.function in ("latest", "earliest"):
            columns[column] = parts[0]["value"]
        else:
            columns[column] = parts[0]
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
        F.lit(None).cast("bigint").alias("_first_window_end"),
        F.lit(None).cast("bigint").alias("_window_end"),
        F.lit(None).cast("bigint").alias("_order"),
    )


def build_query_frame(
    spec: PipelineSpec, source: DataFrame, seeds: DataFrame, table_seeds: DataFrame | None = None
) -> DataFrame:
    """The frame whose micro-batches the driver writes (`_kind, _key, _value` and lineage): the
    source classified once, one shuffle feeding both the aggregation and the dead letters (a
    joined pipeline's: the join's, below its two copies, decision 35). Records the filter skips
    are `filtered` rows of no content, for the writer to count; a windowed pipeline's good
    records are `candidate`s, which the writer keeps when late for at least one of their windows
    (`_first_window_end`, `_window_end`: the last); a joined table's records are `table` rows
    (for the pipeline's copy of the table) or `table_dead`."""
    from pyspark.sql import functions as F

    joined = spec.joined
    if joined is None:
        classified = classify(spec, source)
        good = F.col("_error").isNull() & ~F.col("_filtered")
        sides: list[Column] = []
    else:
        assert table_seeds is not None
        # The source's records and the table's are one scan of Kafka, told apart by topic.
        event = F.col("topic") == spec.source.topic
        records, error = parse(spec, source, only=event)
        records = records.select(*KAFKA_COLUMNS, "_p", F.when(event, error).alias("_parse_error"))
        out = join_stream(spec, records, table_seeds)
        classified = _evaluate(spec, out, F.col("_parse_error"))
        event = F.col("_side") == EVENT
        good = event & F.col("_error").isNull() & ~F.col("_filtered")
        sides = [F.col("_side")]
    lineage = F.struct(*[F.col(c).alias(f"_{c}") for c in ("key", "value", "partition", "offset")])
    first_end = last_end = F.lit(None).cast("bigint")
    other = F.col("_side") != EVENT if joined is not None else F.lit(False)
    if spec.window is not None:
        first_end, last_end = (F.when(good, end).cast("bigint") for end in _window_ends_ms(spec))
        lineage = F.when(~F.col("_filtered") | other, lineage)
    else:
        lineage = F.when(F.col("_error").isNotNull() | other, lineage)
    narrow = classified.select(
        *sides,
        F.col("_error"),
        F.col("_filtered"),
        F.col("_unmatched"),
        F.when(good, F.struct(*partial_columns(spec))).alias("_row"),
        lineage.alias("_lineage"),
        first_end.alias("_first_window_end"),
        last_end.alias("_window_end"),
        # The join's order of a table record, for the writer's last row of each key.
        (F.when(F.col("_side") == TABLE, F.col("_ts")) if joined is not None else F.lit(None))
        .cast("bigint")
        .alias("_order"),
    )
    # A joined pipeline's branches each hold their own copy of the join (decision 35): no
    # exchange above it can be shared, and each branch reads the join's output directly.
    shared = (
        narrow
        if joined is not None
        else _shared(narrow, source.sparkSession.sparkContext.defaultParallelism)
    )
    rows = shared.where(good).select("_row.*").unionByName(seeds)
    table = aggregate(spec, rows)
    rest = shared if spec.window is not None else shared.where(~good)
    kind = (
        F.when(F.col("_unmatched"), F.lit("unmatched"))
        .when(F.col("_filtered"), F.lit("filtered"))
        .when(good, F.lit("candidate"))
        .otherwise(F.lit("dead"))
    )
    error = F.col("_error")
    if joined is not None:
        side = F.col("_side")
        kind = F.when(side == TABLE, "table").when(side == BAD, "table_dead").otherwise(kind)
        error = F.when(side != TABLE, error)
    ends = ["_first_window_end", "_window_end"]
    dead = rest.select(
        kind.alias("_kind"),
        "_lineage.*",
        error.alias("_error"),
        *ends,
        "_order",
    )
    return changelog_records(spec, table).unionByName(dead)


def _shared(frame: DataFrame, partitions: int) -> DataFrame:
    """`frame` behind one shuffle that every reader shares: Spark reuses an exchange only for
    the same plans below it, so the columns are packed into one struct, read back whole through
    a non-deterministic guard, and column pruning finds nothing to push below it."""
    from pyspark.sql import functions as F

    packed = frame.select(F.struct(*frame.columns).alias("_shared")).repartition(partitions)
    return packed.select(once(F.col("_shared")).alias("_shared")).select("_shared.*")
