"""The batch steps: `snapshot`, `validate`, `publish`, `read`, `skew` and `repartition`."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Any

from rich.console import Console

from duality import spec, storage
from duality.arguments import not_negative, repartition_arguments, snapshot_arguments
from duality.cli.output import cell, table
from duality.cli.parsing import Commands
from duality.config import Settings
from duality.errors import UsageError


def add_commands(commands: Commands) -> None:
    snapshot_arguments(
        commands.add(
            "snapshot", _cmd_snapshot, "rebuild a pipeline's Delta snapshot from its changelog"
        )
    )
    check = commands.add(
        "validate", _cmd_validate, "validate a snapshot version and publish it", True
    )
    check.add_argument(
        "--reconcile",
        action="store_true",
        help="also compare every row with the aggregates recomputed from the source topic",
    )
    check.add_argument("--version", type=int, help="the version to validate (default: latest)")
    check.add_argument(
        "--no-publish", action="store_true", help="validate only; do not publish on success"
    )
    publisher = commands.add(
        "publish", _cmd_publish, "publish a version that passed validation", True
    )
    publisher.add_argument(
        "--version", type=int, required=True, help="the version `validate --no-publish` passed"
    )
    reader = commands.add(
        "read", _cmd_read, "the published (validated) snapshot of a pipeline", True
    )
    reader.add_argument(
        "--limit",
        type=not_negative,
        default=20,
        help="rows to show, ordered by key (0: only the version and its row count, without Spark)",
    )
    skewed = commands.add(
        "skew", _cmd_skew, "load per partition, hot partitions and keys of a topic"
    )
    skewed.add_argument("topic", help="the topic to inspect")
    skewed.add_argument("--group", help="also show this consumer group's lag")
    skewed.add_argument("--window", default="60s", help="rate window (60s, 5m, 1h)")
    skewed.add_argument(
        "--plot", help="draw the load per partition to FILE.png (a path or s3a://bucket/key)"
    )

    repartition_arguments(
        commands.add(
            "repartition", _cmd_repartition, "copy a topic into one with N partitions, exactly once"
        )
    )


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
        console.print(table(title, columns, [[cell(row[c]) for c in columns] for row in rows]))
        if total > len(rows):
            console.print(f"showing {len(rows)} of {total:,} rows (--limit)")
    return {
        "pipeline": pipeline.name,
        "version": found.version,
        "rows": total,
        "coverage": found.coverage.as_dict(),
        "data": rows,
    }


def _cmd_skew(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from duality import skew

    window = skew.parse_window(args.window)
    plot = None
    if args.plot is not None:  # a local path is the working folder's
        local = not storage.is_remote(args.plot)
        plot = settings.location(Path(args.plot).absolute() if local else args.plot)
    if plot is not None and plot.suffix.lower() != ".png":
        raise UsageError(f"--plot {args.plot!r} must name a .png file")
    with console.status(f"sampling {args.topic}"):
        report = skew.analyse(settings, args.topic, group=args.group, window_s=window)
    result = report.as_dict()
    if plot is not None:
        result["plot"] = str(skew.plot(report, plot))
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
        console.print(table(title, columns, rows, columns[:-1]))
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
            table(title, ("side", "partition", "records"), rows, ("partition", "records"))
        )
        console.print(
            f"copied {report.copied:,} records in {report.seconds:.1f}s "
            f"({report.records_per_s:,.0f} records/s; the Spark job copying took "
            f"{report.copy_seconds:.1f}s; {report.transactions} transactions); "
            f"skew (max/mean) before {report.skew_before:.2f}, after {report.skew_after:.2f}"
        )
    return result
