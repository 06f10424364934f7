"""Snapshot scenarios of `make bench`: full versus incremental rebuild, and validation speed.

- `snapshot-full`: a Delta snapshot rebuilt from a compacted changelog of `keys` keys (100,000
  by default, written in the changelog's own record format).
- `snapshot-incremental`: after 1% of the keys changed (nine in ten updated, one in ten
  tombstoned), the incremental MERGE; `snapshot-full-after` rebuilds the same state in full, so
  both read the same changelog. The figures carry the changelog records each run read.
- `validate`: the Great Expectations suite (built-in checks plus the spec's) on a snapshot of
  `records` rows (1,000,000 by default); the figure carries seconds per million rows.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from baselines import Figure
from duality import changelog, kafka, snapshot, validate
from duality.config import Settings
from duality.spec import PipelineSpec

CHANGED = 0.01


@dataclass
class SnapshotFigure(Figure):
    changelog_records_read: int = 0
    mode: str = ""

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            **super().as_dict(),
            "changelog_records_read": self.changelog_records_read,
            "mode": self.mode,
        }


@dataclass
class ValidationFigure(Figure):
    checks: int = 0

    def as_dict(self) -> dict[str, float | int | str]:
        per_million = self.seconds / self.records * 1_000_000 if self.records else 0.0
        return {
            **super().as_dict(),
            "checks": self.checks,
            "seconds_per_million_rows": round(per_million, 3),
        }


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
    producer = kafka.producer(settings, linger_ms=20)
    for product, row in changes.items():
        key = changelog.encode_key(spec, [product])
        value = (
            None
            if row is None
            else changelog.encode_value(spec, [product], row, {"count": row["orders"]}, 0)
        )
        kafka.send(producer, spec.changelog_topic, key, value)
    producer.flush(120)


def snapshot_scenarios(settings: Settings, spec: PipelineSpec, keys: int) -> list[Figure]:
    from duality.spark import session

    spark = session(settings, "duality-bench-snapshots")
    kafka.create_topic(
        settings, spec.changelog_topic, 6, config={"cleanup.policy": "compact"}, exist_ok=True
    )
    rng = random.Random(12)
    products = [f"p{i:07d}" for i in range(keys)]
    write_changelog(settings, spec, {p: _row(rng) for p in products})
    figures: list[Figure] = []

    def timed(scenario: str, mode: snapshot.Mode) -> SnapshotFigure:
        started = time.perf_counter()
        result = snapshot.build(settings, spec, mode, spark=spark)
        seconds = time.perf_counter() - started
        assert result.mode == mode, (result.mode, result.fallback_reason)
        return SnapshotFigure(scenario, result.rows, seconds, 0.0, result.records_read, result.mode)

    figures.append(timed("snapshot-full", "full"))
    changed = rng.sample(products, max(1, int(keys * CHANGED)))
    write_changelog(
        settings, spec, {p: None if i % 10 == 9 else _row(rng) for i, p in enumerate(changed)}
    )
    figures.append(timed("snapshot-incremental", "incremental"))
    figures.append(timed("snapshot-full-after", "full"))
    return figures


def validation_scenario(settings: Settings, spec: PipelineSpec, rows: int) -> Figure:
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
    frame.write.format("delta").mode("overwrite").save(str(path))
    started = time.perf_counter()
    report = validate.run(settings, spec, spark=spark, publish=False)
    seconds = time.perf_counter() - started
    assert report.success, report.failed
    return ValidationFigure("validate", report.rows, seconds, 0.0, report.checks)
