"""The benchmark harness itself works: a small run writes its JSON and both baselines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from duality.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_bench_writes_baselines(settings: Settings, tmp_path: Path):
    env = {**os.environ, "DUALITY_BOOTSTRAP_SERVERS": settings.bootstrap_servers}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "run.py"),
            "--records",
            "20000",
            "--keys",
            "500",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "latest.json").read_text())
    figures = {s["scenario"]: s for s in document["scenarios"]}
    assert set(figures) == {
        "kafka-consumer-perf",
        "python-copy",
        "stream-throughput",
        "restore-from-changelog",
        "recompute-from-source",
        "repartition-key-hash",
        "repartition-salted",
        "snapshot-full",
        "snapshot-incremental",
        "snapshot-full-after",
        "validate",
    }
    for name in ("kafka-consumer-perf", "python-copy", "stream-throughput"):
        assert figures[name]["records"] == 20000
        assert figures[name]["records_per_s"] > 0 and figures[name]["mb_per_s"] > 0
    assert figures["restore-from-changelog"]["records"] == 50  # keys: 500 // 10
    assert figures["recompute-from-source"]["seconds"] > 0
    for name in ("repartition-key-hash", "repartition-salted"):
        assert figures[name]["records"] == 20000 and figures[name]["records_per_s"] > 0
    assert figures["repartition-salted"]["skew_before"] > 1.5
    assert figures["repartition-salted"]["skew_after"] <= 1.3
    # 500 keys, 1% of them (5) changed: the incremental run reads only those records.
    assert figures["snapshot-full"]["records"] == 500
    assert figures["snapshot-incremental"]["changelog_records_read"] == 5
    assert figures["snapshot-full-after"]["changelog_records_read"] >= 505
    assert figures["snapshot-incremental"]["records"] == figures["snapshot-full-after"]["records"]
    assert figures["validate"]["records"] == 20000 and figures["validate"]["checks"] > 10
    assert figures["validate"]["seconds_per_million_rows"] > 0
    assert "records/s" in result.stdout and "python-copy" in result.stdout
