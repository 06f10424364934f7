"""`duality serve`: a replica of each pipeline's table and the HTTP API over them, in one
process, until it is told to stop (SIGTERM, SIGINT: the API stops answering, each replica ends
its current write, the stores close). Its address is in `<serve_dir>/serve.json` while it
runs, and its Prometheus target in `<local_dir>/monitoring/targets/serve-<host>-<port>.json`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from duality.config import Settings
from duality.metrics import ServingMetrics, serve_target, write_target
from duality.serve.api import ApiServer
from duality.serve.replica import Replica
from duality.spec import PipelineSpec

log = logging.getLogger("duality.serve")


@dataclasses.dataclass(frozen=True)
class Served:
    """What a `duality serve` did: where it listened, for how long, its replicas at the end."""

    url: str
    seconds: float
    replicas: dict[str, dict[str, object]]


def serve(
    settings: Settings,
    specs: Sequence[PipelineSpec],
    stop: threading.Event,
    ready: Callable[[ApiServer], None] = lambda server: None,
) -> Served:
    """Keep a replica of each of `specs` and answer the API on `settings.serve_host` and
    `serve_port` until `stop` is set; `ready` is called once the API listens."""
    started = time.monotonic()
    metrics = ServingMetrics()
    replicas: dict[str, Replica] = {}
    try:
        for spec in specs:
            replicas[spec.name] = Replica(settings, spec, settings.replica_dir, metrics)
        address = (settings.serve_host, settings.serve_port)
        server = ApiServer(address, replicas, metrics, settings.serve_token)
    except BaseException:
        for replica in replicas.values():
            replica.stop()
        raise
    record = settings.replica_dir / "serve.json"
    port = int(server.server_address[1])
    target, scraped = serve_target(settings, settings.serve_host, port)
    listener = threading.Thread(target=server.serve_forever, name="serve-api")
    try:
        for replica in replicas.values():
            replica.start()
        listener.start()
        record.write_text(
            json.dumps({"url": server.url, "pid": os.getpid(), "pipelines": sorted(replicas)})
        )
        write_target(target, scraped, None)  # Prometheus finds it (docs/monitoring.md)
        log.info("serving %s at %s", ", ".join(sorted(replicas)), server.url)
        ready(server)
        stop.wait()
    finally:
        if listener.is_alive():
            server.shutdown()
        server.server_close()
        for replica in replicas.values():
            replica.stop()
        record.unlink(missing_ok=True)
        target.unlink(missing_ok=True)
    return Served(
        server.url,
        round(time.monotonic() - started, 3),
        {name: replica.describe() for name, replica in replicas.items()},
    )
