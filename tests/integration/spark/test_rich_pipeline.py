"""A pipeline using every construct of issue #29 (computed fields, a filter, a key on a computed
field, every aggregate, every function of the expression language, a hopping window) against a
ground truth written by hand in plain Python: its expressions, classification, filter, windows
and lateness are recomputed here from the source records, independently of duality's code."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import shutil
import statistics
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

from duality import validate
from duality.config import Settings
from duality.kafka import client, records, topics
from duality.snapshot import build
from duality.spec import PipelineSpec, load_spec
from tests import truth
from tests.harness import (
    StreamProcess,
    assert_eventually,
    read_latest,
    read_messages,
    read_topic,
    unique_name,
)

SPEC = """
name: NAME
source:
  topic: NAME-source
  schema: {order_id: string, region: string, customer: string, status: string,
           quantity: long, units: int, price: double, scale: double, ts: timestamp}
  key: [region, band]
  event_time: ts
fields:
  revenue: quantity * price
  band: "case when price >= 100 then 'premium' when price >= 5.0 then 'standard' end"
  per_unit: quantity / units
  micro: quantity * 1000000000000
  scaled: price * scale
  tag: upper(substr(concat(lower(region), '-', status), 1, 6))
where: >-
  status in ('paid', 'shipped') and quantity between 1 and 1000000000
  and not (customer = 'test' or customer is null)
  and coalesce(case when units = 3 then price > 50 else null end, true)
aggregates:
  orders: count()
  revenue: sum(revenue)
  avg_line: avg(quantity * price)
  customers: count_distinct(customer)
  last_price: latest(price)
  first_price: earliest(price)
  price_sd: stddev(price)
  bulk: count_if(quantity >= 10 and per_unit > 1.5 or units <= 1)
  low: min(round(price, 1))
  high: max(abs(-scaled) + ceil(price) - floor(price))
  biggest: max(micro)
  tag_length: max(length(tag))
  odd: sum(1000 % (quantity - 13))
  many: avg(case when units > 5 then per_unit end)
  units: sum(units % 4 + 1)
  cheap: count_if(price < 20 and tag != 'X' and tag <> 'Y' and price > 0 and units is not null)
window: {size: 20 minutes, slide: 5 minutes, watermark: 10 minutes}
changelog: {partitions: 3}
"""
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1
T0 = datetime(2026, 3, 1, tzinfo=UTC).timestamp()
REGIONS = ["north", "south", "east", "west", "centre"]
REGION_WEIGHTS = [60, 20, 10, 6, 4]  # skewed
STATUSES = ["paid"] * 6 + ["shipped"] * 2 + ["cancelled", "pending"]


def _spec(folder: Path, name: str) -> PipelineSpec:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(SPEC.replace("NAME", name))
    return load_spec(path)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def workload(count: int, start: int, seed: int) -> list[bytes]:
    """Orders whose event time advances 2 s a record, with late ones, run-time errors and bad
    records of every kind among them."""
    rng = random.Random(seed)
    records: list[bytes] = []
    for i in range(start, start + count):
        now = T0 + 2 * i
        order: dict[str, Any] = {
            "order_id": f"o{i}",
            "region": rng.choices(REGIONS, REGION_WEIGHTS)[0],
            "customer": f"c{int(rng.paretovariate(1.2)) % 400}",
            "status": rng.choice(STATUSES),
            "quantity": rng.randint(1, 20),
            "units": rng.randint(1, 9),
            "price": round(rng.uniform(1, 200), 6),
            "scale": 1.0,
            "ts": _iso(now - rng.uniform(0, 60)),
        }
        roll = rng.random()
        if roll < 0.04:  # late for some or all of its windows
            order["ts"] = _iso(now - rng.uniform(600, 2400))
        elif roll < 0.05:
            order["units"] = 0  # '/' by zero
        elif roll < 0.06:
            order["quantity"] = 10**8  # long overflow
        elif roll < 0.07:
            order["scale"] = 1e307  # an infinite double
        elif roll < 0.075:
            order["customer"] = "test"
        value = json.dumps(order).encode()
        if 0.07 <= roll < 0.09:
            value = rng.choice(
                [
                    value[:-2],  # malformed
                    value + b" {}",  # trailing text
                    json.dumps({k: v for k, v in order.items() if k != "price"}).encode(),
                    json.dumps({**order, "quantity": "7"}).encode(),  # wrong type
                    value.replace(b'"scale": 1.0', b'"scale": NaN'),  # not finite
                    b"[1, 2]",  # not an object
                ]
            )
        records.append(value)
    return records


# -- the ground truth, in plain Python ----------------------------------------------------------


def _ts_ms(text: str) -> int:
    """Epoch milliseconds, in whole numbers (a float's product may fall short by one)."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


def evaluate(order: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """(reason, values): the dead-letter reason, or None and the record's values (None when
    the filter skips it): this test's spec, by hand."""
    q, units, price, scale = order["quantity"], order["units"], order["price"], order["scale"]
    region, status, customer = order["region"], order["status"], order["customer"]
    revenue = q * price
    band = "premium" if price >= 100 else "standard" if price >= 5.0 else None
    if units == 0:
        return "fields.per_unit: position 10: '/' by zero", None
    per_unit = q / units
    micro = q * 10**12
    if not LONG_MIN <= micro <= LONG_MAX:
        return "fields.micro: position 10: '*': long overflow", None
    scaled = price * scale
    if not math.isfinite(scaled):
        return "fields.scaled: position 7: '*' gives a NaN or infinite double", None
    tag = (region.lower() + "-" + status)[:6].upper()
    if band is None:
        return "null key field band", None
    kept = (
        status in ("paid", "shipped")
        and 1 <= q <= 10**9
        and customer != "test"
        and (price > 50 if units == 3 else True)
    )
    if not kept:
        return None, None
    if q == 13:
        return "aggregates.odd: position 10: '%' by zero", None
    rounded = float(Decimal(repr(price)).quantize(Decimal("0.1"), ROUND_HALF_UP))
    values = {
        "key": (region, band),
        "revenue": revenue,
        "avg_line": q * price,
        "customer": customer,
        "price": price,
        "bulk": (q >= 10 and per_unit > 1.5) or units <= 1,
        "low": rounded,
        "high": abs(-scaled) + math.ceil(price) - math.floor(price),
        "biggest": micro,
        "tag_length": len(tag),
        "odd": int(math.fmod(1000, q - 13)),  # SQL's %: the sign of the dividend
        "many": per_unit if units > 5 else None,
        "units": units % 4 + 1,
        "cheap": price < 20 and tag not in ("X", "Y") and price > 0,
    }
    return None, values


@dataclasses.dataclass
class Expected:
    table: dict[tuple, dict[str, Any]]
    dead: dict[tuple[int, int], str]  # (partition, offset) -> reason
    filtered: int
    late_windows: int
    distinct: dict[tuple, int]  # exact distinct customers per key


SIZE, SLIDE, DELAY = 20 * 60_000, 5 * 60_000, 10 * 60_000


def watermarks(
    spec: PipelineSpec, records: list[truth.Record], queries: list[list[truth.Batch]]
) -> list[int]:
    """Each micro-batch's watermark, recomputed from the records as Spark defines it: the
    largest event time of the good records (kept by the filter, no error) of the query's
    earlier micro-batches minus the delay, never going back. Only each batch's end offsets
    come from the checkpoints (`queries`: one list of batches per query, in order); a
    restart from the checkpoint continues its query's watermark, and a query started after
    the checkpoint was lost starts without one, its first micro-batch also reading the state
    seeded from the changelog, whose rows carry their windows' starts as event times."""
    batches = [b for query in queries for b in query]
    latest: dict[int, int] = {}  # the largest good event time, by batch
    for partition, offset, _, value in records:
        index = next(i for i, b in enumerate(batches) if offset < b.end_offsets[partition])
        reason, document = truth.classify_record(spec, value)
        if reason is not None or evaluate(document)[1] is None:
            continue
        latest[index] = max(_ts_ms(document["ts"]), latest.get(index, LONG_MIN))
    result: list[int] = []
    seen = LONG_MIN  # the largest good event time of the earlier queries
    for number, query in enumerate(queries):
        # The windows seeded from the changelog: the latest of them starts at the slide
        # holding the largest event time counted before (that record is never late).
        most = seen - seen % SLIDE if number > 0 and seen > LONG_MIN else LONG_MIN
        watermark = 0
        for index in range(len(result), len(result) + len(query)):
            result.append(watermark)
            most = max(most, latest.get(index, LONG_MIN))
            if most > LONG_MIN:
                watermark = max(watermark, most - DELAY)
        seen = max([seen, *(latest.get(i, LONG_MIN) for i in range(len(result)))])
    return result


def expected(
    spec: PipelineSpec, records: list[truth.Record], queries: list[list[truth.Batch]]
) -> Expected:
    """Each record's micro-batch (from the checkpoints' offset logs: `queries`, one list of
    batches per query) gives its watermark, recomputed (`watermarks`); each (record, window)
    pair whose window ended by then is dropped, and a record with all its pairs dropped is
    dead-lettered as late."""
    records = sorted(records, key=lambda r: (r[0], r[1]))
    batches = [b for query in queries for b in query]
    recomputed = watermarks(spec, records, queries)
    # The product's own record of them agrees (Spark's offset log).
    recorded = [b.watermark_ms for b in batches]
    assert recorded == recomputed, [
        (i, r, w) for i, (r, w) in enumerate(zip(recorded, recomputed, strict=True)) if r != w
    ][:5]
    groups: dict[tuple, list[tuple[tuple[int, int, int], dict[str, Any]]]] = defaultdict(list)
    result = Expected({}, {}, 0, 0, {})
    for partition, offset, _, value in records:
        index = next(i for i, b in enumerate(batches) if offset < b.end_offsets[partition])
        watermark = recomputed[index]
        reason, document = truth.classify_record(spec, value)
        values = None
        if reason is None:
            assert document is not None
            reason, values = evaluate(document)
        if reason is None and values is None:
            result.filtered += 1
            continue
        if reason is None:
            assert values is not None and document is not None
            ts = _ts_ms(document["ts"])
            last_start = ts - ts % SLIDE
            starts = [s for s in range(last_start - SIZE + SLIDE, last_start + 1, SLIDE)]
            alive = [s for s in starts if s + SIZE > watermark]
            if not alive:
                reason = "late event"
            result.late_windows += len(starts) - len(alive) if alive else 0
            for start in alive:
                window = _iso(start / 1000)
                groups[(*values["key"], window)].append(((ts, partition, offset), values))
        if reason is not None:
            result.dead[(partition, offset)] = reason
    for key, rows in groups.items():
        values = [v for _, v in rows]
        prices = [v["price"] for v in values]
        many = [v["many"] for v in values if v["many"] is not None]
        ordered = sorted(rows, key=lambda r: r[0])
        result.table[key] = {
            "orders": len(values),
            "revenue": sum(v["revenue"] for v in values),
            "avg_line": sum(v["avg_line"] for v in values) / len(values),
            "last_price": ordered[-1][1]["price"],
            "first_price": ordered[0][1]["price"],
            "price_sd": statistics.stdev(prices) if len(prices) > 1 else None,
            "bulk": sum(1 for v in values if v["bulk"]),
            "low": min(v["low"] for v in values),
            "high": max(v["high"] for v in values),
            "biggest": max(v["biggest"] for v in values),
            "tag_length": max(v["tag_length"] for v in values),
            "odd": sum(v["odd"] for v in values),
            "many": sum(many) / len(many) if many else None,
            "units": sum(v["units"] for v in values),
            "cheap": sum(1 for v in values if v["cheap"]),
        }
        result.distinct[key] = len({v["customer"] for v in values})
    return result


# -- the tests ----------------------------------------------------------------------------------


def test_frame_restores_from_its_state(local_spark, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Broker-free: the query frame of every construct compiles and runs in batch; the rows
    seeded from its changelog values, merged with later records, give what all the records
    give at once (sketches, latest and earliest included)."""
    from pyspark.sql import functions as F

    from duality.stream.query import build_query_frame, rows_schema
    from duality.stream.seeding import seed_rows

    spec = _spec(tmp_path, "rich_frame")
    values = workload(1_500, 0, seed=5)
    schema = "key binary, value binary, partition int, offset bigint, timestamp timestamp"
    raw = [(b"k", v, i % 2, i, datetime(2026, 3, 1)) for i, v in enumerate(values)]

    def run(records: list[tuple], seeds: Any) -> dict[bytes, dict[str, Any]]:
        frame = build_query_frame(spec, local_spark.createDataFrame(records, schema), seeds)
        rows = frame.where(F.col("_kind") == "update").collect()
        return {bytes(r["_key"]): json.loads(bytes(r["_value"])) for r in rows}

    no_seeds = local_spark.createDataFrame([], rows_schema(spec))
    whole = run(raw, no_seeds)
    first = run(raw[:800], no_seeds)
    latest = local_spark.createDataFrame([(json.dumps(v),) for v in first.values()], "value string")
    restored = {**first, **run(raw[800:], seed_rows(spec, latest))}
    assert whole.keys() == restored.keys() and len(whole) > 20
    for key, document in whole.items():
        for column in spec.aggregates:
            a, b = document.get(column), restored[key].get(column)
            assert a == b or math.isclose(a, b, rel_tol=1e-9), (key, column, a, b)
    sketch = next(iter(whole.values()))["_state"]["count_distinct.customer"]
    assert isinstance(sketch, str)  # base64


def _produce(settings: Settings, topic: str, values: list[bytes]) -> None:
    producer = client.producer(settings)
    for index, value in enumerate(values):
        records.send(producer, topic, f"k{index % 97}".encode(), value)
    assert producer.flush(30) == 0


def _logged(log: Path, what: str) -> int:
    """The sum of a count over the batches' log lines (`... filtered=3, ...`)."""
    return sum(int(n) for n in re.findall(rf"\b{what}=(\d+)", log.read_text()))


def test_every_construct_through_kill_and_restore(settings: Settings, spark, tmp_path: Path):  # type: ignore[no-untyped-def]
    pipelines = tmp_path / "pipelines"
    spec = _spec(pipelines, "t" + unique_name("rich").split("-")[-1])
    topic = spec.source.topic
    topics.create_topic(settings, topic, 3)
    _produce(settings, topic, workload(2_400, 0, seed=1))
    log = tmp_path / "stream.log"
    stream = StreamProcess(settings, spec, pipelines, log, max_offsets_per_trigger=300)
    checkpoint = settings.checkpoint_root / spec.name
    try:
        stream.start()
        assert_eventually(lambda: stream.covered() >= 900, timeout=180)
        stream.kill()  # SIGKILL mid-stream: resumes from its checkpoint
        stream.start()
        stream.wait_caught_up()
        assert stream.stop() == 0
        _reconcile(settings, spec, spark)
        first = truth.batches_from_checkpoint(checkpoint, topic)
        shutil.rmtree(checkpoint)  # lost: the state is restored from the changelog's _state
        _produce(settings, topic, workload(1_200, 2_400, seed=2))
        stream.start()
        stream.wait_caught_up()
    finally:
        assert stream.stop() == 0, stream.tail()
    assert len(re.findall(r"restored (\d+) keys", log.read_text())) == 2
    queries = [first, truth.batches_from_checkpoint(checkpoint, topic)]

    source = read_topic(settings, topic)
    assert len(source) == 3_600
    want = expected(spec, source, queries)
    latest = read_latest(settings, spec)
    got = {
        tuple(v[c] for c in spec.key_columns): {c: v.get(c) for c in spec.aggregates}
        for v in latest.values()
    }
    assert got.keys() == want.table.keys()
    error = 3 * 1.04 / math.sqrt(4096)  # three standard errors of the sketch's estimate
    for key, exact in want.distinct.items():
        assert abs(got[key].pop("customers") - exact) <= error * exact, (key, got[key], exact)
    truth.assert_tables_equal(got, want.table)

    reasons = {}
    for message in read_messages(settings, spec.dlq_topic):
        headers = dict(message.headers() or [])
        where = (int(headers["duality.source.partition"]), int(headers["duality.source.offset"]))
        assert where not in reasons, "dead-lettered twice"
        reasons[where] = headers["duality.error"].decode()
    assert reasons.keys() == want.dead.keys()
    for where, reason in want.dead.items():
        assert reasons[where].startswith(reason), (where, reasons[where], reason)
    kinds = {r.split(":")[0].split(" (")[0] for r in want.dead.values()}
    assert len(kinds) >= 9 and want.filtered > 100 and want.late_windows > 10, (kinds, want)
    assert _logged(log, "filtered") == want.filtered
    assert _logged(log, "late_windows") == want.late_windows


def _reconcile(settings: Settings, spec: PipelineSpec, spark) -> None:  # type: ignore[no-untyped-def]
    """The snapshot reconciles with the source, and not once a changelog value is tampered
    with; the value is put back after."""
    build.build(settings, spec, spark=spark)
    report = validate.run(settings, spec, reconcile=True, spark=spark)
    assert report.success and report.reconciled, report.failed
    key, value = sorted(read_latest(settings, spec).items())[0]
    producer = client.producer(settings)
    records.send(producer, spec.changelog_topic, key, json.dumps({**value, "bulk": -1}).encode())
    assert producer.flush(30) == 0
    build.build(settings, spec, spark=spark)
    report = validate.run(settings, spec, reconcile=True, spark=spark)
    failed = [f for f in report.failed if f.origin.startswith("reconcile")]
    assert len(failed) == 1 and failed[0].unexpected_count == 1, report.failed
    named = failed[0].keys[0]
    assert [named["region"], named["band"]] == json.loads(key)[:2], (named, key)
    assert "bulk: snapshot -1" in named["_mismatch"]
    records.send(producer, spec.changelog_topic, key, json.dumps(value).encode())
    assert producer.flush(30) == 0
