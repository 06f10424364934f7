"""The benchmark harness itself works: a small run writes its JSON, both baselines and every
scenario with sane figures (no timing thresholds: a benchmark reports, it does not fail)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from duality.config import Settings
from tests.harness import ROOT, assert_eventually, java_processes


def test_bench_writes_baselines(settings: Settings, tmp_path: Path):
    env = {**os.environ, "DUALITY_BOOTSTRAP_SERVERS": settings.bootstrap_servers}
    result = subprocess.run(
        _bench_command(records=20_000, keys=500, out=tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "latest.json").read_text())
    figures = {s["scenario"]: s for s in document["scenarios"]}
    assert set(figures) == {
        "kafka-consumer-perf",
        "python-copy",
        "spark-aggregation",
        "stream-throughput",
        "stream-throughput-warm",
        "state-scale",
        "restore-from-changelog",
        "recompute-from-source",
        "repartition-key-hash",
        "repartition-salted",
        "snapshot-full",
        "snapshot-incremental",
        "snapshot-full-after",
        "snapshot-nothing-new",
        "validate",
        "validate-3x",
        "latency",
    }
    for name in (
        "kafka-consumer-perf",
        "python-copy",
        "spark-aggregation",
        "stream-throughput",
        "stream-throughput-warm",
    ):
        assert figures[name]["records"] == 20000
        assert figures[name]["records_per_s"] > 0 and figures[name]["mb_per_s"] > 0
    _check_stream_scenarios(figures)
    for name in ("repartition-key-hash", "repartition-salted"):
        assert figures[name]["records"] == 20000 and figures[name]["records_per_s"] > 0
    assert figures["repartition-salted"]["skew_before"] > 1.5
    assert figures["repartition-salted"]["skew_after"] <= 1.3
    # 500 keys, 1% of them (5) changed: the incremental run reads only those records.
    assert figures["snapshot-full"]["records"] == 500
    assert figures["snapshot-incremental"]["changelog_records_read"] == 5
    assert figures["snapshot-full-after"]["changelog_records_read"] >= 505
    assert figures["snapshot-incremental"]["records"] == figures["snapshot-full-after"]["records"]
    assert figures["snapshot-nothing-new"]["mode"] == "none"
    assert figures["snapshot-nothing-new"]["records"] == figures["snapshot-full-after"]["records"]
    for name in ("snapshot-incremental", "snapshot-nothing-new"):
        assert len(_targets(figures[name])) == 1
    assert figures["validate"]["records"] == 20000 and figures["validate"]["checks"] > 10
    assert figures["validate-3x"]["records"] == 60000
    for name in ("validate", "validate-3x"):
        assert figures[name]["seconds_per_million_rows"] > 0
    assert len(_targets(figures["validate"])) == 1 and len(_targets(figures["validate-3x"])) == 2
    assert "records/s" in result.stdout and "python-copy" in result.stdout
    for name in ("state-scale (500 keys)", "state-scale (10,000 keys)", "latency"):
        assert name in result.stdout


def _targets(figure: dict) -> list[dict]:
    """Where an issue target applies: its description, the measured value and a verdict."""
    targets = figure["targets"]
    assert targets and all(isinstance(t["met"], bool) and t["target"] for t in targets)
    assert figure["met"] == all(t["met"] for t in targets)
    return targets


def _check_stream_scenarios(figures: dict) -> None:
    throughput = figures["stream-throughput"]
    assert throughput["vs_python_copy"] > 0 and throughput["vs_spark_aggregation"] > 0
    assert "python-copy" in _targets(throughput)[0]["target"]
    # The same stream, given the backlog again at once: ratios, no target.
    warm = figures["stream-throughput-warm"]
    assert warm["vs_python_copy"] > 0 and warm["vs_spark_aggregation"] > 0
    assert "targets" not in warm

    # 500 keys (the throughput run) and 20 times as many, one event each.
    scale = figures["state-scale"]
    assert scale["keys"] == [500, 10_000]
    assert [t["target"] for t in _targets(scale)] == [
        "peak rss growth <= 500 MB",
        "restart at 10,000 keys <= 1.5x restart at 500 keys",
    ]
    small, large = scale["points"]
    assert (small["events"], large["events"]) == (20_000, 10_000)
    assert small["seconds"] == throughput["seconds"]
    for point in (small, large):
        assert point["state_rows"] >= point["distinct_keys"] == point["keys"]
        assert 0 < point["covered_rss_mb"] <= point["peak_rss_mb"]
        assert point["restart_seconds"] > 0 and point["restart_events"] == 1000
        assert point["restart_peak_rss_mb"] > 0 and point["peak_processes"] >= 3
        assert point["peak_rss_parts_mb"]["jvm"] > 0
    growth = large["peak_rss_mb"] - small["peak_rss_mb"]
    assert abs(scale["rss_growth_mb"] - growth) <= 0.2
    assert scale["restart_ratio"] > 0

    # One event per key, as many keys as --records; the Spark batch finds the same keys.
    restore, recompute = figures["restore-from-changelog"], figures["recompute-from-source"]
    assert restore["records"] == restore["keys"] == 20_000
    assert restore["state_rows"] >= 20_000 and restore["seconds"] > 0
    assert recompute["records"] == 20_000 and recompute["keys"] == 20_000
    assert recompute["seconds"] > 0

    # 5,000 events/s for 10 s after the warm-up: every event seen once in the changelog.
    latency = figures["latency"]
    assert latency["records"] == 50_000 and latency["trigger_seconds"] == 0.5
    assert latency["unseen_events"] == 0 and latency["overcounted_records"] == 0
    assert latency["measured_events"] == 50_000
    assert 0 < latency["p50_s"] <= latency["p99_s"] <= latency["max_s"]
    # 10 s measured (the floor at this size) after the shortest warm-up, whose events are
    # reported apart.
    assert latency["warmup_seconds"] == 5 and latency["warmup_events"] == 25_000
    assert latency["warmup_p99_s"] > 0
    assert latency["rate_achieved"] > 0
    assert _targets(latency)[0]["target"] == "p99 <= 2 s"


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
        process = subprocess.Popen(
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
        started.extend(psutil.Process(process.pid).children(recursive=True))
        assert java_processes(process.pid), started
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) != 0
        left = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, (left, output.read_text(errors="replace")[-2000:])
        assert sorted(p.name for p in temporary.iterdir()) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for child in started:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _bench_command(*, records: int, keys: int, out: Path) -> list[str]:
    run = ROOT / "bench" / "run.py"
    return [
        sys.executable,
        str(run),
        "--records",
        str(records),
        "--keys",
        str(keys),
        "--out",
        str(out),
    ]
