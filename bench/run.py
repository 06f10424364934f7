"""`make bench`: run the benchmark scenarios, write JSON under bench/results/, print a table.

Every figure is compared to the baselines measured in the same run on the same topic. Set
DUALITY_BENCH_RECORDS for a smaller workload (the default is 1,000,000 records of ~100 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import Figure, consumer_perf, order_events, preload, python_copy
from duality import kafka
from duality.config import Settings
from duality.local import ephemeral_broker
from repartition import repartition_scenarios
from snapshots import snapshot_scenarios, validation_scenario
from streaming import bench_spec, restore_versus_recompute, run_to_end

RESULTS = Path(__file__).resolve().parent / "results"
PARTITIONS = 6


@contextlib.contextmanager
def cluster(settings: Settings) -> Iterator[Settings]:
    """The cluster DUALITY_BOOTSTRAP_SERVERS names, else a throw-away broker of our own."""
    if os.environ.get("DUALITY_BOOTSTRAP_SERVERS"):
        kafka.ensure_reachable(settings)
        yield settings
    else:
        with ephemeral_broker(settings) as scoped:
            yield scoped


def render(figures: list[Figure], console: Console) -> None:
    baseline = {
        f.scenario: f for f in figures if f.scenario in ("kafka-consumer-perf", "python-copy")
    }
    table = Table(title="duality benchmarks (same run, same topic)")
    for column in (
        "scenario",
        "records",
        "seconds",
        "records/s",
        "MB/s",
        "vs consumer-perf",
        "vs python-copy",
    ):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for figure in figures:
        ratios = [
            f"{figure.records_per_s / baseline[name].records_per_s:.2f}x"
            if name in baseline
            else "-"
            for name in ("kafka-consumer-perf", "python-copy")
        ]
        table.add_row(
            figure.scenario,
            f"{figure.records:,}",
            f"{figure.seconds:.2f}",
            f"{figure.records_per_s:,.0f}",
            f"{figure.mb_per_s:.1f}",
            *ratios,
        )
    console.print(table)
    for figure in figures:
        details = figure.as_dict()
        if "changelog_records_read" in details:
            console.print(
                f"{figure.scenario}: {details['mode']}, read "
                f"{details['changelog_records_read']:,} changelog records, {figure.records:,} rows"
            )
        if "seconds_per_million_rows" in details:
            console.print(
                f"{figure.scenario}: {details['checks']} checks, "
                f"{details['seconds_per_million_rows']:.1f} s per million rows"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--records", type=int, default=int(os.environ.get("DUALITY_BENCH_RECORDS", 1_000_000))
    )
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.records < 1 or args.keys < 1:
        parser.error("--records and --keys must be at least 1")
    console = Console(width=max(120, Console().width))
    # Checkpoints, tables and locks of the benchmark's pipelines stay out of the user's folders.
    scratch = Path(tempfile.mkdtemp(prefix="duality-bench-"))
    settings = Settings.from_env().replace(
        checkpoint_root=scratch / "checkpoints",
        warehouse=scratch / "warehouse",
        local_dir=scratch / "local",
        reports=scratch / "reports",
    )
    started = datetime.now(UTC)
    stamp = int(time.time())
    run_id = f"run-{stamp}"
    figures: list[Figure] = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with cluster(settings) as scoped, Progress(*columns, console=console) as progress:
        source, copy = f"bench-orders-{run_id}", f"bench-copy-{run_id}"
        kafka.create_topic(scoped, source, PARTITIONS)
        kafka.create_topic(scoped, copy, PARTITIONS)
        events = order_events(args.records, args.keys)
        megabytes = preload(scoped, source, events, progress)
        del events
        progress.console.print("running Kafka's ConsumerPerformance")
        figures.append(consumer_perf(scoped, source, args.records))
        figures.append(python_copy(scoped, source, copy, args.records, progress))

        progress.console.print("running the stream over the backlog")
        figures.append(
            run_to_end(scoped, bench_spec(f"bench_sales_{stamp}", source), args.records, megabytes)
        )

        # A changelog of few keys (10k by default) built from as many events as the backlog.
        few_keys = max(1, args.keys // 10)
        compact = f"bench-orders-few-keys-{run_id}"
        kafka.create_topic(scoped, compact, PARTITIONS)
        events = order_events(args.records, few_keys, seed=8)
        preload(scoped, compact, events, progress)
        del events
        spec = bench_spec(f"bench_few_keys_{stamp}", compact)
        progress.console.print(f"building a changelog of {few_keys:,} keys")
        run_to_end(scoped, spec, args.records, megabytes)
        figures.extend(restore_versus_recompute(scoped, spec, args.records, megabytes))

        progress.console.print("repartitioning the backlog, and a topic with a 30% key")
        figures.extend(
            repartition_scenarios(scoped, source, args.records, args.keys, megabytes, progress)
        )

        progress.console.print(f"snapshots of {args.keys:,} keys: full, then 1% changed")
        snapshots = bench_spec(f"bench_snapshot_{stamp}", source)
        figures.extend(snapshot_scenarios(scoped, snapshots, args.keys))
        progress.console.print(f"validating a snapshot of {args.records:,} rows")
        checked = bench_spec(f"bench_validate_{stamp}", source)
        figures.append(validation_scenario(scoped, checked, args.records))
    document = {
        "started": started.isoformat(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "workload": {
            "records": args.records,
            "keys": args.keys,
            "partitions": PARTITIONS,
            "megabytes": round(megabytes, 3),
        },
        "baselines": ["kafka-consumer-perf", "python-copy"],
        "scenarios": [figure.as_dict() for figure in figures],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamped = args.out / f"bench-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    stamped.write_text(json.dumps(document, indent=2) + "\n")
    (args.out / "latest.json").write_text(json.dumps(document, indent=2) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)
    render(figures, console)
    console.print(f"results: {stamped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
