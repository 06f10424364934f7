"""The production topology as `duality up` runs it on one machine (decision 16), as a user runs
the commands, on free ports in a temporary folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import psutil
import psycopg2
import pytest
import yaml

from duality.airflow_api import AirflowClient
from duality.config import SHIPPED_PIPELINES, Settings
from duality.errors import LocalStackError
from duality.kafka import offsets, topics
from duality.local.airflow import AIRFLOW_COMPONENTS, LocalAirflow
from duality.local.ports import free_ports
from duality.local.postgres import LocalPostgres
from duality.local.spark_cluster import local_spark
from duality.snapshot import delta_log
from duality.snapshot.publish import PUBLISHED_VERSION
from duality.spec import PipelineSpec, find_spec
from tests.harness import UP_TIMEOUT_S, assert_eventually, read_latest, run_duality
from tests.integration.spark.test_sasl import PASSWORD, USER, _leaks
from tests.integration.spark.test_stream import _verify
from tests.stack import Stack, stack_env, task_logs

BROKERS, WORKERS = 3, 2
EVENTS = 3_000


# Everything the commands printed, searched for the password at the end.
OUTPUTS: list[str] = []


def _duality(
    env: dict[str, str], *args: str, timeout: float = UP_TIMEOUT_S
) -> subprocess.CompletedProcess:
    done = run_duality(env, *args, "--json", timeout=timeout)
    OUTPUTS.extend((done.stdout, done.stderr))
    return done


def _ok(env: dict[str, str], *args: str) -> dict:
    done = _duality(env, *args)
    said = done.stderr
    if len(said) > 6000:  # the cause is at the start, the stop's messages at the end
        said = f"{said[:3000]}\n[…]\n{said[-3000:]}"
    assert done.returncode == 0, f"duality {' '.join(args)}:\n{said}"
    return dict(json.loads(done.stdout))


def _ours(root: Path) -> list[psutil.Process]:
    """Every process of the stack in `root`: its command line, its folder or its settings
    name `root` (brokers, Spark daemons and executors, Airflow and its database, streams)."""
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            named = " ".join(process.info["cmdline"] or []) + " " + (process.info["cwd"] or "")
            named += " " + process.environ().get("DUALITY_LOCAL_DIR", "")
        except psutil.Error:
            continue
        if str(root) in named:
            found.append(process)
    return found


@pytest.fixture(scope="module")
def topology() -> Iterator[Stack]:
    """`duality up --brokers 3 --spark-workers 2 --airflow-db postgres --sasl --object-store` in a
    folder of its own, the tables, checkpoints and reports in the S3 server's bucket; yields the
    stack with the environment of later commands, which names no address (the stack record
    supplies them) and holds the SCRAM login."""
    # PostgreSQL's own user must pass through the folder (not pytest's 0700 one).
    root = Path(tempfile.mkdtemp(prefix="duality-topology-"))
    root.chmod(0o755)
    env = stack_env(root)
    for setting in ("DUALITY_WAREHOUSE", "DUALITY_CHECKPOINT_ROOT", "DUALITY_REPORTS"):
        del env[setting]  # `up --object-store` puts them in its bucket (issue #49)
    base = free_ports(2 * BROKERS)  # node i listens on base + 2(i-1)
    env["DUALITY_BOOTSTRAP_SERVERS"] = f"localhost:{base}"
    env["DUALITY_CONTROLLER_PORT"] = str(base + 1)
    env.update(
        {
            "DUALITY_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "DUALITY_SASL_MECHANISM": "SCRAM-SHA-512",
            "DUALITY_SASL_USERNAME": USER,
            "DUALITY_SASL_PASSWORD": PASSWORD,
        }
    )
    # The demo pipeline, its snapshot DAG run only when triggered (the schedule's next time is
    # years ahead), so that the test's run is the only one.
    spec = yaml.safe_load((SHIPPED_PIPELINES / "product_sales.yaml").read_text())
    spec["snapshot"] = {**spec.get("snapshot", {}), "schedule": "0 0 29 2 *"}
    (root / "pipelines" / "product_sales.yaml").write_text(yaml.safe_dump(spec))
    later = {
        k: v
        for k, v in env.items()
        if k not in ("DUALITY_BOOTSTRAP_SERVERS", "DUALITY_CONTROLLER_PORT")
    }
    try:
        shape = ("--brokers", str(BROKERS), "--spark-workers", str(WORKERS))
        up = _ok(env, "up", *shape, "--airflow-db", "postgres", "--sasl", "--object-store")
        assert [n["state"] for n in up["broker"]["nodes"]] == ["running"] * BROKERS
        assert up["spark"]["state"] == "running"
        assert up["airflow"]["db"] == "postgres"
        web = up["airflow"]
        client = AirflowClient(Settings.from_env(later).airflow_url, web["user"], web["password"])
        yield Stack(root, later, Settings.from_env(later), client, web["password"])
    finally:
        down = _duality(later, "down")
        assert down.returncode == 0, down.stderr[-3000:]
        assert_eventually(lambda: _ours(root) == [], timeout=60, message="processes left")
    stopped = json.loads(down.stdout)
    assert len(stopped["brokers"]) == BROKERS and stopped["spark"]["was_running"] is True
    assert set(stopped["airflow"]["pids"]) == set(AIRFLOW_COMPONENTS), stopped["airflow"]
    assert stopped["airflow"]["postgres"], stopped["airflow"]  # the database server it stopped
    assert not (root / "local" / "stack.json").exists()
    shutil.rmtree(root, ignore_errors=True)


def test_later_commands_find_the_whole_stack(topology: Stack):
    status = _ok(topology.env, "status")
    assert status["topology"]["brokers"] == BROKERS
    nodes = status["broker"]["nodes"]
    assert [(n["node_id"], n["state"], n["reachable"]) for n in nodes] == [
        (i + 1, "running", True) for i in range(BROKERS)
    ]
    assert status["broker"]["brokers"] == BROKERS  # what the cluster itself answers
    assert status["broker"]["durability"]["replication_factor"] == 3
    assert status["broker"]["durability"]["min_insync_replicas"] == 2
    spark = status["spark"]
    assert spark["state"] == "running" and all(w["registered"] for w in spark["workers"])
    airflow = status["airflow"]
    assert airflow["db"] == "postgres" and airflow["healthy"] is True, airflow
    assert set(airflow["components"]) == set(AIRFLOW_COMPONENTS)
    assert status["object_store"]["state"] == "running", status["object_store"]
    settings = topology.settings
    for location in (settings.warehouse, settings.checkpoint_root, settings.reports):
        assert str(location).startswith(f"s3a://{settings.s3_bucket}/"), location

    # The same stack again: reported, not started twice; another topology is refused.
    again = _ok(topology.env, "up")
    assert [n["pid"] for n in again["broker"]["nodes"]] == [n["pid"] for n in nodes]
    other = _duality(topology.env, "up", "--brokers", "1")
    assert other.returncode == 2 and "duality down" in other.stderr, other.stderr


def test_a_pipeline_runs_on_the_brokers_and_the_workers(topology: Stack):
    settings = topology.settings
    assert len(settings.bootstrap_servers.split(",")) == BROKERS  # from the record
    assert settings.spark_master.startswith("spark://")
    spec = find_spec(settings, "product_sales")
    produced = _ok(topology.env, "produce", spec.name, "--events", str(EVENTS), "--seed", "9")
    assert produced["produced"] == EVENTS
    try:
        started = _ok(topology.env, "stream", "start", spec.name)
        assert started["heartbeat"]["state"] == "running"
        assert_eventually(
            lambda: _caught_up(settings, spec), timeout=240, interval=1.0, message="the stream lags"
        )
        cluster = local_spark(settings, WORKERS)
        apps = {a["name"]: a for a in (cluster.master_state() or {}).get("activeapps", [])}
        # The stream, and the batch server of the batch steps: each an executor per worker.
        assert set(apps) == {f"duality-stream-{spec.name}", "duality-batch-server"}, apps
        for app in apps.values():
            for worker in range(WORKERS):
                assert list((cluster.work_dir(worker) / app["id"]).glob("*")), (app, worker)
    finally:
        stopped = _ok(topology.env, "stream", "stop", spec.name)
    assert stopped["was_running"] is True
    _verify(settings, spec, EVENTS)
    info = topics.describe_topic(settings, spec.changelog_topic)
    assert info.replication_factor == 3 and info.config["min.insync.replicas"] == "2"


def test_scheduler_killed_mid_snapshot_publishes_once_and_nothing_shows_the_password(
    topology: Stack,
):
    """The stream DAG supervises the pipeline while the snapshot DAG runs; the scheduler is
    SIGKILLed mid-snapshot and `duality up` starts it again (decision 15): the run publishes
    once, one stream ran throughout, and no file of the stack, task log, XCom or command output
    holds the password (Airflow's tasks log in through `kafka_default`, SCRAM-SHA-512)."""
    settings, client = topology.settings, topology.client
    spec = find_spec(settings, "product_sales")
    stream_dag, snapshot_dag = f"duality_{spec.name}_stream", f"duality_{spec.name}_snapshot"
    airflow = LocalAirflow(settings)
    with StreamCount(spec.name) as streams:
        # Stopped by a person in the test above, so started by one: from here the stream DAG's
        # supervisor (its schedule runs it at once) keeps it running.
        assert _ok(topology.env, "stream", "start", spec.name)["state"] == "running"
        client.wait_for_dag(stream_dag)
        client.set_paused(stream_dag, False)
        _ok(topology.env, "produce", spec.name, "--events", "500", "--seed", "10")
        assert_eventually(lambda: _caught_up(settings, spec), timeout=240, interval=1.0)
        assert streams.now()["duality.stream.driver"], "the stream is not running"

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
        assert _ok(topology.env, "status")["airflow"]["state"] == "degraded"
        again = _ok(topology.env, "up")["airflow"]  # starts what does not run: the scheduler
        assert again["components"]["scheduler"]["pid"] not in (None, scheduler), again
        assert {n: again["components"][n]["pid"] for n in before} == before, "others restarted"

        try:  # within pytest's own timeout, so that what happened can be said
            run = client.wait_run(snapshot_dag, run_id, timeout=400)
        except LocalStackError as error:
            raise AssertionError(_what_happened(topology, snapshot_dag, run_id)) from error
        assert run["state"] == "success", _what_happened(topology, snapshot_dag, run_id)
        assert _epoch(run["start_date"]) < killed_at < _epoch(run["end_date"])
        assert [r["dag_run_id"] for r in client.runs(snapshot_dag)] == [run_id]
        assert streams.now()["duality.stream"], "the stream is not running any more"
        client.set_paused(stream_dag, True)
    assert streams.most == {"duality.stream": 1, "duality.stream.driver": 1}, (
        f"a pipeline ran two streams at once: {streams.seen}"
    )

    # One publication, of the version this run's snapshot task built, holding every key of the
    # changelog (read from the table's log, without Spark).
    path = spec.snapshot_path(settings)
    history = delta_log.history(path)
    publications = [v.metadata["published"] for v in history if "published" in (v.metadata or {})]
    states = {t["task_id"]: t["state"] for t in client.task_instances(snapshot_dag, run_id)}
    assert states["snapshot"] == "success", _what_happened(topology, snapshot_dag, run_id)
    version = client.xcom(snapshot_dag, run_id, "snapshot")["version"]
    assert [p["version"] for p in publications] == [version], publications
    newest = delta_log.table_state(path, history[0].version)
    assert newest is not None and newest.properties[PUBLISHED_VERSION] == str(version)
    built = delta_log.table_state(path, version)
    latest = read_latest(settings, spec)
    assert built is not None and built.rows == sum(v is not None for v in latest.values()) > 0
    assert _ok(topology.env, "read", spec.name, "--limit", "0")["version"] == version

    texts = [*OUTPUTS]
    for task in client.task_instances(snapshot_dag, run_id):
        log = client.task_log(snapshot_dag, run_id, task["task_id"], task["try_number"])
        assert f"running duality {task['task_id']} " in log, log  # the log was read
        texts += [log, json.dumps(client.xcom(snapshot_dag, run_id, task["task_id"]))]
    texts.append(json.dumps(_ok(topology.env, "status")))
    assert not _leaks([topology.root], texts)


def _caught_up(settings: Settings, spec: PipelineSpec) -> bool:
    ends = offsets.end_offsets(settings, spec.source.topic)
    done = offsets.committed_offsets(settings, spec.consumer_group, spec.source.topic)
    return all(done.get(p, (0, None))[0] >= end for p, end in ends.items())


def _task_state(client: AirflowClient, dag_id: str, run_id: str, task_id: str) -> str | None:
    for task in client.task_instances(dag_id, run_id):
        if task["task_id"] == task_id:
            return task.get("state")
    return None


# A stand-in for a scheduler killed mid-transaction: a process that holds a lock in a
# transaction, forks a child (as LocalExecutor forks its workers), and waits to be killed.
_HOLDER = """
import os, signal, psycopg2
database = psycopg2.connect(os.environ["DSN"])
database.cursor().execute("SELECT pg_advisory_xact_lock(4242)")
child = os.fork()
if child:
    print(child, flush=True)
signal.pause()
"""


def _lock_free(dsn: str) -> bool:
    database = psycopg2.connect(dsn)
    try:
        with database.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(4242)")
            return bool(cursor.fetchone()[0])
    finally:
        database.close()  # which releases the lock if it took it


def test_a_killed_process_transaction_ends_with_the_sessions_its_children_hold(topology: Stack):
    """What a scheduler killed mid-transaction leaves (decision 15): the workers it forked hold
    its database session and so its locks, until `end_sessions_held_by` ends that session."""
    postgres = LocalPostgres(topology.settings)
    dsn = postgres.url().replace("+psycopg2", "")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], env={**os.environ, "DSN": dsn}, stdout=subprocess.PIPE
    )
    assert holder.stdout is not None
    worker = psutil.Process(int(holder.stdout.readline()))
    try:
        holder.kill()
        holder.wait()
        assert not _lock_free(dsn), "the lock went with the process that took it"
        assert postgres.end_sessions_held_by([worker]) == 1
        assert_eventually(lambda: _lock_free(dsn), timeout=30, message="the lock is still held")
    finally:
        worker.kill()


def _what_happened(topology: Stack, dag_id: str, run_id: str) -> str:
    """The run's tasks and their logs' ends, then those of the batch server's and the
    scheduler's logs."""
    lines = [task_logs(topology.client, dag_id, run_id)]
    server = topology.root / "local" / "batch-server" / "server.log"
    for log in (server, LocalAirflow(topology.settings).component_log("scheduler")):
        if log.is_file():
            lines.append(f"--- {log}:\n{log.read_text(errors='replace')[-3000:]}")
    return "\n".join(lines)


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


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
