"""The Avro source's scenario of `make bench` (the `avro` group; issue #50).

- `stream-avro`: stream-throughput's backlog (the same 1,000,000 events) written as Avro in the
  Confluent wire format (a magic byte, the schema id, the binary record; fastavro encodes them
  in the bench process) into a topic of its own, its schema registered in a schema registry the
  group starts (Apicurio, as `duality up --schema-registry` runs it, under the run's scratch
  folder; stopped when the group ends), and consumed by the same plain pipeline with `format:
  avro` and the same `schema:` (the reader schema); cold, started as users start it, timed as
  `stream-throughput` is. Target: at least 1.0x `stream-throughput` (Avro decoding costs no
  more than JSON parsing).

Without the `streams` (or `join`) group, `stream-throughput` is measured here first, as the join
group does (bench/joins.py, `cold_throughput`), so that the ratio is of one run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fastavro

from baselines import Figure, order_events, preload
from duality.avro.registry import Registry
from duality.avro.writer import confluent_frame
from duality.kafka import topics
from duality.local.schema_registry import LocalSchemaRegistry
from duality.stream.options import MAX_OFFSETS_PER_TRIGGER
from streaming import (
    PARTITIONS,
    Bench,
    StreamFigure,
    bench_spec,
    cold_throughput,
    consume_backlog,
    set_throughput_ratio,
)

AVRO_TARGET = 1.0  # stream-avro records/s over stream-throughput's

# The writer schema of order_events' records: their fields and types as the product_sales
# spec reads them; `ts`, which the events leave out, nullable with a null default.
ORDER_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Order",
    "namespace": "dev.duality.bench",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "product", "type": "string"},
        {"name": "customer", "type": "string"},
        {"name": "quantity", "type": "long"},
        {"name": "amount", "type": "double"},
        {
            "name": "ts",
            "type": ["null", {"type": "long", "logicalType": "timestamp-millis"}],
            "default": None,
        },
    ],
}


def avro_events(events: list[tuple[bytes, bytes]], schema_id: int) -> Iterator[tuple[bytes, bytes]]:
    """The JSON events as Confluent frames of the same records, generated lazily."""
    parsed = fastavro.parse_schema(ORDER_SCHEMA)
    for key, value in events:
        yield key, confluent_frame(schema_id, parsed, json.loads(value))


def avro_scenarios(
    bench: Bench,
    source: str,
    records: int,
    keys: int,
    megabytes: float,
    throughput: Figure | None,
) -> list[Figure]:
    """`stream-avro` against `throughput` (the run's `stream-throughput`; measured here first
    when None)."""
    settings, progress = bench.settings, bench.progress
    figures: list[Figure] = []
    if throughput is None:
        throughput = cold_throughput(bench, source, records, keys, megabytes, "avro group")
        figures.append(throughput)

    registry = LocalSchemaRegistry(settings)
    progress.console.print("starting a schema registry for the Avro source")
    status = registry.start()
    try:
        scoped = settings.replace(schema_registry_url=status.url)
        avro_bench = Bench(scoped, bench.pipelines, bench.logs, progress, bench.stamp)
        topic = f"bench-avro-{bench.stamp}"
        schema_id = Registry(scoped).register(f"{topic}-value", ORDER_SCHEMA)
        topics.create_topic(scoped, topic, PARTITIONS)
        progress.console.print(f"the same backlog as Avro (schema id {schema_id})")
        avro_megabytes = preload(
            scoped,
            topic,
            avro_events(order_events(records, keys), schema_id),
            progress,
            total=records,
        )
        spec = bench_spec(f"bench_avro_{bench.stamp}", topic, bench.pipelines, avro=scoped)
        point = consume_backlog(avro_bench, spec, keys, avro_megabytes, "stream-avro", 0)
    finally:
        registry.stop()
    avro = StreamFigure(
        "stream-avro",
        point.events,
        point.seconds,
        avro_megabytes,
        details={
            "keys": keys,
            "avro_megabytes": round(avro_megabytes, 3),
            "json_megabytes": round(megabytes, 3),
            "startup_seconds": round(point.startup_seconds, 3),
            "peak_rss_mb": round(point.peak_rss_mb, 1),
            "max_offsets_per_trigger": MAX_OFFSETS_PER_TRIGGER,
        },
    )
    set_throughput_ratio(
        avro,
        throughput,
        AVRO_TARGET,
        f"the same events as Avro ({avro_megabytes:.1f} MB against JSON's {megabytes:.1f} MB), "
        "schema from the registry",
    )
    figures.append(avro)
    progress.console.print(
        f"stream-avro: {avro.records:,} records in {avro.seconds:.2f} s "
        f"({avro.records_per_s:,.0f}/s; stream-throughput {throughput.seconds:.2f} s): {avro.note}"
    )
    return figures
