"""The snapshot DAG on the batch server (issue #30, docs/decisions/0026): Airflow's tasks send
their steps to one warm Spark, which runs two pipelines' DAGs at once (their steps overlapping
on the server), stops a step whose task was set to failed, and whose loss mid-step fails the
task clearly, its retry publishing. The server takes only requests that carry its secret, over
TLS with the certificate it made as `duality up` does, within its own folders (issue #46,
docs/decisions/0034); the secret is in no log.

One Airflow and one batch server (local mode) serve the module's tests; each has pipelines of
its own. The topology test runs the same server on the Spark standalone cluster."""

from __future__ import annotations

import os
import random
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from duality import process
from duality.airflow_api import AirflowClient
from duality.batch_server import server_report
from duality.config import Settings
from duality.demo import _run_dags, _start_run
from duality.errors import CheckFailed
from duality.kafka import topics
from duality.local.batch_server import LocalBatchServer
from duality.local.ports import free_port
from duality.snapshot import publish
from duality.spec import PipelineSpec
from tests.harness import assert_eventually, make_pipeline, run_duality
from tests.integration.snapshot.test_snapshot import _create_changelog, _row, _table, _truth
from tests.integration.snapshot.test_snapshot import _write as write_changelog
from tests.stack import running_airflow, task_logs

# Enough changelog records that a snapshot step runs for seconds on a warm server.
LONG_KEYS = 300_000
# Keys of each of the two pipelines whose DAGs run at once: their steps take seconds each, longer
# than the gap between the starts of two tasks that the scheduler queues together.
OVERLAP_KEYS = 40_000


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
        # Its address, secret file and certificate, as `duality up` records them; Airflow's
        # `spark_default` gets the secret as its password.
        scoped = scoped.replace(**server.client_settings())
        with running_airflow(scoped) as client:
            yield Stack(scoped, server, client)
    finally:
        server.stop()


def _pipeline(stack: Stack, keys: int, seed: int) -> PipelineSpec:
    """A pipeline whose changelog holds `keys` keys. Its truth is read later: a transaction's
    commit markers reach the partitions after the commit returns, so a read_committed reader
    at once may not see all of it yet."""
    spec = make_pipeline(stack.settings, stack.settings.pipelines, "product_sales")
    topics.create_topic(stack.settings, spec.source.topic, 3)
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
    steps = server_report(stack.settings)["steps"]
    return any(f"snapshot {spec.name}" in step["command"] for step in steps)


def _secret(stack: Stack) -> str:
    secret = stack.settings.read_batch_server_secret()
    assert secret is not None and len(secret) >= 40
    return secret


def _ended(stack: Stack, pipeline: str) -> list[dict[str, Any]]:
    """The steps of `pipeline` that ended on the server, with their start and end times."""
    ended = server_report(stack.settings)["ended"]
    return [step for step in ended if step["command"].split()[1:2] == [pipeline]]


def overlapping(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The pairs of steps, one of each list, whose runs intersect (one started before the other
    ended): none when the server ran them one at a time."""
    return [
        (a["command"], b["command"])
        for a in first
        for b in second
        if max(a["started"], b["started"]) < min(a["ended"], b["ended"])
    ]


def test_overlapping_finds_steps_that_ran_at_once_and_none_of_steps_run_in_turn():
    def step(command: str, started: float, ended: float) -> dict[str, Any]:
        return {"command": command, "started": started, "ended": ended}

    a = [step("snapshot a", 0.0, 4.0), step("validate a", 4.5, 6.0)]
    assert overlapping(a, [step("snapshot b", 3.0, 4.2)]) == [("snapshot a", "snapshot b")]
    # One at a time, even back to back: no overlap.
    assert overlapping(a, [step("snapshot b", 4.0, 4.5), step("validate b", 6.0, 7.0)]) == []


def test_two_pipelines_snapshot_dags_at_once_on_one_server(spark, stack: Stack):  # type: ignore[no-untyped-def]
    pipelines = [_pipeline(stack, OVERLAP_KEYS, seed) for seed in (1, 2)]
    dags = [f"duality_{spec.name}_snapshot" for spec in pipelines]
    for dag_id in dags:  # both parsed first, so that both runs start together
        stack.client.wait_for_dag(dag_id)
    try:
        runs = _run_dags(stack.client, {dag_id: {} for dag_id in dags}, lambda _: None)
    except CheckFailed as failed:
        runs_ = [(d, r["dag_run_id"]) for d in dags for r in stack.client.runs(d)]
        logs = [task_logs(stack.client, d, r) for d, r in runs_]
        raise AssertionError(f"{failed}\n{''.join(logs)}\n{_log(stack)[-3000:]}") from None
    log = _log(stack)
    for spec in pipelines:
        _, table = _published(spark, stack, spec)
        assert table == _truth(stack.settings, spec), spec.name
        for step in (f"snapshot {spec.name}", f"validate {spec.name}", f"publish {spec.name}"):
            assert f"duality {step}" in log, f"the server did not run `{step}`"
    # The server ran them at once: by its own record, a step of one pipeline started before one
    # of the other ended (a server running steps one at a time would show none).
    first, second = (_ended(stack, spec.name) for spec in pipelines)
    assert len(first) == len(second) == 3, (first, second)
    assert overlapping(first, second), f"no two steps overlapped: {first} {second}"
    # The tasks sent the secret (from `spark_default`), which no task log nor the server's holds.
    secret = _secret(stack)
    for dag_id, run_id in runs.items():
        for task in ("snapshot", "validate", "publish"):
            assert secret not in stack.client.task_log(dag_id, run_id, task, 1), (dag_id, task)
    assert secret not in log


def _step(stack: Stack, *args: str, **env: str) -> Any:
    """`duality ARGS --json` as a thin client of the server, with the stack's settings and `env`
    on top ("" unsets a variable)."""
    variables = {**stack.settings.as_env(), **env}
    return run_duality({k: v for k, v in variables.items() if v}, *args, "--json")


def test_the_server_runs_only_requests_with_its_secret_and_says_why_not(stack: Stack):
    spec = _pipeline(stack, 100, 5)
    secret = _secret(stack)
    before = len(_ended(stack, spec.name))
    no_secret = _step(stack, "snapshot", spec.name, DUALITY_BATCH_SERVER_SECRET_FILE="")
    wrong = _step(
        stack,
        "snapshot",
        spec.name,
        DUALITY_BATCH_SERVER_SECRET_FILE="",
        DUALITY_BATCH_SERVER_SECRET="not-the-servers-secret-0123456789",
    )
    for done, reason in (
        (no_secret, "the request carries no secret"),
        (wrong, "the request's secret is not the server's"),
    ):
        assert done.returncode == 2, done.stderr
        assert f"refused `duality snapshot`: {reason}: set " in done.stderr
        assert secret not in done.stdout + done.stderr
    assert len(_ended(stack, spec.name)) == before  # nothing ran
    assert _log(stack).count("refused a request from 127.0.0.1") >= 2
    # The right secret: the step runs.
    done = _step(stack, "snapshot", spec.name)
    assert done.returncode == 0, done.stderr
    assert [s["exit"] for s in _ended(stack, spec.name)] == [0]
    assert secret not in done.stdout + done.stderr and secret not in _log(stack)


def test_the_server_speaks_tls_with_the_certificate_it_made(stack: Stack):
    certificate = stack.server.tls_cert
    assert stack.settings.batch_server_tls_cert == certificate
    assert oct(stack.server.tls_key.stat().st_mode & 0o777) == "0o600"
    assert oct(stack.server.secret_file.stat().st_mode & 0o777) == "0o600"
    host, _, port = (stack.settings.batch_server or "").rpartition(":")
    context = ssl.create_default_context(cafile=str(certificate))
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as secured,
    ):
        presented = secured.getpeercert(binary_form=True)
        assert presented == ssl.PEM_cert_to_DER_cert(certificate.read_text())
        assert secured.version() in ("TLSv1.2", "TLSv1.3")
    spec = _pipeline(stack, 100, 6)
    plain = _step(stack, "snapshot", spec.name, DUALITY_BATCH_SERVER_TLS_CERT="")
    assert plain.returncode == 2, plain.stderr
    assert "takes TLS connections only: set DUALITY_BATCH_SERVER_TLS_CERT" in plain.stderr
    assert _ended(stack, spec.name) == []


def test_settings_outside_the_servers_warehouse_are_refused_naming_the_setting(
    stack: Stack, tmp_path: Path
):
    spec = _pipeline(stack, 100, 7)
    elsewhere = tmp_path / "warehouse"
    done = _step(stack, "snapshot", spec.name, DUALITY_WAREHOUSE=str(elsewhere))
    assert done.returncode == 2, done.stderr
    root = stack.settings.warehouse.resolve()
    assert f"DUALITY_WAREHOUSE={elsewhere} is outside the batch server's warehouse {root}" in (
        done.stderr
    )
    assert _ended(stack, spec.name) == [] and not elsewhere.exists()


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
            not (report := server_report(stack.settings))["steps"] and not report["active_jobs"]
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
