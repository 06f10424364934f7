"""Pull queries: `duality serve` keeps replicas of pipelines' tables and answers their HTTP
API; `duality query` asks them for a key (docs/serving.md)."""

from __future__ import annotations

import json
import signal
import threading
from argparse import Namespace
from typing import Any

from rich.console import Console

from duality import spec
from duality.arguments import not_negative
from duality.cli.parsing import Commands
from duality.config import Settings
from duality.errors import UsageError


def add_commands(commands: Commands) -> None:
    serve = commands.add(
        "serve",
        _cmd_serve,
        "keep replicas of pipelines' tables from their changelogs and answer pull queries over "
        "HTTP until stopped (SIGTERM, Ctrl-C)",
    )
    serve.add_argument(
        "pipelines", nargs="*", metavar="PIPELINE", help="pipelines to serve (default: every spec)"
    )
    query = commands.add(
        "query", _cmd_query, "a key's row from the replicas, with its position", True
    )
    query.add_argument("key", help="the key: a group field's value, or a JSON array of them")
    query.add_argument(
        "--max-lag",
        type=not_negative,
        help="refuse an answer from a replica more records than this behind the changelog",
    )
    query.add_argument(
        "--at", metavar="TOKEN", help="never an answer older than this position token"
    )
    query.add_argument(
        "--wait",
        type=float,
        help="seconds a replica may take to catch up with --at or --max-lag (default 0)",
    )


def _cmd_serve(settings: Settings, args: Namespace, console: Console) -> Any:
    from duality.serve import server

    names = args.pipelines or [path.stem for path in spec.spec_files(settings)]
    if not names:
        raise UsageError(f"no pipeline specs in {settings.pipelines}: name one to serve")
    specs = [_served_spec(settings, name) for name in names]
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())

    def ready(api: Any) -> None:
        console.print(
            f"serving {', '.join(s.name for s in specs)} at [bold]{api.url}[/] (stores in "
            f"{settings.replica_dir}); stop with SIGTERM or Ctrl-C"
        )

    served = server.serve(settings, specs, stop, ready)
    if not args.json:
        console.print(f"stopped after {served.seconds:.0f}s")
    return served


def _served_spec(settings: Settings, name: str) -> spec.PipelineSpec:
    """A replica needs the table's key and columns, not an Avro source's registry: a spec that
    lists its schema loads without it (`duality up` starts the replicas before any workload has
    registered the subject); one that does not asks the registry for its columns."""
    loaded = spec.find_spec(settings, name, registry=False)
    return loaded if loaded.source.columns_known else spec.find_spec(settings, name)


def _cmd_query(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from duality.serve import client

    pipeline = spec.find_spec(settings, args.pipeline)
    answer = client.query(
        settings, pipeline.name, args.key, max_lag=args.max_lag, at=args.at, wait=args.wait
    )
    if not args.json:
        rows = answer.get("windows", [answer])
        for found in rows:
            where = f"partition {found['partition']}, offset {found['offset']}"
            console.print(json.dumps(found["row"]), f"({where})", soft_wrap=True, markup=False)
        console.print(
            f"replica {answer['replica']}, lag {answer['lag']:,}, position token {answer['token']}",
            soft_wrap=True,
            markup=False,
        )
    return answer
