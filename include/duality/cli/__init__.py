"""The `duality` command line; exits 1 when a check failed, 2 on bad usage or no broker.

`main` parses, runs a command's handler and prints its result (as JSON with `--json`); each
module of this package adds its own commands (`add_commands`): `stack` the local stack's,
`streams` a pipeline's stream and spec, `batch` the batch steps, `serving` the replicas'."""

from __future__ import annotations

import argparse
import sys
import time
from argparse import Namespace
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from duality import object_store, spec
from duality.arguments import not_negative
from duality.batch_server import BATCH_COMMANDS, run_remote
from duality.cli import batch, serving, stack, streams
from duality.cli.output import print_json
from duality.cli.parsing import Commands, Parser
from duality.config import Settings
from duality.errors import DualityError
from duality.kafka import client

_out = Console(highlight=False)
_err = Console(stderr=True, highlight=False)

# The modules whose commands `duality` has, in the order `duality --help` lists them.
_COMMAND_MODULES = (stack, streams, batch, serving)


def _cmd_batch_server(settings: Settings, args: Namespace, console: Console) -> None:
    from duality import batch_server

    batch_server.serve(settings, args.host, args.port, main)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="duality",
        description="Streams into tables and tables into streams, on Kafka, Spark and Delta.",
    )
    commands = Commands(parser)
    for module in _COMMAND_MODULES:
        module.add_commands(commands)
    # The batch server runs `main`, so its command is here.
    server = commands.add(
        "batch-server",
        _cmd_batch_server,
        "run the batch steps of `duality` commands in one warm Spark (`duality up` starts one)",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=not_negative, default=7078, help="port to listen on")
    return parser


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
        print_json({**details, "error": str(error), "exit_code": error.exit_code})
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
            if command in object_store.CHECKED_COMMANDS and command != "up":
                # `up` checks after starting its own object store, if it runs one.
                object_store.preflight(settings)
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
            refused = None if settings is None else client.refused_login_in(settings, error)
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
            print_json(result)
    except BrokenPipeError:
        sys.stderr.close()
    return 0
