"""The stream-table join's scenarios of `make bench` (the `join` group; issue #47).

- `stream-join`: stream-throughput's backlog (the same events, preloaded into a topic of their
  own) through the same plain pipeline plus a LEFT join on the events' product with a table of
  as many rows as the backlog has keys (100,000 by default: every event meets a row), read from a
  compacted topic created and filled before the stream starts, and an aggregate of the table's
  `list_price` (`sum(quantity * products.list_price)`), so the join's output is used. Started
  as users start it, cold, timed as stream-throughput is: from the query's first `running`
  heartbeat until the committed offsets cover the backlog (the driver reads the table's topic to
  its end before its query starts, so outside that time, which `startup_seconds` includes; the
  first micro-batch stores the rows). Target: at least 0.6x `stream-throughput`.
- `stream-join-state`: the join's state with a table of 1,000,000 rows, beside a modest backlog
  (100,000 events over the table's keys): the rows and memory the join's state operator reports
  (the heartbeat's `join_state_rows`, `join_state_memory_bytes`, `join_state_sst_bytes`, from
  progress.stateOperators), and the peak RSS of the stream's process tree.

Without the `streams` group, `stream-throughput` is measured here (`cold_throughput`), so that
the ratio is of one run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from baselines import Figure, order_events, preload
from duality.kafka import topics
from duality.stream.options import MAX_OFFSETS_PER_TRIGGER
from streaming import (
    PARTITIONS,
    Bench,
    Point,
    StreamFigure,
    bench_spec,
    cold_throughput,
    consume_backlog,
    set_throughput_ratio,
)

JOIN_TARGET = 0.6  # stream-join records/s over stream-throughput's
STATE_TABLE_ROWS = 1_000_000
STATE_EVENTS = 100_000
# A compacted topic, as a table's topic is; the defaults otherwise (nothing is compacted during
# the run: every key is written once).
TABLE_TOPIC_CONFIG = {"cleanup.policy": "compact"}


def table_rows(rows: int, seed: int = 47) -> Iterator[tuple[bytes, bytes]]:
    """`rows` rows of the `products` table, keyed as order_events draws products
    (`p000000`...), generated lazily."""
    rng = random.Random(seed)
    for i in range(rows):
        product = f"p{i:06d}"
        value = (
            f'{{"product":"{product}","category":"k{i % 50:02d}",'
            f'"list_price":{rng.randrange(100, 50_000) / 100}}}'
        )
        yield product.encode(), value.encode()


def _joined_backlog(
    bench: Bench,
    tag: str,
    events: list[tuple[bytes, bytes]],
    rows: int,
    label: str,
) -> tuple[Point, float, float]:
    """The events in a topic of their own and `rows` table rows in a compacted topic, both
    before the stream starts; then the joined stream over them. (point, MB of events, MB of
    the table)."""
    settings, progress = bench.settings, bench.progress
    topic = f"bench-{tag}-{bench.stamp}"
    table_topic = f"bench-{tag}-products-{bench.stamp}"
    topics.create_topic(settings, topic, PARTITIONS)
    topics.create_topic(settings, table_topic, PARTITIONS, config=TABLE_TOPIC_CONFIG)
    table_megabytes = preload(settings, table_topic, table_rows(rows), progress, total=rows)
    megabytes = preload(settings, topic, events, progress)
    spec = bench_spec(
        f"bench_{tag.replace('-', '_')}_{bench.stamp}",
        topic,
        bench.pipelines,
        table_topic=table_topic,
    )
    point = consume_backlog(bench, spec, rows, megabytes, label, 0, join_rows=rows)
    return point, megabytes, table_megabytes


def join_scenarios(
    bench: Bench,
    source: str,
    records: int,
    keys: int,
    megabytes: float,
    throughput: Figure | None,
) -> list[Figure]:
    """`stream-join` against `throughput` (the run's `stream-throughput`; measured here first
    when None), then `stream-join-state`."""
    progress = bench.progress
    figures: list[Figure] = []
    if throughput is None:
        throughput = cold_throughput(bench, source, records, keys, megabytes, "join group")
        figures.append(throughput)

    progress.console.print(f"the same backlog through a left join on a table of {keys:,} rows")
    point, join_mb, table_mb = _joined_backlog(
        bench, "join", order_events(records, keys), keys, "stream-join"
    )
    join = StreamFigure(
        "stream-join",
        point.events,
        point.seconds,
        join_mb,
        details={
            "keys": keys,
            "table_rows": keys,
            "table_megabytes": round(table_mb, 3),
            "startup_seconds": round(point.startup_seconds, 3),
            "peak_rss_mb": round(point.peak_rss_mb, 1),
            "join_state_rows": point.heartbeat.get("join_state_rows"),
            "join_state_memory_bytes": point.heartbeat.get("join_state_memory_bytes"),
            "join_state_sst_bytes": point.heartbeat.get("join_state_sst_bytes"),
            "state_rows": point.heartbeat.get("state_rows"),
            "max_offsets_per_trigger": MAX_OFFSETS_PER_TRIGGER,
        },
    )
    set_throughput_ratio(
        join,
        throughput,
        JOIN_TARGET,
        f"a left join on a table of {join.details.get('table_rows', 0):,} rows, its list_price "
        "in an aggregate",
    )
    figures.append(join)
    progress.console.print(
        f"stream-join: {join.records:,} records in {join.seconds:.2f} s "
        f"({join.records_per_s:,.0f}/s; stream-throughput {throughput.seconds:.2f} s): {join.note}"
    )

    rows = max(STATE_TABLE_ROWS, keys)
    events = min(STATE_EVENTS, records)
    progress.console.print(
        f"the join's state: a table of {rows:,} rows, {events:,} events over its keys"
    )
    point, state_mb, table_mb = _joined_backlog(
        bench, "join-state", order_events(events, rows, seed=48), rows, "stream-join-state"
    )
    beat = point.heartbeat
    memory = beat.get("join_state_memory_bytes")
    sst = beat.get("join_state_sst_bytes")
    figures.append(
        StreamFigure(
            "stream-join-state",
            point.events,
            point.seconds,
            state_mb,
            details={
                "table_rows": rows,
                "table_megabytes": round(table_mb, 3),
                "join_state_rows": beat.get("join_state_rows"),
                "join_state_memory_bytes": memory,
                "join_state_sst_bytes": sst,
                "state_rows": beat.get("state_rows"),
                "startup_seconds": round(point.startup_seconds, 3),
                "peak_rss_mb": round(point.peak_rss_mb, 1),
                "covered_rss_mb": round(point.covered_rss_mb, 1),
                "peak_rss_parts_mb": point.peak_rss_parts,
            },
            note=(
                f"table of {rows:,} rows: join state {_count(beat.get('join_state_rows'))} "
                f"rows, {_mb(memory)} MB memory, {_mb(sst)} MB of SST files; peak RSS "
                f"{point.peak_rss_mb:,.0f} MB"
            ),
        )
    )
    return figures


def _count(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "?"


def _mb(value: object) -> str:
    return f"{value / 1e6:,.1f}" if isinstance(value, int | float) else "?"
