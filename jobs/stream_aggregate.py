"""spark-submit entry point: run one pipeline's changelog-backed streaming aggregate.

    python jobs/stream_aggregate.py PIPELINE      (or spark-submit ... jobs/stream_aggregate.py)

Runs until SIGTERM; exits non-zero when the stream cannot run (bad spec, lock held).
"""

from __future__ import annotations

import argparse
import logging
import sys

from duality.config import Settings
from duality.errors import DualityError
from duality.spec import find_spec
from duality.stream_job import MAX_OFFSETS_PER_TRIGGER, STALL_TIMEOUT_S, supervise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", help="pipeline name or spec file")
    parser.add_argument(
        "--max-offsets-per-trigger",
        type=int,
        default=MAX_OFFSETS_PER_TRIGGER,
        help="the most source records one micro-batch reads (default %(default)s)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=STALL_TIMEOUT_S,
        help="seconds after which a running micro-batch counts as stalled (default %(default)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings.from_env()
        if args.max_offsets_per_trigger < 1:
            parser.error("--max-offsets-per-trigger must be at least 1")
        spec = find_spec(settings, args.pipeline)
        return supervise(
            settings,
            spec,
            args.pipeline,
            max_offsets_per_trigger=args.max_offsets_per_trigger,
            stall_timeout_s=args.stall_timeout,
        )
    except DualityError as error:
        logging.getLogger("duality.stream").error("%s", error)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
