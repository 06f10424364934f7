"""Tables and joins in specs: a good join types its table's columns; each kind of bad join stops
with exit 2 before any work, naming the file, the spec key and the fix."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from duality.config import Settings
from duality.errors import UsageError
from duality.spec import load_spec
from tests.harness import run_duality

CUSTOMERS = {"topic": "customers", "schema": {"customer": "string", "tier": "string"}}
JOINED: dict[str, Any] = {
    "name": "tier_sales",
    "source": {
        "topic": "orders",
        "schema": {"order_id": "string", "customer": "string", "amount": "double"},
        "key": "customers.tier",
    },
    "tables": {"customers": {**CUSTOMERS, "key": "customer"}},
    "join": [{"table": "customers", "on": "customer"}],
    "aggregates": {"orders": "count()", "revenue": "sum(amount)"},
}
PRODUCTS: dict[str, Any] = {
    "name": "product_totals",
    "source": {
        "topic": "sales",
        "schema": {"product": "string", "units": "long"},
        "key": "product",
    },
    "aggregates": {"units": "sum(units)"},
}


def _write(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _changed(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(JOINED)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value
    return data


def test_a_join_types_the_tables_columns_and_keys_on_one(tmp_path: Path):
    spec = load_spec(_write(tmp_path, JOINED))
    joined = spec.joined
    assert joined is not None
    assert (joined.name, joined.topic, joined.key, joined.type) == (
        "customers",
        "customers",
        "customer",
        "left",
    )
    # `key: customers.tier` is a key field `tier` computed from the table's column.
    assert spec.source.key == ["tier"] and spec.computed_fields["tier"].type == "string"
    assert spec.snapshot_columns[0] == "tier"
    assert spec.required_fields == ["customer", "amount"]
    assert spec.table_topic == "tier_sales-table-customers"


def test_a_bare_on_key_is_not_read_as_yaml_true(tmp_path: Path):
    text = _write(tmp_path, JOINED).read_text().replace("'on'", "on")
    (tmp_path / "tier_sales.yaml").write_text(text)
    assert "\n  on: customer" in text or "- on: customer" in text
    assert load_spec(tmp_path / "tier_sales.yaml").joined is not None


def test_another_pipelines_table_has_its_key_and_aggregates(tmp_path: Path):
    _write(tmp_path, PRODUCTS)
    data = _changed(tables={"totals": {"pipeline": "product_totals"}})
    data["join"] = [{"table": "totals", "on": "customer"}]
    data["source"]["key"] = "customer"
    data["aggregates"]["units_seen"] = "max(totals.units)"
    joined = load_spec(_write(tmp_path, data)).joined
    assert joined is not None
    assert joined.topic == "product_totals-changelog"
    assert joined.columns == {"product": "string", "units": "long"}
    assert joined.pipeline == "product_totals"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (
            _changed(join=[{"table": "clients", "on": "customer"}]),
            "join[0].table: no table 'clients' (tables: customers)",
        ),
        (
            _changed(join=[{"table": "customers", "on": "amount"}]),
            "join[0].on: position 1: a double, but table customers is keyed by customer, a string",
        ),
        (
            _changed(tables={"customer": {**CUSTOMERS, "key": "customer"}}),
            "tables.customer: the table name clashes with the field 'customer'",
        ),
        (
            _changed(source__schema={"order_id": "string", "customer": "string", "tier": "int"}),
            "source.key: 'customers.tier' would be the key column 'tier', which clashes",
        ),
        (
            _changed(tables={"customers": {"pipeline": "tier_sales"}}),
            "tables.customers: pipeline 'tier_sales' would read itself through a table",
        ),
        (
            _changed(tables={"customers": {**CUSTOMERS}}),
            "a table needs key",
        ),
        (
            _changed(join=[{"table": "customers", "on": "customer"}] * 2),
            "join: a pipeline joins one table",
        ),
        (
            _changed(aggregates={"orders": "count()", "x": "sum(customers.nope)"}),
            "unknown field 'customers.nope'",
        ),
        (
            _changed(tables={"customers": {**CUSTOMERS, "key": "customer", "subject": "c-value"}}),
            "tables.customers: subject: only an Avro table (format: avro) has one",
        ),
        (
            _changed(tables={"customers": {"pipeline": "product_totals", "format": "avro"}}),
            "tables.customers: format: a pipeline's table is its changelog, which is JSON",
        ),
    ],
)
def test_a_bad_join_names_the_key_and_the_fix(tmp_path: Path, data: dict[str, Any], needle: str):
    with pytest.raises(UsageError) as raised:
        load_spec(_write(tmp_path, data))
    assert needle in str(raised.value)


def test_an_avro_table_asks_the_registry_unless_told_not_to(tmp_path: Path):
    """An Avro table's `schema:` is checked against its subject when the spec loads: without a
    registry that names the setting; the DAG file's way (registry=False) does not ask."""
    avro = {**CUSTOMERS, "key": "customer", "format": "avro"}
    path = _write(tmp_path, _changed(tables={"customers": avro}))
    settings = Settings.from_env({"DUALITY_HOME": str(tmp_path)})
    assert settings.schema_registry_url is None
    with pytest.raises(UsageError, match="DUALITY_SCHEMA_REGISTRY_URL"):
        load_spec(path, settings=settings)
    joined = load_spec(path, settings=settings, registry=False).joined
    assert joined is not None and joined.avro is None
    assert joined.columns == {"customer": "string", "tier": "string"}


def test_windowed_and_composite_key_pipelines_are_refused_as_tables(tmp_path: Path):
    windowed = copy.deepcopy(PRODUCTS)
    windowed["source"]["schema"]["ts"] = "timestamp"
    windowed["source"]["event_time"] = "ts"
    windowed["window"] = {"size": "1 minute", "watermark": "1 minute"}
    _write(tmp_path, windowed)
    data = _changed(tables={"totals": {"pipeline": "product_totals"}})
    data["join"] = [{"table": "totals", "on": "customer"}]
    data["source"]["key"] = "customer"
    with pytest.raises(UsageError, match="is windowed: its table has a row per key and window"):
        load_spec(_write(tmp_path, data))
    composite = copy.deepcopy(PRODUCTS)
    composite["source"]["schema"]["shop"] = "string"
    composite["source"]["key"] = ["product", "shop"]
    _write(tmp_path, composite)
    with pytest.raises(UsageError, match="is keyed by 2 fields: a join looks up one key"):
        load_spec(_write(tmp_path, data))


def test_a_pipeline_reading_itself_through_another_is_refused(tmp_path: Path):
    loop = copy.deepcopy(PRODUCTS)
    loop["tables"] = {"sales": {"pipeline": "tier_sales"}}
    loop["join"] = [{"table": "sales", "on": "product"}]
    _write(tmp_path, loop)
    data = _changed(tables={"totals": {"pipeline": "product_totals"}})
    data["join"] = [{"table": "totals", "on": "customer"}]
    data["source"]["key"] = "customer"
    with pytest.raises(UsageError, match="tier_sales -> product_totals -> tier_sales"):
        load_spec(_write(tmp_path, data))


def test_spec_validate_exits_2_on_a_bad_join(tmp_path: Path):
    path = _write(tmp_path, _changed(join=[{"table": "clients", "on": "customer"}]))
    result = run_duality({"DUALITY_PIPELINES": str(tmp_path)}, "spec", "validate", str(path))
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr and "join[0].table" in result.stderr
    assert "Traceback" not in result.stderr
