"""The snapshot's suite: built-in checks follow the spec's shape; column types of the snapshot."""

from __future__ import annotations

from duality import validate
from duality.config import Settings
from duality.snapshot.build import column_types
from duality.spec import load_spec, spec_files


def _specs() -> dict:
    # Without the registry: avro_sales lists its schema, so it is typed all the same.
    return {p.stem: load_spec(p, registry=False) for p in spec_files(Settings.from_env())}


def test_snapshot_columns_and_types_follow_the_spec():
    sales, sensors = _specs()["product_sales"], _specs()["sensor_stats"]
    assert column_types(sales) == {
        "product": "string",
        "orders": "bigint",
        "units": "bigint",
        "revenue": "double",
        "max_amount": "double",
        "min_amount": "double",
        "avg_amount": "double",
        "_updated_at": "timestamp",
    }
    assert list(column_types(sensors))[:3] == ["sensor_id", "window_start", "readings"]
    assert column_types(sensors)["window_start"] == "timestamp"
    assert list(column_types(sales)) == sales.snapshot_columns


def test_built_in_checks():
    sales, sensors = _specs()["product_sales"], _specs()["sensor_stats"]
    checks = {
        (c.type, str(c.kwargs.get("column", c.kwargs.get("column_list"))))
        for c in validate.built_in_checks(sales)
    }
    assert ("expect_column_values_to_be_unique", "product") in checks
    assert ("expect_column_values_to_not_be_null", "product") in checks
    assert ("expect_column_values_to_be_between", "orders") in checks
    assert ("expect_column_values_to_be_of_type", "_updated_at") in checks
    ordered = [
        c for c in validate.built_in_checks(sales) if c.type == "unexpected_rows_expectation"
    ]
    assert [c.kwargs["description"] for c in ordered] == ["min_amount <= avg_amount <= max_amount"]
    windowed = {c.type: c.kwargs for c in validate.built_in_checks(sensors)}
    assert windowed["expect_compound_columns_to_be_unique"] == {
        "column_list": ["sensor_id", "window_start"]
    }
    # Every check, built-in and the demo specs' own, is a valid GE expectation.
    for spec in (sales, sensors):
        for check in [*validate.built_in_checks(spec), *validate.spec_checks(spec)]:
            validate._expectation(check, spec.name)
