"""spark-submit entry point: copy a topic into one with N partitions, exactly once.

    python jobs/repartition.py SOURCE --to TARGET --partitions N --strategy key-hash|salted
        [--hot-keys auto|k1,k2] [--salts S] [--continuous]

Prints the report as JSON on stdout; exits 2 on bad arguments (before creating anything),
1 when the copy failed (run it again: it resumes where the committed progress is).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from duality import repartition
from duality.config import Settings
from duality.errors import DualityError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the topic to copy")
    parser.add_argument("--to", required=True, dest="target", help="the topic to copy into")
    parser.add_argument("--partitions", type=int, required=True, help="partitions of TARGET")
    parser.add_argument("--strategy", default="key-hash", help="key-hash (default) or salted")
    parser.add_argument("--hot-keys", help="salted: auto, or the keys to salt (k1,k2)")
    parser.add_argument("--salts", type=int, help="salted: partitions a hot key spreads over")
    parser.add_argument("--continuous", action="store_true", help="keep mirroring until SIGTERM")
    parser.add_argument(
        "--transaction-records",
        type=int,
        default=repartition.TRANSACTION_RECORDS,
        help="records per Kafka transaction (default %(default)s)",
    )
    parser.add_argument(
        "--throttle", type=float, help="at most this many records per second per source partition"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("duality.repartition")
    if args.transaction_records < 1:
        parser.error("--transaction-records must be at least 1")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        settings = Settings.from_env()
        plan = repartition.plan(
            settings,
            args.source,
            args.target,
            args.partitions,
            args.strategy,
            args.hot_keys,
            args.salts,
        )
        log.info("plan: %s", plan.metadata())
        report = repartition.run(
            settings,
            plan,
            continuous=args.continuous,
            stop=stop,
            transaction_records=args.transaction_records,
            throttle=args.throttle,
            progress=lambda done, total: log.info("copied %d of %d records", done, total),
        )
    except DualityError as error:
        log.error("%s", error)
        return error.exit_code
    except Exception:
        log.exception("the copy failed; run it again to resume from the committed progress")
        return 1
    print(json.dumps(report.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
