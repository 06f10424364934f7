"""The joined table's rows when a stream starts without checkpoint: seed files that the query
reads before anything else (docs/streams.md#joins).

After a micro-batch has committed, they are the pipeline's own copy of the table
(`spec.table_topic`), written in each micro-batch's transaction and so exactly the rows the
committed offsets of the table's topic stand for, however much its own topic has been compacted
since. At a first start, after a reset (which empties the copy), or while the copy is empty,
they are the table's topic read to its end: the stream starts with the whole table, and the
first micro-batch writes it to the copy."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from duality import storage
from duality.config import Settings
from duality.join.frame import SEED, TABLE, seed_schema
from duality.kafka import offsets
from duality.spec import PipelineSpec
from duality.stream.seeding import make_folder

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def seed_folder(checkpoint: storage.Location) -> storage.Location:
    return checkpoint / "table-seed"


def seeds_stream(spark: SparkSession, checkpoint: storage.Location) -> DataFrame:
    folder = seed_folder(checkpoint)
    make_folder(folder)
    return spark.readStream.schema(seed_schema()).parquet(str(folder))


def write_seed(
    spark: SparkSession,
    settings: Settings,
    spec: PipelineSpec,
    checkpoint: storage.Location,
    committed: dict[int, int],
) -> tuple[int, dict[int, int]]:
    """Seed files of the table's rows, given the table topic's `committed` offsets (empty
    before the first commit); returns their number and where the stream reads the table's
    topic from."""
    from pyspark.sql import functions as F

    joined = spec.joined
    assert joined is not None
    copy = spec.table_topic
    copied = offsets.end_offsets(settings, copy, "read_committed")
    if committed and not offsets.is_empty(settings, copy, copied):
        topic, side, starts, ends = copy, SEED, committed, copied
    else:  # a first start, a reset (which empties the copy), or a table that was empty
        topic, side = joined.topic, TABLE
        ends = starts = offsets.end_offsets(settings, topic, "read_committed")
    folder = seed_folder(checkpoint)
    storage.remove_tree(folder)
    if offsets.is_empty(settings, topic, ends):
        make_folder(folder)
        return 0, starts
    raw = (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_source_options())
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", json.dumps({topic: {str(p): e for p, e in ends.items()}}))
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    # A key's latest record, in the order the join replays them: timestamp, partition, offset.
    order = F.struct("timestamp", "partition", "offset")
    record = F.struct("value", "partition", "offset")
    latest = raw.groupBy("key").agg(F.max_by(record, order).alias("r"))
    rows = latest.where(F.col("r.value").isNotNull()).select(
        "key", "r.value", "r.partition", "r.offset", F.lit(side).alias("_side")
    )
    # In place, as the stream's own seed (duality.stream.seeding.write_seed says why).
    rows.write.mode("overwrite").parquet(str(folder))
    return spark.read.parquet(str(folder)).count(), starts
