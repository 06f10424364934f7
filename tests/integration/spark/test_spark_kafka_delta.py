"""Spark's Kafka source (batch and stream) and Delta, against the real broker."""

from __future__ import annotations

import json
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from duality.config import Settings
from duality.kafka import client, offsets, topics
from tests.harness import read_topic

SCHEMA = StructType(
    [
        StructField("order_id", StringType()),
        StructField("product", StringType()),
        StructField("quantity", LongType()),
    ]
)


def _produce_orders(settings: Settings, topic: str, first: int, count: int) -> list[dict]:
    orders = [
        {"order_id": f"o{i}", "product": f"p{i % 13}", "quantity": i % 5 + 1}
        for i in range(first, first + count)
    ]
    producer = client.producer(settings)
    for order in orders:
        producer.produce(topic, key=order["product"], value=json.dumps(order))
    assert producer.flush(30) == 0, "producer did not deliver everything"
    return orders


def _parse(frame):  # type: ignore[no-untyped-def]
    return frame.select(
        F.from_json(F.col("value").cast("string"), SCHEMA).alias("o"), "partition", "offset"
    ).select("o.*", "partition", "offset")


def test_batch_read_with_bounded_offsets(settings: Settings, spark: SparkSession, topic: str):
    topics.create_topic(settings, topic, 3)
    first = _produce_orders(settings, topic, 0, 300)
    bound = offsets.end_offsets(settings, topic)
    assert sum(bound.values()) == 300
    _produce_orders(settings, topic, 300, 50)  # beyond the bound: must not be read

    frame = (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_options())
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", json.dumps({topic: {str(p): o for p, o in bound.items()}}))
        .load()
    )
    rows = [row.asDict() for row in _parse(frame).drop("partition", "offset").collect()]
    assert sorted(rows, key=lambda r: r["order_id"]) == sorted(first, key=lambda r: r["order_id"])


def test_stream_into_delta_and_resume(
    settings: Settings, spark: SparkSession, topic: str, tmp_path: Path
):
    topics.create_topic(settings, topic, 2)
    table = str(tmp_path / "orders")
    checkpoint = str(tmp_path / "checkpoint")

    def run_stream_once() -> None:
        source = (
            spark.readStream.format("kafka")
            .options(**settings.spark_kafka_options())
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .load()
        )
        query = (
            _parse(source)
            .writeStream.format("delta")
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start(table)
        )
        try:
            query.awaitTermination(120)
            assert query.exception() is None, query.exception()
            assert not query.isActive, "the availableNow query did not finish within 120s"
        finally:
            query.stop()

    first = _produce_orders(settings, topic, 0, 500)
    run_stream_once()
    stored = spark.read.format("delta").load(table)
    assert stored.count() == 500
    assert {r.order_id for r in stored.select("order_id").collect()} == {
        o["order_id"] for o in first
    }

    # The checkpoint remembers the offsets: a second run appends only the new records.
    second = _produce_orders(settings, topic, 500, 200)
    run_stream_once()
    stored = spark.read.format("delta").load(table)
    assert stored.count() == 700
    assert stored.select("order_id").distinct().count() == 700
    totals = {
        r.product: r.units
        for r in stored.groupBy("product").agg(F.sum("quantity").alias("units")).collect()
    }
    expected: dict[str, int] = {}
    for order in first + second:
        expected[order["product"]] = expected.get(order["product"], 0) + order["quantity"]
    assert totals == expected
    # Two commits in the Delta log, one per run.
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").collect()
    assert len(history) == 2


def test_python_and_spark_agree_on_partitions(settings: Settings, spark: SparkSession, topic: str):
    """Python producers use murmur2 like Java's partitioner, so a key lives in one place."""
    python_topic, spark_topic = topic + "-py", topic + "-spark"
    topics.create_topic(settings, python_topic, 7)
    topics.create_topic(settings, spark_topic, 7)
    keys = [f"customer-{i}" for i in range(200)]
    producer = client.producer(settings)
    for key in keys:
        producer.produce(python_topic, key=key, value=b"{}")
    assert producer.flush(30) == 0

    (
        spark.createDataFrame([(k, "{}") for k in keys], "key string, value string")
        .write.format("kafka")
        .options(**settings.spark_kafka_options())
        .option("topic", spark_topic)
        .save()
    )
    by_python = {k.decode(): p for p, _, k, _ in read_topic(settings, python_topic)}
    by_spark = {k.decode(): p for p, _, k, _ in read_topic(settings, spark_topic)}
    assert len(by_python) == len(by_spark) == 200
    assert by_python == by_spark
    assert len(set(by_python.values())) == 7  # the keys spread over every partition


def test_the_driver_jvm_maps_the_class_archive(spark: SparkSession):
    """`make setup` archived a driver's classes for this installation, and duality's session
    starts its JVM on them: the archive is mapped into the driver's memory (a JVM that rejects
    an archive, for another JDK or changed jars, does not map it)."""
    from duality.spark import CLASS_ARCHIVE

    assert CLASS_ARCHIVE.is_file(), "no class archive: `make setup` writes it"
    jvm = spark.sparkContext._gateway.proc  # type: ignore[union-attr]
    maps = Path(f"/proc/{jvm.pid}/maps").read_text()
    assert str(CLASS_ARCHIVE) in maps
