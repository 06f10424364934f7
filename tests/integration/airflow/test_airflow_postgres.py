"""Airflow's components on PostgreSQL survive a scheduler SIGKILLed mid-task, and `duality down`
stops them all (docs/decisions/0015-airflow-on-postgres.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from duality import kafka, workload
from duality.airflow_api import AirflowClient
from duality.config import Settings
from duality.local.airflow import AIRFLOW_COMPONENTS, AIRFLOW_USER, LocalAirflow
from duality.local.ports import free_port
from duality.snapshot import delta_log
from duality.snapshot.publish import PUBLISHED_VERSION
from duality.spec import PipelineSpec, load_spec
from tests.harness import assert_eventually, make_pipeline, read_latest, run_duality


@pytest.fixture
def root() -> Iterator[Path]:
    """The stack's folder: PostgreSQL's own user must pass through it (not pytest's 0700 one)."""
    folder = Path(tempfile.mkdtemp(prefix="duality-pg-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class StreamCount:
    """Counts, every 0.2 s on a thread, the running stream processes of one pipeline: its
    supervisor (`python -m duality.stream`) and its driver (`python -m duality.stream.driver`)."""

    def __init__(self, name: str):
        self.name = name
        self.most = {"duality.stream": 0, "duality.stream.driver": 0}
        self.seen: dict[str, set[int]] = {kind: set() for kind in self.most}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def now(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {kind: [] for kind in self.most}
        for process in psutil.process_iter(["cmdline", "status"]):
            cmdline = process.info["cmdline"] or []
            if process.info["status"] == psutil.STATUS_ZOMBIE or self.name not in cmdline:
                continue
            for kind in found:
                if any(part.endswith(kind) for part in cmdline):
                    found[kind].append(process.pid)
        return found

    def _watch(self) -> None:
        while not self._stop.is_set():
            for kind, pids in self.now().items():
                self.most[kind] = max(self.most[kind], len(pids))
                self.seen[kind].update(pids)
            self._stop.wait(0.2)

    def __enter__(self) -> StreamCount:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_scheduler_killed_mid_snapshot_publishes_once_and_runs_one_stream(
    settings: Settings, root: Path
):
    scoped = settings.replace(
        local_dir=root / "local",
        pipelines=root / "pipelines",
        reports=root / "reports",
        airflow_url=f"http://localhost:{free_port()}",
        airflow_db="postgres",
    )
    spec = _pipeline(scoped)
    workload.produce(scoped, spec, events=2000, keys=200, seed=3)
    airflow = LocalAirflow(scoped)
    try:
        started = airflow.start()
        assert started.db == "postgres" and started.healthy, started
        assert set(started.components) == set(AIRFLOW_COMPONENTS)
        assert started.postgres is not None and started.postgres.reachable
        client = AirflowClient(scoped.airflow_url, AIRFLOW_USER, str(started.password))
        with StreamCount(spec.name) as streams:
            _stream_and_snapshot(scoped, spec, airflow, client, streams)
            client.set_paused(f"duality_{spec.name}_stream", True)
    finally:
        down = run_duality(
            scoped,
            "down",
            "--json",
            env={"DUALITY_AIRFLOW_DB": "sqlite"},  # stops whatever runs, whatever the setting
            timeout=300,
        )
    assert down.returncode == 0, down.stderr[-3000:]
    stopped = json.loads(down.stdout)
    assert set(stopped["airflow"]["pids"]) == set(AIRFLOW_COMPONENTS), stopped["airflow"]
    assert stopped["airflow"]["postgres"], stopped["airflow"]  # the database server it stopped
    assert [s["pipeline"] for s in stopped["streams"]] == [spec.name], stopped["streams"]
    assert streams.most == {"duality.stream": 1, "duality.stream.driver": 1}, (
        f"a pipeline ran two streams at once: {streams.seen}"
    )
    assert _processes_of(root) == [], "the stack left processes behind"
    status = airflow.status()
    assert status.state == "stopped" and status.postgres and status.postgres.state == "stopped", (
        status
    )


def _stream_and_snapshot(
    settings: Settings,
    spec: PipelineSpec,
    airflow: LocalAirflow,
    client: AirflowClient,
    streams: StreamCount,
) -> None:
    stream_dag = f"duality_{spec.name}_stream"
    snapshot_dag = f"duality_{spec.name}_snapshot"
    client.wait_for_dag(stream_dag)
    client.set_paused(stream_dag, False)  # its schedule runs the supervisor at once

    def caught_up() -> bool:
        ends = kafka.end_offsets(settings, spec.source.topic)
        committed = kafka.committed_offsets(settings, spec.consumer_group, spec.source.topic)
        return all(committed.get(p, (0, None))[0] >= end for p, end in ends.items())

    assert_eventually(caught_up, timeout=240, interval=1.0, message="the stream did not catch up")

    client.wait_for_dag(snapshot_dag)
    client.set_paused(snapshot_dag, False)
    run_id = client.trigger(snapshot_dag)
    assert_eventually(
        lambda: _task_state(client, snapshot_dag, run_id, "snapshot") == "running",
        timeout=120,
        message="the snapshot task did not start",
    )
    before = {name: airflow.component_pid(name) for name in AIRFLOW_COMPONENTS}
    scheduler = before.pop("scheduler")
    assert scheduler is not None
    os.kill(scheduler, signal.SIGKILL)
    killed_at = time.time()
    assert_eventually(lambda: airflow.component_pid("scheduler") is None, timeout=10)
    assert airflow.status().state == "degraded"

    again = airflow.start()  # starts what does not run: the scheduler
    assert not again.already_running and again.healthy, again
    assert again.components["scheduler"].pid not in (None, scheduler)
    assert {n: again.components[n].pid for n in before} == before, "others restarted"

    finished = client.wait_run(snapshot_dag, run_id, timeout=300)
    tasks = {t["task_id"]: t for t in client.task_instances(snapshot_dag, run_id)}
    assert finished["state"] == "success", {n: t["state"] for n, t in tasks.items()}
    assert _epoch(finished["start_date"]) < killed_at < _epoch(finished["end_date"])
    assert [run["dag_run_id"] for run in client.runs(snapshot_dag)] == [run_id]

    # One publication, of the version this run's snapshot task built, holding every key of
    # the changelog (read from the table's log, without Spark).
    path = spec.snapshot_path(settings)
    history = delta_log.history(path)
    publications = [v.metadata["published"] for v in history if "published" in (v.metadata or {})]
    version = client.xcom(snapshot_dag, run_id, "snapshot")["version"]
    assert [p["version"] for p in publications] == [version], publications
    newest = delta_log.table_state(path, history[0].version)
    assert newest is not None and newest.properties[PUBLISHED_VERSION] == str(version)
    built = delta_log.table_state(path, version)
    latest = read_latest(settings, spec)
    assert built is not None and built.rows == sum(v is not None for v in latest.values()) > 0
    assert streams.now()["duality.stream"], "the stream is not running any more"


def _pipeline(settings: Settings) -> PipelineSpec:
    """A demo pipeline whose snapshot DAG runs only when triggered: its schedule's last time
    (29 February 2024) lies before the DAG's start, its next one years ahead."""
    spec = make_pipeline(settings, settings.pipelines, "product_sales")
    path = settings.pipelines / f"{spec.name}.yaml"
    data = yaml.safe_load(path.read_text())
    data["snapshot"] = {"schedule": "0 0 29 2 *"}
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def _task_state(client: AirflowClient, dag_id: str, run_id: str, task_id: str) -> str | None:
    for task in client.task_instances(dag_id, run_id):
        if task["task_id"] == task_id:
            return task.get("state")
    return None


def _epoch(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _processes_of(root: Path) -> list[str]:
    """Live processes whose command line, working folder or AIRFLOW_HOME lies in `root`."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE or process.pid == os.getpid():
            continue
        try:
            cmdline = " ".join(process.info["cmdline"] or [])
            places = (cmdline, process.cwd(), process.environ().get("AIRFLOW_HOME", ""))
        except psutil.Error:
            continue
        if any(str(root) in place for place in places):
            found.append(f"{process.pid} {cmdline[:200]}")
    return found
