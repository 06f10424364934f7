"""Snapshot validation with Great Expectations, the audit of write-audit-publish
(docs/snapshots.md#audit)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from duality import storage
from duality.config import Settings
from duality.errors import CheckFailed, UsageError
from duality.kafka import offsets
from duality.snapshot import delta_log
from duality.snapshot.build import Progress, column_types, quiet, read_changelog
from duality.snapshot.coverage import Coverage
from duality.snapshot.outage import reported
from duality.snapshot.publish import Verdict, published, record_validation
from duality.spark import session
from duality.spec import PipelineSpec
from duality.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

FLOAT_TOLERANCE = 1e-9  # relative, for floating sums and averages
SAMPLE_KEYS = 5
ORIGIN = "duality_origin"  # the key of an expectation's `meta` that says where it comes from
RECONCILE_ORIGIN = "reconcile: the rows recomputed from the source"
# Checks answered from the table's schema, without reading rows.
SCHEMA = {"expect_table_columns_to_match_ordered_list", "expect_column_values_to_be_of_type"}

_GE_TYPES = {
    "string": "StringType",
    "bigint": "LongType",
    "int": "IntegerType",
    "double": "DoubleType",
    "boolean": "BooleanType",
    "timestamp": "TimestampType",
}

# -- the suite ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """One expectation of the suite, in GE's own form, and where it comes from."""

    type: str
    kwargs: dict[str, Any]
    origin: str  # "built-in: ...", "spec expectations[i]" or RECONCILE_ORIGIN


def _q(column: str) -> str:
    # Column names are validated identifiers (spec.NAME / schema.FIELD); quoting keeps them inert.
    return f"`{column}`"


def built_in_checks(spec: PipelineSpec) -> list[Check]:
    checks: list[Check] = []

    def add(type: str, origin: str, **kwargs: Any) -> None:
        checks.append(Check(type, kwargs, f"built-in: {origin}"))

    types = column_types(spec)
    add(
        "expect_table_columns_to_match_ordered_list",
        "the columns are the spec's",
        column_list=list(types),
    )
    for column, kind in types.items():
        add(
            "expect_column_values_to_be_of_type",
            f"{column} is {kind}",
            column=column,
            type_=_GE_TYPES[kind],
        )
    for column in spec.key_columns:
        add("expect_column_values_to_not_be_null", "key columns are not null", column=column)
    if len(spec.key_columns) == 1:
        add("expect_column_values_to_be_unique", "keys are unique", column=spec.key_columns[0])
    else:
        add(
            "expect_compound_columns_to_be_unique",
            "keys are unique",
            column_list=list(spec.key_columns),
        )
    for column, aggregate in spec.aggregates.items():
        if aggregate.function == "count":
            add(
                "expect_column_values_to_be_between",
                f"{column} = count() is positive",
                column=column,
                min_value=1,
            )
        elif aggregate.function in ("count_if", "count_distinct", "stddev"):
            add(
                "expect_column_values_to_be_between",
                f"{column} = {aggregate} is not negative",
                column=column,
                min_value=0,
            )
    by_field: dict[str, dict[str, str]] = {}
    for column, aggregate in spec.aggregates.items():
        if aggregate.field and aggregate.function in ("min", "avg", "max"):
            by_field.setdefault(aggregate.field, {})[aggregate.function] = column
    keys = ", ".join(_q(c) for c in spec.key_columns)
    for field, columns in by_field.items():
        ordered = [columns[f] for f in ("min", "avg", "max") if f in columns]
        if len(ordered) < 2:
            continue
        # One query per field (not one per pair): each unexpected-rows check costs GE two scans.
        broken = " OR ".join(
            f"{_q(low)} - {_q(high)} > {FLOAT_TOLERANCE} * greatest(1, abs({_q(low)}), "
            f"abs({_q(high)}))"
            for low, high in itertools.pairwise(ordered)
        )
        columns_sql = ", ".join(_q(c) for c in ordered)
        chain = " <= ".join(ordered)
        add(
            "unexpected_rows_expectation",
            f"{chain} (aggregates of {field})",
            unexpected_rows_query=f"SELECT {keys}, {columns_sql} FROM {{batch}} WHERE {broken}",
            description=chain,
        )
    return checks


def spec_checks(spec: PipelineSpec) -> list[Check]:
    return [
        Check(e.type, dict(e.kwargs), f"spec expectations[{i}]")
        for i, e in enumerate(spec.expectations)
    ]


def _expectation(check: Check, origin: str) -> Any:
    """The GE Expectation, found in GE's registry by name, with the check's origin in its `meta`;
    a clear UsageError for unknown names or bad arguments."""
    from great_expectations.exceptions import ExpectationNotFoundError
    from great_expectations.expectations.registry import get_expectation_impl

    try:
        cls = get_expectation_impl(check.type)
    except ExpectationNotFoundError:
        raise UsageError(
            f"{origin}: {check.origin}: unknown expectation {check.type!r}; use a Great "
            "Expectations 1.x expectation name such as expect_column_values_to_be_between"
        ) from None
    kwargs = dict(check.kwargs)
    meta = {**(kwargs.pop("meta", None) or {}), ORIGIN: check.origin}
    try:
        return cls(**kwargs, meta=meta)
    except Exception as error:  # GE raises pydantic (v1) validation errors
        detail = " ".join(str(error).split())
        raise UsageError(
            f"{origin}: {check.origin}: invalid arguments for {check.type}: {detail}"
        ) from None


def check_spec_expectations(spec: PipelineSpec, origin: str) -> None:
    """Build the spec's expectations with GE (no data); raises UsageError naming the problem."""
    for check in spec_checks(spec):
        _expectation(check, origin)


# -- reconciliation -------------------------------------------------------------------------


def recompute(
    settings: Settings, spec: PipelineSpec, spark: SparkSession, coverage: Coverage
) -> DataFrame:
    """The aggregates recomputed from the source records below the source offsets `coverage`
    names.

    Uses the stream's classification over the whole covered prefix in one batch. Whether a
    windowed record was late depends on the stream's watermark at its micro-batch, so late
    records are the ones the dead-letter topic holds as late; a hopping window counts the
    records before the end offsets of the micro-batch that last updated it (`_through` in the
    changelog values `coverage` covers).
    """
    from pyspark.sql import functions as F

    from duality.stream import query, seeding

    if spec.joined is not None:
        # Recomputing would need the table as each event met it, which only the stream kept.
        raise UsageError(
            f"cannot reconcile {spec.name}: it joins table {spec.joined.name}, and the rows its "
            "events met are not kept; validate it without --reconcile"
        )
    topic = spec.source.topic
    types = column_types(spec)
    wanted = {p: end for p, end in coverage.source.items() if end > 0}
    if wanted:
        beginning = offsets.beginning_offsets(settings, topic)
        lost = {p: beginning[p] for p in wanted if beginning.get(p, 0) > 0}
        if lost:
            raise UsageError(
                f"cannot reconcile {spec.name}: records of {topic} were deleted by retention "
                f"(first offsets now {lost}); --reconcile needs the source from its first record"
            )
    empty_schema = ", ".join(f"`{c}` {t}" for c, t in types.items())
    if not wanted:
        return spark.createDataFrame([], empty_schema)
    raw = (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_source_options())
        .option("assign", json.dumps({topic: sorted(wanted)}))
        .option("startingOffsets", json.dumps({topic: {str(p): -2 for p in wanted}}))
        .option("endingOffsets", json.dumps({topic: {str(p): o for p, o in wanted.items()}}))
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    if spec.window is not None:
        late = spark.createDataFrame(
            query.late_records(settings, spec), "partition int, offset bigint"
        )
        raw = raw.join(late, ["partition", "offset"], "left_anti")
    through = None
    if spec.window is not None and spec.window.slide_seconds < spec.window.size_seconds:
        changes = read_changelog(spark, settings, spec.changelog_topic, None, coverage.changelog)
        latest = changes.groupBy("key").agg(F.max_by("value", "offset").alias("value"))
        through = seeding.through_rows(spec, latest.where(F.col("value").isNotNull()))
    rows = query.source_rows(spec, query.classify(spec, raw), "partition", "offset")
    table = query.aggregate(spec, rows, through)
    columns: list[Column] = [F.col(f).alias(f) for f in spec.source.key]
    if spec.window is not None:
        columns.append(F.col("_window.start").alias("window_start"))
    for column, value in query.aggregate_columns(spec).items():
        if types[column] == "timestamp":
            value = F.timestamp_millis(value)  # min and max of a timestamp are kept in ms
        columns.append(value.cast(types[column]).alias(column))
    return table.select(*columns)


# The reconciliation's one expectation, on the `_mismatch` column of `reconciliation()`.
RECONCILE_CHECK = Check(
    "expect_column_values_to_be_null",
    {
        "column": "_mismatch",
        "description": "each row equals the aggregates recomputed from the source",
    },
    RECONCILE_ORIGIN,
)


def reconciliation(spec: PipelineSpec, table: DataFrame, truth: DataFrame) -> DataFrame:
    """Key columns and `_mismatch` (null when the row agrees) of a full outer join."""
    from pyspark.sql import functions as F

    types = column_types(spec)
    s, t = table.alias("s"), truth.alias("t")
    on = [F.col(f"s.`{c}`") == F.col(f"t.`{c}`") for c in spec.key_columns]
    joined = s.join(t, on, "full_outer")
    in_table = F.col(f"s.`{spec.key_columns[0]}`").isNotNull()
    in_truth = F.col(f"t.`{spec.key_columns[0]}`").isNotNull()
    problems: list[Column] = []
    for column, aggregate in spec.aggregates.items():
        a, b = F.col(f"s.`{column}`"), F.col(f"t.`{column}`")
        floating = types[column] == "double" and aggregate.function in ("sum", "avg", "stddev")
        if floating:
            limit = F.lit(FLOAT_TOLERANCE) * F.greatest(F.lit(1.0), F.abs(a), F.abs(b))
            differs = ~a.eqNullSafe(b) & (a.isNull() | b.isNull() | (F.abs(a - b) > limit))
        else:
            differs = ~a.eqNullSafe(b)
        problems.append(
            F.when(
                differs,
                F.concat(
                    F.lit(f"{column}: snapshot "),
                    F.coalesce(a.cast("string"), F.lit("null")),
                    F.lit(", source "),
                    F.coalesce(b.cast("string"), F.lit("null")),
                ),
            )
        )
    mismatch = (
        F.when(~in_truth, F.lit("in the snapshot but not in the source"))
        .when(~in_table, F.lit("in the source but not in the snapshot"))
        .otherwise(F.concat_ws("; ", *problems))
    )
    keys = [F.coalesce(F.col(f"s.`{c}`"), F.col(f"t.`{c}`")).alias(c) for c in spec.key_columns]
    return joined.select(*keys, F.when(mismatch != "", mismatch).alias("_mismatch"))


# -- running it -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed expectation, where it comes from, and the keys of a few failing rows."""

    expectation: str
    kwargs: dict[str, Any]
    origin: str
    unexpected_count: Any
    keys: list[Any]
    error: str | None = None  # the exception the check raised
    observed: Any = None  # GE's observed value, for checks that count no rows


@dataclasses.dataclass(frozen=True)
class Report:
    pipeline: str
    path: str
    version: int
    rows: int
    success: bool
    published: bool
    published_version: int | None
    reconciled: bool
    failed: list[Failure]
    checks: int
    seconds: float
    json_report: str
    data_docs: str
    coverage: Coverage | None
    validation_commit: int  # the table's commit that records this verdict


@reported("validate")
def run(
    settings: Settings,
    spec: PipelineSpec,
    *,
    reconcile: bool = False,
    publish: bool = True,
    version: int | None = None,
    spark: SparkSession | None = None,
    progress: Progress = quiet,
) -> Report:
    """Validate a snapshot version (default: the latest), record the verdict in the table, and
    publish the version when it passes."""
    origin = f"pipeline {spec.name}"
    suite_checks = [*built_in_checks(spec), *spec_checks(spec)]
    if reconcile:
        suite_checks.append(RECONCILE_CHECK)
    expectations = [_expectation(check, origin) for check in suite_checks]
    path = delta_log.require_table(spec, spec.snapshot_path(settings))
    started = time.monotonic()
    spark = spark or session(settings, f"duality-validate-{spec.name}")
    versions = delta_log.history(path)
    if version is None:
        version = delta_log.latest_data_version(versions)
    elif version not in {v.version for v in versions}:
        raise UsageError(f"{path} has no version {version}: versions are 0..{versions[0].version}")
    coverage, _ = delta_log.version_coverage(versions, version)
    if reconcile and coverage is None:
        raise UsageError(
            f"version {version} of {path} does not record what it covers (it was written outside "
            f"duality): rebuild it with `duality snapshot {spec.name} --full` to reconcile"
        )

    progress(f"reading version {version} of {path}")
    # Read once, scanned by every check: cached uncompressed, which takes more memory and saves
    # the CPU of compressing it, a tenth of a validation here (docs/benchmarks.md, 2026-11-26).
    uncompressed = {"spark.sql.inMemoryColumnarStorage.compressed": "false"}
    table = delta_log.load(spark, path, version)
    diff = None
    try:
        with delta_log.session_conf(spark, uncompressed):  # read when the cache is built
            rows = table.persist().count()
        if reconcile:
            assert coverage is not None
            progress(f"recomputing the aggregates from {spec.source.topic}")
            truth = recompute(settings, spec, spark, coverage)
            diff = reconciliation(spec, table, truth).persist()
        progress(f"running {len(expectations)} expectations on {rows:,} rows")
        results = _run_ge(settings, spec, version, table, diff, expectations)
        failed = _failures(spark, spec, table, results)
    finally:
        table.unpersist()
        if diff is not None:
            diff.unpersist()
    success = not failed
    current = published(spark, path)
    published_version = current.version if current is not None else None
    # A version written outside duality does not say what it covers: it is never published.
    publishing = success and publish and coverage is not None
    report_dir = settings.reports / spec.name
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    json_report = report_dir / f"{stamp}-v{version}.json"
    verdict = Verdict(
        version=version,
        success=success,
        checks=len(expectations),
        failed=[f"{item.expectation} [{item.origin}]" for item in failed],
        reconciled=reconcile,
        validated_at=stamp,
        json_report=str(json_report),
    )
    again = f"run the same `duality validate {spec.name}` again"
    commit = record_validation(
        spark, path, verdict, publish=coverage if publishing else None, again=again
    )
    if publishing:
        published_version = version
        progress(f"published version {version}")
    report = Report(
        pipeline=spec.name,
        path=str(path),
        version=version,
        rows=rows,
        success=success,
        published=publishing,
        published_version=published_version,
        reconciled=reconcile,
        failed=failed,
        checks=len(expectations),
        seconds=round(time.monotonic() - started, 2),
        json_report=str(report_dir / "latest.json"),
        data_docs=str(report_dir / "data_docs" / "index.html"),
        coverage=coverage,
        validation_commit=commit,
    )
    _write_json(json_report, report, results, stamp)
    return report


def _run_ge(
    settings: Settings,
    spec: PipelineSpec,
    version: int,
    table: DataFrame,
    diff: DataFrame | None,
    expectations: list[Any],
) -> list[dict[str, Any]]:
    """Run the suite (the reconciliation on `diff`) as GE validations; returns the results' JSON."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # GE logs its own start-up at INFO; jobs log at INFO, so keep GE to warnings (one of its
    # modules sets its own logger to INFO).
    for name in ("great_expectations", "great_expectations.data_context.types.base"):
        logging.getLogger(name).setLevel(logging.WARNING)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    site = settings.reports / spec.name / "data_docs"
    with _site_folder(site) as folder:
        return _validate_all(context, spec, version, table, diff, expectations, folder)


@contextlib.contextmanager
def _site_folder(site: Location) -> Iterator[Path]:
    """The folder GE renders the Data Docs `site` into: the site itself when it is local; on
    object storage a temporary folder, whose tree then replaces the site's (GE's S3 backend
    would need boto3; GE itself removes the pages of earlier runs from a site it builds)."""
    if isinstance(site, Path):
        yield site
        return
    with tempfile.TemporaryDirectory(prefix="duality-data-docs-") as rendered:
        yield Path(rendered)
        import pyarrow.fs as pafs

        storage.remove_tree(site)
        filesystem, target = storage.arrow(site)
        pafs.copy_files(
            rendered,
            target,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=filesystem,
        )


def _validate_all(
    context: Any,
    spec: PipelineSpec,
    version: int,
    table: DataFrame,
    diff: DataFrame | None,
    expectations: list[Any],
    site: Path,
) -> list[dict[str, Any]]:
    """The suite's validations run in GE's `context`, rendered into the Data Docs at `site`."""
    import great_expectations as gx

    from duality.snapshot import data_docs

    views = data_docs.views()  # its templates compiled once
    # GE's type of a site's configuration lacks `site_section_builders`, which SiteBuilder takes.
    context.add_data_docs_site(
        "duality",
        cast(
            Any,
            {
                "class_name": "SiteBuilder",
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": str(site),
                },
                "site_index_builder": views["site_index_builder"],
                # The validation pages only: each shows every expectation with its result; the
                # suites' own pages (the same expectations without results) were a third of the
                # rendering's CPU (docs/benchmarks.md).
                "site_section_builders": {
                    "expectations": "0",
                    "profiling": "0",
                    "validations": views["validations"],
                },
            },
        ),
    )
    # The frames come persisted (and are unpersisted after): GE's own persist would be a second
    # copy that nothing unpersists, kept for good in the batch server's long-running Spark.
    source = context.data_sources.add_spark(f"{spec.name}_snapshot", persist=False)
    # GE would query through the process's first session (`builder.getOrCreate`), where the
    # batch server's step did not register its views: it is given the frame's own session.
    source._spark = table.sparkSession
    source._execution_engine = None  # made again, on that session
    reconciling = [e for e in expectations if e.meta[ORIGIN] == RECONCILE_ORIGIN]
    schema = [e for e in expectations if e not in reconciling and e.expectation_type in SCHEMA]
    rows = [e for e in expectations if e not in reconciling and e not in schema]

    def validate(name: str, frame: DataFrame, checks: list[Any], detail: bool) -> dict[str, Any]:
        suite = context.suites.add(gx.ExpectationSuite(f"{spec.name}_v{version}_{name}"))
        for check in checks:
            suite.add_expectation(check)
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(
                name=f"{spec.name}_{name}",
                data=source.add_dataframe_asset(name).add_batch_definition_whole_dataframe("v"),
                suite=suite,
            )
        )
        # A passing check needs no more than its verdict: BOOLEAN_ONLY lets GE compute the
        # unexpected counts of a domain in one aggregation, with no per-check sample queries.
        # Failed checks run again with their counts and the keys of a few failing rows.
        result_format: dict[str, Any] = {"result_format": "BOOLEAN_ONLY"}
        if detail:
            result_format = {
                "result_format": "SUMMARY",
                "unexpected_index_column_names": list(spec.key_columns),
                "partial_unexpected_count": SAMPLE_KEYS,
            }
        outcome = definition.run(batch_parameters={"dataframe": frame}, result_format=result_format)
        return cast(dict[str, Any], outcome.to_json_dict())

    results = []
    for name, checks in (("schema", schema), ("snapshot", rows), ("reconcile", reconciling)):
        if not checks:
            continue
        frame = diff if name == "reconcile" else table
        assert frame is not None
        # Schema checks read no rows; their full results also let Data Docs order the columns.
        result = validate(name, frame, checks, detail=name == "schema")
        failed = {i["expectation_config"]["id"] for i in result["results"] if not i["success"]}
        if failed and name != "schema":
            # An expectation belongs to one suite: the failures' suite gets copies.
            copies: dict[str, Any] = {}
            for check in checks:
                if check.id in failed:
                    duplicate = copy.copy(check)
                    duplicate.id = None
                    copies[check.id] = duplicate
            detailed = validate(f"{name}_failures", frame, list(copies.values()), detail=True)
            original = {duplicate.id: check_id for check_id, duplicate in copies.items()}
            by_id = {original[i["expectation_config"]["id"]]: i for i in detailed["results"]}
            result["results"] = [
                by_id.get(item["expectation_config"]["id"], item) for item in result["results"]
            ]
        results.append(result)
    context.build_data_docs(site_names=["duality"])
    return results


def _failures(
    spark: SparkSession, spec: PipelineSpec, table: DataFrame, results: list[dict[str, Any]]
) -> list[Failure]:
    """The failed expectations, each with its origin (from its `meta`) and the keys of a few
    failing rows."""
    failed = []
    for result in results:
        for item in result["results"]:
            if item["success"]:
                continue
            config = item["expectation_config"]
            kwargs = {
                k: v
                for k, v in config["kwargs"].items()
                if k not in ("batch_id", "result_format") and v is not None
            }
            outcome = item.get("result") or {}
            keys = outcome.get("partial_unexpected_index_list", [])[:SAMPLE_KEYS]
            if config["type"] == "unexpected_rows_expectation":
                query = kwargs["unexpected_rows_query"]
                view = f"duality_validate_{spec.name}"
                table.createOrReplaceTempView(view)
                sample = spark.sql(query.replace("{batch}", view)).limit(SAMPLE_KEYS).collect()
                keys = [row.asDict() for row in sample]
            raised = item.get("exception_info") or {}
            error = raised.get("exception_message") if raised.get("raised_exception") else None
            observed = outcome.get("observed_value")
            failed.append(
                Failure(
                    expectation=config["type"],
                    kwargs=kwargs,
                    origin=(config.get("meta") or {}).get(ORIGIN, "(unknown)"),
                    unexpected_count=outcome.get("unexpected_count", observed),
                    keys=keys,
                    error=error,
                    observed=None if "unexpected_count" in outcome else observed,
                )
            )
    return failed


def _write_json(path: Location, report: Report, results: list[dict[str, Any]], stamp: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {**dataclasses.asdict(report), "validated_at": stamp, "results": results}
    text = json.dumps(document, indent=2, default=str)
    path.write_text(text)
    (path.parent / "latest.json").write_text(text)


def summary(report: Report) -> str:
    """One paragraph for people: what failed and for which keys."""
    if report.success:
        return (
            f"version {report.version} of {report.pipeline} passed {report.checks} checks "
            f"({report.rows:,} rows)" + ("; published" if report.published else "; not published")
        )
    lines = [
        f"version {report.version} of {report.pipeline} failed {len(report.failed)} of "
        f"{report.checks} checks; the published version stays "
        f"{report.published_version if report.published_version is not None else '(none)'}:"
    ]
    for item in report.failed:
        target = item.kwargs.get("column") or item.kwargs.get("column_list") or ""
        keys = "; ".join(json.dumps(k, default=str) for k in item.keys[:3])
        lines.append(
            f"  - {item.expectation}({target}) [{item.origin}]: "
            f"{item.unexpected_count} unexpected" + (f", e.g. {keys}" if keys else "")
        )
    lines.append(f"report: {report.json_report}; Data Docs: {report.data_docs}")
    return "\n".join(lines)


def require_success(report: Report) -> Report:
    if not report.success:
        raise CheckFailed(summary(report), details=dataclasses.asdict(report))
    return report
