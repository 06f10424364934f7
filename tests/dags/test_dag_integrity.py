"""Every DAG file imports quickly and cleanly, and every DAG is one a team can operate."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jsonschema
import pytest

from duality.config import SHIPPED_PIPELINES
from tests.harness import ROOT, run_python

DAG_FILES = sorted((ROOT / "dags").glob("*.py"))


@pytest.fixture(scope="module")
def bags():  # type: ignore[no-untyped-def]
    from airflow.dag_processing.dagbag import DagBag

    return {path.name: DagBag(dag_folder=str(path)) for path in DAG_FILES}


@pytest.fixture(scope="module")
def dags(bags):  # type: ignore[no-untyped-def]
    found = {}
    for bag in bags.values():
        found.update(bag.dags)
    return found


def test_every_dag_file_imports_without_errors_in_under_two_seconds(bags):
    assert DAG_FILES, "no DAG files in dags/"
    for name, bag in bags.items():
        assert bag.import_errors == {}, f"{name}: {bag.import_errors}"
        assert bag.dags, f"{name} defines no DAG"
        for stat in bag.dagbag_stats:
            seconds = stat.duration.total_seconds()
            assert seconds < 2.0, f"{name} took {seconds:.2f}s to import"


def test_the_dags_of_every_pipeline_and_the_global_ones_exist(dags):
    pipelines = sorted(p.stem for p in SHIPPED_PIPELINES.glob("*.yaml"))
    assert pipelines
    expected = {"duality_repartition"}
    for name in pipelines:
        expected |= {f"duality_{name}_{kind}" for kind in ("stream", "snapshot", "reset")}
    assert set(dags) == expected


def test_every_dag_has_tags_an_owner_and_retries(dags):
    for dag_id, dag in dags.items():
        assert "duality" in dag.tags, dag_id
        assert len(dag.tags) >= 2, f"{dag_id}: tags {dag.tags} do not say its kind"
        for task in dag.tasks:
            assert task.owner == "duality", f"{dag_id}.{task.task_id} owner {task.owner!r}"
            assert task.retries is not None, f"{dag_id}.{task.task_id} has no retries setting"
        scheduled = dag.schedule is not None
        if "snapshot" in dag.tags or "repartition" in dag.tags:
            assert scheduled, f"{dag_id} should be scheduled"
            assert any(t.retries >= 1 for t in dag.tasks), f"{dag_id} never retries"
        if "reset" in dag.tags:
            assert not scheduled, f"{dag_id}: a reset runs only by hand"


def test_param_schemas_are_valid_json_schema_and_defaults_conform(dags):
    manual = 0
    for dag_id, dag in dags.items():
        for name, param in dag.params.items():
            schema = param.schema
            jsonschema.Draft202012Validator.check_schema(schema)
            jsonschema.Draft202012Validator(schema).validate(param.value)
            assert param.description, f"{dag_id}: param {name} has no description for the form"
            json.dumps(param.dump())  # the UI gets it as JSON
        manual += bool(dag.params)
    assert manual >= 3  # supervisor, reset and repartition forms


def test_supervisor_and_repartition_params_offer_the_documented_choices(dags):
    stream = next(d for d in dags.values() if "stream" in d.tags)
    actions = ["ensure", "start", "stop", "restart", "rescale"]
    assert stream.params.get_param("action").schema["enum"] == actions
    for name, good, bad in (("replicas", [None, 1, 2], [0, 3]), ("partitions", [None, 8], [0])):
        schema = stream.params.get_param(name).schema
        for value in good:
            jsonschema.validate(value, schema)
        for value in bad:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(value, schema)
    repartition = dags["duality_repartition"]
    assert set(repartition.params) == {"topic", "partitions", "strategy", "dry_run"}
    strategy = repartition.params.get_param("strategy").schema
    assert {"key-hash", "salted"} <= set(strategy["enum"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(0, repartition.params.get_param("partitions").schema)


def test_a_snapshot_dag_publishes_its_asset_only_after_validation(dags):
    snapshot = next(d for d in dags.values() if "snapshot" in d.tags)
    order = [t.task_id for t in snapshot.topological_sort()]
    assert order == ["snapshot", "validate", "publish"]
    publish = snapshot.get_task("publish")
    assert [o.name for o in publish.outlets] == [snapshot.dag_id]
    assert all(not t.outlets for t in snapshot.tasks if t.task_id != "publish")


# Run in a fresh interpreter: this test process has imported duality.kafka (conftest) and
# parsed every DAG (the fixtures) already, so its own sys.modules could never show a new import.
_PARSE = """
import json, socket, sys

def refuse(*args, **kwargs):
    raise AssertionError(f"a DAG file opened a connection at parse time: {args}")

socket.socket.connect = refuse
socket.create_connection = refuse
from airflow.dag_processing.dagbag import DagBag

errors = {path: DagBag(dag_folder=path).import_errors for path in sys.argv[1:]}
print(json.dumps({"errors": errors, "modules": sorted(sys.modules)}))
"""


def test_parsing_touches_no_broker_and_no_spark():
    """Parse every DAG file in a fresh interpreter with networking refused: nothing at parse
    time may connect, nor import Spark, Great Expectations, Delta or a Kafka client."""
    path = {"PYTHONPATH": os.pathsep.join(sys.path)}
    result = run_python(path, "-c", _PARSE, *map(str, DAG_FILES), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.splitlines()[-1])
    assert all(not errors for errors in parsed["errors"].values()), parsed["errors"]
    heavy = {"pyspark", "great_expectations", "confluent_kafka", "delta"}
    loaded = {m.split(".")[0] for m in parsed["modules"]}
    assert not heavy & loaded, f"parsing imported {heavy & loaded}"


_PARSE_DAG_IDS = _PARSE.replace(
    '{"errors": errors,', '{"dags": sorted(DagBag(dag_folder=sys.argv[1]).dags), "errors": errors,'
)


def test_an_avro_spec_imports_with_no_registry_reachable(tmp_path: Path):
    """The DAG file does not ask an Avro source's schema registry (nor anything else) at parse
    time: with the registry down and networking refused, an Avro pipeline's DAGs are there."""
    (tmp_path / "avro_orders.yaml").write_text(
        "name: avro_orders\n"
        "source: {topic: orders, format: avro, key: product}\n"
        "aggregates: {orders: count(), revenue: sum(price)}\n"
    )
    shipped = (SHIPPED_PIPELINES / "product_sales.yaml").read_text()
    (tmp_path / "product_sales.yaml").write_text(shipped)
    variables = {
        "PYTHONPATH": os.pathsep.join(sys.path),
        "DUALITY_PIPELINES": str(tmp_path),
        "DUALITY_SCHEMA_REGISTRY_URL": "http://127.0.0.1:9/apis/ccompat/v7",
    }
    dag_file = str(ROOT / "dags" / "duality_pipelines.py")
    result = run_python(variables, "-c", _PARSE_DAG_IDS, dag_file, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.splitlines()[-1])
    assert parsed["errors"] == {dag_file: {}}
    assert parsed["dags"] == sorted(
        f"duality_{name}_{kind}"
        for name in ("avro_orders", "product_sales")
        for kind in ("stream", "snapshot", "reset")
    )


def test_a_bad_spec_is_an_import_error_naming_the_file(tmp_path: Path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "broken.yaml").write_text("name: broken\nsource: {topic: t}\n")
    monkeypatch.setenv("DUALITY_PIPELINES", str(tmp_path))
    bag = DagBag(dag_folder=str(ROOT / "dags" / "duality_pipelines.py"))
    (error,) = bag.import_errors.values()
    assert "broken.yaml" in error and "invalid pipeline spec" in error


def test_repartition_params_select_the_moves():
    import importlib.util

    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

    loader = importlib.util.spec_from_file_location(
        "repartition_dag", ROOT / "dags" / "duality_repartition.py"
    )
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    select = module.select_moves
    fields = ("source", "target", "partitions", "strategy", "hot_keys", "salts")
    configured = [
        dict(zip(fields, ("a", "a-r", 12, "salted", "auto", None), strict=True)),
        dict(zip(fields, ("b", "b-r", 4, "key-hash", None, None), strict=True)),
    ]
    defaults = {"topic": "", "partitions": None, "strategy": "configured", "dry_run": False}
    assert [m["source"] for m in select(configured, defaults)] == ["a", "b"]
    (only,) = select(
        configured, {**defaults, "topic": "a", "strategy": "key-hash", "dry_run": True}
    )
    assert only["strategy"] == "key-hash" and only["hot_keys"] is None and only["dry_run"]
    (other,) = select(configured, {**defaults, "topic": "c", "partitions": 8})
    wanted = ("c", "c-8p", 8, "key-hash", None, None, False)
    assert other == dict(zip((*fields, "dry_run"), wanted, strict=True))
    with pytest.raises(AirflowFailException, match="partitions"):
        select(configured, {**defaults, "topic": "c"})
    with pytest.raises(AirflowSkipException):
        select([], defaults)


def test_every_task_has_the_execution_timeout_of_its_kind_from_settings(dags):
    from duality.config import Settings

    settings = Settings.from_env()
    kinds = {
        "supervise": "supervise",
        "wait_running": "supervise",
        "snapshot": "snapshot",
        "validate": "validate",
        "publish": "publish",
        "select": "repartition",
        "repartition": "repartition",
        "reset": "reset",
    }
    for dag_id, dag in dags.items():
        for task in dag.tasks:
            seconds = getattr(settings, f"{kinds[task.task_id]}_timeout_s")
            assert task.execution_timeout is not None, f"{dag_id}.{task.task_id}"
            assert task.execution_timeout.total_seconds() == seconds, f"{dag_id}.{task.task_id}"
