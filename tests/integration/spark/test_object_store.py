"""Object storage (docs/operations.md "Object storage") against the real S3 server that `duality
up --object-store` runs (SeaweedFS, the session's `object_store_settings`): it refuses anonymous
requests and creates an object only if absent; a missing bucket, refused credentials and an
endpoint that does not answer stop `stream start` and a batch step before any work, naming the
setting; two Spark drivers appending to one Delta table on S3 at once lose no version and write
none by halves, and delta-rs reads every version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from duality import object_store
from duality.config import Settings
from duality.storage import s3
from tests.harness import ROOT, run_duality, unique_name
from tests.integration.spark.object_store_writer import ROWS


def test_anonymous_requests_are_refused_and_a_key_is_created_only_once(
    object_store_settings: Settings,
):
    anonymous = object_store_settings.replace(s3_access_key=None, s3_secret_key_file=None)
    bucket = object_store_settings.s3_bucket
    assert s3.request(anonymous.store(), "HEAD", f"/{bucket}").status == 403
    key = f"s3a://{bucket}/{unique_name('create-once')}/00000.json"
    assert s3.create_if_absent(object_store_settings.store(), key, b"first")
    assert not s3.create_if_absent(object_store_settings.store(), key, b"second")
    _, path = s3.split(key)
    got = s3.request(object_store_settings.store(), "GET", f"/{bucket}/{path}")
    assert (got.status, got.body) == (200, b"first")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"DUALITY_S3_BUCKET": "no-such-bucket"}, "DUALITY_S3_BUCKET=s3a://no-such-bucket"),
        ({"DUALITY_S3_ACCESS_KEY": "not-a-key"}, "DUALITY_S3_ACCESS_KEY=not-a-key"),
        ({"DUALITY_S3_ENDPOINT": "http://127.0.0.1:1"}, "DUALITY_S3_ENDPOINT=http://127.0.0.1:1"),
    ],
    ids=["missing-bucket", "refused-key", "unreachable"],
)
def test_a_bad_object_store_stops_commands_before_any_work(
    object_store_settings: Settings, change: dict[str, str], named: str, tmp_path: Path
):
    """`stream start` and `snapshot` exit 2 naming the setting and the fix, and start nothing
    (no stream's log, no table)."""
    mine = object_store_settings.replace(local_dir=tmp_path / "local", warehouse=tmp_path / "wh")
    env = {**mine.as_env(), **change}
    for command in (["stream", "start", "product_sales"], ["snapshot", "product_sales"]):
        done = run_duality(env, *command, "--json", timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr[-2000:]
        error = json.loads(done.stdout)["error"]
        assert named in error, error
        assert object_store_settings.read_s3_secret_key() not in done.stdout + done.stderr
    assert not (mine.local_dir / "streams").exists() and not mine.warehouse.exists()


def _writer(
    settings: Settings, table: str, writer: str, commits: int, order: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.spark.object_store_writer",
            table,
            writer,
            str(commits),
            order,
        ],
        env={**settings.process_env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_two_drivers_racing_for_versions_lose_none_and_delta_rs_reads_each(
    object_store_settings: Settings,
):
    """Two drivers append to one table at once (the second starts once the first made version
    0), racing for every later version: Delta's commits go through duality's log store, whose
    conditional create (If-None-Match: *) refuses the loser of a version, which retries at the
    next one. Every commit is a version of its own, whole, and delta-rs reads
    each version as the commits up to it; the secret shows in no configuration or command line."""
    commits = 4
    table = f"s3a://{object_store_settings.s3_bucket}/{unique_name('race')}/table"
    writers = [
        _writer(object_store_settings, table, w, commits, order)
        for w, order in (("a", "first"), ("b", "next"))
    ]
    results: list[dict[str, Any]] = []
    try:
        for process in writers:
            out, err = process.communicate(timeout=600)
            causes = [line for line in err.splitlines() if "Exception" in line][:5]
            assert process.returncode == 0, "\n".join(causes) + err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in writers:
            if process.poll() is None:
                process.kill()
                process.wait()
    for result in results:
        assert result["kept"] == "first" and result["refused"], result
        assert "FileAlreadyExists" in result["refused"] or "412" in result["refused"], result
        assert not result["secret_in_conf"] and not result["secret_in_cmdline"], result
        assert result["jvms"] >= 1 and result["class_archive_mapped"], result
    options = object_store.delta_rs_options(object_store_settings)
    latest = DeltaTable(table, storage_options=options)
    assert latest.version() == 2 * commits - 1
    by_version = {entry["version"]: entry.get("userMetadata") for entry in latest.history()}
    assert sorted(by_version) == list(range(2 * commits))
    assert sorted(by_version.values()) == sorted(
        f"{w}:{b}" for w in ("a", "b") for b in range(commits)
    )
    seen: set[tuple[str, int]] = set()
    for version in range(2 * commits):
        writer, batch = str(by_version[version]).split(":")
        seen.add((writer, int(batch)))
        rows = DeltaTable(table, version=version, storage_options=options).to_pyarrow_table()
        columns = (rows.column(c).to_pylist() for c in ("writer", "batch", "n"))
        got = sorted(zip(*columns, strict=True))
        assert got == sorted((w, b, n) for w, b in seen for n in range(ROWS)), version
