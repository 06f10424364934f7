"""The `duality` command line; exits 1 when a check failed, 2 on bad usage or no broker."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from duality import kafka, spec
from duality.arguments import (
    at_least_one,
    not_negative,
    repartition_arguments,
    snapshot_arguments,
    stream_arguments,
)
from duality.batch_server import BATCH_COMMANDS, run_remote
from duality.config import AIRFLOW_DBS, Settings
from duality.errors import DualityError, UsageError
from duality.local import stack
from duality.local.broker import BrokerStatus
from duality.stream.options import StreamOptions

if TYPE_CHECKING:
    from duality.stream.control import StreamState

Handler = Callable[[Settings, Namespace, Console], Any]

_out = Console(highlight=False)
_err = Console(stderr=True, highlight=False)


class _Parser(argparse.ArgumentParser):
    """argparse that says what to do next when the usage is wrong (exit code 2)."""

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _cmd_up(settings: Settings, args: Namespace, console: Console) -> stack.StackUp:
    with console.status("starting the local stack") as spinner:
        started = stack.up(
            settings,
            brokers=args.brokers,
            spark_workers=args.spark_workers,
            airflow_db=args.airflow_db,
            sasl=args.sasl,
            monitoring=args.monitoring,
            progress=spinner.update,
        )
    if args.json:
        return started
    broker = started.broker
    if isinstance(broker, BrokerStatus):
        verb = "already running" if broker.already_running else "started"
        console.print(
            f"Kafka broker {verb} at [bold]{broker.bootstrap_servers}[/] (pid {broker.pid}); "
            f"logs in {broker.log}"
        )
    else:
        console.print(
            f"Kafka cluster of {len(broker.nodes)} brokers running at "
            f"[bold]{broker.bootstrap_servers}[/]"
        )
    spark = started.spark
    if spark is not None:
        console.print(
            f"Spark master at [bold]{spark.master_url}[/] with {len(spark.workers)} workers "
            f"(UI {spark.master_ui}); logs in {spark.root}"
        )
    batch = started.batch
    verb = "already running" if batch.already_running else "started"
    console.print(
        f"batch server {verb} at [bold]{batch.address}[/] (pid {batch.pid}, Spark "
        f"{batch.master}): the batch steps run in its warm Spark; log {batch.log}"
    )
    watching = started.monitoring
    if watching is not None:
        verb = "already running" if watching.already_running else "started"
        console.print(
            f"Prometheus {verb} at [bold]http://{watching.prometheus.address}[/] (pid "
            f"{watching.prometheus.pid}; config {watching.config}, alert rules {watching.rules}), "
            f"its Pushgateway at [bold]{watching.pushgateway.address}[/] (pid "
            f"{watching.pushgateway.pid}); logs in {watching.prometheus.log.parent.parent}"
        )
    web = started.airflow
    verb = "already running" if web.already_running else "started"
    console.print(
        f"Airflow {verb} at [bold]{web.url}[/] (pid {web.pid}); log in as [bold]{web.user}[/] "
        f"with password [bold]{web.password}[/] (kept in {web.password_file}); logs in {web.log}"
    )
    return started


def _cmd_down(settings: Settings, args: Namespace, console: Console) -> stack.StackDown:
    stopped = stack.down(settings)
    if args.json:
        return stopped
    for stream in stopped.streams:
        console.print(f"stream {stream.pipeline} stopped (pid {stream.pid})")
    airflow = stopped.airflow
    console.print(
        f"Airflow stopped (pid {airflow.pid})" if airflow.was_running else "Airflow was not running"
    )
    if stopped.batch.was_running:
        console.print(f"batch server stopped (pid {stopped.batch.pid})")
    for name, pid in stopped.monitoring.pids.items():
        console.print(f"{name} stopped (pid {pid})")
    if stopped.spark.was_running:
        console.print(f"Spark master and workers stopped (pids {stopped.spark.pids})")
    for node in stopped.brokers:
        console.print(f"Kafka {node.node} stopped (pid {node.pid})")
    if not stopped.brokers:
        console.print("Kafka was not running")
    return stopped


def _cmd_status(settings: Settings, args: Namespace, console: Console) -> stack.StackStatus:
    report = stack.status(settings)
    if not args.json:
        _print_status(report, console)
    stack.require_sound(report)
    return report


def _table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[str] = ()
) -> Table:
    """A table of text cells, left-justified but for the columns named in `right`."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    for row in rows:
        table.add_row(*row)
    return table


def _print_status(report: stack.StackStatus, console: Console) -> None:
    broker, spark, airflow = report.broker, report.spark, report.airflow
    if report.topology.brokers == 1:
        nodes = [("kafka", broker.state, broker.bootstrap_servers, broker.pid, broker.reachable)]
    else:
        nodes = [
            (f"kafka-{n.node_id}", n.state, n.bootstrap_servers, n.pid, n.reachable)
            for n in broker.nodes
        ]
    rows = [
        (name, state, address, str(pid or "-"), "yes" if reachable else "no", str(node.log))
        for (name, state, address, pid, reachable), node in zip(nodes, broker.nodes, strict=True)
    ]
    if spark is not None:
        alive = f"{sum(w.registered for w in spark.workers)}/{len(spark.workers)} workers"
        pid = str(spark.master_pid or "-")
        rows.append(("spark", spark.state, spark.master_url or "-", pid, alive, str(spark.log)))
    batch = report.batch
    pid = str(batch.pid or "-")
    steps = "" if batch.steps is None else f"{len(batch.steps)} steps running"
    rows.append(("batch-server", batch.state, batch.address or "-", pid, steps, str(batch.log)))
    if report.monitoring is not None:
        for name, program in (
            ("prometheus", report.monitoring.prometheus),
            ("pushgateway", report.monitoring.pushgateway),
        ):
            ready = "yes" if program.ready else "no"
            pid = str(program.pid or "-")
            rows.append((name, program.state, program.address or "-", pid, ready, str(program.log)))
    for name, component in airflow.components.items():
        rows.append(
            (
                "airflow" if name == "standalone" else f"airflow {name}",
                "running" if component.pid else "stopped",
                airflow.url if name in ("standalone", "api-server") else "",
                str(component.pid or "-"),
                "yes" if airflow.healthy else "no",
                str(component.log),
            )
        )
    database = airflow.postgres
    if database is not None:
        address = f"127.0.0.1:{database.port}" if database.port else "-"
        pid = str(database.pid or "-")
        rows.append(("postgres", database.state, address, pid, "", str(database.log)))
    columns = ("service", "state", "address", "pid", "reachable", "log")
    console.print(_table("duality local stack", columns, rows))
    durable = broker.durability
    if durable is None:
        return
    console.print(
        f"new topics: replication factor {durable.replication_factor}, "
        f"min.insync.replicas {durable.min_insync_replicas} "
        f"({durable.brokers} brokers; chosen by {durable.chosen_by})"
    )
    header = ("topic", "replicas", "min.insync.replicas", "below min ISR now")
    topics = [
        (
            t.topic + (" [red](fewer than configured)[/red]" if t.below_configured else ""),
            str(t.replication_factor),
            str(t.min_insync_replicas),
            str(t.below_min_isr),
        )
        for t in broker.topics
    ]
    console.print(_table("duality's topics", header, topics))


def _cmd_lag(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    rows = kafka.lag(settings, args.group or None)
    result = [{**dataclasses.asdict(r), "lag": r.lag} for r in rows]
    if not args.json:
        columns = ("group", "topic", "partition", "committed", "end", "lag")
        cells = [list(map(str, row.values())) for row in result]
        table = _table(f"consumer lag on {settings.bootstrap_servers}", columns, cells, columns[1:])
        console.print(table if rows else "no consumer group has committed offsets")
    return {"lag": result}


def _cmd_batch_server(settings: Settings, args: Namespace, console: Console) -> None:
    from duality import batch_server

    batch_server.serve(settings, args.host, args.port, main)


def _cmd_demo(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from duality import demo

    result = demo.run(settings, args.events, console, seed=args.seed)
    if not args.json:
        console.print(demo_summary(result))
    return result


def demo_summary(result: Mapping[str, Any]) -> Table:
    """`duality demo`'s summary: every pipeline it ran, the repartition, where to look."""
    moved = result["repartition"]
    table = Table(
        title=f"duality demo: {len(result['pipelines'])} pipelines in {result['seconds']:.0f}s"
    )
    table.add_column("what")
    table.add_column("result", overflow="fold")
    writes = {}  # topic -> what went to it (two pipelines may read one topic)
    for ran in result["pipelines"].values():
        made = ran["produced"]
        bad = sum(made["bad"].values())
        writes[made["topic"]] = f"{made['produced']:,} to {made['topic']} ({bad:,} bad)"
        if "table" in ran:
            joined = ran["table"]
            writes[joined["topic"]] = f"{joined['rows']:,} table rows to {joined['topic']}"
    table.add_row("events produced", "; ".join(writes.values()))
    table.add_row(
        "skew (max/mean)",
        f"{moved['skew_before']:.2f} in {moved['source']} -> {moved['skew_after']:.2f} in "
        f"{moved['target']} (partitions {moved['partitions']}; it holds "
        f"{moved['target_records']:,} records, {moved['copied_this_run']:,} copied by this "
        "run)",
    )
    for name, ran in result["pipelines"].items():
        stream, published = ran["stream"], ran["snapshot"]
        keys = stream.get("keys")
        text = (
            f"{stream['source_records']:,} records of {ran['source']}"
            + (f" into {keys:,} rows of state" if isinstance(keys, int) else "")
            + f", {ran['dead_letters']:,} dead-lettered"
        )
        joined = ran.get("table")
        if joined is not None:
            text += f"; {joined['join']} join with table {joined['name']} ({joined['topic']})"
            if isinstance(stream.get("unmatched"), int):
                text += f", {stream['unmatched']:,} events without a row"
        text += (
            f"\nsnapshot version {published['version']} published ({published['rows']:,} rows, "
            f"{published['mode']}); validation {published['validation']} "
            f"({published['checks']} checks); Data Docs {published['data_docs']}"
        )
        table.add_row(name, text)
    table.add_row("skew plot", moved["plot"])
    table.add_row("Airflow", f"{result['airflow']} (DAGs tagged duality)")
    table.add_row("pipelines page", result["pipelines_page"])
    return table


def _cmd_spec_validate(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    paths = [Path(p) for p in args.specs] or spec.spec_files(settings)
    if not paths:
        raise UsageError(f"no pipeline specs in {settings.pipelines}: add one, or name a file")
    valid, errors = [], []
    for path in paths:
        try:
            loaded = spec.find_spec(settings, str(path))
            if loaded.expectations:
                from duality import validate

                validate.check_spec_expectations(loaded, str(path))
            valid.append({"file": str(path), "pipeline": loaded.name})
            if not args.json:
                console.print(f"[green]ok[/]      {path} ({loaded.name})")
        except UsageError as error:
            errors.append(str(error))
    if errors:
        raise UsageError("\n".join(errors))
    return {"valid": valid}


def _cmd_spec_schema(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    schema = spec.json_schema()
    if not args.json:
        _print_json(schema)
    return schema


def _cmd_produce(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from rich.progress import Progress

    from duality import workload

    pipeline = spec.find_spec(settings, args.pipeline)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"producing to {pipeline.source.topic}", total=args.events)
        report = workload.produce(
            settings,
            pipeline,
            events=args.events,
            keys=args.keys,
            zipf=args.zipf,
            bad_fraction=args.bad_fraction,
            rate=args.rate,
            seed=args.seed,
            partitions=args.partitions,
            progress=lambda done: progress.update(task, completed=done),
        )
    result = report.as_dict()
    if not args.json:
        bad = ", ".join(f"{n} {kind}" for kind, n in sorted(report.bad.items())) or "none"
        console.print(
            f"{report.produced:,} events to {report.topic} in {report.seconds:.1f}s over "
            f"{report.keys:,} keys: {report.valid:,} valid; bad: {bad}"
        )
    return result


def _cmd_stream(settings: Settings, args: Namespace, console: Console) -> Any:
    from duality.stream import control

    pipeline = spec.find_spec(settings, args.pipeline)
    action = args.stream_command
    if action == "start":
        options = StreamOptions.from_args(args)
        if args.foreground:
            # This process becomes the stream (`python -m duality.stream`, which is what the
            # pid check looks for), with the settings this command runs with.
            command = [sys.executable, "-m", control.MODULE, args.pipeline, *options.to_args()]
            sys.stdout.flush()
            sys.stderr.flush()
            os.execve(sys.executable, command, settings.process_env())
        with console.status(f"starting the stream of {pipeline.name}"):
            started = control.start(settings, pipeline, job_args=options.to_args())
        if not args.json:
            verb = "already running" if started.already_running else "started"
            console.print(f"stream {pipeline.name} {verb} (pid {started.pid}); log {started.log}")
        return started
    if action == "stop":
        with console.status(f"stopping the stream of {pipeline.name}"):
            stopped = control.stop(settings, pipeline)
        if not args.json:
            verb = "stopped" if stopped.was_running else "was not running"
            console.print(f"stream {pipeline.name} {verb}")
        return stopped
    state = control.describe(settings, pipeline)
    if not args.json:
        console.print(stream_status_line(state))
    return state


def stream_status_line(state: StreamState) -> str:
    """`duality stream status`'s line: a `control.StreamState` as people read it."""
    beat = state.heartbeat
    return (
        f"stream {state.pipeline}: {state.state}"
        + (f" (pid {state.pid})" if state.pid else "")
        + (
            f"; last heartbeat {state.heartbeat_age_s}s ago: {beat.get('state')}, "
            f"batch {beat.get('batch_id', '-')}, {beat.get('state_rows', '-')} rows in state"
            f" ({beat.get('state_partitions', '-')} partitions)"
            if beat
            else "; no heartbeat yet"
        )
        + (f"; lag {state.lag:,}" if state.lag is not None else "")
        + "".join(
            f"; table {t.name} (topic {t.topic}, {t.join} join): lag "
            + (f"{t.lag:,}" if t.lag is not None else "unknown (no topic)")
            for t in state.tables
        )
        + (
            f"; {beat['unmatched']:,} events unmatched (no row in the table)"
            if beat and state.tables and isinstance(beat.get("unmatched"), int)
            else ""
        )
        + (
            f"; metrics http://{beat['host']}:{beat['metrics_port']}/metrics"
            if beat and beat.get("metrics_port")
            else ""
        )
        + (
            f"; active driver pid {beat.get('pid')} on {beat.get('host')}"
            if beat and state.standby
            else ""
        )
        + (
            f"; standby driver pid {state.standby.get('pid')} on {state.standby.get('host')}"
            if state.standby
            else ""
        )
    )


def _cmd_rescale(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from duality.stream import rescale

    pipeline = spec.find_spec(settings, args.pipeline)
    plan = rescale.plan(settings, pipeline, args.partitions)
    steps = plan.steps()
    if not args.json:
        if not steps:
            console.print(
                f"{pipeline.name} already has {plan.partitions} state partitions; nothing to do"
            )
        else:
            title = "would" if args.dry_run else "will"
            console.print(
                f"rescale of {pipeline.name} from {plan.partitions_before} to "
                f"{plan.partitions} state partitions {title}:"
            )
            for step in steps:
                console.print(f"  - {step}")
    if not args.dry_run and steps:
        with console.status(f"rescaling {pipeline.name}"):
            rescale.execute(settings, pipeline, plan)
        if not args.json:
            console.print(f"{pipeline.name} now runs with {plan.partitions} state partitions")
    return {**plan.as_dict(), "dry_run": args.dry_run}


def _cmd_reset(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from datetime import datetime

    from duality import reset

    pipeline = spec.find_spec(settings, args.pipeline)
    moment = None
    if args.to_datetime:
        try:
            moment = datetime.fromisoformat(args.to_datetime.replace("Z", "+00:00"))
        except ValueError:
            raise UsageError(
                f"--to-datetime {args.to_datetime!r} is not ISO-8601: write it like "
                "2026-11-21T10:00:00Z"
            ) from None
    plan = reset.plan(settings, pipeline, to_datetime=moment, to_offsets=args.to_offsets)
    if not args.json:
        title = "would" if args.dry_run else "will"
        console.print(f"reset of {pipeline.name} {title}:")
        for step in plan.steps():
            console.print(f"  - {step}")
    if not args.dry_run:
        reset.execute(settings, pipeline, plan)
        if not args.json:
            console.print(
                f"{pipeline.name} reset; start it with `duality stream start {pipeline.name}`"
            )
    return {**plan.as_dict(), "dry_run": args.dry_run}


def _cmd_snapshot(settings: Settings, args: Namespace, console: Console) -> Any:
    from duality.snapshot import build, maintain

    pipeline = spec.find_spec(settings, args.pipeline)
    if args.maintain:
        with console.status(f"maintaining the snapshot of {pipeline.name}") as status:
            done = maintain.maintain(
                settings, pipeline, retain_hours=args.retain_hours, progress=status.update
            )
        if not args.json:
            console.print(
                f"{done.path}: OPTIMIZE compacted {done.files_removed_by_optimize} files "
                f"into {done.files_added_by_optimize}; VACUUM (retention "
                f"{done.retention_hours:g} h) deleted {done.files_deleted_by_vacuum} "
                f"files; published version {done.published_version} stays readable"
            )
        return done
    mode: build.Mode = "full" if args.full else "incremental" if args.incremental else "auto"
    with console.status(f"snapshot of {pipeline.name}") as status:
        built = build.build(settings, pipeline, mode, progress=status.update)
    if not args.json:
        if built.fallback_reason:
            console.print(
                f"[yellow]full rebuild instead of incremental:[/] {built.fallback_reason}"
            )
        if built.version is None:
            console.print(
                f"{pipeline.name}: the changelog has not moved since version "
                f"{built.previous_version}; no new version"
            )
        else:
            console.print(
                f"{pipeline.name}: version {built.version} ({built.mode}) of {built.path}: "
                f"{built.rows:,} rows; read {built.records_read:,} changelog records for "
                f"{built.keys_read:,} keys; {built.inserted:,} inserted, {built.updated:,} "
                f"updated, {built.deleted:,} deleted in {built.seconds:.1f}s. Validate and "
                f"publish it with `duality validate {pipeline.name}`."
            )
    return built


def _cmd_validate(settings: Settings, args: Namespace, console: Console) -> Any:
    from duality import validate

    pipeline = spec.find_spec(settings, args.pipeline)
    with console.status(f"validating the snapshot of {pipeline.name}") as status:
        report = validate.run(
            settings,
            pipeline,
            reconcile=args.reconcile,
            publish=not args.no_publish,
            version=args.version,
            progress=status.update,
        )
    validate.require_success(report)
    if not args.json:
        console.print(validate.summary(report))
        console.print(f"report: {report.json_report}; Data Docs: {report.data_docs}")
    return report


def _cmd_publish(settings: Settings, args: Namespace, console: Console) -> Any:
    from duality.snapshot import publish

    pipeline = spec.find_spec(settings, args.pipeline)
    with console.status(f"publishing version {args.version} of {pipeline.name}"):
        result = publish.publish(settings, pipeline, args.version)
    if not args.json:
        verb = "was already" if result.already_published else "is now"
        console.print(
            f"version {args.version} of {pipeline.name} {verb} the published version "
            f"(validated in {result.report})"
        )
    return result


def _cmd_read(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from duality.snapshot import publish

    pipeline = spec.find_spec(settings, args.pipeline)
    path = pipeline.snapshot_path(settings)
    # No rows asked for: the version and its size come from the table's log, without Spark.
    size = publish.published_size(pipeline, path) if args.limit == 0 else None
    if size is not None:
        found, total = size
        rows: list[dict[str, Any]] = []
    else:
        with console.status(f"reading the published snapshot of {pipeline.name}"):
            frame, found = publish.read(settings, pipeline)
            total = frame.count()
            ordered = frame.orderBy(*pipeline.key_columns).limit(args.limit)
            rows = [row.asDict() for row in ordered.collect()]
    if not args.json:
        title = f"{pipeline.name}: published version {found.version} ({total:,} rows)"
        columns = list(rows[0]) if rows else pipeline.snapshot_columns
        console.print(_table(title, columns, [[_cell(row[c]) for c in columns] for row in rows]))
        if total > len(rows):
            console.print(f"showing {len(rows)} of {total:,} rows (--limit)")
    return {
        "pipeline": pipeline.name,
        "version": found.version,
        "rows": total,
        "coverage": found.coverage.as_dict(),
        "data": rows,
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _cmd_skew(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from duality import skew

    window = skew.parse_window(args.window)
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise UsageError(f"--plot {str(args.plot)!r} must name a .png file")
    with console.status(f"sampling {args.topic}"):
        report = skew.analyse(settings, args.topic, group=args.group, window_s=window)
    result = report.as_dict()
    if args.plot is not None:
        result["plot"] = str(skew.plot(report, args.plot))
    if not args.json:
        columns = ("partition", "records", "bytes (est.)", "records/s", "lag", "top keys")
        rows = [
            (
                f"{'[red]' if load.partition in report.hot_partitions else ''}{load.partition}",
                f"{load.records:,}",
                f"{load.bytes:,}",
                f"{load.rate:,.1f}",
                "-" if load.lag is None else f"{load.lag:,}",
                ", ".join(f"{k} ({n:,})" for k, n in load.top_keys[:3]),
            )
            for load in report.partitions
        ]
        title = f"load per partition of {args.topic} (window {window:g}s)"
        console.print(_table(title, columns, rows, columns[:-1]))
        advice = report.recommendation
        console.print(
            f"skew (max/mean): rate {report.skew_rate:.2f}, size {report.skew_size:.2f}; "
            f"hot partitions: {report.hot_partitions or 'none'}"
        )
        if advice["action"] == "none":
            console.print(f"recommendation: nothing to do ({advice['reason']})")
        else:
            command = (
                f"duality repartition {args.topic} --to {args.topic}-{advice['partitions']}p "
                f"--partitions {advice['partitions']} --strategy {advice['strategy']}"
            )
            if advice["strategy"] == "salted":
                command += f" --hot-keys {','.join(advice['hot_keys'])} --salts {advice['salts']}"
            console.print(
                f"recommendation: {advice['reason']} (predicted skew "
                f"{advice['predicted_skew']:.2f}):\n  {command}"
            )
        if args.plot is not None:
            console.print(f"plot: {result['plot']}")
    return result


def _cmd_repartition(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    import signal
    import threading

    from rich.progress import Progress

    from duality import repartition

    plan = repartition.plan(
        settings,
        args.source,
        args.target,
        args.partitions,
        args.strategy,
        args.hot_keys,
        args.salts,
    )
    if args.dry_run:
        result = repartition.dry_run(settings, plan)
        if not args.json:
            console.print(
                f"would copy {result['to_copy']:,} records of {plan.source} into {plan.target} "
                f"({plan.partitions} partitions, {plan.strategy}"
                + (f", hot keys {', '.join(plan.hot_keys)}" if plan.hot_keys else "")
                + f"); predicted skew after {result['predicted_skew_after']:.2f}; nothing changed"
            )
        return result
    stop = threading.Event()
    if args.continuous:
        # Stop mirroring after the round in progress, then report what was copied.
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, lambda *_: stop.set())
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"copying {plan.source} -> {plan.target}", total=None)
        report = repartition.run(
            settings,
            plan,
            continuous=args.continuous,
            stop=stop,
            transaction_records=args.transaction_records,
            throttle=args.throttle,
            progress=lambda done, total: progress.update(task, completed=done, total=total),
        )
    result = report.as_dict()
    if not args.json:
        rows = [
            (side, partition, f"{records:,}")
            for side in ("source", "target")
            for partition, records in result[f"{side}_partitions"].items()
        ]
        title = f"{plan.source} -> {plan.target} ({plan.strategy})"
        console.print(
            _table(title, ("side", "partition", "records"), rows, ("partition", "records"))
        )
        console.print(
            f"copied {report.copied:,} records in {report.seconds:.1f}s "
            f"({report.records_per_s:,.0f} records/s; the Spark job copying took "
            f"{report.copy_seconds:.1f}s; {report.transactions} transactions); "
            f"skew (max/mean) before {report.skew_before:.2f}, after {report.skew_after:.2f}"
        )
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="duality",
        description="Streams into tables and tables into streams, on Kafka, Spark and Delta.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    def add(
        name: str, handler: Handler, help_text: str, pipeline: bool = False, under: Any = commands
    ) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = under.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="print the result as JSON")
        sub.set_defaults(handler=handler)
        if pipeline:
            sub.add_argument("pipeline", help="pipeline name or spec file")
        return sub

    def actions(name: str, dest: str, help_text: str) -> Any:
        sub = commands.add_parser(name, help=help_text).add_subparsers(dest=dest, metavar="ACTION")
        sub.required = True
        return sub

    up = add("up", _cmd_up, "start the local stack (idempotent)")
    up.add_argument(
        "--brokers", type=at_least_one, help="Kafka brokers, a KRaft quorum from 3 (default 1)"
    )
    up.add_argument(
        "--spark-workers",
        type=not_negative,
        help="start a Spark standalone master and this many workers (default 0: local mode)",
    )
    up.add_argument(
        "--sasl",
        action="store_true",
        help="clients log in with SCRAM-SHA-512 as DUALITY_SASL_USERNAME with "
        "DUALITY_SASL_PASSWORD (DUALITY_SECURITY_PROTOCOL=SASL_PLAINTEXT, "
        "DUALITY_SASL_MECHANISM=SCRAM-SHA-512)",
    )
    up.add_argument(
        "--monitoring",
        action="store_true",
        help="also start Prometheus (scraping the streams, Spark and the Pushgateway, with the "
        "alert rules of monitoring/alerts.yml) and the Pushgateway the batch steps push to",
    )
    up.add_argument(
        "--airflow-db",
        choices=AIRFLOW_DBS,
        help="Airflow's metadata database: standalone on SQLite (default), or its components "
        "as separate processes on a local PostgreSQL",
    )
    add("down", _cmd_down, "stop the local stack")
    add("status", _cmd_status, "report the local stack")
    lag = add("lag", _cmd_lag, "consumer lag per group, topic and partition")
    lag.add_argument("--group", action="append", help="only this consumer group (repeatable)")
    specs = actions("spec", "spec_command", "validate pipeline specs or print their schema")
    add(
        "validate",
        _cmd_spec_validate,
        "validate specs (default: every spec in the folder)",
        under=specs,
    ).add_argument("specs", nargs="*", metavar="SPEC", help="spec files or names")
    add("schema", _cmd_spec_schema, "print the JSON schema of a pipeline spec", under=specs)

    produce = add("produce", _cmd_produce, "produce a demo workload to a pipeline's source", True)
    produce.add_argument("--events", type=int, default=20_000, help="events to produce")
    produce.add_argument("--keys", type=int, default=1_000, help="distinct group keys")
    produce.add_argument("--zipf", type=float, default=1.1, help="key skew (0 is uniform)")
    produce.add_argument(
        "--bad-fraction",
        type=float,
        default=0.02,
        help="fraction of bad records, spread over every kind",
    )
    produce.add_argument(
        "--rate", type=float, help="events per second (default: as fast as possible)"
    )
    produce.add_argument("--seed", type=int, help="random seed, for a repeatable workload")
    produce.add_argument(
        "--partitions",
        type=int,
        default=6,
        help="partitions of the source topic when it is created",
    )

    streams = actions("stream", "stream_command", "start, stop or inspect a pipeline's stream")
    start = add("start", _cmd_stream, "start the stream (detached, or --foreground)", under=streams)
    stream_arguments(start)
    start.add_argument("--foreground", action="store_true", help="run in this process")
    add("stop", _cmd_stream, "stop the stream gracefully", True, streams)
    add("status", _cmd_stream, "process, last heartbeat and lag of the stream", True, streams)
    rescale = add("rescale", _cmd_rescale, "change the stream's state partitions", True, streams)
    rescale.add_argument(
        "--partitions",
        type=at_least_one,
        help="state partitions (default: the spec's `parallelism`, else DUALITY_STREAM_PARTITIONS)",
    )
    rescale.add_argument("--dry-run", action="store_true", help="print the plan only")

    rewind = add("reset", _cmd_reset, "reset a pipeline to reprocess its source", True)
    rewind.add_argument("--to-datetime", help="reprocess from this time (ISO-8601)")
    rewind.add_argument("--to-offsets", help="reprocess from these offsets (0:100,1:250)")
    rewind.add_argument("--dry-run", action="store_true", help="print the plan only")

    snapshot_arguments(
        add("snapshot", _cmd_snapshot, "rebuild a pipeline's Delta snapshot from its changelog")
    )
    check = add("validate", _cmd_validate, "validate a snapshot version and publish it", True)
    check.add_argument(
        "--reconcile",
        action="store_true",
        help="also compare every row with the aggregates recomputed from the source topic",
    )
    check.add_argument("--version", type=int, help="the version to validate (default: latest)")
    check.add_argument(
        "--no-publish", action="store_true", help="validate only; do not publish on success"
    )
    publisher = add("publish", _cmd_publish, "publish a version that passed validation", True)
    publisher.add_argument(
        "--version", type=int, required=True, help="the version `validate --no-publish` passed"
    )
    reader = add("read", _cmd_read, "the published (validated) snapshot of a pipeline", True)
    reader.add_argument(
        "--limit",
        type=not_negative,
        default=20,
        help="rows to show, ordered by key (0: only the version and its row count, without Spark)",
    )
    skewed = add("skew", _cmd_skew, "load per partition, hot partitions and keys of a topic")
    skewed.add_argument("topic", help="the topic to inspect")
    skewed.add_argument("--group", help="also show this consumer group's lag")
    skewed.add_argument("--window", default="60s", help="rate window (60s, 5m, 1h)")
    skewed.add_argument("--plot", type=Path, help="draw the load per partition to FILE.png")

    repartition_arguments(
        add(
            "repartition", _cmd_repartition, "copy a topic into one with N partitions, exactly once"
        )
    )

    server = add(
        "batch-server",
        _cmd_batch_server,
        "run the batch steps of `duality` commands in one warm Spark (`duality up` starts one)",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=not_negative, default=7078, help="port to listen on")

    demo = add("demo", _cmd_demo, "the whole story through Airflow on the local stack")
    demo.add_argument("--events", type=int, default=50_000, help="orders to produce")
    demo.add_argument("--seed", type=int, help="random seed, for a repeatable workload")
    return parser


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=_json_value))


def _json_value(value: Any) -> Any:
    """What `json.dumps` cannot write itself: a result dataclass as its fields, else text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


# Commands whose runs are pushed to the Pushgateway as batch steps (docs/monitoring.md), and
# the argument that names what they ran on.
_PUSHED_STEPS = {
    "snapshot": "pipeline",
    "validate": "pipeline",
    "publish": "pipeline",
    "repartition": "source",
}


def _push_step(settings: Settings, args: Namespace, result: Any, seconds: float) -> None:
    """A batch step's run (`result` None: it failed) for Prometheus, where it ran: on the batch
    server when a command forwarded it there."""
    if settings.pushgateway is None or args.command not in _PUSHED_STEPS:
        return
    if getattr(args, "dry_run", False):
        return
    from duality import metrics
    from duality.snapshot import delta_log

    step = "maintain" if getattr(args, "maintain", False) else args.command
    figures: dict[str, Any] = {}
    success = result is not None
    if isinstance(result, dict):  # repartition
        figures["records_read"] = result.get("copied")
    elif result is not None:
        success = bool(getattr(result, "success", True))
        for name in ("rows", "records_read", "version"):
            figures[name] = getattr(result, name, None)
        published = getattr(result, "published_version", None)
        path = getattr(result, "path", None)
        if published is not None and path is None:  # `publish`: the table is the spec's
            path = str(spec.find_spec(settings, args.pipeline).snapshot_path(settings))
        if published is not None and path is not None:
            commits = {v.version: v.timestamp_ms for v in delta_log.history(Path(path))}
            if published in commits:
                figures["published_version"] = published
                figures["published_at"] = commits[published] / 1000
    metrics.push_step(
        settings,
        step,
        getattr(args, _PUSHED_STEPS[args.command]),
        seconds=seconds,
        success=success,
        figures=figures,
    )


def failed(error: DualityError | KeyboardInterrupt, command: str, *, as_json: bool) -> int:
    """Say why `duality COMMAND` stopped (with `--json`, also as JSON); its exit code."""
    if isinstance(error, KeyboardInterrupt):
        _err.print(f"duality {command}: interrupted")
        return 130
    if as_json:
        details = getattr(error, "details", {})
        _print_json({**details, "error": str(error), "exit_code": error.exit_code})
    _err.print(f"duality {command}: error: {error}", style="red", markup=False, soft_wrap=True)
    return error.exit_code


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    forward: bool = True,
) -> int:
    """`duality ARGV` with the settings of `environ` (default: this process's); a batch step
    goes to the batch server when one is configured, unless `forward` is false (on the server)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    action = getattr(args, "spec_command", None) or getattr(args, "stream_command", None)
    command = f"{args.command} {action}" if action else args.command
    console = _err if args.json else _out
    settings: Settings | None = None
    try:
        try:
            settings = Settings.from_env(environ)
            if forward and settings.batch_server and args.command in BATCH_COMMANDS:
                return run_remote(settings, argv, command)
            started = time.monotonic()
            try:
                result = args.handler(settings, args, console)
            except DualityError:
                _push_step(settings, args, None, time.monotonic() - started)
                raise
            _push_step(settings, args, result, time.monotonic() - started)
        except DualityError:
            raise
        except Exception as error:
            # A login that Spark's Kafka client had refused is named like any refused login.
            refused = None if settings is None else kafka.refused_login_in(settings, error)
            if refused is None:
                raise
            raise refused from None
    except (DualityError, KeyboardInterrupt) as error:
        return failed(error, command, as_json=args.json)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    try:
        if args.json:
            _print_json(result)
    except BrokenPipeError:
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
