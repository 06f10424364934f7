"""Snapshot scenarios of `make bench`: full versus incremental rebuild, and validation speed.

A full run and three incremental ones on a table of a tenth as many keys come first, so that
the JVM's first Delta writes and MERGEs (a few seconds) fall on none of the timed runs.
- `snapshot-full`: a Delta snapshot rebuilt from a compacted changelog of `keys` keys
  (1,000,000 by default, written in the changelog's own record format).
- `snapshot-incremental`: after 1% of the keys changed (nine in ten updated, one in ten
  tombstoned), the incremental MERGE; `snapshot-full-after` rebuilds the same state in full, so
  both read the same changelog, and both tables are compared with an independent read of the
  changelog (a plain consumer, tests.harness.read_latest; the run fails when they differ).
  The figures carry the changelog records each run read; the target: incremental at most
  0.25x the full rebuild.
- `snapshot-nothing-new`: `duality snapshot` run as a command when the changelog has not moved
  (the whole process: Python start, Kafka offsets, the table's log); target at most 3 s.
- `validate`: the Great Expectations suite (built-in checks plus the spec's) on snapshots of
  `records` rows and of three times as many; the figures carry seconds per million rows (target
  at most 5, and not growing from the smaller table to the larger). A warm-up validation of a
  small table runs first, so the figures hold no process start-up: the Spark session and the
  import of Great Expectations are a few seconds per process, whatever the table's size.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baselines import Figure
from duality import changelog, validate
from duality.config import Settings
from duality.kafka import client, records, topics
from duality.snapshot import build, delta_log
from duality.spec import PipelineSpec
from streaming import bench_spec
from tests.harness import read_latest

CHANGED = 0.01
INCREMENTAL_RATIO = 0.25
NOTHING_NEW_SECONDS = 3.0
VALIDATE_SECONDS_PER_MILLION = 5.0
WARM_UP_MERGES = 3


def _target(description: str, value: float, met: bool) -> dict[str, Any]:
    return {"target": description, "value": round(value, 3), "met": bool(met)}


@dataclass
class SnapshotFigure(Figure):
    changelog_records_read: int = 0
    mode: str = ""
    targets: list[dict[str, Any]] = field(default_factory=list)
    # Checked against an independent read of the changelog (the run fails when it differs).
    equals_changelog: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            **super().as_dict(),
            "changelog_records_read": self.changelog_records_read,
            "mode": self.mode,
        }
        if self.equals_changelog is not None:
            document["equals_changelog"] = self.equals_changelog
        if self.targets:
            document["targets"] = self.targets
            document["met"] = all(t["met"] for t in self.targets)
        return document


@dataclass
class ValidationFigure(Figure):
    checks: int = 0
    targets: list[dict[str, Any]] = field(default_factory=list)

    @property
    def per_million(self) -> float:
        return self.seconds / self.records * 1_000_000 if self.records else 0.0

    def as_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            **super().as_dict(),
            "checks": self.checks,
            "seconds_per_million_rows": round(self.per_million, 3),
        }
        if self.targets:
            document["targets"] = self.targets
            document["met"] = all(t["met"] for t in self.targets)
        return document


def _row(rng: random.Random) -> dict[str, float | int]:
    orders = rng.randint(1, 50)
    low, high = sorted((round(rng.uniform(1, 500), 2), round(rng.uniform(1, 500), 2)))
    return {
        "orders": orders,
        "units": orders * rng.randint(1, 9),
        "revenue": round(orders * (low + high) / 2, 2),
        "max_amount": high,
        "min_amount": low,
        "avg_amount": (low + high) / 2,
    }


def write_changelog(
    settings: Settings, spec: PipelineSpec, changes: dict[str, dict[str, float | int] | None]
) -> None:
    producer = client.producer(settings, linger_ms=20)
    for product, row in changes.items():
        key = changelog.encode_key(spec, [product])
        value = (
            None
            if row is None
            else changelog.encode_value(spec, [product], row, {"count": row["orders"]}, 0)
        )
        records.send(producer, spec.changelog_topic, key, value)
    producer.flush(120)


def snapshot_scenarios(
    settings: Settings, spec: PipelineSpec, keys: int, pipelines: Path
) -> list[Figure]:
    """Full, incremental, nothing new (as a command), full again; `spec` is written to
    `pipelines` so that the command finds it."""
    from duality.spark import session

    spark = session(settings, "duality-bench-snapshots")
    rng = random.Random(12)
    warm_up = bench_spec(f"{spec.name}_warmup", spec.source.topic)
    _warm_up(settings, warm_up, spark, rng, max(1_000, keys // 10))
    topics.create_topic(
        settings, spec.changelog_topic, 6, config={"cleanup.policy": "compact"}, exist_ok=True
    )
    products = [f"p{i:07d}" for i in range(keys)]
    write_changelog(settings, spec, {p: _row(rng) for p in products})
    figures: list[SnapshotFigure] = []

    def timed(scenario: str, mode: build.Mode) -> SnapshotFigure:
        started = time.perf_counter()
        result = build.build(settings, spec, mode, spark=spark)
        seconds = time.perf_counter() - started
        assert result.mode == mode, (result.mode, result.fallback_reason)
        figure = SnapshotFigure(
            scenario, result.rows, seconds, 0.0, result.records_read, result.mode
        )
        figures.append(figure)
        return figure

    timed("snapshot-full", "full")
    changed = rng.sample(products, max(1, int(keys * CHANGED)))
    write_changelog(
        settings, spec, {p: None if i % 10 == 9 else _row(rng) for i, p in enumerate(changed)}
    )
    truth = _changelog_truth(settings, spec)
    incremental = timed("snapshot-incremental", "incremental")
    _assert_equal(spark, settings, spec, truth, "incremental")
    incremental.equals_changelog = True
    figures.append(_nothing_new(settings, spec, pipelines))
    full = timed("snapshot-full-after", "full")
    _assert_equal(spark, settings, spec, truth, "full")
    full.equals_changelog = True
    ratio = incremental.seconds / full.seconds
    incremental.targets = [
        _target(
            f"incremental at most {INCREMENTAL_RATIO}x the full rebuild of the same state",
            ratio,
            ratio <= INCREMENTAL_RATIO,
        )
    ]
    return list(figures)


def _warm_up(
    settings: Settings, spec: PipelineSpec, spark: Any, rng: random.Random, keys: int
) -> None:
    """A full run, then incremental ones, on a table of `keys` keys (a tenth of the timed
    table's), so that both kinds of timed run are measured warm: the JVM's one-time costs of its
    first Delta writes and MERGEs (class loading, code generation, compiling the hot loops: a
    few seconds) would otherwise fall on whichever kind runs first in the process."""
    topics.create_topic(settings, spec.changelog_topic, 6, config={"cleanup.policy": "compact"})
    products = [f"w{i:07d}" for i in range(keys)]
    write_changelog(settings, spec, {p: _row(rng) for p in products})
    build.build(settings, spec, "full", spark=spark)
    for _ in range(WARM_UP_MERGES):
        changed = rng.sample(products, max(1, int(keys * CHANGED)))
        write_changelog(
            settings, spec, {p: None if i % 10 == 9 else _row(rng) for i, p in enumerate(changed)}
        )
        result = build.build(settings, spec, "incremental", spark=spark)
        assert result.mode == "incremental", result.fallback_reason


def _changelog_truth(settings: Settings, spec: PipelineSpec) -> dict[str, tuple[Any, ...]]:
    """The aggregates of each live key, read from the changelog with a plain consumer (the
    tests' own, not duality.kafka's reader that the incremental snapshot uses)."""
    columns = list(spec.aggregates)
    latest = read_latest(settings, spec).values()
    return {value["product"]: tuple(value[c] for c in columns) for value in latest}


def _assert_equal(
    spark: Any,
    settings: Settings,
    spec: PipelineSpec,
    truth: dict[str, tuple[Any, ...]],
    label: str,
) -> None:
    """The snapshot's latest version holds exactly the changelog's live keys and values."""
    columns = list(spec.aggregates)
    table = delta_log.load(spark, spec.snapshot_path(settings))
    rows = table.select("product", *columns).toArrow().to_pylist()
    actual = {row["product"]: tuple(row[c] for c in columns) for row in rows}
    if actual != truth:
        missing = len(truth.keys() - actual.keys())
        extra = len(actual.keys() - truth.keys())
        differ = sum(1 for k in truth.keys() & actual.keys() if truth[k] != actual[k])
        raise AssertionError(
            f"the {label} snapshot differs from the changelog: {missing} keys missing, "
            f"{extra} keys extra, {differ} rows differ"
        )


def _nothing_new(settings: Settings, spec: PipelineSpec, pipelines: Path) -> SnapshotFigure:
    """`duality snapshot` as a process, when nothing is new: its whole wall time."""
    env = {**os.environ, **settings.as_env(), "DUALITY_PIPELINES": str(pipelines)}
    command = [str(Path(sys.executable).with_name("duality")), "snapshot", spec.name, "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    assert result["mode"] == "none", result
    figure = SnapshotFigure("snapshot-nothing-new", result["rows"], seconds, 0.0, 0, "none")
    figure.targets = [
        _target(
            f"a run that finds nothing new at most {NOTHING_NEW_SECONDS:g} s (the command)",
            seconds,
            seconds <= NOTHING_NEW_SECONDS,
        )
    ]
    return figure


def validation_scenarios(settings: Settings, spec: PipelineSpec, rows: int) -> list[Figure]:
    """The suite on `rows` rows and on three times as many, after a warm-up on a small table."""
    _validate(settings, spec, 1_000)
    figures = [_validate(settings, spec, rows), _validate(settings, spec, 3 * rows)]
    small, large = figures
    small.scenario, large.scenario = "validate", "validate-3x"
    for figure in figures:
        figure.targets = [
            _target(
                f"at most {VALIDATE_SECONDS_PER_MILLION:g} s per million rows",
                figure.per_million,
                figure.per_million <= VALIDATE_SECONDS_PER_MILLION,
            )
        ]
    large.targets.append(
        _target(
            "seconds per million rows do not grow with three times the rows",
            large.per_million / small.per_million,
            large.per_million <= small.per_million,
        )
    )
    return list(figures)


def _validate(settings: Settings, spec: PipelineSpec, rows: int) -> ValidationFigure:
    """The suite on a `rows`-row snapshot written directly with Spark."""
    from pyspark.sql import functions as F

    from duality.spark import session

    spark = session(settings, "duality-bench-snapshots")
    path = spec.snapshot_path(settings)
    low = F.round(F.rand(1) * 250 + 1, 2)
    high = F.round(F.rand(2) * 250 + 251, 2)
    frame = (
        spark.range(rows)
        .select(
            F.format_string("p%09d", "id").alias("product"),
            (F.col("id") % 50 + 1).alias("orders"),
            (F.col("id") % 50 + 1).alias("units"),
            ((low + high) / 2 * (F.col("id") % 50 + 1)).alias("revenue"),
            high.alias("max_amount"),
            low.alias("min_amount"),
            ((low + high) / 2).alias("avg_amount"),
            F.current_timestamp().alias("_updated_at"),
        )
        .select(*spec.snapshot_columns)
    )
    frame.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(str(path))
    started = time.perf_counter()
    report = validate.run(settings, spec, spark=spark, publish=False)
    seconds = time.perf_counter() - started
    assert report.success, report.failed
    return ValidationFigure("validate", report.rows, seconds, 0.0, report.checks)
