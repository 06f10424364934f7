"""Entry point: run one pipeline's changelog-backed streaming aggregate.

    python jobs/stream_aggregate.py PIPELINE

Runs until SIGTERM; exits non-zero when the stream cannot run (bad spec, lock held).
"""

from __future__ import annotations

import argparse
import logging
import sys

from duality.arguments import stream_arguments
from duality.config import Settings
from duality.errors import DualityError
from duality.spec import find_spec
from duality.stream_job import StreamOptions, supervise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings.from_env()
        options = StreamOptions.from_args(args)
        spec = find_spec(settings, args.pipeline)
        return supervise(settings, spec, args.pipeline, options)
    except DualityError as error:
        logging.getLogger("duality.stream").error("%s", error)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
