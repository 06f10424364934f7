"""Avro sources without a registry (issue 50, decision 38): the registry settings, the columns
and reader schema taken from a subject's versions, the compatibility of a spec's `schema:` with
them, and the errors that name the setting or the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from duality.avro import schema
from duality.avro.registry import Registry, Version, authorization
from duality.config import Settings
from duality.errors import UsageError
from duality.spec import parse_spec

V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "dev.duality",
    "fields": [
        {"name": "product", "type": "string"},
        {"name": "quantity", "type": "int"},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
        {"name": "price", "type": "float"},
    ],
}
V2 = {
    **V1,
    "fields": [f if f["name"] != "quantity" else {**f, "type": "long"} for f in V1["fields"]],
}


def _settings(tmp_path: Path, **more: str) -> Settings:
    return Settings.from_env({"DUALITY_HOME": str(tmp_path), **more})


def test_registry_settings_are_checked_and_the_password_never_shown(tmp_path: Path):
    settings = _settings(
        tmp_path,
        DUALITY_SCHEMA_REGISTRY_URL="http://127.0.0.1:8081/apis/ccompat/v7",
        DUALITY_SCHEMA_REGISTRY_USER="reader",
        DUALITY_SCHEMA_REGISTRY_PASSWORD="s3cret-registry-password",
    )
    assert "s3cret" not in repr(settings)
    assert authorization(settings) == "Basic cmVhZGVyOnMzY3JldC1yZWdpc3RyeS1wYXNzd29yZA=="
    with pytest.raises(UsageError, match="DUALITY_SCHEMA_REGISTRY_URL='localhost:8081'"):
        _settings(tmp_path, DUALITY_SCHEMA_REGISTRY_URL="localhost:8081")
    with pytest.raises(UsageError, match="both DUALITY_SCHEMA_REGISTRY_USER and"):
        _settings(tmp_path, DUALITY_SCHEMA_REGISTRY_USER="reader")


def test_columns_of_a_subject_version():
    columns, left_out = schema.columns(V1)
    assert columns == {
        "product": "string",
        "quantity": "int",
        "note": "string",
        "ts": "timestamp",
        "kind": "string",
        "price": "double",
    }
    assert left_out == ["tags"]


def test_reader_schema_of_a_spec_schema():
    reader = schema.reader_schema({"product": "string", "ts": "timestamp", "qty": "long"}, V1)
    assert reader["name"] == "Order" and reader["namespace"] == "dev.duality"
    by_name = {f["name"]: f for f in reader["fields"]}
    # Every field nullable with a null default; a timestamp keeps the writer's unit.
    assert all(f["default"] is None and f["type"][0] == "null" for f in reader["fields"])
    assert by_name["ts"]["type"][1] == {"type": "long", "logicalType": "timestamp-micros"}
    assert by_name["qty"]["type"][1] == "long"


def test_a_spec_schema_must_read_every_version():
    versions = [Version("orders-value", 1, 1, V1), Version("orders-value", 2, 2, V2)]
    # Widening is resolution: int and long read as long, float as double.
    schema.check_compatible({"quantity": "long", "price": "double"}, versions)
    with pytest.raises(ValueError, match=r"schema\.quantity is a int, but version 2 of subject"):
        schema.check_compatible({"quantity": "int"}, versions)
    with pytest.raises(ValueError, match=r"schema\.product is a long"):
        schema.check_compatible({"product": "long"}, versions)
    with pytest.raises(ValueError, match=r"schema\.qty is in no version of subject"):
        schema.check_compatible({"qty": "long"}, versions)


def _spec(source: dict) -> dict:
    return {"name": "avro_orders", "source": source, "aggregates": {"orders": "count()"}}


def test_an_avro_spec_needs_a_reachable_registry_and_names_the_setting(tmp_path: Path):
    source = {"topic": "orders", "format": "avro", "key": "product"}
    with pytest.raises(UsageError, match="set DUALITY_SCHEMA_REGISTRY_URL"):
        parse_spec(_spec(source), "avro_orders.yaml", settings=_settings(tmp_path))
    # Port 9 (discard) answers nothing here: the connection is refused at once.
    down = _settings(tmp_path, DUALITY_SCHEMA_REGISTRY_URL="http://127.0.0.1:9/apis/ccompat/v7")
    with pytest.raises(
        UsageError, match=r"cannot reach the schema registry at http://127\.0\.0\.1:9"
    ):
        parse_spec(_spec(source), "avro_orders.yaml", settings=down)
    with pytest.raises(UsageError, match=r"\(DUALITY_SCHEMA_REGISTRY_URL\)"):
        Registry(down).versions("orders-value")


def test_json_sources_are_as_before(tmp_path: Path):
    source = {"topic": "orders", "key": "product", "schema": {"product": "string"}}
    assert parse_spec(_spec(source), "x.yaml").source.avro is None
    with pytest.raises(UsageError, match="subject: only an Avro source"):
        parse_spec(_spec({**source, "subject": "s"}), "x.yaml")
    without = {k: v for k, v in source.items() if k != "schema"}
    with pytest.raises(UsageError, match="schema: a JSON source lists its fields"):
        parse_spec(_spec(without), "x.yaml")
    with pytest.raises(UsageError, match="format"):
        parse_spec(_spec({**source, "format": "protobuf"}), "x.yaml")


def test_without_the_registry_a_spec_loads_for_the_dag_file_and_the_task_still_asks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`load_spec(..., registry=False)` (the DAG file's parse) asks no registry: an Avro
    source's columns are then unknown and its expressions untyped, while what needs no columns
    is still checked; loading it as the stream's task does asks the registry and names the
    setting. A pipeline joining its table is loaded the same way."""
    from duality.spec import find_spec, load_spec

    down = "http://127.0.0.1:9/apis/ccompat/v7"
    monkeypatch.setenv("DUALITY_SCHEMA_REGISTRY_URL", down)
    monkeypatch.setenv("DUALITY_PIPELINES", str(tmp_path))
    (tmp_path / "avro_orders.yaml").write_text(
        "name: avro_orders\n"
        "source: {topic: orders, format: avro, key: product, event_time: ts}\n"
        "fields: {revenue: quantity * price}\n"
        "aggregates: {orders: count(), revenue: sum(revenue)}\n"
        "expectations: [{type: expect_column_values_to_not_be_null, kwargs: {column: product}}]\n"
    )
    spec = load_spec(tmp_path / "avro_orders.yaml", registry=False)
    assert not spec.source.columns_known and spec.source.fields == {}
    assert spec.source.avro is None and spec.computed_fields == {}
    assert spec.changelog_topic == "avro_orders-changelog"
    assert spec.dag_id("stream") == "duality_avro_orders_stream"
    (tmp_path / "joined.yaml").write_text(
        "name: joined\n"
        "source: {topic: sales, key: region, schema: {product: string, region: string}}\n"
        "tables: {orders: {pipeline: avro_orders}}\n"
        "join: [{table: orders, on: product}]\n"
        "aggregates: {sales: count()}\n"
    )
    joined = load_spec(tmp_path / "joined.yaml", registry=False)
    assert not joined.source.columns_known and joined.joined is None
    # What needs no columns is checked all the same.
    (tmp_path / "windowed.yaml").write_text(
        "name: windowed\nsource: {topic: orders, format: avro, key: product}\n"
        "aggregates: {orders: count()}\nwindow: {size: 1 minute, watermark: 1 minute}\n"
    )
    with pytest.raises(UsageError, match=r"window: a windowed pipeline needs source\.event_time"):
        load_spec(tmp_path / "windowed.yaml", registry=False)
    # A spec listing its schema is typed as before, without the registry.
    (tmp_path / "listed.yaml").write_text(
        "name: listed\n"
        "source: {topic: orders, format: avro, key: product, schema: {product: string}}\n"
        "aggregates: {total: sum(product)}\n"
    )
    with pytest.raises(UsageError, match=r"sum\(\) needs a number; product is a string"):
        load_spec(tmp_path / "listed.yaml", registry=False)
    # The stream's task (and every command) loads it with the registry.
    for name in ("avro_orders", "joined"):
        with pytest.raises(UsageError, match=r"cannot reach .*\(DUALITY_SCHEMA_REGISTRY_URL\)"):
            find_spec(Settings.from_env(), name)


def test_the_avro_workload_frames_records_and_every_bad_kind(tmp_path: Path):
    """`duality produce`'s Avro records (without a registry: the writer as it would be
    registered): good ones decode with fastavro to the record, each bad kind is one the stream
    refuses: a short frame, no magic byte, another schema id, bytes after the record, a null
    key, a null value."""
    import io
    import struct

    import fastavro

    from duality import workload
    from duality.avro.writer import AvroWriter, spec_schema

    source = {
        "topic": "orders",
        "format": "avro",
        "key": "product",
        "schema": {"product": "string", "quantity": "long", "ts": "timestamp"},
    }
    spec = parse_spec(_spec(source), "avro_orders.yaml", registry=False)
    written = spec_schema(spec)
    assert written["name"] == "AvroOrdersEvent"
    assert [f["type"] for f in written["fields"]] == [
        ["null", "string"],
        ["null", "long"],
        ["null", {"type": "long", "logicalType": "timestamp-millis"}],
    ]
    parsed = fastavro.parse_schema(written)
    writer = AvroWriter(
        "orders-value", 7, written, {}, frozenset(f["name"] for f in written["fields"]), parsed
    )
    made = workload.Workload(spec, keys=5, zipf=1.0, bad_fraction=0.5, seed=3, writer=writer)
    kinds: dict[str, int] = {}
    for _, value, kind in made.records(400):
        kinds[kind] = kinds.get(kind, 0) + 1
        frame = value or b""
        if kind == "null_value":
            assert value is None
            continue
        if kind == "short_frame":
            assert len(frame) < 5
            continue
        assert frame[0] == (1 if kind == "no_magic_byte" else 0), kind
        schema_id = struct.unpack(">I", frame[1:5])[0]
        assert schema_id == (workload.UNKNOWN_SCHEMA_ID if kind == "unknown_schema_id" else 7)
        body = io.BytesIO(frame[5:])
        record = fastavro.schemaless_reader(body, parsed, parsed)
        assert (body.tell() < len(frame) - 5) == (kind == "undecodable"), kind
        assert (record["product"] is None) == (kind == "missing_key"), kind
        if kind == "valid":
            assert record["product"].startswith("product-") and 1 <= record["quantity"] <= 9
            assert record["ts"].tzinfo is not None
    assert set(kinds) == {"valid", *workload.AVRO_BAD_KINDS} - {"late"}, kinds
