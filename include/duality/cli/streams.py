"""A pipeline's stream and its spec: `spec`, `produce`, `stream`, `stream rescale` and `reset`."""

from __future__ import annotations

import os
import sys
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from duality import spec
from duality.arguments import at_least_one, stream_arguments
from duality.cli.output import print_json
from duality.cli.parsing import Commands
from duality.config import Settings
from duality.errors import UsageError
from duality.stream.options import StreamOptions

if TYPE_CHECKING:
    from duality.stream.control import StreamState


def add_commands(commands: Commands) -> None:
    specs = commands.actions(
        "spec", "spec_command", "validate pipeline specs or print their schema"
    )
    commands.add(
        "validate",
        _cmd_spec_validate,
        "validate specs (default: every spec in the folder)",
        under=specs,
    ).add_argument("specs", nargs="*", metavar="SPEC", help="spec files or names")
    commands.add(
        "schema", _cmd_spec_schema, "print the JSON schema of a pipeline spec", under=specs
    )

    produce = commands.add(
        "produce", _cmd_produce, "produce a demo workload to a pipeline's source", True
    )
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

    streams = commands.actions(
        "stream", "stream_command", "start, stop or inspect a pipeline's stream"
    )
    start = commands.add(
        "start", _cmd_stream, "start the stream (detached, or --foreground)", under=streams
    )
    stream_arguments(start)
    start.add_argument("--foreground", action="store_true", help="run in this process")
    commands.add("stop", _cmd_stream, "stop the stream gracefully", True, streams)
    commands.add(
        "status", _cmd_stream, "process, last heartbeat and lag of the stream", True, streams
    )
    rescale = commands.add(
        "rescale", _cmd_rescale, "change the stream's state partitions", True, streams
    )
    rescale.add_argument(
        "--partitions",
        type=at_least_one,
        help="state partitions (default: the spec's `parallelism`, else DUALITY_STREAM_PARTITIONS)",
    )
    rescale.add_argument("--dry-run", action="store_true", help="print the plan only")

    rewind = commands.add("reset", _cmd_reset, "reset a pipeline to reprocess its source", True)
    rewind.add_argument("--to-datetime", help="reprocess from this time (ISO-8601)")
    rewind.add_argument("--to-offsets", help="reprocess from these offsets (0:100,1:250)")
    rewind.add_argument("--dry-run", action="store_true", help="print the plan only")


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
            entry: dict[str, Any] = {"file": str(path), "pipeline": loaded.name}
            avro = loaded.source.avro
            if avro is not None:
                entry |= {"columns": loaded.source.fields, "columns_from": avro.origin}
            valid.append(entry)
            if not args.json:
                console.print(f"[green]ok[/]      {path} ({loaded.name})")
            if avro is not None and not args.json:
                columns = ", ".join(f"{n} {t}" for n, t in loaded.source.fields.items())
                console.print(f"        Avro columns from {avro.origin}: {columns}")
                if avro.left_out:
                    console.print(f"        not columns (no spec type): {', '.join(avro.left_out)}")
        except UsageError as error:
            errors.append(str(error))
    if errors:
        raise UsageError("\n".join(errors))
    return {"valid": valid}


def _cmd_spec_schema(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    schema = spec.json_schema()
    if not args.json:
        print_json(schema)
    return schema


def _cmd_produce(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from rich.progress import Progress

    from duality import workload

    # An Avro spec that lists its schema loads before its subject exists: producing registers it.
    pipeline = spec.find_spec(settings, args.pipeline, registry=False)
    if not pipeline.source.columns_known:  # an Avro source's columns are its subject's
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
        written = f" as Avro ({report.schema})" if report.schema else ""
        console.print(
            f"{report.produced:,} events to {report.topic}{written} in {report.seconds:.1f}s "
            f"over {report.keys:,} keys: {report.valid:,} valid; bad: {bad}"
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
