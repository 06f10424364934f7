"""Pipeline specs: the demo specs load; bad ones fail with file, field and reason (exit 2)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from duality.config import Settings
from duality.errors import UsageError
from duality.spec import Aggregate, json_schema, load_spec, parse_duration, spec_files
from tests.harness import run_duality

GOOD = {
    "name": "shop_sales",
    "source": {
        "topic": "orders",
        "schema": {"product": "string", "quantity": "long", "amount": "double", "ts": "timestamp"},
        "key": "product",
    },
    "aggregates": {"orders": "count()", "units": "sum(quantity)", "avg_amount": "avg(amount)"},
}


def _write(folder: Path, data: dict, name: str | None = None) -> Path:
    path = folder / f"{name or data.get('name', 'spec')}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_demo_specs_load_and_differ_in_shape():
    # Without the registry: avro_sales lists its schema, so it is typed all the same.
    specs = {p.stem: load_spec(p, registry=False) for p in spec_files(Settings.from_env())}
    assert {"product_sales", "sensor_stats"} <= specs.keys()
    assert specs["product_sales"].window is None
    assert specs["avro_sales"].source.format == "avro" and specs["avro_sales"].source.columns_known
    assert specs["sensor_stats"].window is not None
    assert specs["sensor_stats"].key_columns == ["sensor_id", "window_start"]


def test_aggregate_grammar():
    assert Aggregate.parse("count()") == Aggregate(function="count")
    total = Aggregate.parse(" sum( amount ) ")
    assert (total.function, total.field, str(total)) == ("sum", "amount", "sum(amount)")
    line = Aggregate.parse("avg(quantity * price)")
    assert (line.function, line.field, str(line.argument)) == ("avg", None, "quantity * price")
    injections = ("sum(x); drop table", "__import__('os')", "sum(x, y)", "amount * 2")
    for bad in ("median(x)", "sum()", "count(x)", "abs(x)", *injections):
        with pytest.raises(ValueError):
            Aggregate.parse(bad)


def test_durations():
    assert parse_duration("10 minutes") == 600
    assert parse_duration("1 hour") == 3600
    with pytest.raises(ValueError):
        parse_duration("soon")


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"aggregates": {"x": "median(amount)"}}, "aggregates.x", "unknown function 'median'"),
        ({"aggregates": {"x": "sum(price)"}}, "aggregates.x", "position 5: unknown field 'price'"),
        ({"source": {**GOOD["source"], "key": "shop"}}, "source.key", "'shop' is neither"),
        ({"name": "Shop-Sales"}, "name", "not a pipeline name"),
        ({"aggregates": {"x": "sum(product)"}}, "aggregates.x", "sum() needs a number"),
        ({"source": {**GOOD["source"], "schema": {"_x": "long"}}}, "source.schema", "_ are"),
        (
            {"window": {"size": "1 hour", "watermark": "5 minutes"}},
            "(top level)",
            "needs source.event_time",
        ),
        ({"extra": 1}, "extra", "Extra inputs are not permitted"),
        (
            {
                "expectations": [
                    {"type": "expect_column_values_to_be_between", "kwargs": {"column": "amount"}}
                ]
            },
            "(top level)",
            "expectations[0] (expect_column_values_to_be_between) names column 'amount'",
        ),
        ({"expectations": [{"type": "column_min"}]}, "expectations.0.type", "should match"),
    ],
)
def test_bad_spec_names_file_field_and_reason(
    tmp_path: Path, change: dict, field: str, reason: str
):
    path = _write(tmp_path, {**GOOD, **change}, name="bad")
    with pytest.raises(UsageError) as error:
        load_spec(path)
    message = str(error.value)
    assert str(path) in message
    assert f"{field}:" in message
    assert reason in message


def test_file_name_must_match_pipeline(tmp_path: Path):
    with pytest.raises(UsageError, match=r"rename the file to shop_sales\.yaml"):
        load_spec(_write(tmp_path, GOOD, name="other"))


def test_spec_validate_command_exit_codes(tmp_path: Path):
    good = _write(tmp_path, GOOD)
    bad = _write(tmp_path, {**GOOD, "aggregates": {"x": "median(amount)"}}, name="broken")

    def run(*args: str) -> subprocess.CompletedProcess:
        return run_duality({"DUALITY_PIPELINES": str(tmp_path)}, "spec", *args, timeout=60)

    ok = run("validate", str(good))
    assert ok.returncode == 0, ok.stderr
    failed = run("validate", str(bad))
    assert failed.returncode == 2
    assert str(bad) in failed.stderr and "aggregates.x" in failed.stderr
    assert "median" in failed.stderr and "Traceback" not in failed.stderr
    everything = run("validate")  # the folder holds one good and one bad spec
    assert everything.returncode == 2
    schema = run("schema")
    assert schema.returncode == 0
    assert json.loads(schema.stdout)["properties"]["aggregates"]


def test_json_schema_documents_aggregates_as_strings():
    schema = json_schema()
    aggregates = schema["properties"]["aggregates"]["additionalProperties"]
    assert aggregates["type"] == "string"
    assert "source" in schema["required"]


def test_spec_validate_checks_expectations_with_great_expectations(tmp_path: Path):
    unknown = {**GOOD, "expectations": [{"type": "expect_revenue_to_grow", "kwargs": {}}]}
    bad_args = {
        **GOOD,
        "name": "bad_args",
        "expectations": [
            {"type": "expect_column_values_to_be_between", "kwargs": {"column": "units"}}
        ],
    }
    env = {"DUALITY_PIPELINES": str(tmp_path)}
    for data, needle in (
        (unknown, "unknown expectation 'expect_revenue_to_grow'"),
        (bad_args, "min_value and max_value cannot both be None"),
    ):
        path = _write(tmp_path, data)
        result = run_duality(env, "spec", "validate", str(path), timeout=120)
        assert result.returncode == 2, result.stderr
        assert str(path) in result.stderr and "expectations[0]" in result.stderr
        assert needle in result.stderr and "Traceback" not in result.stderr
