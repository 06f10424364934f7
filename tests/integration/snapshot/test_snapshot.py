"""Delta snapshots from compacted changelogs, against an independent read_committed read of it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from duality import changelog, kafka, validate
from duality.config import Settings
from duality.snapshot import build, delta_log, publish
from duality.snapshot.coverage import Coverage
from duality.snapshot.maintain import maintain
from duality.spec import PipelineSpec
from tests.harness import ROOT, StreamProcess, make_pipeline, read_latest, read_topic, run_duality

# -- a changelog writer, as the stream writes it (transactions, tombstones, aborted ones) ----


def _create_changelog(settings: Settings, spec: PipelineSpec) -> None:
    kafka.create_topic(
        settings,
        spec.changelog_topic,
        3,
        config={"cleanup.policy": "compact", **kafka.FAST_COMPACTION},
    )


def _row(product: str, orders: int, rng: random.Random) -> dict[str, Any]:
    amounts = [round(rng.uniform(1, 500), 2) for _ in range(orders)]
    return {
        "orders": orders,
        "units": orders * 3,
        "revenue": sum(amounts),
        "max_amount": max(amounts),
        "min_amount": min(amounts),
        "avg_amount": sum(amounts) / orders,
    }


def _write(
    settings: Settings,
    spec: PipelineSpec,
    changes: dict[str, dict[str, Any] | None],
    *,
    abort: bool = False,
) -> None:
    """One transaction of changelog records: a row per key, None for a tombstone."""
    producer = kafka.producer(settings, transactional_id=f"test-{spec.name}")
    producer.init_transactions(30)
    producer.begin_transaction()
    for product, row in changes.items():
        key = changelog.encode_key(spec, [product])
        value = (
            None
            if row is None
            else changelog.encode_value(spec, [product], row, {"count": row["orders"]}, 1_700_000)
        )
        kafka.send(producer, spec.changelog_topic, key, value)
    if abort:
        producer.flush(30)
        producer.abort_transaction(30)
    else:
        producer.commit_transaction(30)


def _truth(
    settings: Settings, spec: PipelineSpec, below: dict[int, int] | None = None
) -> dict[str, dict[str, Any]]:
    """The latest live value per key of the changelog (of its records below `below`)."""
    latest: dict[str, dict[str, Any]] = {}
    for partition, offset, key, value in read_topic(settings, spec.changelog_topic):
        assert key is not None
        if below is not None and offset >= below[partition]:
            continue
        if value is None:
            latest.pop(key.decode(), None)
        else:
            document = json.loads(value)
            latest[key.decode()] = {c: document[c] for c in spec.aggregates}
    return latest


def _table(frame: Any, spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    rows = {}
    for row in frame.collect():
        values = row.asDict()
        assert values["_updated_at"] is not None
        rows[values["product"]] = {c: values[c] for c in spec.aggregates}
    assert len(rows) == frame.count(), "a key appears twice in the snapshot"
    return rows


def _second_engine(path: Path, spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """The table's newest version as delta-rs reads it: a second Delta engine, which applies
    the deletion vectors itself."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    reader = QueryBuilder().register("snapshot", DeltaTable(str(path)))
    rows = pa.table(reader.execute("SELECT * FROM snapshot").read_all()).to_pylist()
    table = {row["product"]: {c: row[c] for c in spec.aggregates} for row in rows}
    assert len(table) == len(rows), "a key appears twice in the snapshot"
    return table


def _delta_checks_the_checksum(spark, path: Path) -> int:  # type: ignore[no-untyped-def]
    """Delta's own check of the newest version's `.crc` against the state it reconstructs from
    the log (it throws on a mismatch); the version checked."""
    jvm = spark._jvm
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, str(path))
    snapshot = log.update(False, jvm.scala.Option.empty(), jvm.scala.Option.empty())
    assert snapshot.checksumOpt().isDefined(), "the version has no checksum file"
    no_context = getattr(getattr(jvm.scala.collection.immutable, "Map$"), "MODULE$").empty()
    assert snapshot.validateChecksum(no_context)
    return int(snapshot.version())


def _records_between(settings: Settings, spec: PipelineSpec, start: dict[int, int]) -> int:
    return sum(1 for p, o, _, _ in read_topic(settings, spec.changelog_topic) if o >= start[p])


@pytest.fixture
def pipeline(settings: Settings, tmp_path: Path) -> tuple[Settings, PipelineSpec]:
    scoped = settings.replace(reports=tmp_path / "reports", pipelines=tmp_path / "pipelines")
    spec = make_pipeline(scoped, tmp_path / "pipelines", "product_sales")
    kafka.create_topic(scoped, spec.source.topic, 3)
    _create_changelog(scoped, spec)
    return scoped, spec


def _history(rng: random.Random, keys: range) -> dict[str, dict[str, Any] | None]:
    return {f"p{i:04d}": _row(f"p{i:04d}", rng.randint(1, 40), rng) for i in keys}


def test_full_then_incremental_equal_the_changelog(spark, pipeline) -> None:  # type: ignore[no-untyped-def]
    settings, spec = pipeline
    rng = random.Random(7)
    _write(settings, spec, _history(rng, range(400)))
    _write(settings, spec, _history(rng, range(0, 400, 3)))  # updates
    _write(settings, spec, {f"p{i:04d}": None for i in range(0, 60, 2)})  # tombstones
    # An aborted transaction's records must never reach a snapshot.
    _write(settings, spec, {f"p{i:04d}": _row("x", 999, rng) for i in range(100)}, abort=True)

    full = build.build(settings, spec, "full", spark=spark)
    path = spec.snapshot_path(settings)
    truth = _truth(settings, spec)
    assert len(truth) == 400 - 30
    assert _table(delta_log.load(spark, path, full.version), spec) == truth
    # The offsets the version covers are in its commit.
    ends = kafka.end_offsets(settings, spec.changelog_topic)
    recorded = delta_log.history(path)[0].metadata
    assert recorded is not None
    assert Coverage.from_dict(recorded["coverage"]).changelog == ends

    # More changes: updates, new keys, deletes, a deleted key coming back, another abort.
    _write(settings, spec, _history(rng, range(350, 450)))
    _write(settings, spec, {f"p{i:04d}": None for i in range(100, 120)})
    _write(settings, spec, {"p0000": _row("p0000", 5, rng)})
    _write(settings, spec, {f"p{i:04d}": None for i in range(200, 300)}, abort=True)
    incremental = build.build(settings, spec, "incremental", spark=spark)
    assert incremental.mode == "incremental" and incremental.fallback_reason is None
    # duality's own commit (deletion vectors, an appended file): Spark and delta-rs read it so.
    assert incremental.merged_by == "duality"
    truth = _truth(settings, spec)
    incremental_rows = _table(delta_log.load(spark, path, incremental.version), spec)
    assert incremental_rows == truth == _second_engine(path, spec)
    # Its checksum file is what Delta's own state reconstruction computes for the version.
    assert _delta_checks_the_checksum(spark, path) == incremental.version
    # It read only the records after the recorded offsets (the job's own figures).
    assert {int(p): r[0] for p, r in incremental.read_ranges.items()} == {
        p: ends[p] for p in map(int, incremental.read_ranges)
    }
    assert incremental.records_read == _records_between(settings, spec, ends)
    assert incremental.records_read < full.records_read
    assert incremental.deleted == 20 and incremental.inserted == 51  # 400..449 and p0000

    # Again over the same files: keys whose rows already sit in the appended file, keys of rows
    # already marked, keys deleted and back. Each file's new deletion vector keeps the old rows.
    _write(settings, spec, _history(rng, range(0, 450, 7)))
    _write(settings, spec, {f"p{i:04d}": None for i in range(400, 420)})
    _write(settings, spec, _history(rng, range(100, 105)))
    # Delta checkpoints the log at its next commit: the state is replayed from that checkpoint.
    table = delta_log.sql_name(path)
    spark.sql(f"ALTER TABLE {table} SET TBLPROPERTIES ('delta.checkpointInterval' = '1')")
    assert list((path / "_delta_log").glob("*.checkpoint.parquet"))
    again = build.build(settings, spec, "incremental", spark=spark)
    assert again.merged_by == "duality" and (again.inserted, again.deleted) == (12, 20)
    truth = _truth(settings, spec)
    assert again.rows == len(truth)
    assert _table(delta_log.load(spark, path), spec) == truth == _second_engine(path, spec)
    assert _delta_checks_the_checksum(spark, path) == again.version
    # Delta's own OPTIMIZE and VACUUM over them: the rows stay, the replaced files go.
    maintain(settings, spec, retain_hours=0, spark=spark)
    assert _table(delta_log.load(spark, path), spec) == truth == _second_engine(path, spec)
    assert not list(path.glob("deletion_vector_*.bin"))

    rebuilt = build.build(settings, spec, "full", spark=spark)
    assert _table(delta_log.load(spark, path, rebuilt.version), spec) == truth

    # Nothing new: no new version.
    assert build.build(settings, spec, "incremental", spark=spark).version is None

    # A recreated changelog (the reset tool) cannot be merged: full rebuild, and why.
    kafka.delete_topic(settings, spec.changelog_topic)
    _create_again(settings, spec)
    _write(settings, spec, _history(rng, range(5)))
    # The job's entry point, run with Python as users run it.
    job = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "rebuild_snapshot.py"), spec.name, "--incremental"],
        env={**os.environ, **settings.as_env()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-2000:]
    after_reset = json.loads(job.stdout)
    assert after_reset["mode"] == "full" and "recreated" in after_reset["fallback_reason"]
    assert after_reset["fallback_reason"] in job.stderr  # said in the log too
    assert _table(delta_log.load(spark, path, after_reset["version"]), spec) == _truth(
        settings, spec
    )


def _create_again(settings: Settings, spec: PipelineSpec) -> None:
    from tests.harness import assert_eventually

    def created() -> bool:
        try:
            _create_changelog(settings, spec)
            return True
        except Exception:  # the deletion is still in progress
            return False

    assert_eventually(created, timeout=60, message="changelog could not be recreated")


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return run_duality(settings, *args, "--json", timeout=300)


def test_failed_validation_keeps_the_published_version(spark, pipeline) -> None:  # type: ignore[no-untyped-def]
    settings, spec = pipeline
    rng = random.Random(11)
    _write(settings, spec, _history(rng, range(200)))
    first = build.build(settings, spec, "full", spark=spark)
    report = validate.run(settings, spec, spark=spark)
    assert report.success and report.published and report.published_version == first.version
    assert Path(report.data_docs).is_file() and Path(report.json_report).is_file()
    good = _truth(settings, spec)
    # duality wrote the verdict and the publication as one commit of its own (decision 30):
    # Delta in Spark and a second engine read the properties it set.
    from deltalake import DeltaTable

    path = spec.snapshot_path(settings)
    commit = path / "_delta_log" / f"{report.validation_commit:020d}.json"
    assert json.loads(commit.read_text().splitlines()[0])["commitInfo"]["engineInfo"] == "duality"
    configuration = DeltaTable(str(path)).metadata().configuration
    detail = spark.sql(f"DESCRIBE DETAIL {delta_log.sql_name(path)}").first()["properties"]
    for properties in (configuration, detail):
        assert properties[publish.PUBLISHED_VERSION] == str(first.version)

    # A new version with a bad row: a duplicate key with a negative count.
    _write(settings, spec, _history(rng, range(200, 220)))
    second = build.build(settings, spec, spark=spark)
    bad = delta_log.load(spark, path, second.version).where("product = 'p0003'")
    columns = [
        "CAST(-5 AS BIGINT) AS orders" if c == "orders" else f"`{c}`" for c in spec.snapshot_columns
    ]
    bad.selectExpr(*columns).write.format("delta").mode("append").save(str(path))

    result = _cli(settings, "validate", spec.name)
    assert result.returncode == 1, result.stderr[-2000:]
    output = json.loads(result.stdout)
    failed = {item["expectation"]: item for item in output["failed"]}
    origins = {"built-in: keys are unique", "built-in: orders = count() is positive"}
    assert {item["origin"] for item in output["failed"]} == origins
    unique, between = "expect_column_values_to_be_unique", "expect_column_values_to_be_between"
    assert set(failed) == {unique, between}
    assert failed["expect_column_values_to_be_between"]["keys"] == [
        {"product": "p0003", "orders": -5}
    ]
    assert "p0003" in result.stderr and "expect_column_values_to_be_unique" in result.stderr
    written = json.loads(Path(output["json_report"]).read_text())
    assert not written["success"] and len(written["failed"]) == 2
    assert Path(output["data_docs"]).is_file()

    # `read --limit 0` answers from the checksum files: the published version, not the latest.
    assert first.version is not None
    expected = publish.Published(first.version, first.coverage)
    assert publish.published_size(spec, path) == (expected, len(good))
    refused = _cli(settings, "read", spec.name, "--limit", "-1")
    assert refused.returncode == 2 and "--limit" in refused.stderr, refused.stderr
    read = _cli(settings, "read", spec.name, "--limit", "1000")
    assert read.returncode == 0, read.stderr[-2000:]
    published = json.loads(read.stdout)
    assert published["version"] == first.version and published["rows"] == len(good)
    assert {r["product"]: r["orders"] for r in published["data"]} == {
        k: v["orders"] for k, v in good.items()
    }

    # The foreign commit is not built upon: the next incremental run rebuilds in full.
    rebuilt = build.build(settings, spec, "incremental", spark=spark)
    assert rebuilt.mode == "full" and "outside duality" in (rebuilt.fallback_reason or "")
    assert validate.run(settings, spec, spark=spark).published

    # Maintenance: compaction, and a VACUUM asked to keep nothing still keeps every file the
    # published version reads (Delta rounds retention to whole hours: 0 would delete them all).
    # (Through the CLI: VACUUM prints its counts, and --json output must stay parseable.)
    run = _cli(settings, "snapshot", spec.name, "--maintain", "--retain-hours", "0")
    assert run.returncode == 0, run.stderr[-2000:]
    maintained = json.loads(run.stdout)
    assert maintained["files_removed_by_optimize"] > maintained["files_added_by_optimize"] >= 1
    assert maintained["retention_hours"] >= 1 and maintained["published_version"] == rebuilt.version
    frame, found = publish.read(settings, spec, spark=spark)
    assert found.version == rebuilt.version and _table(frame, spec) == _truth(settings, spec)


def test_reconcile_with_the_source(spark, pipeline, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from duality import workload

    settings, spec = pipeline
    kafka.delete_topic(settings, spec.changelog_topic)  # the stream creates its own
    workload.produce(
        settings, spec, events=4_000, keys=300, zipf=1.1, bad_fraction=0.03, seed=5, partitions=3
    )
    StreamProcess(settings, spec, settings.pipelines, tmp_path / "stream.log").run_until_caught_up()

    build.build(settings, spec, spark=spark)
    report = validate.run(settings, spec, reconcile=True, spark=spark)
    assert report.success, report.failed
    assert report.reconciled and report.checks > 10

    # Tamper with one changelog value: the snapshot follows it, reconciliation catches it.
    latest = read_latest(settings, spec)
    key, value = next(iter(sorted(latest.items())))
    value = {**value, "orders": value["orders"] + 1}
    producer = kafka.producer(settings)
    kafka.send(producer, spec.changelog_topic, key, json.dumps(value).encode())
    producer.flush(30)
    tampered = build.build(settings, spec, spark=spark)
    assert tampered.mode == "incremental" and tampered.records_read == 1

    result = _cli(settings, "validate", spec.name, "--reconcile")
    assert result.returncode == 1, result.stderr[-2000:]
    failed = json.loads(result.stdout)["failed"]
    assert [item["expectation"] for item in failed] == ["expect_column_values_to_be_null"]
    assert failed[0]["origin"].startswith("reconcile") and failed[0]["unexpected_count"] == 1
    assert failed[0]["keys"][0]["product"] == key.decode()
    assert "orders: snapshot" in failed[0]["keys"][0]["_mismatch"]


def test_publish_reads_the_verdict_from_the_table_not_from_a_report(
    spark, pipeline, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """`validate` on one worker (its own Airflow home and report folder), `publish` on another:
    the gate is the verdict the table records, so no report file needs to travel."""
    settings, spec = pipeline
    rng = random.Random(3)
    _write(settings, spec, _history(rng, range(50)))
    passed = build.build(settings, spec, "full", spark=spark).version
    _write(settings, spec, _history(rng, range(50, 60)))
    unvalidated = build.build(settings, spec, spark=spark).version
    negative = {"orders": -5, "units": 1, "revenue": 1.0, "max_amount": 1.0}
    _write(settings, spec, {"p0001": {**negative, "min_amount": 1.0, "avg_amount": 1.0}})
    failed = build.build(settings, spec, spark=spark).version

    def worker(name: str) -> Settings:
        return settings.replace(reports=tmp_path / name / "reports", local_dir=tmp_path / name)

    # Delta checkpoints the log every 4 commits of its own; the publication (duality's commit,
    # 3 versions after this one) asks Delta for the checkpoint that is due.
    path = spec.snapshot_path(settings)
    table = delta_log.sql_name(path)
    spark.sql(f"ALTER TABLE {table} SET TBLPROPERTIES ('delta.checkpointInterval' = '4')")
    for version, success in ((passed, True), (failed, False)):
        report = validate.run(worker("a"), spec, version=version, publish=False, spark=spark)
        assert report.success is success and not report.published
    assert not list((path / "_delta_log").glob("*.checkpoint.parquet"))

    def run_publish(version: int) -> subprocess.CompletedProcess[str]:
        return run_duality(
            worker("b"),
            *("publish", spec.name, "--version", str(version), "--json"),
            env={"AIRFLOW_HOME": str(tmp_path / "b" / "airflow")},
            timeout=300,
        )

    refused = run_publish(unvalidated)
    assert refused.returncode == 1 and "no validation recorded" in refused.stderr, refused.stderr
    refused = run_publish(failed)
    assert refused.returncode == 1 and "failed validation" in refused.stderr, refused.stderr
    done = run_publish(passed)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["published_version"] == passed
    assert publish.published(spark, path).version == passed  # type: ignore[union-attr]
    assert not (tmp_path / "b" / "reports").exists()
    # The publication's commit is checkpointed: Delta, a second engine and duality's own replay
    # (from the checkpoint now) read the same table.
    latest = delta_log.history(path)[0].version
    assert json.loads((path / "_delta_log" / "_last_checkpoint").read_text())["version"] == latest
    state = delta_log.table_state(path, latest)
    assert state is not None and state.properties[publish.PUBLISHED_VERSION] == str(passed)
    assert state.rows == delta_log.load(spark, path).count() == len(_truth(settings, spec))
    assert _table(delta_log.load(spark, path), spec) == _truth(settings, spec)
    assert _second_engine(path, spec) == _truth(settings, spec)
