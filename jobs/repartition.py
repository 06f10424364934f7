"""Entry point: copy a topic into one with N partitions, exactly once.

    python jobs/repartition.py SOURCE --to TARGET --partitions N [OPTIONS]
        (the arguments of `duality repartition`)

Prints the report (with --dry-run, what it would copy) as JSON on stdout; exits 2 on bad
arguments (before creating anything), 1 when the copy failed (run it again: it resumes where
the committed progress is).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from duality import repartition
from duality.arguments import repartition_arguments
from duality.config import Settings
from duality.errors import DualityError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    repartition_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("duality.repartition")
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
        if args.dry_run:
            print(json.dumps(repartition.dry_run(settings, plan), indent=2))
            return 0
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
