"""A small benchmark run: every scenario of its groups in its JSON, the snapshot tables equal to
the changelog; no timing thresholds (a benchmark reports, it does not fail). The groups of whole
processes, the streams', the join's, the commands' and serve's, are left to `make bench`
(docs/testing.md): some 30 process starts of Spark and Airflow, which the product's own tests
already make, and more CPU than the suite can spend on them again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from duality import process
from duality.config import Settings
from tests.harness import ROOT, assert_eventually, java_processes

RECORDS, KEYS = 2_000, 100
GROUPS = ["repartition", "snapshots"]
COPIES = [  # the scenarios that read or copy every record once
    *["kafka-consumer-perf", "python-copy", "repartition-key-hash", "repartition-salted"],
]
SCENARIOS = {
    *COPIES,
    *["snapshot-full", "snapshot-incremental", "snapshot-full-after", "snapshot-nothing-new"],
    *["validate", "validate-3x"],
}


# Beside the other workers' tests a run takes minutes, more than the suite's default.
@pytest.mark.timeout(600)
def test_bench_writes_its_figures_and_its_snapshots_equal_the_changelog(
    settings: Settings, tmp_path: Path
):
    bench = subprocess.Popen(
        [
            *_bench_command(records=RECORDS, keys=KEYS, out=tmp_path),
            *("--groups", ",".join(GROUPS)),
        ],
        env={**os.environ, "DUALITY_BOOTSTRAP_SERVERS": settings.bootstrap_servers},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = bench.communicate(timeout=500)
    finally:  # however the test ends, the benchmark's processes go too
        process.kill_group(bench.pid, reap=bench)
    assert bench.returncode == 0, stdout[-3000:] + stderr[-3000:]
    document = json.loads((tmp_path / "latest.json").read_text())
    assert document["workload"]["records"] == RECORDS and document["workload"]["keys"] == KEYS
    assert document["workload"]["groups"] == GROUPS
    assert document["machine"]["cpus"] > 0
    figures = {s["scenario"]: s for s in document["scenarios"]}
    assert set(figures) == SCENARIOS
    for name, figure in figures.items():
        assert figure["seconds"] > 0 and figure["records"] >= 0, name
        assert figure["records_per_s"] >= 0 and figure["mb_per_s"] >= 0, name
        for goal in figure.get("targets", []):
            assert goal["target"] and isinstance(goal["met"], bool), (name, goal)
            assert goal["value"] is None or isinstance(goal["value"], int | float), (name, goal)

    for name in COPIES:  # each covers exactly the records produced
        assert figures[name]["records"] == RECORDS, name
    _check_snapshots(figures)
    assert "records/s" in stdout and "python-copy" in stdout


def _check_snapshots(figures: dict[str, dict[str, Any]]) -> None:
    """KEYS keys, 1% of them (one) changed: the incremental run reads only that record, and both
    tables equal an independent read of the changelog."""
    full, incremental = figures["snapshot-full"], figures["snapshot-incremental"]
    after, nothing = figures["snapshot-full-after"], figures["snapshot-nothing-new"]
    assert full["records"] == KEYS and full["mode"] == "full"
    assert incremental["changelog_records_read"] == 1 and incremental["mode"] == "incremental"
    assert after["changelog_records_read"] >= KEYS + 1
    assert incremental["equals_changelog"] is True and after["equals_changelog"] is True
    assert incremental["records"] == after["records"] == nothing["records"]
    assert nothing["mode"] == "none" and nothing["changelog_records_read"] == 0
    assert figures["validate"]["records"] == RECORDS and figures["validate"]["checks"] > 10
    assert figures["validate-3x"]["records"] == 3 * RECORDS


def test_bench_stops_its_broker_on_sigterm(tmp_path: Path):
    """A benchmark stopped with SIGTERM (a CI timeout, `kill`) leaves no process behind: the
    throw-away broker it started (no DUALITY_BOOTSTRAP_SERVERS) is stopped on the way out, and
    no folder either: the broker's and the run's scratch folder are deleted."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "DUALITY_BOOTSTRAP_SERVERS"}
    env["TMPDIR"] = str(temporary)
    output = tmp_path / "bench.log"
    with open(output, "wb") as out:
        bench = subprocess.Popen(
            _bench_command(records=2_000, keys=50, out=tmp_path / "results"),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started: list[psutil.Process] = []
    try:
        assert_eventually(
            lambda: "ConsumerPerformance" in output.read_text(errors="replace"),
            timeout=120,
            message=f"the benchmark never reached its first scenario; see {output}",
        )
        started.extend(psutil.Process(bench.pid).children(recursive=True))
        assert java_processes(bench.pid), started
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(90) != 0
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, (left, output.read_text(errors="replace")[-2000:])
        assert sorted(p.name for p in temporary.iterdir()) == []
    finally:
        process.kill_group(bench.pid, reap=bench)
        for child in started:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _bench_command(*, records: int, keys: int, out: Path) -> list[str]:
    options = ("--records", str(records), "--keys", str(keys), "--out", str(out))
    return [sys.executable, str(ROOT / "bench" / "run.py"), *options]
