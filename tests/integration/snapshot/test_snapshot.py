"""Delta snapshots from compacted changelogs, against an independent read_committed read of it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from duality import changelog, cli, validate
from duality.config import Settings
from duality.kafka import client, offsets, records, topics
from duality.snapshot import build, delta_log, dv_commit, publish
from duality.snapshot import maintain as maintain_module
from duality.snapshot.coverage import Coverage
from duality.snapshot.maintain import maintain
from duality.spec import PipelineSpec
from tests.harness import (
    ROOT,
    StreamProcess,
    assert_eventually,
    make_pipeline,
    not_delta_s,
    read_latest,
    read_topic,
    run_duality,
)

# -- a changelog writer, as the stream writes it (transactions, tombstones, aborted ones) ----


def _create_changelog(settings: Settings, spec: PipelineSpec) -> None:
    topics.create_topic(
        settings,
        spec.changelog_topic,
        3,
        config={"cleanup.policy": "compact", **topics.FAST_COMPACTION},
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
    producer = client.producer(settings, transactional_id=f"test-{spec.name}")
    producer.init_transactions(30)
    producer.begin_transaction()
    for product, row in changes.items():
        key = changelog.encode_key(spec, [product])
        value = (
            None
            if row is None
            else changelog.encode_value(spec, [product], row, {"count": row["orders"]}, 1_700_000)
        )
        records.send(producer, spec.changelog_topic, key, value)
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
    topics.create_topic(scoped, spec.source.topic, 3)
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
    ends = offsets.end_offsets(settings, spec.changelog_topic)
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

    # Nothing new: no new version; the newest built one was never validated, and says so (the
    # snapshot DAG validates and publishes it rather than skip).
    nothing = build.build(settings, spec, "incremental", spark=spark)
    assert (nothing.version, nothing.unvalidated_version) == (None, rebuilt.version)

    # A recreated changelog (the reset tool) cannot be merged: full rebuild, and why.
    topics.delete_topic(settings, spec.changelog_topic)
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
    topics.delete_topic(settings, spec.changelog_topic)  # the stream creates its own
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
    producer = client.producer(settings)
    records.send(producer, spec.changelog_topic, key, json.dumps(value).encode())
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


# -- races for one Delta version between duality's own commits and Delta's writers ----------


@contextlib.contextmanager
def _around_duality_s_commit(
    monkeypatch: pytest.MonkeyPatch,
    path: Path,
    racer: Callable[[int], contextlib.AbstractContextManager[None]],
) -> Iterator[dict[str, Any]]:
    """`racer(version)` entered just before duality creates its next commit file (`version`),
    after it read the version before and wrote its files, and left when the create returned:
    what another writer of the table does at that moment. Yields the version raced for and
    the files duality's attempt had written by then."""
    create = dv_commit.storage.create_if_absent
    before = set(path.iterdir())
    raced: dict[str, Any] = {}

    def racing(final: Path, data: bytes) -> bool:
        if final.suffix != ".json" or raced:
            return create(final, data)
        raced.update(version=int(final.stem), files=set(path.iterdir()) - before)
        with racer(int(final.stem)):
            return create(final, data)

    monkeypatch.setattr(dv_commit.storage, "create_if_absent", racing)
    try:
        yield raced
    finally:
        monkeypatch.setattr(dv_commit.storage, "create_if_absent", create)
    assert raced, "duality made no commit of its own"


def _commit_info(path: Path, version: int) -> dict[str, Any]:
    """The commitInfo of a version's commit file (it must hold exactly one)."""
    lines = (path / "_delta_log" / f"{version:020d}.json").read_text().splitlines()
    infos = [json.loads(line)["commitInfo"] for line in lines if '"commitInfo"' in line]
    assert len(infos) == 1, f"version {version} holds {len(infos)} commits"
    return dict(infos[0])


def _every_version_read_alike(spark, path: Path, spec: PipelineSpec) -> int:  # type: ignore[no-untyped-def]
    """Each version from 0 to the newest has one commit, and delta-rs reads it as Delta in
    Spark does; the newest version."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    names = [file.name for file in (path / "_delta_log").glob("*.json")]
    versions = sorted(int(name.split(".")[0]) for name in names)
    assert versions == list(range(len(versions))), versions
    for version in versions:
        _commit_info(path, version)
        reader = QueryBuilder().register("t", DeltaTable(str(path), version=version))
        rows = pa.table(reader.execute("SELECT * FROM t").read_all()).to_pylist()
        second = {row["product"]: {c: row[c] for c in spec.aggregates} for row in rows}
        assert len(second) == len(rows), f"a key appears twice in version {version}"
        assert second == _table(delta_log.load(spark, path, version), spec), version
    return versions[-1]


def _delta_statement_first(spark, statement: str, path: Path):  # type: ignore[no-untyped-def]
    """A racer (`_around_duality_s_commit`) that has Delta in Spark commit `statement` on the
    table first, taking the very version duality is about to create."""

    @contextlib.contextmanager
    def racer(version: int) -> Iterator[None]:
        spark.sql(statement.format(table=delta_log.sql_name(path))).collect()
        # Delta read the version duality read, and committed the one duality now creates.
        assert _commit_info(path, version)["readVersion"] == version - 1
        yield

    return racer


def test_a_version_delta_takes_first_is_neither_lost_nor_doubled(  # type: ignore[no-untyped-def]
    spark, pipeline, monkeypatch
) -> None:
    """Delta's OPTIMIZE takes the version duality's incremental snapshot is about to commit,
    and Delta's ALTER TABLE the one its verdict is about to commit, each from the version
    duality read: duality's create finds the version taken; the snapshot falls back to Delta's
    MERGE and the verdict commits the next version itself. Both writers' changes are in the
    table, and nothing of the attempt that lost is left."""
    settings, spec = pipeline
    rng = random.Random(17)
    _write(settings, spec, _history(rng, range(300)))
    build.build(settings, spec, "full", spark=spark)
    _write(settings, spec, _history(rng, range(0, 300, 7)))
    assert build.build(settings, spec, spark=spark).merged_by == "duality"  # files for OPTIMIZE
    path = spec.snapshot_path(settings)

    _write(settings, spec, _history(rng, range(0, 320, 4)))
    _write(settings, spec, {f"p{i:04d}": None for i in range(1, 60, 4)})
    optimize = _delta_statement_first(spark, "OPTIMIZE {table}", path)
    with _around_duality_s_commit(monkeypatch, path, optimize) as raced:
        built = build.build(settings, spec, spark=spark)
    taken = raced["version"]
    assert _commit_info(path, taken)["operation"] == "OPTIMIZE"  # Delta's, kept
    # The snapshot fell back to Delta's MERGE, which read the table as OPTIMIZE left it.
    assert (built.version, built.merged_by) == (taken + 1, "delta")
    merge = _commit_info(path, taken + 1)
    assert (merge["operation"], merge["readVersion"]) == ("MERGE", taken)
    assert "duality" not in merge["engineInfo"]
    assert delta_log.history(path)[0].metadata["kind"] == "snapshot"  # type: ignore[index]
    # duality's attempt had written a deletion vector and a data file; both were removed.
    assert {file.suffix for file in raced["files"]} == {".bin", ".parquet"}
    assert not any(file.exists() for file in raced["files"])
    assert not_delta_s(path) == []
    truth = _truth(settings, spec)
    assert _table(delta_log.load(spark, path), spec) == truth == _second_engine(path, spec)

    # A verdict that publishes, against Delta's ALTER TABLE from the same version.
    alter = "ALTER TABLE {table} SET TBLPROPERTIES ('duality.test.race' = 'delta took it')"
    verdict = publish.Verdict(built.version or 0, True, 1, [], False, "now", "report.json")
    with _around_duality_s_commit(monkeypatch, path, _delta_statement_first(spark, alter, path)):
        commit = publish.record_validation(
            spark, path, verdict, built.coverage, again="run it again"
        )
    taken = commit - 1
    assert _commit_info(path, taken)["operation"] == "SET TBLPROPERTIES"  # Delta's, kept
    assert "duality" not in _commit_info(path, taken)["engineInfo"]
    # duality read the table again and committed the next version itself: both properties set.
    info = _commit_info(path, commit)
    assert (info["engineInfo"], info["readVersion"]) == ("duality", taken)
    from deltalake import DeltaTable

    detail = spark.sql(f"DESCRIBE DETAIL {delta_log.sql_name(path)}").first()["properties"]
    for properties in (DeltaTable(str(path)).metadata().configuration, detail):
        assert properties["duality.test.race"] == "delta took it"
        assert properties[publish.PUBLISHED_VERSION] == str(built.version)
        assert json.loads(properties[publish.VALIDATION])["version"] == built.version
    assert not_delta_s(path) == []
    assert _every_version_read_alike(spark, path, spec) == commit


@contextlib.contextmanager
def _task_slots_held(spark) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Every task slot of the local Spark held by a job whose tasks each wait on a connection
    to this block, closed when it ends: the tasks of jobs submitted meanwhile wait for it.
    Yields the holding job's group."""
    group = f"slots-{uuid.uuid4().hex}"
    slots = spark.sparkContext.defaultParallelism
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(120)
        port = server.getsockname()[1]

        def hold(_: int) -> int:
            import socket

            with socket.create_connection(("127.0.0.1", port)) as connection:
                connection.recv(1)  # until the test closes it
            return 0

        def run() -> None:
            spark.sparkContext.setJobGroup(group, "test: every task slot held")
            spark.sparkContext.parallelize(range(slots), slots).map(hold).collect()

        holder = threading.Thread(target=run)
        holder.start()
        connections = [server.accept()[0] for _ in range(slots)]
        try:
            yield group
        finally:
            for connection in connections:
                connection.close()
            holder.join(timeout=120)


def _optimize_reads_first(spark, maintaining: threading.Thread):  # type: ignore[no-untyped-def]
    """A racer (`_around_duality_s_commit`) that starts `maintaining` (a `--maintain` run)
    while Spark's task slots are held, lets duality create its commit once OPTIMIZE has read the
    version before and waits for a slot, and frees the slots after: OPTIMIZE then commits on a
    version that is no longer the newest."""

    @contextlib.contextmanager
    def racer(version: int) -> Iterator[None]:
        tracker = spark.sparkContext.statusTracker()
        with _task_slots_held(spark) as held:
            maintaining.start()

            def optimize_waits() -> list[int]:
                return sorted(
                    set(tracker.getActiveJobsIds()) - set(tracker.getJobIdsForGroup(held))
                )

            waiting = assert_eventually(optimize_waits, timeout=120, message="OPTIMIZE ran no job")
            # Its first job computes the files of the version it read (Delta's OPTIMIZE fixes
            # its snapshot before): the version before duality's.
            store = spark._jsc.sc().statusStore()
            description = store.job(waiting[0]).description()
            assert description.isDefined(), "OPTIMIZE's job has no description"
            said = description.get()
            assert f"snapshot for version: {version - 1}" in said or "Optimizing" in said, said
            yield

    return racer


def test_a_losing_optimize_runs_again_or_says_what_to_do(  # type: ignore[no-untyped-def]
    spark, pipeline, monkeypatch, capsys
) -> None:
    """`snapshot --maintain` started with an incremental snapshot, its OPTIMIZE reading the
    version before the snapshot's and committing after it: Delta refuses the commit (the
    snapshot changed files it compacted). The run reads the table again and compacts it; with
    no attempt left, the command fails with one line naming the commit that won and the fix.
    (VACUUM keeps an hour: every version stays readable.)"""
    settings, spec = pipeline
    rng = random.Random(19)
    _write(settings, spec, _history(rng, range(300)))
    build.build(settings, spec, "full", spark=spark)
    path = spec.snapshot_path(settings)
    said: list[str] = []
    outcome: dict[str, Any] = {}

    def maintaining() -> None:
        try:
            outcome["done"] = maintain(
                settings, spec, retain_hours=1, spark=spark, progress=said.append
            )
        except BaseException as error:  # reported by the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=maintaining)
    _write(settings, spec, _history(rng, range(0, 300, 3)))
    with _around_duality_s_commit(monkeypatch, path, _optimize_reads_first(spark, thread)) as raced:
        built = build.build(settings, spec, spark=spark)
    thread.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    version = raced["version"]
    assert (built.version, built.merged_by) == (version, "duality")
    # OPTIMIZE lost once, said so, and compacted the table as duality's commit left it.
    lost = [line for line in said if "lost the race" in line]
    assert len(lost) == 1, said
    assert f"version {version} (MERGE by `duality snapshot`) took it first" in lost[0]
    optimized = _commit_info(path, version + 1)
    assert (optimized["operation"], optimized["readVersion"]) == ("OPTIMIZE", version)
    assert outcome["done"].files_removed_by_optimize >= 2
    assert not_delta_s(path) == []
    truth = _truth(settings, spec)
    assert _table(delta_log.load(spark, path), spec) == truth == _second_engine(path, spec)

    # With no attempt left, the command says in one line what happened and what to do.
    monkeypatch.setattr(maintain_module, "_OPTIMIZE_ATTEMPTS", 1)
    _write(settings, spec, _history(rng, range(0, 300, 5)))
    assert build.build(settings, spec, spark=spark).merged_by == "duality"  # a second file
    _write(settings, spec, _history(rng, range(1, 300, 5)))
    environ = {**os.environ, **settings.as_env()}
    command = ["snapshot", spec.name, "--maintain", "--retain-hours", "1"]
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(cli.main(command, environ, forward=False))
    )
    capsys.readouterr()
    with _around_duality_s_commit(monkeypatch, path, _optimize_reads_first(spark, thread)) as raced:
        build.build(settings, spec, spark=spark)
    thread.join(timeout=300)
    error = capsys.readouterr().err.strip()
    version = raced["version"]
    assert codes == [1], error
    assert error.count("\n") == 0 and "Traceback" not in error and "java" not in error, error
    assert error.startswith(f"duality snapshot: error: OPTIMIZE of {path} lost the race"), error
    assert f"version {version} (MERGE by `duality snapshot`) took it first" in error
    assert error.endswith(f"run `duality snapshot {spec.name} --maintain` again"), error
    # Nothing was written: duality's snapshot is the newest version, the rows are the truth.
    assert delta_log.history(path)[0].version == version
    assert not_delta_s(path) == []
    assert _every_version_read_alike(spark, path, spec) == version
    assert _table(delta_log.load(spark, path), spec) == _truth(settings, spec)
