"""`spark-aggregation`, a baseline of `make bench`: Spark's own streaming aggregation of a topic.

Run as a process of its own, as the stream is (a new JVM each time), with duality's Spark
session (RocksDB state store, the same partitions and driver memory as a stream): one
`from_json`, `groupBy(key).agg()` in Update mode (`spec_table`), each changed row written as
JSON by Spark's Kafka sink, micro-batches of at most MAX_OFFSETS records until the topic's
backlog is consumed. It classifies nothing, dead-letters nothing and writes no transaction:
what the stream costs beyond it is what duality adds. Prints one JSON line: the records read and
the seconds from the query's start to its end.

    python bench/spark_aggregation.py PIPELINE_SPEC.yaml TARGET_TOPIC CHECKPOINT MAX_OFFSETS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from duality.config import Settings
from duality.schema import SQL_TYPES
from duality.spark import session
from duality.spec import PipelineSpec, load_spec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def spec_table(spec: PipelineSpec, raw: DataFrame) -> DataFrame:
    """The spec's aggregates per key computed by Spark alone from raw Kafka rows: one
    `from_json`, records missing a field the pipeline uses left out, `groupBy().agg()`. Also
    what `recompute-from-source` runs as a batch."""
    from pyspark.sql import functions as F

    ddl = ", ".join(f"`{name}` {SQL_TYPES[kind]}" for name, kind in spec.source.fields.items())
    events = raw.select(F.from_json(F.col("value").cast("string"), ddl).alias("e")).select("e.*")
    for name in [*spec.source.key, *(a.field for a in spec.aggregates.values() if a.field)]:
        events = events.where(F.col(name).isNotNull())
    functions = {"sum": F.sum, "min": F.min, "max": F.max, "avg": F.avg}
    columns = [
        (F.count(F.lit(1)) if a.function == "count" else functions[a.function](a.field)).alias(c)
        for c, a in spec.aggregates.items()
    ]
    return events.groupBy(*spec.source.key).agg(*columns)


def main(spec_file: str, target: str, checkpoint: str, max_offsets: str) -> int:
    from pyspark.sql import functions as F

    settings = Settings.from_env()
    spec = load_spec(Path(spec_file))
    spark = session(
        settings,
        "duality-bench-spark-aggregation",
        {"spark.driver.memory": settings.stream_driver_memory},
    )
    raw = (
        spark.readStream.format("kafka")
        .options(**settings.spark_kafka_source_options())
        .option("subscribe", spec.source.topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", max_offsets)
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    table = spec_table(spec, raw)
    key = F.to_json(F.array(*[F.col(k).cast("string") for k in spec.source.key]))
    if len(spec.source.key) == 1:
        key = F.col(spec.source.key[0]).cast("string")
    output = table.select(key.alias("key"), F.to_json(F.struct(*table.columns)).alias("value"))
    started = time.perf_counter()
    query = (
        output.writeStream.format("kafka")
        .options(**settings.spark_kafka_options())
        .option("topic", target)
        .option("checkpointLocation", checkpoint)
        .outputMode("update")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - started
    records = sum(progress["numInputRows"] for progress in query.recentProgress)
    print(json.dumps({"records": records, "seconds": round(seconds, 3)}), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
