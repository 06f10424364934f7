"""`dag.test()` runs of the DAGs in child processes (tests/run_dag.py); DUALITY_BOOTSTRAP_SERVERS
is wrong on purpose, so a task that ignored `kafka_default` would fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from duality.config import Settings
from duality.kafka import topics
from duality.snapshot import delta_log
from tests.harness import (
    ROOT,
    StreamProcess,
    make_pipeline,
    read_latest,
    read_messages,
    read_topic,
    run_duality,
)


@pytest.fixture(scope="module")
def airflow_env(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import os

    root = tmp_path_factory.mktemp("dagtest")
    env = {
        **os.environ,
        **settings.as_env(),
        "DUALITY_BOOTSTRAP_SERVERS": "localhost:1",  # the connection below must take over
        "DUALITY_PIPELINES": str(root / "pipelines"),
        "DUALITY_REPORTS": str(root / "reports"),
        "DUALITY_REPARTITION_CONFIG": str(root / "repartition.yaml"),
        "AIRFLOW_HOME": str(root / "airflow"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW_CONN_KAFKA_DEFAULT": json.dumps(
            {"conn_type": "kafka", "extra": {"bootstrap.servers": settings.bootstrap_servers}}
        ),
        "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(
            {"conn_type": "spark", "host": settings.spark_master}
        ),
    }
    (root / "pipelines").mkdir()
    migrate = subprocess.run(
        [str(Path(sys.executable).with_name("airflow")), "db", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    return env


def dag_test(env: dict[str, str], dag_id: str, conf: dict[str, Any] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "run_dag.py"), dag_id, json.dumps(conf or {})],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def duality(env: dict[str, str], *args: str) -> dict[str, Any]:
    """The CLI as a person runs it outside Airflow: Kafka from DUALITY_BOOTSTRAP_SERVERS."""
    real = json.loads(env["AIRFLOW_CONN_KAFKA_DEFAULT"])["extra"]["bootstrap.servers"]
    done = run_duality(env, *args, "--json", env={"DUALITY_BOOTSTRAP_SERVERS": real}, timeout=600)
    result = json.loads(done.stdout) if done.stdout.strip() else {}
    return {**result, "exit_code": done.returncode}


def test_a_snapshot_dag_run_that_fails_validation_publishes_nothing(
    settings: Settings, airflow_env: dict[str, str]
):
    """A version that fails validation is built but never published: validate fails, publish is
    skipped as upstream_failed. (A run that passes is published by the e2e demo and on the local
    topology, through Airflow's scheduler.)"""
    pipelines = Path(airflow_env["DUALITY_PIPELINES"])
    spec = make_pipeline(settings, pipelines, "product_sales")
    # An expectation the data cannot meet: 1,500 orders of 200 products, at most 1 each.
    path = pipelines / f"{spec.name}.yaml"
    data = yaml.safe_load(path.read_text())
    data["expectations"] = [
        {
            "type": "expect_column_values_to_be_between",
            "kwargs": {"column": "orders", "max_value": 1},
        }
    ]
    path.write_text(yaml.safe_dump(data))
    scoped = settings.replace(pipelines=pipelines)
    produced = duality(airflow_env, "produce", spec.name, "--events", "1500", "--keys", "200")
    assert produced["exit_code"] == 0, produced
    stream = StreamProcess(scoped, spec, pipelines, pipelines.parent / "stream.log")
    stream.start()
    try:
        stream.wait_caught_up()
    finally:
        assert stream.stop() == 0, stream.tail()

    run = dag_test(airflow_env, f"duality_{spec.name}_snapshot")
    assert run["state"] == "failed", run
    assert run["tasks"] == {
        "snapshot": "success",
        "validate": "failed",
        "publish": "upstream_failed",
    }
    report = json.loads(
        (Path(airflow_env["DUALITY_REPORTS"]) / spec.name / "latest.json").read_text()
    )
    latest = read_latest(settings, spec)
    assert not report["success"] and report["rows"] == sum(v is not None for v in latest.values())
    assert [f["expectation"] for f in report["failed"]] == ["expect_column_values_to_be_between"]
    # The version was built, from the changelog of `kafka_default`; no version was published.
    history = delta_log.history(spec.snapshot_path(settings))
    assert report["version"] in [v.version for v in history] and report["rows"] > 0
    assert not [v for v in history if "published" in (v.metadata or {})]


def test_repartition_dag_moves_every_record_and_a_dry_run_moves_none(
    settings: Settings, airflow_env: dict[str, str], topic: str
):
    pipelines = Path(airflow_env["DUALITY_PIPELINES"])
    spec = make_pipeline(settings, pipelines, "product_sales", topic=topic)
    produced = duality(airflow_env, "produce", spec.name, "--events", "3000", "--zipf", "1.4")
    assert produced["exit_code"] == 0, produced
    target = f"{topic}-8"
    move = {"source": topic, "target": target, "partitions": 8, "strategy": "key-hash"}
    Path(airflow_env["DUALITY_REPARTITION_CONFIG"]).write_text(yaml.safe_dump({"topics": [move]}))
    dry = dag_test(airflow_env, "duality_repartition", {"dry_run": True})
    assert dry["state"] == "success", dry
    assert not topics.topic_exists(settings, target)

    run = dag_test(airflow_env, "duality_repartition")
    assert run["state"] == "success", run
    assert run["tasks"] == {"select": "success", "repartition[0]": "success"}
    assert topics.partition_count(settings, target) == 8
    source = {(p, o) for p, o, _, _ in read_topic(settings, topic)}
    lineage = set()
    for message in read_messages(settings, target):
        headers = dict(message.headers() or [])
        lineage.add(
            (int(headers["duality.source.partition"]), int(headers["duality.source.offset"]))
        )
    assert lineage == source and len(lineage) == 3000
    assert (Path(airflow_env["DUALITY_REPORTS"]) / "skew" / f"{topic}.png").is_file()
