"""Airflow tasks ended by a timeout or set to failed leave no process within 30 s
(docs/decisions/0009-airflow-task-processes.md)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from duality.airflow_api import AirflowClient
from duality.config import Settings
from duality.kafka import topics
from duality.local.ports import free_port
from tests.harness import assert_eventually, make_pipeline
from tests.stack import running_airflow


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _named(name: str) -> list[psutil.Process]:
    """The processes whose command line names the pipeline (the child and its JVM)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(name in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return _alive(found)


def _snapshot_task(client: AirflowClient, dag_id: str) -> dict | None:
    for run in client.runs(dag_id):
        for task in client.task_instances(dag_id, run["dag_run_id"]):
            if task["task_id"] == "snapshot" and task["state"] is not None:
                return {**task, "dag_run_id": run["dag_run_id"]}
    return None


@pytest.mark.parametrize("ending", ["execution_timeout", "set_failed_through_the_api"])
def test_an_ended_snapshot_task_leaves_no_process(settings: Settings, tmp_path: Path, ending):  # type: ignore[no-untyped-def]
    scoped = settings.replace(
        local_dir=tmp_path / "local",
        pipelines=tmp_path / "pipelines",
        reports=tmp_path / "reports",
        warehouse=tmp_path / "warehouse",
        airflow_url=f"http://localhost:{free_port()}",
        spark_master=f"spark://127.0.0.1:{free_port()}",  # nobody answers there
        snapshot_timeout_s=5.0 if ending == "execution_timeout" else 1800.0,
    )
    spec = make_pipeline(scoped, scoped.pipelines, "product_sales")
    for topic in (spec.source.topic, spec.changelog_topic):
        topics.create_topic(scoped, topic, 1)
    dag_id = f"duality_{spec.name}_snapshot"
    with running_airflow(scoped) as client:
        client.wait_for_dag(dag_id)
        client.set_paused(dag_id, False)  # Airflow runs the latest interval at once
        task = assert_eventually(lambda: _snapshot_task(client, dag_id), timeout=120)
        run_id = task["dag_run_id"]

        def child_and_jvm() -> list[psutil.Process]:
            named = _named(spec.name)
            return named if any("java" in p.name() for p in named) else []

        if ending == "set_failed_through_the_api":
            tree = assert_eventually(child_and_jvm, timeout=60, message="no JVM started")
            client.set_task_state(dag_id, run_id, "snapshot", "failed")
            expected = "failed"
        else:
            tree = _named(spec.name)  # the timeout may come before the JVM
            expected = "up_for_retry"  # a try that failed; the DAG gives it one retry
        ended = assert_eventually(
            lambda: (task := _snapshot_task(client, dag_id)) and task["state"] == expected and task,
            timeout=60,
            message=f"the snapshot task did not become {expected}",
        )
        assert_eventually(
            lambda: not _named(spec.name) and not _alive(tree),
            timeout=30,
            message=f"processes of the task remain: {_named(spec.name)}",
        )
        client.set_paused(dag_id, True)
        log = client.task_log(dag_id, run_id, "snapshot", ended["try_number"])
        assert "stopping process group" in log
        if ending == "execution_timeout":
            assert "AirflowTaskTimeout" in log
