"""The join's part of a stream's query: the table topic's records parsed into rows, the events
keyed by `on`, both replayed per key by `TableJoin.java` (in the order docs/streams.md#joins
gives), and out come the events with `_t`, the table's row as it stood for each, and the
output rows of the table: its records (for the pipeline's copy of the table) and those that do
not parse (for the dead-letter topic)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from duality.expressions.columns import to_column
from duality.spec import SQL_TYPES, JoinedTable, PipelineSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# The sides of the operator's input, in the order it replays records of equal timestamps.
SEED, TABLE, EVENT = 0, 1, 2
# Seeds come before anything a micro-batch reads.
_FIRST_MS = -(2**63)
# The Kafka columns an event keeps through the join, for `query.classify`.
_KAFKA = ("key", "value", "topic", "partition", "offset", "timestamp")


def row_type(joined: JoinedTable) -> str:
    """The table's row as a Spark struct type."""
    return "struct<" + ", ".join(f"`{c}`:{SQL_TYPES[t]}" for c, t in joined.columns.items()) + ">"


def seed_schema() -> str:
    """The seed files' rows: table records as Kafka has them (a tombstone's value null), and
    their side: TABLE for a table read to its end at a first start (written to the pipeline's
    table topic in the first micro-batch), SEED for the rows restored from it."""
    return "`key` binary, `value` binary, `partition` int, `offset` bigint, `_side` int"


def table_rows(joined: JoinedTable, records: DataFrame) -> DataFrame:
    """Table records (Kafka's `key`, `value`, `partition`, `offset`) as `_jk` (the record key
    as text), `_trow` (the row; null for a tombstone) and `_error` (why a record is bad)."""
    from pyspark.sql import functions as F

    ddl = ", ".join(f"`{c}` {SQL_TYPES[t]}" for c, t in joined.columns.items())
    text = F.col("value").cast("string")
    parsed = F.from_json(text, ddl)
    as_text = F.from_json(text, ", ".join(f"`{c}` string" for c in joined.columns))
    jk = F.col("key").cast("string")
    where = f"table {joined.name} (topic {joined.topic})"
    checks: list[tuple[Column, Column]] = [
        (F.col("key").isNull(), F.lit(f"{where}: a record without a key")),
        (
            F.json_object_keys(text).isNull(),
            F.lit(f"{where}: malformed JSON or not a JSON object"),
        ),
        (
            parsed[joined.key].isNull(),
            F.lit(f"{where}: missing or mistyped key field {joined.key}"),
        ),
        (
            parsed[joined.key].cast("string") != jk,
            F.concat(
                F.lit(f"{where}: key field {joined.key} is "),
                parsed[joined.key].cast("string"),
                F.lit(", the record key "),
                jk,
            ),
        ),
    ]
    for column, kind in joined.columns.items():
        wrong = as_text[column].isNotNull() & parsed[column].isNull()
        checks.append((wrong, F.lit(f"{where}: wrong type for {column}: expected {kind}")))
    error = F.when(F.col("value").isNotNull(), F.coalesce(*[F.when(c, r) for c, r in checks]))
    return records.select(
        "*",
        jk.alias("_jk"),
        F.when(F.col("value").isNotNull(), parsed).cast(row_type(joined)).alias("_trow"),
        error.alias("_error"),
    )


def join_stream(
    spec: PipelineSpec, raw: DataFrame, seeds: DataFrame
) -> tuple[DataFrame, DataFrame]:
    """The events of `raw` (the Kafka rows of the source and the table topic) with `_t`, and the
    table's output rows (`query.OUTPUT` columns): changed rows and bad table records."""
    from pyspark.sql import DataFrame as Frame
    from pyspark.sql import functions as F

    joined = spec.joined
    assert joined is not None
    row = row_type(joined)
    no_event = F.lit(None).cast(
        "struct<" + ", ".join(f"`{c}`:{t}" for c, t in _kafka_types(raw).items()) + ">"
    )
    events = raw.where(F.col("topic") == spec.source.topic)
    fields = list(dict.fromkeys(joined.on.fields))
    ddl = ", ".join(f"`{f}` {SQL_TYPES[spec.source.fields[f]]}" for f in fields)
    parsed = F.from_json(F.col("value").cast("string"), ddl)
    on, failed = to_column(joined.on, {f: parsed[f] for f in fields})
    keyed = events.select(*_KAFKA, F.when(failed.isNull(), on.cast("string")).alias("_jk"))
    table = table_rows(joined, raw.where(F.col("topic") == joined.topic))
    seeded = table_rows(joined, seeds.withColumn("timestamp", F.lit(None).cast("timestamp")))

    def side(frame: Frame, kind: Column, ts: Column, trow: Column, event: Column) -> Frame:
        return frame.select(
            F.col("_jk"),
            kind.cast("int").alias("_side"),
            ts.cast("bigint").alias("_ts"),
            F.col("partition").cast("int").alias("_partition"),
            F.col("offset").cast("bigint").alias("_offset"),
            trow.cast(row).alias("_trow"),
            event.alias("_event"),
        )

    stamp = F.unix_millis(F.col("timestamp"))
    good = F.col("_error").isNull()
    replayed = (
        side(
            keyed.where(F.col("_jk").isNotNull()),
            F.lit(EVENT),
            stamp,
            F.lit(None),
            F.struct(*_KAFKA),
        )
        .unionByName(side(table.where(good), F.lit(TABLE), stamp, F.col("_trow"), no_event))
        .unionByName(
            side(seeded.where(good), F.col("_side"), F.lit(_FIRST_MS), F.col("_trow"), no_event)
        )
    )
    spark = raw.sparkSession
    jvm = spark._jvm
    assert jvm is not None
    out = Frame(jvm.duality.join.TableJoin.apply(replayed._jdf), spark)
    matched = out.select("_event.*", F.col("_trow").alias("_t"))
    unkeyed = keyed.where(F.col("_jk").isNull()).select(*_KAFKA, F.lit(None).cast(row).alias("_t"))
    # The table records of the micro-batch (and a first start's rows), for the pipeline's copy
    # of the table: the changelog writer keeps each key's last in the join's order.
    lineage = ("key", "value", "partition", "offset", "_jk", "_trow", "_error")
    first = seeded.where(F.col("_side") == TABLE)
    records = table.select(*lineage, stamp.alias("_order")).unionByName(
        first.select(*lineage, F.lit(_FIRST_MS).alias("_order"))
    )
    changed = records.where(good).select(
        F.lit("table").alias("_kind"),
        F.col("_jk").cast("binary").alias("_key"),
        F.to_json("_trow").cast("binary").alias("_value"),
        F.col("partition").cast("int").alias("_partition"),
        F.col("offset").cast("bigint").alias("_offset"),
        F.lit(None).cast("string").alias("_error"),
        F.lit(None).cast("bigint").alias("_first_window_end"),
        F.lit(None).cast("bigint").alias("_window_end"),
        F.col("_order").cast("bigint"),
    )
    # Bad records read live, or when a first start read the table to its end.
    bad = records.where(~good).select(
        F.lit("table_dead").alias("_kind"),
        F.col("key").alias("_key"),
        F.col("value").alias("_value"),
        F.col("partition").cast("int").alias("_partition"),
        F.col("offset").cast("bigint").alias("_offset"),
        F.col("_error"),
        F.lit(None).cast("bigint").alias("_first_window_end"),
        F.lit(None).cast("bigint").alias("_window_end"),
        F.lit(None).cast("bigint").alias("_order"),
    )
    return matched.unionByName(unkeyed), changed.unionByName(bad)


def _kafka_types(raw: DataFrame) -> dict[str, str]:
    types = dict(raw.dtypes)
    return {c: types[c] for c in _KAFKA}


def table_scope(spec: PipelineSpec) -> dict[str, Column]:
    """The joined table's columns as the spec's expressions name them, read from `_t`."""
    from pyspark.sql import functions as F

    joined = spec.joined
    if joined is None:
        return {}
    return {f"{joined.name}.{c}": F.col("_t")[c] for c in joined.columns}
