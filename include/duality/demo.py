"""`duality demo`: a short tour of the stack on whatever broker the settings name.

It produces a batch of orders, reads them back with Spark's Kafka source over fixed offsets,
keeps per-product totals in a Delta table under the warehouse, and reports what it did.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress

from duality import kafka
from duality.config import Settings
from duality.errors import UsageError

DEMO_TOPIC = "demo-orders"
_PRODUCTS = [f"product-{i:02d}" for i in range(20)]


def run(settings: Settings, events: int, console: Console) -> dict[str, Any]:
    if events < 1:
        raise UsageError(f"--events must be at least 1, got {events}")
    kafka.ensure_reachable(settings)
    kafka.create_topic(settings, DEMO_TOPIC, 3, exist_ok=True)
    before = kafka.end_offsets(settings, DEMO_TOPIC)

    rng = random.Random()
    producer = kafka.producer(settings)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"producing {events:,} orders to {DEMO_TOPIC}", total=events)
        for i in range(events):
            # A skewed choice of product, as real sales are.
            product = _PRODUCTS[min(int(rng.paretovariate(1.2)) - 1, len(_PRODUCTS) - 1)]
            order = {
                "order_id": f"{time.time_ns()}-{i}",
                "product": product,
                "quantity": rng.randint(1, 5),
                "amount": round(rng.uniform(1, 200), 2),
            }
            kafka.send(producer, DEMO_TOPIC, key=product, value=json.dumps(order))
            if i % 5000 == 0:
                producer.poll(0)
                progress.update(task, completed=i)
        undelivered = producer.flush(60)
    if undelivered:
        raise UsageError(f"{undelivered} demo records were not delivered to {DEMO_TOPIC}")
    after = kafka.end_offsets(settings, DEMO_TOPIC)

    from pyspark.sql import functions as F

    from duality.spark import session

    with console.status("reading the new orders with Spark and writing a Delta table"):
        spark = session(settings, "duality-demo")
        frame = (
            spark.read.format("kafka")
            .options(**settings.spark_kafka_options())
            .option("subscribe", DEMO_TOPIC)
            .option(
                "startingOffsets", json.dumps({DEMO_TOPIC: {str(p): o for p, o in before.items()}})
            )
            .option(
                "endingOffsets", json.dumps({DEMO_TOPIC: {str(p): o for p, o in after.items()}})
            )
            .load()
        )
        schema = "order_id string, product string, quantity long, amount double"
        totals = (
            frame.select(F.from_json(F.col("value").cast("string"), schema).alias("o"))
            .groupBy("o.product")
            .agg(
                F.count("*").alias("orders"),
                F.sum("o.quantity").alias("units"),
                F.round(F.sum("o.amount"), 2).alias("revenue"),
            )
        )
        table = str(settings.warehouse / "demo_product_sales")
        totals.write.format("delta").mode("overwrite").save(table)
        rows = spark.read.format("delta").load(table).orderBy(F.desc("orders")).collect()
    return {
        "topic": DEMO_TOPIC,
        "produced": events,
        "offsets": {"from": before, "to": after},
        "delta_table": table,
        "products": [row.asDict() for row in rows],
    }
