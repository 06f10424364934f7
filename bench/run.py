"""`make bench`: run the benchmark scenarios, write JSON under bench/results/, print a table.

Every figure is compared to the baselines measured in the same run on the same topic, except
`stream-throughput-warm`: the baselines start cold, so it is compared with the cold stream only.
Set DUALITY_BENCH_RECORDS for a smaller workload (the default is 1,000,000 records of ~100
bytes). The stream scenarios (bench/streaming.py) run `python -m duality.stream` as a process
(tests.harness.StreamProcess), as users do; where the issue sets a target, the JSON carries the
value and whether it was met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
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

from avro_source import avro_scenarios
from broker_loss import broker_loss_scenario
from commands import command_scenarios
from joins import join_scenarios
from object_storage import object_store_scenarios
from serving import SCENARIOS as SERVE_SCENARIOS
from serving import serve_scenarios

from baselines import Figure, consumer_perf, order_events, preload, python_copy
from duality.config import Settings
from duality.kafka import client, topics
from duality.local.broker import ephemeral_broker
from repartition import repartition_scenarios
from snapshots import snapshot_scenarios, validation_scenarios
from streaming import (
    STATE_SCALE_FACTOR,
    Bench,
    StreamFigure,
    bench_spec,
    set_throughput_target,
    set_warm_ratio,
    stream_scenarios,
)

RESULTS = Path(__file__).resolve().parent / "results"
PARTITIONS = 6
FULL_RECORDS = 1_000_000
LATENCY_RATE = 5_000.0
LATENCY_SECONDS = 60.0
TRIGGER_SECONDS = 0.5
# Scenario groups beside the baselines, which always run (everything is compared with them).
GROUPS = (
    "repartition",
    "streams",
    "join",
    "avro",
    "snapshots",
    "commands",
    "broker-loss",
    "serve",
    "object-store",
)
# Seconds of the serve group's load, scaled down with --records (at least 10).
SERVE_SECONDS = 30.0


def scenario_groups(text: str) -> tuple[str, ...]:
    """`--groups`: a comma-separated subset of GROUPS."""
    chosen = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [group for group in chosen if group not in GROUPS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"{text!r}: name groups among {', '.join(GROUPS)}, separated by commas"
        )
    return chosen


@contextlib.contextmanager
def cluster(settings: Settings) -> Iterator[Settings]:
    """The cluster DUALITY_BOOTSTRAP_SERVERS names, else a throw-away broker of our own."""
    if os.environ.get("DUALITY_BOOTSTRAP_SERVERS"):
        client.ensure_reachable(settings)
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
        "notes",
    ):
        if column == "scenario":
            table.add_column(column, no_wrap=True)
        elif column == "notes":
            table.add_column(column, ratio=1, overflow="fold")
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for figure in figures:
        samples = figure.as_dict().get("samples")
        runs = f"median of {', '.join(f'{x:.2f}' for x in samples)} s" if samples else ""
        runs = "; ".join(part for part in (runs, figure.as_dict().get("notes")) if part)
        rows = figure.table_rows() if isinstance(figure, StreamFigure) else [(figure, runs)]
        for row, notes in rows:
            # The baselines are cold: a warm figure is compared with its own cold run alone;
            # broker-loss's figure is a stall, no rate; the serve group's are requests, probes
            # and replicas' starts, no copy of the backlog.
            cold = row.scenario not in ("stream-throughput-warm", "broker-loss", *SERVE_SCENARIOS)
            ratios = [
                f"{row.records_per_s / baseline[name].records_per_s:.2f}x"
                if name in baseline and cold
                else "-"
                for name in ("kafka-consumer-perf", "python-copy")
            ]
            table.add_row(
                row.scenario,
                f"{row.records:,}",
                f"{row.seconds:.2f}",
                f"{row.records_per_s:,.0f}",
                f"{row.mb_per_s:.1f}",
                *ratios,
                notes,
            )
    console.print(table)
    for figure in figures:
        for goal in figure.as_dict().get("targets") or []:
            verdict = "[green]met[/green]" if goal["met"] else "[red]not met[/red]"
            value = "no value" if goal["value"] is None else f"{goal['value']:g}"
            console.print(f"{figure.scenario}: {goal['target']}: {value}, {verdict}")
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
    parser.add_argument(
        "--snapshot-keys",
        type=int,
        default=None,
        help="keys of the snapshot scenarios (default 1,000,000; --keys below "
        f"{FULL_RECORDS:,} records)",
    )
    parser.add_argument(
        "--latency-rate",
        type=float,
        default=LATENCY_RATE,
        help="events/s of the latency scenario (default %(default)g)",
    )
    parser.add_argument(
        "--latency-seconds",
        type=float,
        default=None,
        help=f"seconds the latency scenario produces (default {LATENCY_SECONDS:g}, scaled "
        f"down with --records below {FULL_RECORDS:,}, at least 10)",
    )
    parser.add_argument(
        "--trigger-seconds",
        type=float,
        default=TRIGGER_SECONDS,
        help="trigger interval of the latency scenario's and the serve group's stream (default "
        "%(default)g)",
    )
    parser.add_argument(
        "--state-scale-factor",
        type=int,
        default=STATE_SCALE_FACTOR,
        help="the larger state of state-scale (and failover) has this many times --keys "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--failover",
        choices=("both", "larger"),
        default="both",
        help="measure failover at both states of state-scale (default), or at the larger only "
        "(the test suite's short run)",
    )
    parser.add_argument(
        "--groups",
        type=scenario_groups,
        default=GROUPS,
        help=f"the scenario groups to run, of {','.join(GROUPS)} (default all); the baselines "
        "always run",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.snapshot_keys is None:
        args.snapshot_keys = 1_000_000 if args.records >= FULL_RECORDS else args.keys
    if min(args.records, args.keys, args.snapshot_keys, args.state_scale_factor) < 1:
        parser.error(
            "--records, --keys, --snapshot-keys and --state-scale-factor must be at least 1"
        )
    if args.latency_rate <= 0 or args.trigger_seconds <= 0:
        parser.error("--latency-rate and --trigger-seconds must be positive")
    if args.latency_seconds is None:
        args.latency_seconds = max(
            10.0, min(LATENCY_SECONDS, LATENCY_SECONDS * args.records / FULL_RECORDS)
        )
    elif args.latency_seconds <= 0:
        parser.error("--latency-seconds must be positive")
    console = Console(width=max(140, Console().width))
    # Checkpoints, tables and locks of the benchmark's pipelines stay out of the user's folders.
    # Removed when the run ends, however it ends (Ctrl-C and SIGTERM included).
    scratch_dir = tempfile.TemporaryDirectory(prefix="duality-bench-", ignore_cleanup_errors=True)
    scratch = Path(scratch_dir.name)
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
    # SIGTERM unwinds the run as Ctrl-C does: its broker and streams are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with scratch_dir, cluster(settings) as scoped, Progress(*columns, console=console) as progress:
        source, copy = f"bench-orders-{run_id}", f"bench-copy-{run_id}"
        topics.create_topic(scoped, source, PARTITIONS)
        topics.create_topic(scoped, copy, PARTITIONS)
        events = order_events(args.records, args.keys)
        megabytes = preload(scoped, source, events, progress)
        distinct_keys = len({key for key, _ in events})
        del events
        progress.console.print("running Kafka's ConsumerPerformance")
        figures.append(consumer_perf(scoped, source, args.records))
        figures.append(python_copy(scoped, source, copy, args.records, progress))

        groups = args.groups
        repartitioned: list[Figure] = []
        if "repartition" in groups:
            # Repartitioning reads the backlog as preloaded; the stream scenarios append to it.
            progress.console.print("repartitioning the backlog, and a topic with a 30% key")
            repartitioned = repartition_scenarios(
                scoped, source, args.records, args.keys, megabytes, progress
            )
        if "streams" in groups:
            bench = Bench(scoped, scratch / "pipelines", scratch / "logs", progress, stamp)
            streams = stream_scenarios(
                bench,
                source,
                args.records,
                args.keys,
                megabytes,
                distinct_keys=distinct_keys,
                latency_rate=args.latency_rate,
                latency_seconds=args.latency_seconds,
                trigger_seconds=args.trigger_seconds,
                state_scale_factor=args.state_scale_factor,
                failover_at_both=args.failover == "both",
            )
            by_name = {f.scenario: f for f in [*figures, *streams]}
            cold, warm = by_name["stream-throughput"], by_name["stream-throughput-warm"]
            assert isinstance(cold, StreamFigure) and isinstance(warm, StreamFigure)
            set_throughput_target(cold, by_name["python-copy"], by_name["spark-aggregation"])
            set_warm_ratio(warm, cold)
            figures.extend(streams)
        if "join" in groups:
            # Against the streams group's stream-throughput, else one measured by the group.
            measured = next((f for f in figures if f.scenario == "stream-throughput"), None)
            bench = Bench(scoped, scratch / "pipelines", scratch / "logs", progress, stamp)
            figures.extend(
                join_scenarios(bench, source, args.records, args.keys, megabytes, measured)
            )
        if "avro" in groups:
            # Against the run's stream-throughput, else one measured by the group.
            measured = next((f for f in figures if f.scenario == "stream-throughput"), None)
            bench = Bench(scoped, scratch / "pipelines", scratch / "logs", progress, stamp)
            figures.extend(
                avro_scenarios(bench, source, args.records, args.keys, megabytes, measured)
            )
        figures.extend(repartitioned)

        pipelines = scratch / "pipelines"
        if "snapshots" in groups:
            progress.console.print(
                f"snapshots of {args.snapshot_keys:,} keys: full, then 1% changed, then nothing new"
            )
            snapshots = bench_spec(f"bench_snapshot_{stamp}", source, pipelines)
            figures.extend(snapshot_scenarios(scoped, snapshots, args.snapshot_keys, pipelines))
            progress.console.print(
                f"validating snapshots of {args.records:,} and {3 * args.records:,} rows"
            )
            checked = bench_spec(f"bench_validate_{stamp}", source)
            figures.extend(validation_scenarios(scoped, checked, args.records))
        if "commands" in groups:
            progress.console.print(
                f"the snapshot DAG's steps as whole commands, {args.snapshot_keys:,} keys: each "
                "with a Spark of its own, then on a batch server"
            )
            say = progress.console.print
            figures.extend(
                command_scenarios(scoped, source, args.snapshot_keys, pipelines, stamp, say)
            )
        if "object-store" in groups:
            # The commands group's figures, when it ran, are the local twins of the S3 ones.
            local = [f for f in figures if f.scenario.startswith(("cmd-", "dag-"))] or None
            bench = Bench(scoped, scratch / "pipelines", scratch / "logs", progress, stamp)
            figures.extend(
                object_store_scenarios(
                    bench, source, args.snapshot_keys, args.keys, stamp, progress, local
                )
            )
        if "broker-loss" in groups:
            # On a three-broker cluster of its own, beside the run's single broker.
            figures.append(broker_loss_scenario(settings, scratch, progress, stamp))
        if "serve" in groups:
            # A stream under 5,000 events/s and one replica asked from a process of its own;
            # then new replicas from a published snapshot and from the changelog alone.
            bench = Bench(scoped, scratch / "pipelines", scratch / "logs", progress, stamp)
            serve_seconds = max(
                10.0, min(SERVE_SECONDS, SERVE_SECONDS * args.records / FULL_RECORDS)
            )
            figures.extend(
                serve_scenarios(
                    bench,
                    scratch / "serve",
                    args.keys,
                    args.snapshot_keys,
                    serve_seconds,
                    args.trigger_seconds,
                )
            )
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
            "snapshot_keys": args.snapshot_keys,
            "partitions": PARTITIONS,
            "megabytes": round(megabytes, 3),
            "latency_rate": args.latency_rate,
            "latency_seconds": args.latency_seconds,
            "trigger_seconds": args.trigger_seconds,
            "state_scale_factor": args.state_scale_factor,
            "failover": args.failover,
            "groups": list(args.groups),
        },
        "baselines": ["kafka-consumer-perf", "python-copy", "spark-aggregation"],
        "scenarios": [figure.as_dict() for figure in figures],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamped = args.out / f"bench-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    stamped.write_text(json.dumps(document, indent=2) + "\n")
    (args.out / "latest.json").write_text(json.dumps(document, indent=2) + "\n")
    render(figures, console)
    console.print(f"results: {stamped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
