"""Table maintenance: OPTIMIZE (compaction) and VACUUM that keep the published version readable."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any

import tenacity

from duality.config import Settings
from duality.errors import ConcurrentWrite, UsageError
from duality.snapshot import delta_log
from duality.snapshot.build import Progress, quiet
from duality.snapshot.outage import reported
from duality.snapshot.publish import published
from duality.spark import session
from duality.spec import PipelineSpec
from duality.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# How many times OPTIMIZE runs when each run loses the race for its version.
_OPTIMIZE_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class Maintenance:
    pipeline: str
    path: str
    files_added_by_optimize: int
    files_removed_by_optimize: int
    retention_hours: float
    requested_retention_hours: float
    files_deleted_by_vacuum: int
    published_version: int | None
    seconds: float


@reported("snapshot --maintain")
def maintain(
    settings: Settings,
    spec: PipelineSpec,
    *,
    retain_hours: float = 168.0,
    spark: SparkSession | None = None,
    progress: Progress = quiet,
) -> Maintenance:
    """OPTIMIZE and VACUUM; the retention is rounded up to whole hours (Delta rounds it) and never
    less than the published version's age, so every file it reads stays (docs/snapshots.md)."""
    if retain_hours < 0:
        raise UsageError(f"--retain-hours {retain_hours:g}: must be zero or more")
    path = delta_log.require_table(spec, spec.snapshot_path(settings))
    spark = spark or session(settings, f"duality-maintain-{spec.name}")
    versions = delta_log.history(path)
    found = published(spark, path)
    retention = math.ceil(retain_hours)
    if found is not None:
        published_at = next(v.timestamp_ms for v in versions if v.version == found.version)
        # Files the published version reads are removed, if at all, by later commits.
        needed = (time.time() * 1000 - published_at) / 3_600_000
        retention = max(retention, math.ceil(needed), 1)
    table = delta_log.sql_name(path)
    again = f"run `duality snapshot {spec.name} --maintain` again"
    progress(f"compacting the files of {path}")
    started = time.monotonic()

    def said(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        progress(f"OPTIMIZE again, attempt {state.attempt_number + 1}: {error}")

    # OPTIMIZE loses the race for its version to a commit that removed files it compacted (an
    # incremental snapshot's): Delta retries only when no such file changed. Run again, it
    # compacts the table as the winner left it.
    for attempt in tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(ConcurrentWrite),
        stop=tenacity.stop_after_attempt(_OPTIMIZE_ATTEMPTS),
        before_sleep=said,
        reraise=True,
    ):
        metadata = _metadata(path)
        with (
            attempt,
            delta_log.commit_metadata(spark, metadata),
            delta_log.lost_race(path, "OPTIMIZE", again),
        ):
            # SQL, as every Delta statement duality runs (docs/decisions/0026).
            optimized = spark.sql(f"OPTIMIZE {table}").first()
    progress(f"removing files older than {retention} hours")
    before = _data_files(path)
    # Delta refuses a retention below its default (a week) unless this check is off.
    vacuum = {"spark.databricks.delta.retentionDurationCheck.enabled": "false"}
    with (
        delta_log.session_conf(spark, vacuum),
        delta_log.commit_metadata(spark, _metadata(path)),
        delta_log.lost_race(path, "VACUUM", again),
    ):
        spark.sql(f"VACUUM {table} RETAIN {retention} HOURS")
    after = _data_files(path)
    opt_metrics = (optimized["metrics"].asDict() if optimized is not None else {}) or {}
    return Maintenance(
        pipeline=spec.name,
        path=str(path),
        files_added_by_optimize=int(opt_metrics.get("numFilesAdded", 0)),
        files_removed_by_optimize=int(opt_metrics.get("numFilesRemoved", 0)),
        retention_hours=round(retention, 4),
        requested_retention_hours=retain_hours,
        files_deleted_by_vacuum=len(before - after),
        published_version=found.version if found else None,
        seconds=round(time.monotonic() - started, 2),
    )


def _metadata(path: Location) -> dict[str, Any]:
    """The userMetadata of a maintenance commit: what the table's newest version covers."""
    versions = delta_log.history(path)
    coverage, _ = delta_log.version_coverage(versions, versions[0].version)
    metadata: dict[str, Any] = {"kind": "maintain"}
    if coverage is not None:
        metadata["coverage"] = coverage.as_dict()
    return metadata


def _data_files(path: Location) -> set[str]:
    prefix = len(str(path)) + 1  # each file's path below the table's
    return {str(p)[prefix:] for p in path.rglob("*.parquet")}
