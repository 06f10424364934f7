"""The join's part of a stream's query: the table topic's records parsed into rows, the events
keyed by `on`, both replayed per key by `TableJoin.java` (in the order docs/streams.md#joins
gives). Out come the events with `_t`, the table's row as it stood for each, and the table's
records: for the pipeline's copy of the table, or the dead-letter topic when they do not parse.
Every record of a micro-batch goes through the operator, so that the query reads its Kafka
source once, below the operator's one exchange."""

from __future__ import annotations

from typing import TYPE_CHECKING

from duality.expressions.columns import once, to_column
from duality.join.spec import JoinedTable
from duality.schema import SQL_TYPES
from duality.spec import PipelineSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# The sides of the operator's input, in the order it replays records of equal timestamps; a bad
# table record passes through it untouched.
SEED, TABLE, EVENT, BAD = 0, 1, 2, 3
# Seeds come before anything a micro-batch reads.
_FIRST_MS = -(2**63)
# The Kafka columns a record keeps through the join.
KAFKA_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp")


def row_type(joined: JoinedTable) -> str:
    """The table's row as a Spark struct type."""
    return "struct<" + ", ".join(f"`{c}`:{SQL_TYPES[t]}" for c, t in joined.columns.items()) + ">"


def seed_schema() -> str:
    """The seed files' rows: table records as Kafka has them (a tombstone's value null), and
    their side: TABLE for a table read to its end at a first start (written to the pipeline's
    table topic in the first micro-batch), SEED for the rows restored from it."""
    return "`key` binary, `value` binary, `partition` int, `offset` bigint, `_side` int"


def table_rows(
    joined: JoinedTable,
    records: DataFrame,
    only: Column | None = None,
    copied: Column | None = None,
) -> DataFrame:
    """Table records (Kafka's `key`, `value`, `partition`, `offset`) as `_jk` (the record key
    as text), `_trow` (the row; null for a tombstone) and `_error` (why a record is bad); rows
    for which `only` is false are left alone (all three null). An Avro table's records are
    decoded by `ConfluentAvro.java` into the row, except those for which `copied` holds: rows
    of the pipeline's copy of the table, which is JSON (`join_stream`)."""
    from pyspark.sql import functions as F

    guard = F.lit(True) if only is None else only
    ddl = ", ".join(f"`{c}` {SQL_TYPES[t]}" for c, t in joined.columns.items())
    text = F.col("value").cast("string")
    where = f"table {joined.name} (topic {joined.topic})"
    frame, avro = records, F.lit(False)
    if joined.avro is not None:
        from duality.avro.frame import decode

        avro = guard if copied is None else guard & ~copied
        decoded = decode(records.sparkSession, joined.avro, joined.columns, F.col("value"))
        frame = frame.withColumn("_tavro", once(F.when(avro, decoded)))
    json = guard & ~avro
    frame = frame.withColumn("_tparsed", once(F.when(json, F.from_json(text, ddl))))
    parsed = F.col("_tparsed")
    if joined.avro is not None:
        parsed = F.when(avro, F.col("_tavro.p")).otherwise(parsed)
    as_text = F.from_json(text, ", ".join(f"`{c}` string" for c in joined.columns))
    jk = F.col("key").cast("string")
    checks: list[tuple[Column, Column]] = [
        (F.col("key").isNull(), F.lit(f"{where}: a record without a key")),
        (
            json & F.json_object_keys(text).isNull(),
            F.lit(f"{where}: malformed JSON or not a JSON object"),
        ),
    ]
    if joined.avro is not None:
        reason = F.col("_tavro.error")
        checks.append((avro & reason.isNotNull(), F.concat(F.lit(f"{where}: "), reason)))
    checks += [
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
    # The decoder types an Avro record's columns itself (its reader schema was checked against
    # every version of the subject when the spec loaded).
    for column, kind in joined.columns.items():
        wrong = json & as_text[column].isNotNull() & parsed[column].isNull()
        checks.append((wrong, F.lit(f"{where}: wrong type for {column}: expected {kind}")))
    present = guard & F.col("value").isNotNull()
    error = F.when(present, F.coalesce(*[F.when(c, r) for c, r in checks]))
    return frame.select(
        *records.columns,
        F.when(guard, jk).alias("_jk"),
        F.when(present, parsed).cast(row_type(joined)).alias("_trow"),
        error.alias("_error"),
    )


def join_stream(spec: PipelineSpec, records: DataFrame, seeds: DataFrame) -> DataFrame:
    """Every record of the micro-batch through the join, one exchange below it all: `records`
    (the Kafka rows of the source and of the table's topic, the source's parsed: `_p` and
    `_parse_error`) and the `seeds`. Out come `_side`, `_jk`, `_ts`, `_t` (an event's row as
    it stood; null unmatched) and the `KAFKA_COLUMNS`: for an event its own, with `_p` and
    `_parse_error`; for a table record (`TABLE`) the pipeline's copy of its row (`key` the join
    key, `value` the row as JSON, null for a tombstone); for a bad table record (`BAD`) the
    record as read, its reason in `_parse_error`."""
    from pyspark.sql import DataFrame as Frame
    from pyspark.sql import functions as F

    joined = spec.joined
    assert joined is not None
    row = row_type(joined)
    fields = {f: F.col(f"_p.{f}") for f in dict.fromkeys(joined.on.fields)}
    on, failed = to_column(joined.on, fields)
    from_table = F.col("topic") == joined.topic
    keyed = F.col("_parse_error").isNull() & failed.isNull()
    table = table_rows(joined, records, only=from_table)
    seeds = seeds.withColumn("timestamp", F.lit(None).cast("timestamp"))
    # Seeds restored from the pipeline's copy of the table are JSON; those read from the
    # table's topic (at a first start) are in its format.
    seeded = table_rows(
        joined,
        seeds.withColumn("topic", F.lit(joined.topic)),
        copied=F.col("_side") == SEED,
    )
    parsed = records.schema["_p"].dataType.simpleString()

    def side(frame: Frame, kind: Column, jk: Column, ts: Column, p: Column, error: Column) -> Frame:
        """`frame` as the operator's input rows (`TableJoin.java`'s columns)."""
        event = [*[F.col(c) for c in KAFKA_COLUMNS], p.alias("_p"), error.alias("_parse_error")]
        return frame.select(
            jk.alias("_jk"),
            kind.cast("int").alias("_side"),
            ts.cast("bigint").alias("_ts"),
            F.col("partition").cast("int").alias("_partition"),
            F.col("offset").cast("bigint").alias("_offset"),
            F.col("_trow").cast(row).alias("_trow"),
            F.struct(*event).alias("_event"),
        )

    good = F.col("_error").isNull()
    kind = F.when(~from_table, EVENT).when(good, TABLE).otherwise(BAD)
    jk = F.when(from_table, F.col("_jk")).when(keyed, on.cast("string"))
    error = F.when(from_table, F.col("_error")).otherwise(F.col("_parse_error"))
    stamp = F.unix_millis(F.col("timestamp"))
    no_event = F.lit(None).cast(parsed)
    # A bad row restored from the copy cannot be: only good rows are written there.
    restored = seeded.where(good | (F.col("_side") == TABLE))
    replayed = side(table, kind, jk, stamp, F.col("_p"), error).unionByName(
        side(
            restored,
            F.when(good, F.col("_side")).otherwise(F.lit(BAD)),
            F.col("_jk"),
            F.lit(_FIRST_MS),
            no_event,
            F.col("_error"),
        )
    )
    spark = records.sparkSession
    jvm = spark._jvm
    assert jvm is not None
    out = Frame(jvm.duality.join.TableJoin.apply(replayed._jdf), spark)
    copied = F.col("_side") == TABLE
    carried = [c for c in (*KAFKA_COLUMNS, "_p", "_parse_error") if c not in ("key", "value")]
    return out.select(
        "_side",
        "_jk",
        "_ts",
        F.col("_trow").alias("_t"),
        *[F.col(f"_event.{c}") for c in carried],
        F.when(copied, F.col("_jk").cast("binary")).otherwise(F.col("_event.key")).alias("key"),
        F.when(copied, F.to_json("_trow").cast("binary"))
        .otherwise(F.col("_event.value"))
        .alias("value"),
    )


def table_scope(spec: PipelineSpec) -> dict[str, Column]:
    """The joined table's columns as the spec's expressions name them, read from `_t`."""
    from pyspark.sql import functions as F

    joined = spec.joined
    if joined is None:
        return {}
    return {f"{joined.name}.{c}": F.col("_t")[c] for c in joined.columns}
