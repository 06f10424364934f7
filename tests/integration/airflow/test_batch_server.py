"""The snapshot DAG on the batch server (issue #30, docs/decisions/0026): Airflow's tasks send
their steps to one warm Spark, which runs two pipelines' DAGs at once, stops a step whose task
was set to failed, and whose loss mid-step fails the task clearly, its retry publishing.

One Airflow and one batch server (local mode) serve the module's tests; each has pipelines of
its own. The topology test runs the same server on the Spark standalone cluster."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from duality import kafka, process
from duality.airflow_api import AirflowClient
from duality.batch_server import server_report
from duality.config import Settings
from duality.demo import _run_dags, _start_run
from duality.local.batch_server import LocalBatchServer
from duality.local.ports import free_port
from duality.snapshot import publish
from duality.spec import PipelineSpec
from tests.harness import assert_eventually, make_pipeline
from tests.integration.snapshot.test_snapshot import _create_changelog, _row, _table, _truth
from tests.integration.snapshot.test_snapshot import _write as write_changelog
from tests.stack import running_airflow, task_logs

# Enough changelog records that a snapshot step runs for seconds on a warm server.
LONG_KEYS = 300_000


@dataclass
class Stack:
    settings: Settings
    server: LocalBatchServer
    client: AirflowClient


@pytest.fixture(scope="module")
def stack(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("batch")
    scoped = settings.replace(
        local_dir=root / "local",
        pipelines=root / "pipelines",
        reports=root / "reports",
        warehouse=root / "warehouse",
        airflow_url=f"http://localhost:{free_port()}",
    )
    server = LocalBatchServer(scoped)
    server.start()
    try:
        scoped = scoped.replace(batch_server=server.address)
        with running_airflow(scoped) as client:
            yield Stack(scoped, server, client)
    finally:
        server.stop()


def _pipeline(stack: Stack, keys: int, seed: int) -> PipelineSpec:
    """A pipeline whose changelog holds `keys` keys. Its truth is read later: a transaction's
    commit markers reach the partitions after the commit returns, so a read_committed reader
    at once may not see all of it yet."""
    spec = make_pipeline(stack.settings, stack.settings.pipelines, "product_sales")
    kafka.create_topic(stack.settings, spec.source.topic, 3)
    _create_changelog(stack.settings, spec)
    _write_keys(stack, spec, "p", keys, seed)
    return spec


def _write_keys(stack: Stack, spec: PipelineSpec, prefix: str, keys: int, seed: int) -> None:
    """`keys` new keys in the changelog, in transactions of at most 50,000 records."""
    rng = random.Random(seed)
    names = [f"{prefix}{i:07d}" for i in range(keys)]
    for start in range(0, keys, 50_000):
        chunk = names[start : start + 50_000]
        write_changelog(stack.settings, spec, {n: _row(n, rng.randint(1, 5), rng) for n in chunk})


def _published(spark, stack: Stack, spec: PipelineSpec) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    frame, found = publish.read(stack.settings, spec, spark=spark)
    return found.version, _table(frame, spec)


def _log(stack: Stack) -> str:
    return stack.server.log.read_text(errors="replace")


def _running(stack: Stack, spec: PipelineSpec) -> bool:
    steps = server_report(stack.settings.batch_server or "")["steps"]
    return any(f"snapshot {spec.name}" in step["command"] for step in steps)


def test_two_pipelines_snapshot_dags_at_once_on_one_server(spark, stack: Stack):  # type: ignore[no-untyped-def]
    pipelines = [_pipeline(stack, 500, seed) for seed in (1, 2)]
    dags = [f"duality_{spec.name}_snapshot" for spec in pipelines]
    _run_dags(stack.client, {dag_id: {} for dag_id in dags}, lambda _: None)
    log = _log(stack)
    for spec in pipelines:
        _, table = _published(spark, stack, spec)
        assert table == _truth(stack.settings, spec), spec.name
        for step in (f"snapshot {spec.name}", f"validate {spec.name}", f"publish {spec.name}"):
            assert f"duality {step}" in log, f"the server did not run `{step}`"


def test_a_snapshot_task_set_to_failed_stops_its_step_on_the_server(spark, stack: Stack):  # type: ignore[no-untyped-def]
    spec = _pipeline(stack, 200, 3)
    dag_id = f"duality_{spec.name}_snapshot"
    _run_dags(stack.client, {dag_id: {}}, lambda _: None)
    first, _ = _published(spark, stack, spec)
    truth = _truth(stack.settings, spec)
    _write_keys(stack, spec, "q", LONG_KEYS, LONG_KEYS)

    run_id = stack.client.trigger(dag_id)
    assert_eventually(lambda: _running(stack, spec), timeout=120, message="no step on the server")
    stack.client.set_task_state(dag_id, run_id, "snapshot", "failed")
    assert_eventually(
        lambda: (
            not (report := server_report(stack.settings.batch_server or ""))["steps"]
            and not report["active_jobs"]
        ),
        timeout=60,
        message="the step (or its Spark jobs) kept running on the server",
    )
    assert "its command went away; interrupting its Spark jobs" in _log(stack)
    # The scheduler marks the run failed at its next look at it (its later tasks upstream-failed).
    assert_eventually(
        lambda: stack.client.run(dag_id, run_id)["state"] == "failed",
        timeout=120,
        message="the run did not end failed",
    )
    version, table = _published(spark, stack, spec)
    assert version == first and table == truth  # the previous version stays published


def test_the_server_killed_mid_snapshot_fails_the_task_clearly_and_its_retry_publishes(
    spark, stack: Stack
):  # type: ignore[no-untyped-def]
    spec = _pipeline(stack, LONG_KEYS, 4)
    dag_id = f"duality_{spec.name}_snapshot"
    run_id = _start_run(stack.client, dag_id, {}, lambda _: None)
    assert_eventually(lambda: _running(stack, spec), timeout=180, message="no step on the server")
    pid = stack.server.pid()
    assert pid is not None
    process.kill_group(os.getpgid(pid))
    stack.server.start()  # restarted, as compose's restart policy or `duality up` would

    def first_try_failed() -> bool:
        tries = [
            t for t in stack.client.task_instances(dag_id, run_id) if t["task_id"] == "snapshot"
        ]
        return bool(tries) and tries[0]["try_number"] >= 2

    assert_eventually(first_try_failed, timeout=240, message="the snapshot task was not retried")
    log = stack.client.task_log(dag_id, run_id, "snapshot", 1)
    assert "closed the connection before `duality snapshot" in log, log[-3000:]
    finished = stack.client.wait_run(dag_id, run_id)
    assert finished["state"] == "success", (
        task_logs(stack.client, dag_id, run_id) + _log(stack)[-3000:]
    )
    _, table = _published(spark, stack, spec)
    assert table == _truth(stack.settings, spec)
