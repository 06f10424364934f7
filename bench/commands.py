"""The snapshot DAG's steps as Airflow runs them: each a whole `duality` command, from the
process's start to its exit, without and with the warm Spark (the batch server).

On a changelog of `keys` keys (1,000,000 by default): `snapshot --full`, then 1% of the keys
changed (nine in ten updated, one in ten tombstoned), `snapshot` (incremental), `validate
--no-publish` of that version, `publish` of it, and `snapshot` once more with nothing new. The
`cmd-*` scenarios start a Spark of their own in each process, as every step did before the
server; the `cmd-*-warm` ones are clients of a server the run starts, which first serves one
such sequence on a table of a tenth as many keys (a server in use has served earlier runs).
On the server, the 1% change, incremental snapshot, validation and publication are done three
times over (a scheduled DAG does them again and again): each figure is the median of the three,
all three in its JSON (`samples`). Each table is compared with an independent read of the
changelog. Then Airflow (started for it) runs that pipeline's snapshot DAG on the server after
1% more changes: the `dag-*-task` scenarios are its tasks' durations, `dag-snapshot-run` the
run's, from Airflow's REST API. Targets, on the warm ones: the incremental snapshot at most 0.25x
the full rebuild; validation at most 5 s per million rows; incremental snapshot, validation and
publication at most 15 s together; nothing new at most 3 s.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baselines import Figure
from duality.config import Settings
from duality.kafka import topics
from duality.local.batch_server import LocalBatchServer
from duality.snapshot import delta_log
from duality.snapshot.publish import PUBLISHED_VERSION
from duality.spec import PipelineSpec
from duality.storage import ObjectPath
from snapshots import CHANGED, _assert_equal, _changelog_truth, _row, _target, write_changelog
from streaming import bench_spec

INCREMENTAL_RATIO = 0.25
VALIDATE_SECONDS_PER_MILLION = 5.0
PUBLISHED_SECONDS = 15.0
NOTHING_NEW_SECONDS = 3.0
WARM_ROUNDS = 3  # rounds of 1% changed on the server; a figure is their median


@dataclass
class CommandFigure(Figure):
    command: str = ""
    warm: bool = False
    # The command's own `seconds` (its work, without the process's start and imports).
    reported_seconds: float | None = None
    targets: list[dict[str, Any]] = field(default_factory=list)
    # Each round's whole seconds, where the figure is their median.
    samples: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            **super().as_dict(),
            "command": self.command,
            "warm": self.warm,
            "reported_seconds": self.reported_seconds,
        }
        if self.samples:
            document["samples"] = [round(seconds, 3) for seconds in self.samples]
        if self.targets:
            document["targets"] = self.targets
            document["met"] = all(t["met"] for t in self.targets)
        return document


def command_scenarios(
    settings: Settings,
    source: str,
    keys: int,
    pipelines: Path,
    stamp: int,
    say: Callable[[str], None],
) -> list[Figure]:
    """Both sequences; the server is started, used and stopped here."""
    cold = _sequence(settings, source, keys, pipelines, f"bench_cmd_{stamp}", "", say)
    server = LocalBatchServer(settings)
    say("starting a batch server")
    started = time.perf_counter()
    server.start()
    say(f"the server took {time.perf_counter() - started:.1f} s to start")
    try:
        warm_settings = settings.replace(**server.client_settings())
        say("a first sequence through the server, on a tenth of the keys")
        _sequence(
            warm_settings, source, max(1_000, keys // 10), pipelines, f"bench_cmdw_{stamp}", "", say
        )
        warm = _sequence(
            warm_settings,
            source,
            keys,
            pipelines,
            f"bench_cmd_warm_{stamp}",
            "-warm",
            say,
            WARM_ROUNDS,
        )
        dag = _dag_tasks(warm_settings, source, pipelines, f"bench_cmd_warm_{stamp}", keys, say)
    finally:
        server.stop()
    _set_targets(warm)
    return [*cold, *warm, *dag]


def _dag_tasks(
    settings: Settings,
    source: str,
    pipelines: Path,
    name: str,
    keys: int,
    say: Callable[[str], None],
) -> list[CommandFigure]:
    """The snapshot DAG of the warm sequence's pipeline, run by Airflow on the server after 1%
    more changes: each task's duration and the run's, from Airflow's REST API."""
    from duality.airflow_api import AirflowClient
    from duality.demo import _run_dags
    from duality.local.airflow import AIRFLOW_USER, LocalAirflow
    from duality.local.ports import free_port

    scoped = settings.replace(
        pipelines=pipelines,
        airflow_url=f"http://localhost:{free_port()}",
        local_dir=settings.local_dir / "bench-airflow",
    )
    spec = bench_spec(name, source, pipelines)
    rng = random.Random(22)
    changed = rng.sample([f"p{i:07d}" for i in range(keys)], max(1, int(keys * CHANGED)))
    write_changelog(scoped, spec, {p: _row(rng) for p in changed})
    say("starting Airflow to run the snapshot DAG on the server")
    airflow = LocalAirflow(scoped)
    started = airflow.start()
    try:
        client = AirflowClient(scoped.airflow_url, AIRFLOW_USER, str(started.password))
        dag_id = f"duality_{spec.name}_snapshot"
        run_id = _run_dags(client, {dag_id: {}}, say)[dag_id]
        tasks = {t["task_id"]: t for t in client.task_instances(dag_id, run_id)}
        run = client.run(dag_id, run_id)
    finally:
        airflow.stop()
    figures = []
    for task in ("snapshot", "validate", "publish"):
        figure = CommandFigure(f"dag-{task}-task", 0, float(tasks[task]["duration"]), 0.0)
        figure.command, figure.warm = f"Airflow task {task} of {dag_id}", True
        figures.append(figure)
    total = _seconds(run["end_date"]) - _seconds(run["start_date"])
    figure = CommandFigure("dag-snapshot-run", 0, total, 0.0)
    figure.command, figure.warm = f"Airflow run {run_id} of {dag_id}", True
    return [*figures, figure]


def _seconds(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _sequence(
    settings: Settings,
    source: str,
    keys: int,
    pipelines: Path,
    name: str,
    suffix: str,
    say: Callable[[str], None],
    rounds: int = 1,
) -> list[CommandFigure]:
    spec = bench_spec(name, source, pipelines)
    topics.create_topic(
        settings, spec.changelog_topic, 6, config={"cleanup.policy": "compact"}, exist_ok=True
    )
    rng = random.Random(21)
    products = [f"p{i:07d}" for i in range(keys)]
    write_changelog(settings, spec, {p: _row(rng) for p in products})
    runs: dict[str, list[CommandFigure]] = {}

    def run(scenario: str, *arguments: str) -> dict[str, Any]:
        say(f"{scenario}{suffix}: duality {' '.join(arguments)}")
        result, seconds = _command(settings, pipelines, *arguments)
        rows = int(result.get("rows") or 0)
        figure = CommandFigure(f"{scenario}{suffix}", rows, seconds, 0.0)
        figure.command = f"duality {' '.join(arguments)}"
        figure.warm = settings.batch_server is not None
        figure.reported_seconds = result.get("seconds")
        runs.setdefault(scenario, []).append(figure)
        return result

    full = run("cmd-snapshot-full", "snapshot", spec.name, "--full")
    assert full["mode"] == "full", full
    for _ in range(rounds):
        changed = rng.sample(products, max(1, int(keys * CHANGED)))
        write_changelog(
            settings, spec, {p: None if i % 10 == 9 else _row(rng) for i, p in enumerate(changed)}
        )
        built = run("cmd-snapshot-incremental", "snapshot", spec.name)
        assert built["mode"] == "incremental", built
        version = str(built["version"])
        report = run("cmd-validate", "validate", spec.name, "--version", version, "--no-publish")
        assert report["success"], report
        run("cmd-publish", "publish", spec.name, "--version", version)
    none = run("cmd-snapshot-nothing-new", "snapshot", spec.name)
    assert none["mode"] == "none", none
    _assert_published(settings, spec, int(version))
    return [_median(figures) for figures in runs.values()]


def _median(figures: list[CommandFigure]) -> CommandFigure:
    """The run of median seconds, with every run's seconds as its samples when there are several."""
    middle = sorted(figures, key=lambda figure: figure.seconds)[len(figures) // 2]
    if len(figures) > 1:
        middle.samples = [figure.seconds for figure in figures]
    return middle


def _command(settings: Settings, pipelines: Path, *arguments: str) -> tuple[dict[str, Any], float]:
    """`duality ARGUMENTS --json` as a process: its result and its whole wall time."""
    env = {**os.environ, **settings.as_env(), "DUALITY_PIPELINES": str(pipelines)}
    command = [str(Path(sys.executable).with_name("duality")), *arguments, "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-3000:]}")
    return dict(json.loads(done.stdout)), seconds


def _assert_published(settings: Settings, spec: PipelineSpec, version: int) -> None:
    """The table publishes `version`, and holds exactly the changelog's live keys and values
    (read by a plain consumer), read by a Spark of this process's own."""
    from duality.spark import session

    path = spec.snapshot_path(settings)
    state = delta_log.table_state(path, delta_log.history(path)[0].version)
    assert state is not None, f"the log of {path} cannot be replayed"
    assert state.properties.get(PUBLISHED_VERSION) == str(version), state.properties
    truth = _changelog_truth(settings, spec)
    if isinstance(path, ObjectPath):
        # This process's Spark (the local scenarios') has no S3A on its class path: a table on
        # object storage is read by delta-rs, a second Delta engine, from the store.
        _assert_equal_on_store(settings, spec, path, truth)
        return
    spark = session(settings, "duality-bench-snapshots")
    _assert_equal(spark, settings, spec, truth, "published")


def _assert_equal_on_store(
    settings: Settings, spec: PipelineSpec, path: ObjectPath, truth: dict[str, tuple[Any, ...]]
) -> None:
    """The table's latest version on object storage, as delta-rs reads it, holds exactly the
    changelog's live keys and values."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    from duality.object_store import delta_rs_options

    columns = list(spec.aggregates)
    table = DeltaTable(str(path), storage_options=delta_rs_options(settings))
    reader = QueryBuilder().register("snapshot", table)
    selected = ", ".join(["product", *columns])
    rows = pa.table(reader.execute(f"SELECT {selected} FROM snapshot").read_all()).to_pylist()
    actual = {row["product"]: tuple(row[c] for c in columns) for row in rows}
    assert len(actual) == len(rows), f"a key appears twice in {path}"
    if actual != truth:
        differ = sum(1 for k in truth.keys() & actual.keys() if truth[k] != actual[k])
        raise AssertionError(
            f"the published snapshot on {path} differs from the changelog: "
            f"{len(truth.keys() - actual.keys())} keys missing, "
            f"{len(actual.keys() - truth.keys())} keys extra, {differ} rows differ"
        )


def _set_targets(warm: list[CommandFigure]) -> None:
    by = {f.scenario.removesuffix("-warm"): f for f in warm}
    full, incremental = by["cmd-snapshot-full"], by["cmd-snapshot-incremental"]
    validated, published = by["cmd-validate"], by["cmd-publish"]
    ratio = incremental.seconds / full.seconds
    incremental.targets = [
        _target(f"at most {INCREMENTAL_RATIO}x the full rebuild", ratio, ratio <= INCREMENTAL_RATIO)
    ]
    per_million = validated.seconds / validated.records * 1_000_000 if validated.records else 0
    validated.targets = [
        _target(
            f"at most {VALIDATE_SECONDS_PER_MILLION:g} s per million rows",
            per_million,
            per_million <= VALIDATE_SECONDS_PER_MILLION,
        )
    ]
    total = incremental.seconds + validated.seconds + published.seconds
    published.targets = [
        _target(
            f"incremental snapshot, validation and publication at most {PUBLISHED_SECONDS:g} s",
            total,
            total <= PUBLISHED_SECONDS,
        )
    ]
    none = by["cmd-snapshot-nothing-new"]
    none.targets = [
        _target(
            f"nothing new at most {NOTHING_NEW_SECONDS:g} s",
            none.seconds,
            none.seconds <= NOTHING_NEW_SECONDS,
        )
    ]
