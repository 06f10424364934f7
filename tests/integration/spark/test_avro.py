"""Avro sources through a real schema registry (Apicurio, `registry_settings`) and broker
(issue 50, decision 38): records of three writer versions, interleaved, decode into the reader
schema, and the changelog equals a plain-Python oracle decoding them with fastavro; each kind
of bad frame is dead-lettered, byte for byte, with its reason."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import random
import struct
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import fastavro
import pytest
import yaml

from duality.avro.registry import Registry
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, records, topics
from duality.spec import load_spec
from tests import truth
from tests.harness import (
    StreamProcess,
    assert_eventually,
    joined_covered,
    read_latest,
    read_messages,
    run_duality,
    unique_name,
)

V1: dict[str, Any] = {
    "type": "record",
    "name": "Order",
    "namespace": "dev.duality.test",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "product", "type": "string"},
        {"name": "quantity", "type": "int"},
        {"name": "note", "type": "string"},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
}
# v2 adds a field with a default; v3 removes `note` and widens `quantity` to long.
V2 = {**V1, "fields": [*V1["fields"], {"name": "customer", "type": "string", "default": "anon"}]}
V3 = {
    **V1,
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "product", "type": "string"},
        {"name": "quantity", "type": "long"},
        V1["fields"][4],
        {"name": "customer", "type": "string", "default": "anon"},
    ],
}
# The same record with `quantity` a string: no Avro resolution reads it as a long.
INCOMPATIBLE = {**V3, "fields": [*V3["fields"][:2], {"name": "quantity", "type": "string"}]}

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
AGGREGATES = {
    "orders": "count()",
    "units": "sum(quantity)",
    "anonymous": "count_if(customer = 'anon')",
    "latest_ts": "max(ts)",
}


def _frame(schema_id: int, schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return b"\x00" + struct.pack(">I", schema_id) + out.getvalue()


def _oracle(
    frames: list[bytes], writers: dict[int, dict[str, Any]], reader: dict[str, Any]
) -> dict[tuple, dict[str, Any]]:
    """The table the pipeline must hold: each frame decoded by fastavro from its writer schema
    into the reader schema, aggregated in plain Python."""
    parsed_reader = fastavro.parse_schema(reader)
    table: dict[tuple, dict[str, Any]] = defaultdict(
        lambda: {"orders": 0, "units": 0, "anonymous": 0, "latest_ts": None}
    )
    for frame in frames:
        (schema_id,) = struct.unpack(">I", frame[1:5])
        writer = fastavro.parse_schema(writers[schema_id])
        record = fastavro.schemaless_reader(io.BytesIO(frame[5:]), writer, parsed_reader)
        row = table[(record["product"],)]
        row["orders"] += 1
        row["units"] += record["quantity"]
        row["anonymous"] += record["customer"] == "anon"
        # The changelog holds a timestamp as milliseconds since the epoch.
        ts = (record["ts"] - EPOCH) // dt.timedelta(milliseconds=1)
        row["latest_ts"] = ts if row["latest_ts"] is None else max(row["latest_ts"], ts)
    return dict(table)


def _write_spec(folder: Path, name: str, source: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "name": name,
        "source": source,
        "aggregates": AGGREGATES,
        "changelog": {"partitions": 3},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def pipelines(tmp_path: Path) -> Path:
    return tmp_path / "pipelines"


def test_three_writer_versions_and_bad_frames(
    registry_settings: Settings, pipelines: Path, tmp_path: Path
):
    settings = registry_settings
    name = f"t{uuid.uuid4().hex[:10]}"
    topic = f"{name}-orders"
    registry = Registry(settings)
    subject = f"{topic}-value"
    ids = {version: registry.register(subject, s) for version, s in ((1, V1), (2, V2), (3, V3))}
    other = registry.register(f"{topic}-other", INCOMPATIBLE)
    writers = {ids[1]: V1, ids[2]: V2, ids[3]: V3, other: INCOMPATIBLE}
    assert len(set(writers)) == 4, writers

    # No `schema:`: the columns are the latest version's (v3), as `spec validate` prints them.
    path = _write_spec(pipelines, name, {"topic": topic, "format": "avro", "key": "product"})
    spec = load_spec(path, settings=settings)
    assert spec.source.avro is not None and spec.source.avro.subject == subject
    assert spec.source.fields == {
        "order_id": "string",
        "product": "string",
        "quantity": "long",
        "ts": "timestamp",
        "customer": "string",
    }
    env = {**settings.process_env(), "DUALITY_PIPELINES": str(pipelines)}
    shown = run_duality(env, "spec", "validate", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"subject {subject}, version 3" in shown.stdout, shown.stdout

    rng = random.Random(50)
    good: list[bytes] = []
    for n in range(3_000):
        version = rng.choice((1, 2, 3))
        record: dict[str, Any] = {
            "order_id": f"o{n}",
            "product": f"p-{rng.randrange(40)}",
            "quantity": rng.randrange(1, 9),
            "ts": 1_790_000_000_000 + rng.randrange(86_400_000),
        }
        if version < 3:
            record["note"] = "n" * rng.randrange(4)
        if version > 1:
            record["customer"] = rng.choice(("anon", "c1", "c2"))
        good.append(_frame(ids[version], (V1, V2, V3)[version - 1], record))
    valid = _frame(ids[3], V3, {"order_id": "x", "product": "p-0", "quantity": 1, "ts": 0})
    bad = {
        b"\x00\x00\x01": "short frame",
        b"": "short frame",
        b'{"product": "p-0"}': "no magic byte",
        b"\x00" + struct.pack(">I", 987_654) + valid[5:]: "unknown schema id 987654",
        valid[:5] + b"\x02": "does not decode",
        valid + b"\x00": "does not decode",
        _frame(
            other, INCOMPATIBLE, {"order_id": "y", "product": "p-1", "quantity": "3", "ts": 0}
        ): (f"writer schema id {other} is incompatible"),
    }
    topics.create_topic(settings, topic, 3)
    producer = client.producer(settings)
    mixed = list(good)
    for frame in bad:
        mixed.insert(rng.randrange(len(mixed)), frame)
    for n, frame in enumerate(mixed):
        records.send(producer, topic, f"k{n % 97}".encode(), frame)
    assert producer.flush(30) == 0

    stream = StreamProcess(settings, spec, pipelines, tmp_path / "stream.log")
    stream.run_until_caught_up()

    reader = V3  # the latest version, the reader schema without `schema:`
    wanted = _oracle(good, writers, reader)
    truth.assert_tables_equal(truth.changelog_table(spec, read_latest(settings, spec)), wanted)

    letters = read_messages(settings, spec.dlq_topic)
    reasons = {m.value() or b"": dict(m.headers() or [])["duality.error"].decode() for m in letters}
    assert len(letters) == len(bad), sorted(reasons.values())
    for frame, reason in bad.items():
        assert reasons[frame].startswith(reason), (frame, reasons[frame], reason)


def test_a_spec_schema_is_the_reader_schema(
    registry_settings: Settings, pipelines: Path, tmp_path: Path
):
    """A spec's `schema:` is the reader schema: a field only v1 and v2 have reads as null from
    v3 (its default), and a field that cannot read a version's is refused, naming it."""
    settings = registry_settings
    topic = unique_name("avro-reader")
    registry = Registry(settings)
    for schema in (V1, V2, V3):
        registry.register(f"{topic}-value", schema)
    source = {"topic": topic, "format": "avro", "key": "product"}
    typed = {"product": "string", "quantity": "long", "note": "string", "ts": "timestamp"}
    spec_path = _write_spec(pipelines, "reader_ok", {**source, "schema": typed, "key": "product"})
    data = yaml.safe_load(spec_path.read_text())
    data["aggregates"] = {"orders": "count()", "units": "sum(quantity)"}
    spec_path.write_text(yaml.safe_dump(data))
    spec = load_spec(spec_path, settings=settings)
    assert spec.source.avro is not None
    assert '"default": null' in spec.source.avro.reader

    wrong = {**typed, "quantity": "int"}
    bad_path = _write_spec(pipelines, "reader_bad", {**source, "schema": wrong})
    with pytest.raises(UsageError, match=r"schema\.quantity is a int, but version 3"):
        load_spec(bad_path, settings=settings)
    env = {**settings.process_env(), "DUALITY_PIPELINES": str(pipelines)}
    refused = run_duality(env, "spec", "validate", str(bad_path))
    assert refused.returncode == 2 and "schema.quantity" in refused.stderr, refused.stderr

    unreachable = {**env, "DUALITY_SCHEMA_REGISTRY_URL": "http://127.0.0.1:9/apis/ccompat/v7"}
    down = run_duality(unreachable, "spec", "validate", str(spec_path))
    assert down.returncode == 2, down.stderr
    assert "DUALITY_SCHEMA_REGISTRY_URL" in down.stderr, down.stderr


def test_versions_registered_while_running_and_a_registry_outage(
    registry_settings: Settings, pipelines: Path, tmp_path: Path
):
    """A version registered while the stream runs is read when its first record comes; with the
    registry stopped, records of cached ids go on, a record of an id the stream has not met
    waits (nothing dead-lettered, nothing lost) until the registry is back."""
    from duality.local.schema_registry import LocalSchemaRegistry

    settings = registry_settings
    name = f"t{uuid.uuid4().hex[:10]}"
    topic = f"{name}-orders"
    registry = Registry(settings)
    subject = f"{topic}-value"
    writers = {registry.register(subject, V1): V1, registry.register(subject, V2): V2}
    ids = list(writers)
    path = _write_spec(pipelines, name, {"topic": topic, "format": "avro", "key": "product"})
    spec = load_spec(path, settings=settings)  # the reader: v2, the latest when it loads
    topics.create_topic(settings, topic, 3)
    producer = client.producer(settings)
    rng = random.Random(51)
    sent: list[bytes] = []

    def send(schema_id: int, count: int) -> None:
        for _ in range(count):
            record = {
                "order_id": f"o{len(sent)}",
                "product": f"p-{rng.randrange(20)}",
                "quantity": rng.randrange(1, 9),
                "note": "n",
                "ts": 1_790_000_000_000 + rng.randrange(86_400_000),
                "customer": rng.choice(("anon", "c1")),
            }
            frame = _frame(schema_id, writers[schema_id], record)
            records.send(producer, topic, record["product"].encode(), frame)
            sent.append(frame)
        assert producer.flush(30) == 0

    send(ids[0], 300)
    send(ids[1], 300)
    with StreamProcess(settings, spec, pipelines, tmp_path / "stream.log") as stream:
        stream.start()
        stream.wait_caught_up()
        # v3 registered while the stream runs: a field added, which the reader (v2) drops.
        v3_schema = {**V2, "fields": [*V2["fields"], {"name": "x", "type": "int", "default": 0}]}
        v3 = registry.register(subject, v3_schema)
        writers[v3] = v3_schema
        send(v3, 300)
        stream.wait_caught_up()
        # v4 (without `customer`, which the reader defaults; with a field of its own, so that
        # it is no earlier version's text, which the registry would give the earlier id)
        # registered, then the registry stopped before the stream met its id.
        region = {"name": "region", "type": "string", "default": "eu"}
        v4_schema = {
            **V2,
            "fields": [*[f for f in V2["fields"] if f["name"] != "customer"], region],
        }
        v4 = registry.register(subject, v4_schema)
        assert v4 not in writers, "the registry gave v4 an earlier version's id"
        writers[v4] = v4_schema
        local = LocalSchemaRegistry(settings)
        assert local.stop() is not None, "the session's registry is not duality's own"
        try:
            send(ids[0], 200)  # cached: decoded while the registry is down
            send(v4, 200)  # not cached: waits for the registry
            time.sleep(10)
            stream.check()
            assert not read_messages(settings, spec.dlq_topic), "good records dead-lettered"
            # The stream is waiting for v4's schema, asking again with backoff.
            assert f"did not give schema id {v4}" in stream.log.read_text(errors="replace")
        finally:
            local.start()
        stream.wait_caught_up(timeout=600)
        assert stream.stop() == 0, stream.tail()

    reader = V2
    wanted = _oracle(sent, writers, reader)
    truth.assert_tables_equal(truth.changelog_table(spec, read_latest(settings, spec)), wanted)
    assert not read_messages(settings, spec.dlq_topic), "good records dead-lettered"


ORDER = {
    "type": "record",
    "name": "Order",
    "namespace": "dev.duality.test",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "product", "type": "string"},
        {"name": "customer", "type": "string"},
        {"name": "quantity", "type": "int"},
    ],
}
# The table's writer: `rate` a float, which the spec's `schema:` reads as a double.
CUSTOMER = {
    "type": "record",
    "name": "Customer",
    "namespace": "dev.duality.test",
    "fields": [
        {"name": "customer", "type": "string"},
        {"name": "tier", "type": "string"},
        {"name": "rate", "type": "float"},
    ],
}


def test_an_avro_source_joined_to_an_avro_table(
    registry_settings: Settings, pipelines: Path, tmp_path: Path
):
    """Avro orders joined (left) with an Avro table of customers: its rows read at the first
    start, then updated, deleted and added while the stream runs; the changelog equals a
    plain-Python oracle decoding every frame with fastavro, and a table record that is no
    Confluent frame is dead-lettered with its reason."""
    settings = registry_settings
    name = f"t{uuid.uuid4().hex[:10]}"
    topic, table_topic = f"{name}-orders", f"{name}-customers"
    registry = Registry(settings)
    order_id = registry.register(f"{topic}-value", ORDER)
    customer_id = registry.register(f"{table_topic}-value", CUSTOMER)
    data = {
        "name": name,
        # No `schema:`: the source's columns are its subject's; the table lists its own.
        "source": {"topic": topic, "format": "avro", "key": "product"},
        "tables": {
            "customers": {
                "topic": table_topic,
                "format": "avro",
                "schema": {"customer": "string", "tier": "string", "rate": "double"},
                "key": "customer",
            }
        },
        "join": [{"table": "customers", "on": "customer", "type": "left"}],
        "aggregates": {
            "orders": "count()",
            "units": "sum(quantity)",
            "gold": "count_if(customers.tier = 'gold')",
            "no_row": "count_if(customers.tier is null)",
            "top_rate": "max(customers.rate)",
        },
        "changelog": {"partitions": 3},
    }
    pipelines.mkdir(parents=True, exist_ok=True)
    path = pipelines / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path, settings=settings)
    assert spec.joined is not None and spec.joined.avro is not None
    topics.create_topic(settings, topic, 3)
    topics.create_topic(settings, table_topic, 2, config={"cleanup.policy": "compact"})
    producer = client.producer(settings)
    rng = random.Random(52)
    rows: dict[str, bytes | None] = {}  # the table as it stands: a customer's latest frame
    wanted: dict[tuple, dict[str, Any]] = {}
    reader = fastavro.parse_schema(
        {**CUSTOMER, "fields": [*CUSTOMER["fields"][:2], {"name": "rate", "type": "double"}]}
    )

    def table(customer: str, tier: str | None) -> None:
        frame = None
        if tier is not None:
            row = {"customer": customer, "tier": tier, "rate": rng.randrange(1, 400) / 8 + 0.1}
            frame = _frame(customer_id, CUSTOMER, row)
        records.send(producer, table_topic, customer.encode(), frame)
        rows[customer] = frame

    def orders(count: int) -> None:
        """Orders of customers c0..c14, each meeting its customer's row as it stands."""
        for _ in range(count):
            customer = f"c{rng.randrange(15)}"
            record = {
                "order_id": f"o{rng.randrange(10**9)}",
                "product": f"p-{rng.randrange(12)}",
                "customer": customer,
                "quantity": rng.randrange(1, 9),
            }
            records.send(producer, topic, customer.encode(), _frame(order_id, ORDER, record))
            agg = wanted.setdefault(
                (record["product"],),
                {"orders": 0, "units": 0, "gold": 0, "no_row": 0, "top_rate": None},
            )
            agg["orders"] += 1
            agg["units"] += record["quantity"]
            frame = rows.get(customer)
            if frame is None:
                agg["no_row"] += 1
                continue
            writer = fastavro.parse_schema(CUSTOMER)
            row = fastavro.schemaless_reader(io.BytesIO(frame[5:]), writer, reader)
            agg["gold"] += row["tier"] == "gold"
            top = agg["top_rate"]
            agg["top_rate"] = row["rate"] if top is None else max(top, row["rate"])
        assert producer.flush(30) == 0

    # Before the first start: rows of c0..c9 and a table record that is no Confluent frame.
    for n in range(10):
        table(f"c{n}", rng.choice(("gold", "silver")))
    records.send(producer, table_topic, b"c99", b'{"customer": "c99"}')
    orders(150)
    with StreamProcess(settings, spec, pipelines, tmp_path / "stream.log") as stream:
        stream.start()
        caught_up = lambda: stream.check() or joined_covered(settings, spec)  # noqa: E731
        assert_eventually(caught_up, timeout=240, interval=1.0, message=str(stream.log))
        # While it runs: rows changed, one deleted (a tombstone), one added; then more orders.
        for n in range(5):
            table(f"c{n}", "gold")
        table("c5", None)
        table("c12", "gold")
        assert producer.flush(30) == 0
        assert_eventually(caught_up, timeout=240, interval=1.0, message=str(stream.log))
        orders(150)
        assert_eventually(caught_up, timeout=240, interval=1.0, message=str(stream.log))
        assert stream.stop() == 0, stream.tail()

    truth.assert_tables_equal(truth.changelog_table(spec, read_latest(settings, spec)), wanted)
    letters = read_messages(settings, spec.dlq_topic)
    assert [m.value() for m in letters] == [b'{"customer": "c99"}']
    reason = dict(letters[0].headers() or [])["duality.error"].decode()
    assert reason.startswith(f"table customers (topic {table_topic}): no magic byte"), reason


def test_duality_produce_writes_an_avro_workload_the_stream_reads(
    registry_settings: Settings, pipelines: Path, tmp_path: Path
):
    """`duality produce` of an Avro spec that lists its schema registers a writer schema of its
    fields under the subject (the same id when run again) and writes the Confluent wire format
    with bad frames among the records: the changelog equals a fastavro oracle of the topic and
    every bad record is dead-lettered."""
    settings = registry_settings
    name = f"t{uuid.uuid4().hex[:10]}"
    topic = f"{name}-orders"
    pipelines.mkdir(parents=True)
    path = pipelines / f"{name}.yaml"
    source = {
        "topic": topic,
        "format": "avro",
        "key": "product",
        "schema": {"product": "string", "quantity": "long", "amount": "double", "ts": "timestamp"},
    }
    aggregates = {"orders": "count()", "units": "sum(quantity)", "latest_ts": "max(ts)"}
    path.write_text(yaml.safe_dump({"name": name, "source": source, "aggregates": aggregates}))
    env = {**settings.process_env(), "DUALITY_PIPELINES": str(pipelines)}
    runs = []
    for seed in ("5", "6"):
        done = run_duality(
            env, "produce", name, "--events", "1500", "--seed", seed, "--bad-fraction", "0.05",
            "--partitions", "3", "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout))
    subject = f"{topic}-value"
    registry = Registry(settings)
    assert registry.versions(subject) == [1], "producing again registered another version"
    writer_id = registry.version(subject).id
    assert runs[0]["schema"] == runs[1]["schema"] == f"subject {subject}, schema id {writer_id}"
    bad = sum(sum(r["bad"].values()) for r in runs)
    kinds = {kind for r in runs for kind in r["bad"]}
    assert {"short_frame", "no_magic_byte", "unknown_schema_id", "undecodable"} <= kinds, kinds

    # The oracle reads the topic itself: a frame of the writer's id that fastavro decodes to its
    # end with a product counts; everything else must be a dead letter.
    writer = fastavro.parse_schema(registry.schema(writer_id))
    wanted: dict[tuple, dict[str, Any]] = defaultdict(
        lambda: {"orders": 0, "units": 0, "latest_ts": None}
    )
    refused = 0
    for message in read_messages(settings, topic):
        frame = message.value() or b""
        decoded = None
        if len(frame) > 5 and frame[0] == 0 and struct.unpack(">I", frame[1:5])[0] == writer_id:
            body = io.BytesIO(frame[5:])
            with contextlib.suppress(Exception):
                decoded = fastavro.schemaless_reader(body, writer, writer)
            decoded = decoded if body.tell() == len(frame) - 5 else None
        if decoded is None or decoded["product"] is None:
            refused += 1
            continue
        row = wanted[(decoded["product"],)]
        row["orders"] += 1
        row["units"] += decoded["quantity"]
        ts = (decoded["ts"] - EPOCH) // dt.timedelta(milliseconds=1)
        row["latest_ts"] = ts if row["latest_ts"] is None else max(row["latest_ts"], ts)
    assert refused == bad and len(wanted) > 10

    spec = load_spec(path, settings=settings)
    stream = StreamProcess(settings, spec, pipelines, tmp_path / "stream.log")
    stream.run_until_caught_up()
    truth.assert_tables_equal(truth.changelog_table(spec, read_latest(settings, spec)), wanted)
    assert len(read_messages(settings, spec.dlq_topic)) == bad
