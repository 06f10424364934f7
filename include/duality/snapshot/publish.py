"""Verdicts recorded in the table, the published version in its properties, and reading it
(docs/decisions/0010-publish-gate-in-delta.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

from duality.config import Settings
from duality.errors import CheckFailed
from duality.snapshot import delta_log, dv_commit
from duality.snapshot.coverage import Coverage
from duality.snapshot.outage import reported
from duality.spark import session
from duality.spec import PipelineSpec
from duality.storage import Location, s3

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

PUBLISHED_VERSION = "duality.published.version"
PUBLISHED_COVERAGE = "duality.published.coverage"
VALIDATION = "duality.validation"  # the latest verdict, for people reading the properties
_COMMIT_ATTEMPTS = 3

log = logging.getLogger("duality.snapshot")


@dataclasses.dataclass(frozen=True)
class Published:
    """The version readers get and what it covers."""

    version: int
    coverage: Coverage


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A validation's verdict on a version, as the table records it."""

    version: int
    success: bool
    checks: int
    failed: list[str]  # "expectation [origin]" of each failed check
    reconciled: bool
    validated_at: str
    json_report: str  # on the machine that validated


@dataclasses.dataclass(frozen=True)
class Publication:
    pipeline: str
    published_version: int
    already_published: bool
    validation_commit: int  # the table's commit that records the passing verdict
    report: str  # where the validating machine wrote its report
    coverage: Coverage
    commit: int | None  # the commit that published it; None when it already was


def published(spark: SparkSession, path: Location) -> Published | None:
    """The published version and what it covers, from the table's properties (read from the
    latest version's log; from Spark when it cannot be replayed)."""
    state = delta_log.table_state(path, delta_log.history(path)[0].version)
    if state is not None:
        return _published_in(state.properties)
    detail = spark.sql(f"DESCRIBE DETAIL {delta_log.sql_name(path)}")
    row = detail.select("properties").first()
    return _published_in((row["properties"] if row else None) or {})


def published_in_log(path: Location) -> Published | None:
    """The published version from the latest version's log alone, without Spark; None when
    none is published or the log cannot be replayed."""
    latest = delta_log.table_state(path, delta_log.history(path)[0].version)
    return _published_in(latest.properties) if latest is not None else None


def published_size(spec: PipelineSpec, path: Location) -> tuple[Published, int] | None:
    """The published version and its row count from the table's log alone, without Spark;
    None when it does not say (none published, no statistics: `read` then asks)."""
    delta_log.require_table(spec, path)
    found = published_in_log(path)
    state = delta_log.table_state(path, found.version) if found is not None else None
    return (found, state.rows) if found and state and state.rows is not None else None


def _published_in(properties: dict[str, str]) -> Published | None:
    if PUBLISHED_VERSION not in properties:
        return None
    coverage = Coverage.from_dict(json.loads(properties[PUBLISHED_COVERAGE]))
    return Published(int(properties[PUBLISHED_VERSION]), coverage)


@reported("read")
def read(
    settings: Settings, spec: PipelineSpec, *, spark: SparkSession | None = None
) -> tuple[DataFrame, Published]:
    """The published snapshot (time travel to the validated version)."""
    path = delta_log.require_table(spec, spec.snapshot_path(settings))
    spark = spark or session(settings, f"duality-read-{spec.name}")
    found = published(spark, path)
    if found is None:
        raise CheckFailed(
            f"no version of {spec.name}'s snapshot has passed validation yet: run "
            f"`duality validate {spec.name}`"
        )
    return delta_log.load(spark, path, found.version), found


def record_validation(
    spark: SparkSession,
    path: Location,
    verdict: Verdict,
    publish: Coverage | None = None,
    *,
    again: str,
) -> int:
    """Record the verdict of a version's validation in the table: a metadata-only commit whose
    userMetadata holds it (`validation` finds it there); with `publish`, the same commit also
    publishes that version. Returns the commit's version; `again` says what to do when a
    conflicting commit takes it."""
    recorded = dataclasses.asdict(verdict)
    properties = {VALIDATION: _json(recorded)}
    metadata: dict[str, Any] = {"kind": "validation", "validation": recorded}
    if publish is not None:
        publishing, metadata["published"] = _publication(verdict.version, publish)
        properties.update(publishing)
    return _metadata_commit(spark, path, properties, metadata, again)


def validation(
    versions: list[delta_log.Version], version: int | None = None
) -> tuple[Verdict, int] | None:
    """The newest verdict the table records for `version` (from `history()`; None: for any
    version) and the commit that records it; None when it was never validated."""
    fields = [field.name for field in dataclasses.fields(Verdict)]
    for entry in versions:
        recorded = (entry.metadata or {}).get("validation")
        if isinstance(recorded, dict) and version in (None, recorded.get("version")):
            return Verdict(**{name: recorded[name] for name in fields}), entry.version
    return None


@reported("publish")
def publish(
    settings: Settings, spec: PipelineSpec, version: int, *, spark: SparkSession | None = None
) -> Publication:
    """Publish a version that passed `validate --no-publish` (the audit step before this), by
    the verdict the table records for it: no report on this machine is needed or read."""
    path = delta_log.require_table(spec, spec.snapshot_path(settings))
    spark = spark or session(settings, f"duality-publish-{spec.name}")
    versions = delta_log.history(path)
    found = validation(versions, version)
    if found is None or not found[0].success:
        why = (
            "has no validation recorded in the table"
            if found is None
            else f"failed validation (commit {found[1]}: {'; '.join(found[0].failed)})"
        )
        raise CheckFailed(
            f"version {version} of {spec.name}'s snapshot {why}: it needs a passing "
            f"`duality validate {spec.name} --version {version}` first; nothing was published"
        )
    verdict, validation_commit = found
    coverage, _ = delta_log.version_coverage(versions, version)
    if coverage is None:
        raise CheckFailed(
            f"version {version} of {path} does not record what it covers (written outside "
            f"duality): it is never published; rebuild with `duality snapshot {spec.name} --full`"
        )
    current = published(spark, path)
    already = current is not None and current.version == version
    commit = None
    if not already:
        properties, record = _publication(version, coverage)
        metadata = {"kind": "publish", "published": record}
        again = f"run `duality publish {spec.name} --version {version}` again"
        commit = _metadata_commit(spark, path, properties, metadata, again)
    return Publication(
        spec.name, version, already, validation_commit, verdict.json_report, coverage, commit
    )


def _publication(version: int, coverage: Coverage) -> tuple[dict[str, str], dict[str, Any]]:
    """The table properties that publish `version`, and the commit's record of it."""
    record = {"version": version, "coverage": coverage.as_dict()}
    return {PUBLISHED_VERSION: str(version), PUBLISHED_COVERAGE: _json(record["coverage"])}, record


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=str)


def _metadata_commit(
    spark: SparkSession,
    path: Location,
    properties: dict[str, str],
    metadata: dict[str, Any],
    again: str,
) -> int:
    """One commit that sets table properties (no data change) with `metadata` as its
    userMetadata; returns its version. Written by duality from the log (decision 30) when its
    writer can write the table, which a Spark statement's transaction makes cost a Spark job;
    by Delta's ALTER TABLE otherwise, which fails saying `again` (what to do) when a
    conflicting commit takes its version."""
    for _ in range(_COMMIT_ATTEMPTS):  # another writer may take the next version first
        state = delta_log.table_state(path, delta_log.history(path)[0].version)
        if state is None or dv_commit.blocker(state) is not None:
            break
        try:
            version = dv_commit.set_properties(path, state, properties, metadata)
        except s3.ConditionRefused as refused:
            # No safe commit of duality's own on this store (issue #49): Delta's ALTER TABLE.
            log.warning("%s; Delta's ALTER TABLE commits the properties instead", refused)
            break
        if version is None:
            continue
        # A publication's commit is also when the log is checkpointed, as Delta's own commits
        # do it: readers replay fewer JSON commits, and expired log files are removed.
        if PUBLISHED_VERSION in properties and delta_log.checkpoint_if_due(
            spark, path, version, state.properties
        ):
            log.info("%s: Delta checkpointed the log at version %d", path, version)
        return version

    def literal(text: str) -> str:
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"

    assignments = ", ".join(f"{literal(k)} = {literal(v)}" for k, v in properties.items())
    with (
        delta_log.commit_metadata(spark, metadata),
        delta_log.lost_race(path, "ALTER TABLE SET TBLPROPERTIES", again),
    ):
        spark.sql(f"ALTER TABLE {delta_log.sql_name(path)} SET TBLPROPERTIES ({assignments})")
    return delta_log.history(path)[0].version
