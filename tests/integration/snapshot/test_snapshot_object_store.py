"""Snapshots with the warehouse and the reports on object storage (`s3a://`, issue #49), against
a real S3 server (SeaweedFS, as `duality up --object-store` runs it; this module's own, which it
stops and starts again): a full and an incremental snapshot (duality's own commit), validation
and publication, each version read alike by Delta in Spark and by delta-rs; two of duality's
writers racing for one version; and the server stopped in the middle of a snapshot."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from deltalake import DeltaTable

from duality import object_store, overview
from duality.config import Settings
from duality.kafka import topics
from duality.local.object_store import LocalObjectStore
from duality.serve import bootstrap
from duality.snapshot import delta_log, dv_commit, publish
from duality.spec import PipelineSpec
from duality.storage import ObjectPath
from tests.harness import (
    ROOT,
    assert_eventually,
    duality_json,
    make_pipeline,
    not_delta_s,
    run_python,
)
from tests.integration.snapshot.test_snapshot import (
    _create_changelog,
    _history,
    _truth,
    _write,
)


@pytest.fixture(scope="module")
def store(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalObjectStore]:
    """An S3 server of this module's own (the session's is never stopped)."""
    local = tmp_path_factory.mktemp("object-store")
    server = LocalObjectStore(settings.replace(local_dir=local), root=local / "object-store")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def table(
    settings: Settings, store: LocalObjectStore, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Settings, PipelineSpec]:
    """A pipeline whose warehouse and reports are in the store's bucket, with a changelog and a
    full snapshot of it (`duality snapshot --full`)."""
    folder = tmp_path_factory.mktemp("pipelines")
    prefix = f"s3a://{settings.s3_bucket}/{folder.name}"
    scoped = Settings.from_env(
        {
            **settings.as_env(),
            **store.client_settings(),
            "DUALITY_WAREHOUSE": f"{prefix}/warehouse",
            "DUALITY_REPORTS": f"{prefix}/reports",
            "DUALITY_PIPELINES": str(folder),
        }
    )
    assert isinstance(scoped.warehouse, ObjectPath) and isinstance(scoped.reports, ObjectPath)
    spec = make_pipeline(scoped, folder, "product_sales")
    topics.create_topic(scoped, spec.source.topic, 3)
    _create_changelog(scoped, spec)
    rng = random.Random(49)
    _write(scoped, spec, _history(rng, range(300)))
    _write(scoped, spec, {f"p{i:04d}": None for i in range(0, 40, 2)})
    full = duality_json(scoped, "snapshot", spec.name, "--full", timeout=300)
    assert (full["mode"], full["version"]) == ("full", 0)
    assert full["path"] == f"{prefix}/warehouse/{spec.name}"
    return scoped, spec


def _delta_rs_rows(settings: Settings, path: ObjectPath, version: int) -> Any:
    """A version's rows (a pyarrow Table) as delta-rs reads them from the store (applying
    deletion vectors itself)."""
    import pyarrow as pa
    from deltalake import QueryBuilder

    options = object_store.delta_rs_options(settings)
    found = DeltaTable(str(path), version=version, storage_options=options)
    reader = QueryBuilder().register("snapshot", found)
    table = pa.table(reader.execute("SELECT * FROM snapshot").read_all())
    # Its text comes as string views, which few of Arrow's kernels take.
    plain = [f.with_type(pa.string()) if f.type == pa.string_view() else f for f in table.schema]
    return table.cast(pa.schema(plain))


def _delta_rs(
    settings: Settings, spec: PipelineSpec, path: ObjectPath, version: int
) -> dict[str, dict[str, Any]]:
    """A version's aggregates by key, as delta-rs reads them."""
    rows = _delta_rs_rows(settings, path, version).to_pylist()
    table = {row["product"]: {c: row[c] for c in spec.aggregates} for row in rows}
    assert len(table) == len(rows), f"a key appears twice in version {version}"
    return table


def _whole_versions(path: ObjectPath) -> list[int]:
    """The table's versions, each a whole commit (every line an action, one commitInfo), from 0
    to the newest without a gap; nothing in its log but Delta's files (no writer's temporary
    file left behind)."""
    log = path / "_delta_log"
    names = sorted(entry.name for entry in log.iterdir())
    versions = sorted(int(name[:20]) for name in names if name.endswith(".json"))
    assert versions == list(range(len(versions))), names
    for version in versions:
        text = (log / f"{version:020d}.json").read_text()
        actions = [json.loads(line) for line in text.splitlines()]
        assert sum("commitInfo" in action for action in actions) == 1, version
    assert not_delta_s(path) == []  # type: ignore[arg-type]
    return versions


def test_snapshots_validation_and_publication_on_object_storage(table) -> None:  # type: ignore[no-untyped-def]
    settings, spec = table
    path = spec.snapshot_path(settings)
    assert isinstance(path, ObjectPath)
    rng = random.Random(50)
    _write(settings, spec, _history(rng, range(250, 320)))
    _write(settings, spec, {f"p{i:04d}": None for i in range(100, 110)})
    incremental = duality_json(settings, "snapshot", spec.name, timeout=300)
    # duality's own commit (deletion vectors, an appended file), created only if absent.
    assert incremental["mode"] == "incremental" and incremental["merged_by"] == "duality"
    version = incremental["version"]
    assert delta_log.history(path)[0].operation == "MERGE"
    assert _delta_rs(settings, spec, path, version) == _truth(settings, spec)

    checked = duality_json(settings, "validate", spec.name, "--no-publish", timeout=300)
    assert checked["success"] and not checked["published"] and checked["version"] == version
    # The reports are on the store: the JSON report and GE's Data Docs.
    report = json.loads(settings.location(checked["json_report"]).read_text())
    assert report["version"] == version and report["success"]
    docs = settings.location(checked["data_docs"])
    assert isinstance(docs, ObjectPath) and docs.is_file()
    assert list(docs.parent.rglob("*.html")) != [docs], "Data Docs hold no validation page"
    done = duality_json(settings, "publish", spec.name, "--version", str(version), timeout=300)
    assert done["published_version"] == version
    assert done["commit"] == checked["validation_commit"] + 1
    # duality wrote both commits (decision 30); delta-rs reads the properties they set.
    options = object_store.delta_rs_options(settings)
    configuration = DeltaTable(str(path), storage_options=options).metadata().configuration
    assert configuration[publish.PUBLISHED_VERSION] == str(version)
    for commit in (checked["validation_commit"], done["commit"]):
        assert (
            json.loads((path / "_delta_log" / f"{commit:020d}.json").read_text().split("\n")[0])[
                "commitInfo"
            ]["engineInfo"]
            == "duality"
        )
    truth = _truth(settings, spec)
    read = duality_json(settings, "read", spec.name, "--limit", "0")
    assert (read["version"], read["rows"]) == (version, len(truth))
    _whole_versions(path)
    # The overview and a new replica of `duality serve` read the published version from the
    # store, without Spark.
    view = overview._snapshot(settings, spec, time.time())
    assert (view.published_version, view.published_rows) == (version, len(truth))
    assert view.verdict == "passed" and view.data_docs is not None
    found = publish.published_in_log(path)
    assert found is not None
    replica = bootstrap.published(settings, spec, found.coverage.changelog_topic_id)
    assert replica is not None
    first = {json.loads(document)["product"]: json.loads(document) for *_, document in replica[1]}
    assert {k: {c: v[c] for c in ("orders", "units")} for k, v in first.items()} == {
        k: {c: v[c] for c in ("orders", "units")} for k, v in truth.items()
    }


def test_two_of_duality_s_writers_race_for_one_version(table) -> None:  # type: ignore[no-untyped-def]
    """Both prepared from the same version: each writes its files, then creates the next
    version's commit only if absent. One wins; the other's commit is refused, its files are
    removed, and run again from the winner's version it commits the next one."""
    settings, spec = table
    path = spec.snapshot_path(settings)
    assert isinstance(path, ObjectPath)
    base = delta_log.history(path)[0]
    state = delta_log.table_state(path, base.version)
    assert state is not None and dv_commit.blocker(state) is None
    rows = _delta_rs(settings, spec, path, base.version)
    import pyarrow as pa

    live = _delta_rs_rows(settings, path, base.version)
    # Each writer rewrites some keys' rows as they are: the table's rows do not change, so the
    # version still covers what its coverage says.
    coverage, _ = delta_log.version_coverage(delta_log.history(path), base.version)
    assert coverage is not None
    metadata = {"kind": "maintain", "coverage": coverage.as_dict()}
    keys = sorted(rows)

    def changes(chosen: list[str]) -> pa.Table:
        products = live.column("product").to_pylist()
        picked = live.take([i for i, product in enumerate(products) if product in chosen])
        return picked.append_column("_deleted", pa.array([False] * picked.num_rows))

    mine, theirs = changes(keys[:10]), changes(keys[10:25])
    before = {entry.name for entry in path.iterdir()}
    start = threading.Barrier(2)
    results: dict[str, Any] = {}

    def writer(name: str, rows: pa.Table) -> None:
        start.wait(timeout=60)
        results[name] = dv_commit.write(path, state, rows, ["product"], metadata)

    racers = [threading.Thread(target=writer, args=a) for a in (("a", mine), ("b", theirs))]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=120)
    won = [name for name, written in results.items() if written is not None]
    assert len(results) == 2 and len(won) == 1, results
    winner, loser = won[0], "b" if won[0] == "a" else "a"
    assert results[winner].version == base.version + 1
    # The loser's files are gone: every new file is one the winner's commit names.
    commit = (path / "_delta_log" / f"{base.version + 1:020d}.json").read_text().splitlines()
    named = {json.loads(line).get("add", {}).get("path") for line in commit}
    vectors = {
        json.loads(line)["add"]["deletionVector"]["pathOrInlineDv"]
        for line in commit
        if json.loads(line).get("add", {}).get("deletionVector")
    }
    added = {entry.name for entry in path.iterdir()} - before - {"_delta_log"}
    parquet = {name for name in added if name.endswith(".parquet")}
    assert parquet <= named and len(parquet) == 1, (parquet, named)
    assert len(added - parquet) == len(vectors) == 1, added

    # The loser, run again from the winner's version, commits the next one.
    again = delta_log.table_state(path, base.version + 1)
    assert again is not None
    retried = dv_commit.write(path, again, mine if loser == "a" else theirs, ["product"], metadata)
    assert retried is not None and retried.version == base.version + 2
    versions = _whole_versions(path)
    for version in (base.version, base.version + 1, base.version + 2):
        assert _delta_rs(settings, spec, path, version) == rows, version
    assert versions[-1] == base.version + 2


def test_the_store_stopped_in_the_middle_of_a_snapshot(table, store) -> None:  # type: ignore[no-untyped-def]
    """The S3 server killed once the snapshot job has read the table and is merging: the job
    fails saying the store does not answer; the table has no partial version; started again,
    the snapshot run again commits and validation publishes it; every version reads alike in Spark
    and delta-rs."""
    settings, spec = table
    path = spec.snapshot_path(settings)
    assert isinstance(path, ObjectPath)
    newest = _whole_versions(path)[-1]
    rng = random.Random(51)
    _write(settings, spec, _history(rng, range(280, 340)))
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "jobs" / "rebuild_snapshot.py"), spec.name, "--incremental"],
        env={**os.environ, **settings.as_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    said: list[str] = []
    with _stopped_on_timeout(job):
        assert job.stderr is not None
        for line in job.stderr:
            said.append(line)
            if "merging changes from" in line:
                break
        assert said and "merging changes from" in said[-1], "".join(said)[-3000:]
        pid = store.pid()
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)  # the server goes, as a crash takes it
        assert_eventually(lambda: store.pid() is None, timeout=30, message="the server lives")
        out, err = job.communicate(timeout=600)
    assert job.returncode == 2, "".join(said)[-2000:] + err[-3000:]
    assert "does not answer" in err and f"DUALITY_S3_ENDPOINT={settings.s3_endpoint}" in err
    assert "no partial version" in err
    assert settings.read_s3_secret_key() not in out + err

    store.stop()
    store.start()
    assert _whole_versions(path)[-1] == newest, "the failed run left a version"
    retried = duality_json(settings, "snapshot", spec.name, timeout=300)
    assert (retried["version"], retried["merged_by"]) == (newest + 1, "duality")
    checked = duality_json(settings, "validate", spec.name, timeout=300)
    assert checked["published"] and checked["version"] == newest + 1
    truth = _truth(settings, spec)
    found = publish.published_in_log(path)
    assert found is not None and found.version == newest + 1
    # Delta's OPTIMIZE and VACUUM on the store keep every file the published version reads.
    kept = duality_json(settings, "snapshot", spec.name, "--maintain", timeout=300)
    assert kept["published_version"] == newest + 1 and kept["files_removed_by_optimize"] > 0

    # Every version whole, and read alike by Delta in Spark and by delta-rs.
    spark_read = run_python(
        settings, "-m", "tests.integration.snapshot.object_store_reader", spec.name, timeout=300
    )
    assert spark_read.returncode == 0, spark_read.stderr[-3000:]
    by_spark = json.loads(spark_read.stdout)
    versions = _whole_versions(path)
    assert sorted(map(int, by_spark)) == versions
    for version in versions:
        assert _delta_rs(settings, spec, path, version) == by_spark[str(version)], version
    assert _delta_rs(settings, spec, path, versions[-1]) == truth


@contextlib.contextmanager
def _stopped_on_timeout(process: subprocess.Popen[str]) -> Iterator[None]:
    """The process killed if the block fails (a test never leaves it running)."""
    try:
        yield
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=60)
