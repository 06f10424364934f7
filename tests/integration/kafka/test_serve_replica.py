"""A replica of a changelog written here (no stream): it equals the changelog's latest values,
read committed, across aborted transactions and tombstones; SIGKILLed mid-apply, its store holds
exactly a prefix of the changelog (rows and offsets written together), and a restart resumes
from it, applying only what came after. Across compaction too: a replica stopped before the log
cleaner removed records past its offsets, and a new one of the compacted log. A replica behind
the changelog's committed end refuses `max_lag` (503, Retry-After, its position)."""

from __future__ import annotations

import json
import sqlite3
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from duality.config import Settings
from duality.kafka import topics
from duality.metrics import serve_target
from duality.serve.keys import token
from duality.serve.store import Store
from duality.spec import PipelineSpec
from tests.harness import assert_eventually, make_pipeline, read_latest, read_messages
from tests.serving import ServeProcess, stable_ends

KEYS = [f"k{n:03d}" for n in range(300)]
BACKLOG = 100_000  # records of updates, to SIGKILL the replica while it applies them


COMPACT = {"cleanup.policy": "compact", "segment.ms": "1000", "min.compaction.lag.ms": "0"}


def _changelog(
    settings: Settings, spec: PipelineSpec, topic_config: Mapping[str, str] = COMPACT
) -> Producer:
    """The spec's changelog topic, compacted, 3 partitions; a transactional producer for it."""
    config = settings.kafka_client_config()
    topic = NewTopic(spec.changelog_topic, 3, 1, config=dict(topic_config))
    admin = AdminClient(config)  # kept until the topic is made: its futures end with it
    admin.create_topics([topic])[spec.changelog_topic].result(60)
    producer = Producer({**config, "transactional.id": f"{spec.name}-writer", "linger.ms": 5})
    producer.init_transactions(60)
    return producer


def _write(
    producer: Producer, topic: str, records: Iterable[tuple[str, Any]], commit: bool = True
) -> None:
    """One transaction of (key, value) records (value None: a tombstone), committed or aborted."""
    producer.begin_transaction()
    for key, value in records:
        document = None if value is None else json.dumps({"product": key, "orders": value})
        producer.produce(topic, key=key.encode(), value=document)
        producer.poll(0)
    if commit:
        producer.commit_transaction(60)
    else:
        producer.abort_transaction(60)


def _stored(path: Path) -> tuple[dict[int, int], dict[bytes, Any]]:
    """The position and rows in a replica's SQLite file, read as it is on disk."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        position = dict(db.execute("SELECT partition, next_offset FROM positions").fetchall())
        rows = {
            bytes(k): json.loads(v) for k, v in db.execute("SELECT changelog_key, value FROM rows")
        }
    db.close()
    return position, rows


def _latest_before(
    settings: Settings, spec: PipelineSpec, position: dict[int, int]
) -> dict[bytes, Any]:
    """The changelog's latest live value per key among the records below `position`."""
    latest: dict[bytes, Any] = {}
    for message in read_messages(settings, spec.changelog_topic):
        partition, offset = message.partition(), message.offset()
        assert partition is not None and offset is not None
        if offset >= position.get(partition, 0) or message.key() is None:
            continue
        value = message.value()
        if value is None:
            latest.pop(message.key(), None)
        else:
            latest[message.key()] = json.loads(value)
    return latest


def test_a_replica_is_the_changelog_and_resumes_from_its_store(settings: Settings, tmp_path: Path):
    spec = make_pipeline(settings, tmp_path / "pipelines", "product_sales")
    scoped = settings.replace(pipelines=tmp_path / "pipelines")
    topic = spec.changelog_topic
    producer = _changelog(settings, spec)
    _write(producer, topic, ((k, 1) for k in KEYS))
    _write(producer, topic, ((k, -1) for k in KEYS[:100]), commit=False)  # aborted
    _write(producer, topic, ((k, None) for k in KEYS[200:250]))  # tombstones
    _write(producer, topic, ((k, 2) for k in KEYS[100:150]))
    for batch in range(BACKLOG // 10_000):
        _write(producer, topic, ((KEYS[n % 300], 10 + batch) for n in range(10_000)))
    _write(producer, topic, ((k, -2) for k in KEYS[250:]), commit=False)  # aborted, last
    producer.flush(60)

    # Small writes, so that many of them apply the backlog and the SIGKILL falls among them: at 50
    # records a write the backlog was all applied before a test worker starved by the suite's
    # load came to kill it (2026-11-28, 21:40 UTC); at 10 the apply takes five times as long.
    replica = ServeProcess(scoped.replace(serve_write_records=10), tmp_path / "serve", spec.name)
    store = replica.folder / f"{spec.name}.sqlite"
    total = len(read_messages(settings, topic))  # committed records, tombstones included
    try:
        replica.start()
        # SIGKILL while it applies the backlog: some of it written, not all.
        assert_eventually(
            lambda: sum(_stored(store)[0].values()) > 0 if store.exists() else False,
            timeout=120,
            interval=0.01,
        )
        replica.kill()
    finally:
        replica.kill()
    position, rows = _stored(store)
    assert len(rows) > 0 and rows == _latest_before(settings, spec, position)
    behind = sum(
        1
        for m in read_messages(settings, topic)
        if m.offset() >= position.get(m.partition(), 0)  # type: ignore[operator]
    )
    assert 0 < behind < total, f"killed at {position}, not mid-apply ({behind} of {total} to go)"
    seen = token(topic, position)

    ends = stable_ends(settings, topic)
    again = ServeProcess(scoped, tmp_path / "serve", spec.name)
    try:
        again.start()
        # Never older than a position the killed replica answered with.
        status, body = again.row(spec.name, KEYS[0], at=seen, wait=30)
        assert status in (200, 404), body
        assert all(body["position"][str(p)] >= o for p, o in position.items()), body
        assert_eventually(lambda: again.caught_up(spec.name, ends), timeout=120)
        assert again.applied(spec.name) == behind  # resumed from its store, not the start
        truth = read_latest(settings, spec)
        for key in KEYS:
            status, body = again.row(spec.name, key)
            if key.encode() in truth:
                assert status == 200 and body["row"] == truth[key.encode()], (key, body)
            else:
                assert status == 404 and body["position"], (key, body)  # tombstoned
        assert again.get("/healthz")[0] == 200
        # Prometheus finds it by its file (docs/monitoring.md), which a graceful stop removes.
        target, address = serve_target(scoped, "127.0.0.1", int(again.url.rsplit(":", 1)[1]))
        assert json.loads(target.read_text()) == [{"targets": [address], "labels": {}}]
        assert again.url == f"http://{address}"
    finally:
        again.stop()
    assert not target.exists()
    final = Store(store, topic)
    try:
        assert final.rows() == truth and final.position() == ends
    finally:
        final.close()


def test_a_replica_started_before_its_changelog_reads_it_once_made(
    settings: Settings, tmp_path: Path
):
    """`duality up` starts the replicas before any stream made its changelog: the replica says
    why it has nothing yet, stays healthy, and reads the topic once it exists."""
    spec = make_pipeline(settings, tmp_path / "pipelines", "product_sales")
    replica = ServeProcess(
        settings.replace(pipelines=tmp_path / "pipelines"), tmp_path / "s", spec.name
    )
    try:
        replica.start()
        status, body = assert_eventually(
            lambda: replica.get(f"/v1/pipelines/{spec.name}"),
            lambda answer: answer[1].get("error") is not None,
            timeout=60,
        )
        assert status == 200 and spec.changelog_topic in body["error"], body
        assert replica.get("/healthz")[0] == 200
        assert replica.row(spec.name, KEYS[0])[0] == 404
        producer = _changelog(settings, spec)
        _write(producer, spec.changelog_topic, ((k, 7) for k in KEYS[:10]))
        status, body = assert_eventually(
            lambda: replica.row(spec.name, KEYS[9]), lambda answer: answer[0] == 200, timeout=60
        )
        assert body["row"] == {"product": KEYS[9], "orders": 7}
    finally:
        replica.stop()


def test_ensure_starts_this_hosts_replica_again(settings: Settings, tmp_path: Path):
    """What the stream DAG's supervisor runs: a configured replica that answers is left alone;
    this host's, SIGKILLed, is started again on its port; another host's is reported down; a
    host that never ran one starts none."""
    from duality import process
    from duality.local.ports import free_port
    from duality.serve import control
    from duality.serve.control import ReplicaState

    make_pipeline(settings, tmp_path / "pipelines", "product_sales")
    port = free_port()
    mine, elsewhere = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}"
    configured = settings.replace(
        pipelines=tmp_path / "pipelines", serve_dir=tmp_path / "own", replicas=f"{mine},{elsewhere}"
    )
    try:
        assert control.ensure(configured) == [
            ReplicaState(mine, False, "down"),  # nothing ever ran here
            ReplicaState(elsewhere, False, "down"),
        ]
        launched = control.launch(configured, port)
        assert_eventually(lambda: control.answers(mine), timeout=60)
        assert control.ensure(configured)[0] == ReplicaState(mine, True, "none")
        process.kill_group(launched.pid, reap=launched)
        assert control.ensure(configured) == [
            ReplicaState(mine, True, "started"),
            ReplicaState(elsewhere, False, "down"),
        ]
        again = control.pid(configured)
        assert again is not None and again != launched.pid
    finally:
        stopped = control.stop(configured)
    assert stopped.was_running and control.pid(configured) is None


def _compacted(settings: Settings, producer: Producer, topic: str, keys: list[str]) -> bool:
    """Whether the log cleaner has left one record of each of `keys` in `topic` (a committed
    filler record in each partition rolls its active segment meanwhile)."""
    producer.begin_transaction()
    for partition in range(3):
        producer.produce(
            topic, key=f"filler{partition}".encode(), value=b'{"orders": 0}', partition=partition
        )
    producer.commit_transaction(60)
    counts = Counter(m.key() for m in read_messages(settings, topic))
    return all(counts[key.encode()] <= 1 for key in keys)


def test_replicas_across_compaction(settings: Settings, tmp_path: Path):
    """A replica stopped, the changelog updated and compacted past its offsets (the records
    after them superseded and removed), then started again; and a new replica of the compacted
    log: both equal the changelog's latest values."""
    spec = make_pipeline(settings, tmp_path / "pipelines", "product_sales")
    scoped = settings.replace(pipelines=tmp_path / "pipelines")
    topic = spec.changelog_topic
    keys = KEYS[:60]
    producer = _changelog(settings, spec, topics.FAST_COMPACTION)
    _write(producer, topic, ((k, 1) for k in keys))
    before = ServeProcess(scoped, tmp_path / "before", spec.name)
    try:
        before.start()
        ends = stable_ends(settings, topic)
        assert_eventually(lambda: before.caught_up(spec.name, ends), timeout=60)
    finally:
        before.stop()
    stopped_at = _stored(before.folder / f"{spec.name}.sqlite")[0]
    for version in range(2, 6):
        _write(producer, topic, ((k, version) for k in keys))
    _write(producer, topic, ((k, None) for k in keys[:10]))  # tombstones
    _write(producer, topic, ((k, -1) for k in keys[10:20]), commit=False)  # aborted
    assert_eventually(
        lambda: _compacted(settings, producer, topic, keys),
        timeout=120,
        interval=1.0,
        message="the log cleaner did not compact the changelog",
    )
    # Records right after the stopped replica's offsets are gone: it resumes into a gap.
    kept = {(m.partition(), m.offset()) for m in read_messages(settings, topic)}
    assert any((p, o) not in kept for p, o in stopped_at.items()), (stopped_at, len(kept))
    truth = read_latest(settings, spec)
    ends = stable_ends(settings, topic)
    fresh = ServeProcess(scoped, tmp_path / "fresh", spec.name)
    try:
        for replica in (before, fresh):
            replica.start()
            assert_eventually(lambda r=replica: r.caught_up(spec.name, ends), timeout=60)  # type: ignore[misc]
            for key in keys:
                status, body = replica.row(spec.name, key)
                if key.encode() in truth:
                    assert status == 200 and body["row"] == truth[key.encode()], (key, body)
                    assert body["row"]["orders"] == 5, body
                else:
                    assert status == 404, (key, body)  # tombstoned
            replica.stop()
    finally:
        before.kill()
        fresh.kill()
    for replica in (before, fresh):
        final = Store(replica.folder / f"{spec.name}.sqlite", topic)
        try:
            assert final.rows() == truth and final.position() == ends
        finally:
            final.close()


def test_max_lag_refuses_a_replica_behind(settings: Settings, tmp_path: Path):
    """A replica that cannot apply (its store's write lock held from outside, as a stalled disk
    would) while the changelog moves on: its lag to the committed end shows it; `max_lag`
    below that lag is a 503 with Retry-After and its position; `wait` answers once it applied."""
    spec = make_pipeline(settings, tmp_path / "pipelines", "product_sales")
    scoped = settings.replace(pipelines=tmp_path / "pipelines")
    topic = spec.changelog_topic
    producer = _changelog(settings, spec)
    _write(producer, topic, ((k, 1) for k in KEYS[:50]))
    replica = ServeProcess(scoped, tmp_path / "serve", spec.name)
    try:
        replica.start()
        ends = stable_ends(settings, topic)
        assert_eventually(lambda: replica.caught_up(spec.name, ends), timeout=60)
        assert replica.row(spec.name, KEYS[0], max_lag=0)[0] == 200
        blocker = sqlite3.connect(replica.folder / f"{spec.name}.sqlite", isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")  # the replica's writer waits for it
            _write(producer, topic, ((k, 2) for k in KEYS[:50]))
            status, state = assert_eventually(
                lambda: replica.get(f"/v1/pipelines/{spec.name}"),
                lambda answer: answer[1]["lag"] >= 50,
                timeout=30,
            )
            query = f"/v1/pipelines/{spec.name}/rows/{KEYS[0]}?max_lag=10"
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(replica.url + query, timeout=30)
            assert refused.value.code == 503
            assert refused.value.headers["Retry-After"] == "1"
            body = json.loads(refused.value.read())
            assert body["lag"] >= 50 and body["position"] == state["position"], body
            assert "max_lag=10" in body["error"] and body["token"] == state["token"], body
            assert replica.row(spec.name, KEYS[0])[1]["row"]["orders"] == 1  # no max_lag
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        status, body = replica.row(spec.name, KEYS[0], max_lag=0, wait=30)
        assert status == 200 and body["row"]["orders"] == 2 and body["lag"] == 0, body
    finally:
        replica.stop()
