"""A pull-query client for the `serve` group of `make bench` (bench/serving.py), run as a process
of its own: point lookups of random keys over one keep-alive HTTP connection, at a fixed rate
or without pause, for a number of seconds. It writes what it measured as JSON to `--out`.

At a fixed rate, request n is due at start + n / rate and its latency counts from then, not
from when it was sent: a slow answer delays the next requests, and their wait counts too (no
coordinated omission). Without pause (`--rate 0`), each request is sent when the last answered.
Anything but a 200, or no answer within `--timeout`, is an error (the connection is then made
again).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import time
import urllib.parse
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="the replica, http://host:port")
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--keys", type=int, required=True, help="keys product-000000 onwards")
    parser.add_argument("--key-format", default="product-{:06d}")
    parser.add_argument("--rate", type=float, default=1000.0, help="requests/s; 0: no pause")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    address = urllib.parse.urlsplit(args.url)
    host, port = address.hostname or "127.0.0.1", address.port or 80
    prefix = f"/v1/pipelines/{urllib.parse.quote(args.pipeline, safe='')}/rows/"
    rng = random.Random(args.seed)
    connection = http.client.HTTPConnection(host, port, timeout=args.timeout)
    latencies: list[float] = []  # ms
    statuses: dict[str, int] = {}
    errors = 0
    first_error = ""
    started = time.perf_counter()
    end = started + args.seconds
    sent = 0
    while True:
        if args.rate > 0:
            due = started + sent / args.rate
            if due >= end:
                break
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        else:
            due = time.perf_counter()
            if due >= end:
                break
        key = args.key_format.format(rng.randrange(args.keys))
        sent += 1
        try:
            connection.request("GET", prefix + urllib.parse.quote(key, safe=""))
            answer = connection.getresponse()
            answer.read()
            status = str(answer.status)
        except (OSError, http.client.HTTPException) as error:
            status = type(error).__name__
            connection.close()
            connection = http.client.HTTPConnection(host, port, timeout=args.timeout)
        latencies.append((time.perf_counter() - due) * 1000)
        statuses[status] = statuses.get(status, 0) + 1
        if status != "200":
            errors += 1
            first_error = first_error or f"{key}: {status}"
    seconds = time.perf_counter() - started
    connection.close()
    args.out.write_text(
        json.dumps(
            {
                "requests": sent,
                "seconds": seconds,
                "rate": args.rate,
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
