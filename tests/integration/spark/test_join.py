"""Streams that meet tables, against the real broker and Spark: a plain-Python oracle replays
the source and the table topic in the documented order (docs/streams.md#joins) and the
changelog, read_committed, must equal it, through a first start, micro-batches holding a table
update and an event of one key in both orders, a tombstone, a driver SIGKILLed, and a restart
without checkpoint after the table's topic was compacted."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from duality.config import Settings
from duality.kafka import client, topics
from duality.spec import PipelineSpec, load_spec
from duality.stream import heartbeat
from tests.harness import (
    StreamProcess,
    assert_eventually,
    duality_json,
    joined_covered,
    read_latest,
    read_messages,
)

SOURCE_PARTITIONS, TABLE_PARTITIONS = 6, 3
TIERS = ("gold", "silver", "bronze")


def _spec(folder: Path, join_type: str, key: str = "order_id") -> PipelineSpec:
    """A pipeline keyed by order (each changelog row tells which row its one event met), or by
    `key`."""
    name = f"j{uuid.uuid4().hex[:10]}"
    data: dict[str, Any] = {
        "name": name,
        "source": {
            "topic": f"{name}-orders",
            "schema": {"order_id": "string", "customer": "string", "quantity": "int"},
            "key": key,
        },
        "tables": {
            "customers": {
                "topic": f"{name}-customers",
                "schema": {"customer": "string", "tier": "string"},
                "key": "customer",
            }
        },
        "join": [{"table": "customers", "on": "customer", "type": join_type}],
        "aggregates": {
            "orders": "count()",
            **{tier: f"count_if(customers.tier = '{tier}')" for tier in TIERS},
            "no_row": "count_if(customers.tier is null)",
            # A table's column itself as an argument (its state column named without the dot).
            "tiers": "count_distinct(customers.tier)",
        },
        "changelog": {"partitions": 3},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


class Feed:
    """Records for the source and the table's topic, each phase in one transaction (so that
    the stream reads a phase in one micro-batch), kept for the oracle with their partitions,
    offsets and timestamps."""

    def __init__(self, settings: Settings, spec: PipelineSpec):
        assert spec.joined is not None
        self.spec, self.table = spec, spec.joined.topic
        self.producer = client.transactional_producer(settings, f"feed-{uuid.uuid4().hex}")
        self.phases: list[list[dict[str, Any]]] = []
        # Timestamps near now, or the brokers' time retention would delete the records.
        self.clock = 0
        self.orders = 0

    def phase(self, *records: tuple[str, str, str | None, int]) -> None:
        """(side, key, tier or customer, timestamp step) each: side "table" writes the key's
        row (a tombstone when the tier is None), "event" an order of customer `key`."""
        written: list[dict[str, Any]] = []
        # Now (not ahead: a segment with records from the future is not rolled, so not
        # compacted), and after the previous phase.
        self.clock = max(self.clock + 100, int(time.time() * 1000))
        self.producer.begin_transaction()
        for side, key, detail, step in records:
            ts = self.clock + step
            if side == "table":
                topic, value = self.table, None
                if detail is not None:
                    value = json.dumps({"customer": key, "tier": detail})
                record = {"side": side, "key": key, "tier": detail, "ts": ts}
                record_key = key
            else:
                self.orders += 1
                order = f"o{self.orders}"
                topic = self.spec.source.topic
                value = json.dumps({"order_id": order, "customer": key, "quantity": 1})
                record = {"side": side, "key": key, "order": order, "ts": ts}
                record_key = order

            def delivered(error: Any, message: Any, record: dict[str, Any] = record) -> None:
                assert error is None, error
                record["partition"], record["offset"] = message.partition(), message.offset()

            self.producer.produce(
                topic, key=record_key, value=value, timestamp=ts, on_delivery=delivered
            )
            written.append(record)
        self.producer.commit_transaction(60)
        self.phases.append(written)

    def bad_records(self, key: str) -> None:
        """A table record and an order that do not parse (in a phase of their own; the order
        has no join key, and passes the join's operator by)."""
        self.producer.begin_transaction()
        self.producer.produce(self.table, key=key, value=b"{not json")
        self.producer.produce(self.spec.source.topic, key="bad-order", value=b"{not json")
        self.producer.commit_transaction(60)


def oracle(feed: Feed, first_start_phases: int) -> dict[str, str | None]:
    """Each order's tier as the documented order gives it: the phases produced before the first
    start with the table read to its end first; every later phase (one micro-batch) replayed by
    timestamp, table records before events at equal times, then partition and offset."""
    rows: dict[str, str | None] = {}
    met: dict[str, str | None] = {}

    def replay(records: list[dict[str, Any]]) -> None:
        side = {"table": 1, "event": 2}
        ordered = sorted(
            records, key=lambda r: (r["ts"], side[r["side"]], r["partition"], r["offset"])
        )
        for record in ordered:
            if record["side"] == "table":
                rows[record["key"]] = record["tier"]
            else:
                met[record["order"]] = rows.get(record["key"])

    early = [r for phase in feed.phases[:first_start_phases] for r in phase]
    replay([r for r in early if r["side"] == "table"])
    replay([r for r in early if r["side"] == "event"])
    for phase in feed.phases[first_start_phases:]:
        replay(phase)
    return met


def _assert_changelog(settings: Settings, spec: PipelineSpec, met: dict[str, str | None]) -> None:
    assert spec.joined is not None
    latest = {k.decode(): v for k, v in read_latest(settings, spec).items()}
    inner = spec.joined.type == "inner"
    expected = {}
    for order, tier in met.items():
        if inner and tier is None:
            continue
        counts = {t: int(tier == t) for t in TIERS}
        expected[order] = {"orders": 1, **counts, "no_row": int(tier is None)}
        expected[order]["tiers"] = int(tier is not None)
    columns = ("orders", *TIERS, "no_row", "tiers")
    got = {k: {c: v[c] for c in columns} for k, v in latest.items()}
    assert got == expected


def test_a_left_join_meets_the_oracle_through_kills_and_a_lost_checkpoint(
    settings: Settings, tmp_path: Path
):
    pipelines = tmp_path / "pipelines"
    spec = _spec(pipelines, "left")
    assert spec.joined is not None
    topics.create_topic(settings, spec.source.topic, SOURCE_PARTITIONS)
    topics.create_topic(
        settings, spec.joined.topic, TABLE_PARTITIONS, config=topics.FAST_COMPACTION
    )
    feed = Feed(settings, spec)
    # Before the first start: rows, then orders, some of customers without a row.
    feed.phase(*[("table", f"c{i}", TIERS[i % 3], i) for i in range(12)])
    feed.phase(*[("event", f"c{i % 15}", None, i) for i in range(30)])
    first_start = len(feed.phases)
    stream = StreamProcess(settings, spec, pipelines, tmp_path / "stream.log")

    def caught_up() -> None:
        assert_eventually(
            lambda: stream.check() or joined_covered(settings, spec),
            timeout=240,
            message=f"the stream did not catch up; {stream.log}",
        )

    stream.start()
    try:
        caught_up()
        # One micro-batch, each order of update and event: c1 is updated before its order,
        # c2 after it; c13 gets a first row after its order; c0 is deleted before its order.
        feed.phase(
            ("table", "c1", "bronze", 5),
            ("event", "c1", None, 6),
            ("event", "c2", None, 5),
            ("table", "c2", "gold", 6),
            ("event", "c13", None, 3),
            ("table", "c13", "silver", 4),
            ("table", "c0", None, 1),
            ("event", "c0", None, 2),
            # At equal times, the table's record first.
            ("event", "c4", None, 7),
            ("table", "c4", "silver", 7),
        )
        caught_up()
        feed.bad_records("c5")
        # The table updated while the stream runs, then orders in micro-batches after it.
        feed.phase(*[("table", f"c{i}", "gold", i) for i in range(6, 9)])
        caught_up()
        feed.phase(*[("event", f"c{i}", None, i) for i in range(15)])
        caught_up()
        _assert_changelog(settings, spec, oracle(feed, first_start))

        # SIGKILLed mid-run: restarted on its checkpoint, still exact.
        feed.phase(*[("event", f"c{i}", None, i) for i in range(15)])
        stream.kill()
        feed.phase(("table", "c9", "bronze", 0), *[("event", f"c{i}", None, 1) for i in range(15)])
        stream.start()
        caught_up()
        _assert_changelog(settings, spec, oracle(feed, first_start))

        # Stopped; the table's topic compacted (c1's and c2's first rows gone); the
        # checkpoint lost: the rows come back from the pipeline's copy, as committed.
        stream.stop()
        feed.phase(("table", "c1", "silver", 0), ("table", "c2", "bronze", 1))
        assert_eventually(
            lambda: _compacted(settings, spec.joined.topic if spec.joined else ""),
            timeout=120,
            message="the table's topic was not compacted",
        )
        shutil.rmtree(settings.checkpoint_root / spec.name)
        # Events of the same phase as new rows: they meet them in the documented order.
        feed.phase(
            ("event", "c3", None, 0),
            ("table", "c3", "bronze", 1),
            *[("event", f"c{i}", None, 2) for i in range(15)],
        )
        stream.start()
        caught_up()
        _assert_changelog(settings, spec, oracle(feed, first_start))
    finally:
        stream.kill()

    # The bad table record went to the dead-letter topic with its reason and the table's name,
    # the bad order with its own.
    dead = read_messages(settings, spec.dlq_topic)
    reasons = {
        dict(m.headers() or [])["duality.source.topic"].decode(): (
            dict(m.headers() or [])["duality.error"].decode(),
            m.value(),
        )
        for m in dead
    }
    assert len(dead) == 2, reasons
    reason, value = reasons[spec.joined.topic]
    assert reason.startswith(
        f"table customers (topic {spec.joined.topic}): malformed JSON or not a JSON object"
    )
    assert value == b"{not json"
    reason, value = reasons[spec.source.topic]
    assert reason.startswith("malformed JSON") and value == b"{not json", reason


def _compacted(settings: Settings, topic: str) -> bool:
    """Whether compaction has removed c1's and c2's superseded records from `topic` (a filler
    record in each partition rolls its active segment meanwhile)."""
    producer = client.producer(settings)
    for partition in range(TABLE_PARTITIONS):
        key = f"filler{partition}"
        value = json.dumps({"customer": key, "tier": "x"})
        producer.produce(topic, key=key, value=value, partition=partition)
    producer.flush(10)
    keys = Counter(m.key() for m in read_messages(settings, topic))
    return keys[b"c1"] == 1 and keys[b"c2"] == 1


def test_an_inner_join_by_tier_counts_unmatched_events_and_resets(
    settings: Settings, tmp_path: Path
):
    """Keyed by the table's column: unmatched events are counted, not aggregated nor
    dead-lettered; after `duality reset`, the source is read again against the table as it is
    now (read to its end at the start)."""
    pipelines = tmp_path / "pipelines"
    spec = _spec(pipelines, "inner", key="customers.tier")
    assert spec.joined is not None
    topics.create_topic(settings, spec.source.topic, SOURCE_PARTITIONS)
    topics.create_topic(
        settings, spec.joined.topic, TABLE_PARTITIONS, config=topics.FAST_COMPACTION
    )
    feed = Feed(settings, spec)
    feed.phase(*[("table", f"c{i}", TIERS[i % 3], i) for i in range(6)])
    feed.phase(*[("event", f"c{i % 9}", None, i) for i in range(27)])  # c6-c8: no row
    stream = StreamProcess(settings, spec, pipelines, tmp_path / "stream.log")

    def by_tier(met: dict[str, str | None]) -> dict[str, int]:
        return dict(Counter(tier for tier in met.values() if tier is not None))

    def caught_up() -> None:
        assert_eventually(
            lambda: stream.check() or joined_covered(settings, spec),
            timeout=240,
            message=f"the stream did not catch up; {stream.log}",
        )

    def changelog() -> dict[str, int]:
        return {k.decode(): v["orders"] for k, v in read_latest(settings, spec).items()}

    stream.start()
    try:
        caught_up()
        assert changelog() == by_tier(oracle(feed, 2))
        beat = heartbeat.latest(settings)[spec.name]
        assert beat["unmatched"] == 9 and beat["dead_lettered"] == 0, beat
        # The table changes while the stream is stopped; a reset reads the source again.
        stream.stop()
        feed.phase(("table", "c6", "gold", 0), ("table", "c0", "bronze", 1))
        done = duality_json(settings.replace(pipelines=pipelines), "reset", spec.name)
        assert any(spec.table_topic in step for step in done["steps"]), done
        stream.start()
        caught_up()
        # Every order now meets the table as it stands at the restart.
        rows = {f"c{i}": TIERS[i % 3] for i in range(6)} | {"c6": "gold", "c0": "bronze"}
        orders = [r for phase in feed.phases for r in phase if r["side"] == "event"]
        met = Counter(rows[o["key"]] for o in orders if o["key"] in rows)
        assert changelog() == dict(met)

        # Rescaled to 3 state partitions: the join's rows come back from the pipeline's copy of
        # the table, the aggregation's from the changelog; later orders meet a later row.
        stream.stop()
        path = pipelines / f"{spec.name}.yaml"
        path.write_text(yaml.safe_dump(yaml.safe_load(path.read_text()) | {"parallelism": 3}))
        done = duality_json(settings.replace(pipelines=pipelines), "stream", "rescale", spec.name)
        assert done["partitions_before"] != 3 and done["partitions"] == 3, done
        assert any(spec.table_topic in step for step in done["steps"]), done
        feed.phase(("table", "c7", "silver", 0), *[("event", f"c{i}", None, 1) for i in range(9)])
        stream.start()
        caught_up()
        rows["c7"] = "silver"
        assert changelog() == dict(
            met + Counter(rows[f"c{i}"] for i in range(9) if f"c{i}" in rows)
        )
    finally:
        stream.kill()
    assert read_messages(settings, spec.dlq_topic) == []
