"""A pull-query client for the `serve` group of `make bench` (bench/serving.py), run as a process
of its own: point lookups of random keys over `--connections` keep-alive HTTP connections (a
thread each), at a fixed rate or without pause, for a number of seconds. It writes what it
measured as JSON to `--out`.

At a fixed rate, request n is due at start + n / rate, taken by the next free connection, and
its latency counts from when it was due, not from when it was sent: when every connection
waits for an answer, the requests falling due meanwhile wait too, and that wait counts (no
coordinated omission). Without pause (`--rate 0`), each connection sends its next request when
its last one was answered.
Anything but a 200, or no answer within `--timeout`, is an error (the connection is then made
again).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from pathlib import Path


class _Schedule:
    """Request n is due at start + n / rate (rate 0: as soon as a connection is free), until
    `seconds` have passed; the connections take the requests in turn."""

    def __init__(self, rate: float, seconds: float) -> None:
        self.rate, self.lock, self.next = rate, threading.Lock(), 0
        self.started = time.perf_counter()
        self.end = self.started + seconds

    def take(self) -> float | None:
        """When the next request is due; None once the run is over."""
        with self.lock:
            now = time.perf_counter()
            due = self.started + self.next / self.rate if self.rate > 0 else now
            if due >= self.end:
                return None
            self.next += 1
            return due


class _Worker(threading.Thread):
    """One keep-alive connection asking for random keys when the schedule says."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        args: argparse.Namespace,
        schedule: _Schedule,
        rng: random.Random,
    ) -> None:
        super().__init__(daemon=True)
        self.host, self.port, self.prefix, self.args = host, port, prefix, args
        self.schedule, self.rng = schedule, rng
        self.latencies: list[float] = []  # ms
        self.statuses: dict[str, int] = {}
        self.errors = 0
        self.first_error = ""

    def run(self) -> None:
        args = self.args
        connection = http.client.HTTPConnection(self.host, self.port, timeout=args.timeout)
        while (due := self.schedule.take()) is not None:
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            key = args.key_format.format(self.rng.randrange(args.keys))
            try:
                connection.request("GET", self.prefix + urllib.parse.quote(key, safe=""))
                answer = connection.getresponse()
                answer.read()
                status = str(answer.status)
            except (OSError, http.client.HTTPException) as error:
                status = type(error).__name__
                connection.close()
                connection = http.client.HTTPConnection(self.host, self.port, timeout=args.timeout)
            self.latencies.append((time.perf_counter() - due) * 1000)
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if status != "200":
                self.errors += 1
                self.first_error = self.first_error or f"{key}: {status}"
        connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="the replica, http://host:port")
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--keys", type=int, required=True, help="keys product-000000 onwards")
    parser.add_argument("--key-format", default="product-{:06d}")
    parser.add_argument("--rate", type=float, default=1000.0, help="requests/s; 0: no pause")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--connections", type=int, default=4, help="keep-alive connections, a thread each"
    )
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    address = urllib.parse.urlsplit(args.url)
    host, port = address.hostname or "127.0.0.1", address.port or 80
    prefix = f"/v1/pipelines/{urllib.parse.quote(args.pipeline, safe='')}/rows/"
    schedule = _Schedule(args.rate, args.seconds)
    workers = [
        _Worker(host, port, prefix, args, schedule, random.Random(args.seed * 1000 + n))
        for n in range(args.connections)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - schedule.started
    latencies = sorted(x for w in workers for x in w.latencies)
    statuses: dict[str, int] = {}
    for worker in workers:
        for status, count in worker.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
    errors = sum(w.errors for w in workers)
    first_error = next((w.first_error for w in workers if w.first_error), "")
    sent = len(latencies)
    args.out.write_text(
        json.dumps(
            {
                "requests": sent,
                "seconds": seconds,
                "rate": args.rate,
                "connections": args.connections,
                "errors": errors,
                "first_error": first_error,
                "statuses": statuses,
                "latencies_ms": [round(x, 4) for x in latencies],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
