"""duality on a Spark standalone cluster from pyspark's `bin/spark-class`: the stream runs
unchanged, its executors get duality as a zip (`spark.submit.pyFiles`)."""

from __future__ import annotations

import itertools
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from duality import workload
from duality.config import Settings
from duality.kafka import offsets, topics
from duality.local.spark_cluster import LocalSparkCluster
from duality.snapshot import delta_log
from duality.spark import package_zip
from duality.stream import control, heartbeat
from tests.harness import (
    ROOT,
    StreamProcess,
    assert_eventually,
    duality_json,
    make_pipeline,
    run_duality,
    run_python,
)
from tests.integration.spark.test_stream import _verify

EVENTS, MORE_EVENTS, KEYS = 12_000, 4_000, 500
KILLED, SURVIVOR = 0, 1

_IMPORT_CHECK = """
import json, sys
from duality.config import Settings
from duality.spark import session

def where(_):
    import os
    import duality
    yield duality.__file__, os.getcwd()

spark = session(Settings.from_env(), "duality-import-check")
try:
    print(json.dumps(spark.sparkContext.parallelize(range(8), 8).mapPartitions(where).collect()))
finally:
    spark.stop()
"""


def _daemons(root: Path) -> list[psutil.Process]:
    """Spark Master and Worker processes whose command line names a folder under `root`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        daemon = any(part.startswith("org.apache.spark.deploy.") for part in cmdline)
        if daemon and any(str(root) in part for part in cmdline):
            found.append(process)
    return found


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, settings: Settings
) -> Iterator[LocalSparkCluster]:
    root = tmp_path_factory.mktemp("spark-cluster")
    cluster = LocalSparkCluster(settings, workers=2, root=root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        assert cluster.processes() == [], "processes of the cluster survived stop()"
        assert _daemons(root) == [], "a Spark master or worker survived stop()"


def _state_store_dirs(cluster: LocalSparkCluster, worker: int) -> dict[str, list[Path]]:
    """RocksDB working files under a worker's local dirs, by state store partition."""
    stores: dict[str, list[Path]] = {}
    for store in cluster.local_dir(worker).rglob("StateStoreId(*"):
        files = [f for f in store.glob("workingDir-*/*") if f.is_file()]
        if files:
            partition = store.name.split("partId=")[1].split(",")[0]
            stores.setdefault(partition, []).extend(files)
    return stores


def _shipped(settings: Settings) -> dict[str, bytes]:
    """The zips of duality that sessions on the cluster made, by name (sources may change while
    the suite runs, so a test does not assume the current one is the one the stream used)."""
    folder = package_zip(settings).parent
    return {path.name: path.read_bytes() for path in folder.glob("duality-*.zip")}


def test_executors_import_duality_from_the_shipped_zip(
    cluster: LocalSparkCluster, settings: Settings
):
    scoped = settings.replace(spark_master=cluster.master_url)
    result = run_python(scoped, "-c", _IMPORT_CHECK, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    shipped = _shipped(scoped)
    work_dirs = [cluster.work_dir(i) for i in range(cluster.workers)]
    for module, cwd in json.loads(result.stdout.strip().splitlines()[-1]):
        # Python workers import duality from the zip fetched into the executor's work dir.
        zip_name, *inside = Path(module).parts[-3:]
        assert inside == ["duality", "__init__.py"] and zip_name in shipped, module
        assert any(Path(cwd).is_relative_to(work) for work in work_dirs), cwd
        assert (Path(cwd) / zip_name).read_bytes() == shipped[zip_name]


def test_stream_survives_a_worker_sigkill(
    cluster: LocalSparkCluster, settings: Settings, tmp_path: Path
):
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(settings, pipelines, "product_sales")
    topics.create_topic(settings, spec.source.topic, 4)
    workload.produce(settings, spec, events=EVENTS, keys=KEYS, bad_fraction=0.06, seed=51)
    on_cluster = settings.replace(spark_master=cluster.master_url)
    stream = StreamProcess(
        on_cluster, spec, pipelines, tmp_path / "stream.log", max_offsets_per_trigger=3_000
    )
    stream.start()
    try:
        assert_eventually(
            lambda: stream.covered() >= EVENTS // 3,
            timeout=180,
            interval=0.5,
            message=f"the stream on {cluster.master_url} never covered a third; {stream.log}",
        )
        cluster.kill_worker(KILLED)
        assert_eventually(cluster.alive_workers, [SURVIVOR], timeout=60)
        workload.produce(settings, spec, events=MORE_EVENTS, keys=KEYS, bad_fraction=0.06, seed=52)
        stream.wait_caught_up(timeout=240)
        # Read while the stream runs: a worker deletes an application's local dirs at its end.
        apps = [app["id"] for app in (cluster.master_state() or {}).get("activeapps", [])]
        survivor_stores = _state_store_dirs(cluster, SURVIVOR)
        killed_stores = _state_store_dirs(cluster, KILLED)
    finally:
        code = stream.stop()
    assert code == 0, stream.tail()

    _verify(settings, spec, EVENTS + MORE_EVENTS)

    # Both workers ran executors of the stream, each with duality's zip fetched from the driver.
    assert len(apps) == 1, f"the master lists {apps} as running, expected the stream alone"
    shipped = _shipped(settings)
    for worker in (KILLED, SURVIVOR):
        executors = list((cluster.work_dir(worker) / apps[0]).glob("*"))
        assert executors, f"worker {worker} ran no executor of the stream ({apps[0]})"
        for executor in executors:
            fetched = list(executor.glob("duality-*.zip"))
            assert len(fetched) == 1, f"{executor} holds {fetched}, expected one zip of duality"
            assert fetched[0].read_bytes() == shipped[fetched[0].name], fetched[0]

    # The table lives in the executors' RocksDB state stores, in the workers' own folders: after
    # the kill the survivor holds every partition (restored from the checkpoint).
    everywhere = set(survivor_stores) | set(killed_stores)
    assert everywhere, (
        f"no RocksDB state store files under {cluster.local_dir(SURVIVOR)} or "
        f"{cluster.local_dir(KILLED)}: the stream keeps no state on the executors"
    )
    assert set(survivor_stores) == everywhere, (survivor_stores.keys(), killed_stores.keys())


def _ran_on_both_workers(cluster: LocalSparkCluster, name: str) -> str:
    """The id of the finished application `name`, asserted to have had executors on both
    workers (their work dirs hold one folder per executor)."""
    apps = [
        app["id"]
        for app in (cluster.master_state() or {}).get("completedapps", [])
        if app.get("name") == name
    ]
    assert len(apps) == 1, f"the master lists {apps} for {name}"
    for worker in range(cluster.workers):
        executors = list((cluster.work_dir(worker) / apps[0]).glob("*"))
        assert executors, f"worker {worker} ran no executor of {name} ({apps[0]})"
    return str(apps[0])


def _job(settings: Settings, *args: str) -> dict:
    done = run_python(settings, *args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))


def test_snapshot_and_repartition_run_on_the_workers(
    cluster: LocalSparkCluster, settings: Settings, spark, tmp_path: Path
):  # type: ignore[no-untyped-def]
    """The batch jobs, unchanged, on the cluster: executors on both workers, and the results
    local mode gives (a snapshot equal to the changelog, an exact copy)."""
    from tests.integration.snapshot.test_snapshot import (
        _create_changelog,
        _history,
        _table,
        _truth,
        _write,
    )
    from tests.integration.spark.test_repartition import _assert_exact_copy

    cluster.start()  # both workers again, if an earlier test killed one
    on_cluster = settings.replace(
        spark_master=cluster.master_url,
        pipelines=tmp_path / "pipelines",
        warehouse=tmp_path / "warehouse",
        reports=tmp_path / "reports",
    )
    spec = make_pipeline(on_cluster, on_cluster.pipelines, "product_sales")
    topics.create_topic(on_cluster, spec.source.topic, 4)
    _create_changelog(on_cluster, spec)
    rng = random.Random(17)
    _write(on_cluster, spec, _history(rng, range(600)))
    _write(on_cluster, spec, {f"p{i:04d}": None for i in range(0, 90, 3)})

    built = _job(on_cluster, str(ROOT / "jobs" / "rebuild_snapshot.py"), spec.name)
    _ran_on_both_workers(cluster, f"duality-snapshot-{spec.name}")
    rows = _table(delta_log.load(spark, spec.snapshot_path(on_cluster), built["version"]), spec)
    assert len(rows) == 570
    assert rows == _truth(on_cluster, spec)

    target = f"{spec.source.topic}-6p"
    workload.produce(on_cluster, spec, events=8_000, keys=KEYS, bad_fraction=0, seed=53)
    args = [spec.source.topic, "--to", target, "--partitions", "6"]
    report = _job(on_cluster, str(ROOT / "jobs" / "repartition.py"), *args)
    _ran_on_both_workers(cluster, f"duality-repartition-{target}")
    assert report["copied"] == 8_000
    _assert_exact_copy(on_cluster, spec.source.topic, target)


def _set_parallelism(spec_file: Path, partitions: int) -> None:
    data = yaml.safe_load(spec_file.read_text())
    data["parallelism"] = partitions
    spec_file.write_text(yaml.safe_dump(data))


class _OffsetsWatch:
    """The stream's committed source offsets, read every 0.2 s in a thread: they must never go
    back (a record read twice would take them back first)."""

    def __init__(self, settings: Settings, group: str, topic: str):
        self.settings, self.group, self.topic = settings, group, topic
        self.seen: list[dict[int, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopping.wait(0.2):
            committed = offsets.committed_offsets(self.settings, self.group, self.topic)
            self.seen.append({p: offset for p, (offset, _) in committed.items()})

    def stop(self) -> list[dict[int, int]]:
        self.stopping.set()
        self.thread.join(timeout=30)
        return self.seen


def test_rescale_under_load_4_to_8_then_8_to_2(
    cluster: LocalSparkCluster, settings: Settings, tmp_path: Path
):
    cluster.start()  # both workers again, if an earlier test killed one
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(settings, pipelines, "product_sales")
    spec_file = pipelines / f"{spec.name}.yaml"
    topics.create_topic(settings, spec.source.topic, 4)
    workload.produce(settings, spec, events=EVENTS // 2, keys=KEYS, bad_fraction=0.06, seed=61)
    # One core each, of the two workers: the warm standby's driver gets an executor too.
    on_cluster = settings.replace(
        spark_master=cluster.master_url, pipelines=pipelines, spark_cores_max=1
    )
    options = ("--max-offsets-per-trigger", "1000")
    load = threading.Thread(
        target=workload.produce,
        args=(settings, spec),
        kwargs={"events": MORE_EVENTS, "keys": KEYS, "bad_fraction": 0.06, "rate": 120, "seed": 62},
    )
    watch = _OffsetsWatch(settings, spec.consumer_group, spec.source.topic)

    def tasks() -> int | None:  # from the heartbeats, as `stream status` reads them
        return heartbeat.latest(settings).get(spec.name, {}).get("state_tasks")

    def shown(partitions: int) -> dict:
        status = duality_json(on_cluster, "stream", "status", spec.name)
        assert status["heartbeat"]["state_tasks"] == partitions, status
        return status

    def standby_waiting(pid: int | None) -> bool:
        """Whether the standby started as `pid` waits, warm, as the standby (its heartbeat)."""
        beat = heartbeat.latest(settings).get(control.standby_key(spec.name), {})
        return pid is not None and beat.get("state") == "standby" and beat.get("ppid") == pid

    try:
        duality_json(on_cluster, "stream", "start", spec.name, *options)
        # A warm standby beside it, as the supervisor DAG's replicas 2 keeps one.
        duality_json(on_cluster, "stream", "start", spec.name, "--standby", *options)
        standby = control.running_pid(settings, spec, standby=True)
        assert standby_waiting(standby), heartbeat.latest(settings).get(f"{spec.name}@standby")
        assert_eventually(tasks, 4, timeout=180, message="the stateful stage's tasks on 4")
        shown(4)
        load.start()
        # 4 -> 8 while the stream runs: rescale stops the standby first (it would take over from
        # the stream stopped), then the stream, and starts both again with their options.
        _set_parallelism(spec_file, 8)
        plan = duality_json(on_cluster, "stream", "rescale", spec.name, "--dry-run")
        assert (plan["partitions_before"], plan["partitions"]) == (4, 8), plan
        assert plan["stop_pid"] is not None and plan["job_args"][:2] == list(options)
        assert plan["standby_pid"] == standby and "--standby" in plan["standby_args"], plan
        assert plan["steps"][0].startswith("stop this host's standby"), plan["steps"]
        assert plan["steps"][-1] == "start the standby again", plan["steps"]
        done = duality_json(on_cluster, "stream", "rescale", spec.name, timeout=400)
        # The same plan (the load moved the committed offsets it names meanwhile).
        assert done["dry_run"] is False and done["steps"][:4] == plan["steps"][:4]
        assert_eventually(tasks, 8, timeout=180, message="the stateful stage's tasks on 8")
        # The stream's own instance is the active driver again, a new standby waits beside it.
        restarted = control.running_pid(settings, spec, standby=True)
        assert restarted not in (None, standby), (restarted, standby)
        assert_eventually(
            lambda: standby_waiting(restarted),
            timeout=180,
            message="the standby did not wait again as the standby after the rescale",
        )
        status = shown(8)
        assert status["heartbeat"]["ppid"] == status["pid"], status
        assert status["standby"]["ppid"] == restarted, status
        # 8 -> 2 while it is stopped: a start with the new number refuses, naming the rescale.
        duality_json(on_cluster, "stream", "stop", spec.name)
        _set_parallelism(spec_file, 2)
        refused = run_duality(on_cluster, "stream", "start", spec.name, *options)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"duality stream rescale {spec.name} --partitions 2" in refused.stderr
        done = duality_json(on_cluster, "stream", "rescale", spec.name)
        assert (done["partitions_before"], done["stop_pid"]) == (8, None), done
        duality_json(on_cluster, "stream", "start", spec.name, *options)
        assert_eventually(tasks, 2, timeout=180, message="the stateful stage's tasks on 2")
        shown(2)
        load.join(timeout=300)
        assert not load.is_alive(), "the load producer did not finish"
        produced = EVENTS // 2 + MORE_EVENTS
        assert_eventually(
            lambda: sum(watch.seen[-1].values()) if watch.seen else 0, produced, timeout=240
        )
    finally:
        seen = watch.stop()
        run_duality(on_cluster, "stream", "stop", spec.name)
    for earlier, later in itertools.pairwise(seen):
        assert all(later.get(p, 0) >= offset for p, offset in earlier.items()), (earlier, later)
    # The changelog equals the ground truth, and every bad record was dead-lettered once.
    _verify(settings, spec, produced)
