"""A new replica starts from the published Delta snapshot (read without Spark, deletion vectors
applied) and reads the changelog from the offsets it covers: it applies only the records after
them, and equals the changelog's latest values (a row only the snapshot holds has no `_state`
and no offset); one of a recreated changelog reads it from the start."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from duality import changelog, validate
from duality.config import Settings
from duality.kafka import client, records, topics
from duality.snapshot import build, publish
from duality.spec import PipelineSpec
from tests.harness import assert_eventually, make_pipeline, read_latest, read_topic
from tests.serving import ServeProcess, stable_ends


def _write(settings: Settings, spec: PipelineSpec, changes: dict[str, Any]) -> None:
    """One transaction of changelog records, as the stream writes them; None: a tombstone."""
    producer = client.producer(settings, transactional_id=f"test-{spec.name}")
    producer.init_transactions(30)
    producer.begin_transaction()
    for product, row in changes.items():
        key = changelog.encode_key(spec, [product])
        value = (
            None
            if row is None
            else changelog.encode_value(spec, [product], row, {"count": row["orders"]}, 1_700_000)
        )
        records.send(producer, spec.changelog_topic, key, value)
    producer.commit_transaction(30)


def _row(orders: int, rng: random.Random) -> dict[str, Any]:
    amounts = [round(rng.uniform(1, 500), 2) for _ in range(orders)]
    return {
        "orders": orders,
        "units": orders * 3,
        "revenue": sum(amounts),
        "max_amount": max(amounts),
        "min_amount": min(amounts),
        "avg_amount": sum(amounts) / orders,
    }


def test_a_new_replica_starts_from_the_published_snapshot(
    spark, settings: Settings, tmp_path: Path
):  # type: ignore[no-untyped-def]
    scoped = settings.replace(reports=tmp_path / "reports", pipelines=tmp_path / "pipelines")
    spec = make_pipeline(scoped, tmp_path / "pipelines", "product_sales")
    topics.create_topic(scoped, spec.source.topic, 3)
    topics.create_topic(scoped, spec.changelog_topic, 3, config={"cleanup.policy": "compact"})
    rng = random.Random(3)
    keys = [f"p{i:04d}" for i in range(300)]
    _write(scoped, spec, {k: _row(rng.randint(1, 20), rng) for k in keys})
    _write(scoped, spec, {k: _row(rng.randint(1, 20), rng) for k in keys[:100]})
    _write(scoped, spec, dict.fromkeys(keys[290:]))  # tombstones before the snapshot
    build.build(scoped, spec, "full", spark=spark)
    assert validate.run(scoped, spec, spark=spark).published
    found = publish.published_in_log(spec.snapshot_path(scoped))
    assert found is not None
    covered = found.coverage.changelog
    # After the snapshot: updates, a tombstone of a key it holds, a key it does not.
    _write(scoped, spec, {**{k: _row(30, rng) for k in keys[:20]}, keys[50]: None})
    _write(scoped, spec, {"p9999": _row(2, rng)})
    after = sum(1 for p, o, _, _ in read_topic(scoped, spec.changelog_topic) if o >= covered[p])

    replica = ServeProcess(scoped, tmp_path / "serve", spec.name)
    try:
        replica.start()
        ends = stable_ends(scoped, spec.changelog_topic)
        assert_eventually(lambda: replica.caught_up(spec.name, ends), timeout=120)
        assert replica.applied(spec.name) == after  # the changelog from the coverage only
        truth = read_latest(scoped, spec)
        updated = {k.encode() for k in [*keys[:20], "p9999"]}
        for raw, value in truth.items():
            status, body = replica.row(spec.name, raw.decode())
            assert status == 200, (raw, body)
            if raw in updated:
                assert body["row"] == value and body["offset"] is not None, (raw, body)
            else:  # only the snapshot's: no `_state`, no partition and offset
                assert body["row"] == {k: v for k, v in value.items() if k != "_state"}, raw
                assert body["offset"] is None and body["partition"] is None, body
        for gone in (keys[50], *keys[290:]):
            assert replica.row(spec.name, gone)[0] == 404, gone
    finally:
        replica.stop()
    # The changelog made again (a reset): the snapshot covers another incarnation of it.
    topics.delete_topic(scoped, spec.changelog_topic)
    assert_eventually(lambda: not topics.topic_exists(scoped, spec.changelog_topic), timeout=60)
    topics.create_topic(scoped, spec.changelog_topic, 3, config={"cleanup.policy": "compact"})
    _write(scoped, spec, {"p0001": _row(1, rng)})
    fresh = ServeProcess(scoped, tmp_path / "fresh", spec.name)
    try:
        fresh.start()
        ends = stable_ends(scoped, spec.changelog_topic)
        assert_eventually(lambda: fresh.caught_up(spec.name, ends), timeout=120)
        assert fresh.row(spec.name, "p0001")[1]["row"]["orders"] == 1
        assert fresh.row(spec.name, "p0002")[0] == 404  # not the earlier snapshot's
    finally:
        fresh.stop()
