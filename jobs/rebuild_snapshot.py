"""Entry point: rebuild one pipeline's Delta snapshot from its changelog.

    python jobs/rebuild_snapshot.py PIPELINE [OPTIONS]      (the arguments of `duality snapshot`)

Writes one Delta commit (or none when the changelog has not moved) and prints the result as
JSON on stdout; exits 2 on bad input, 1 when the run failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from duality import object_store
from duality.arguments import snapshot_arguments
from duality.config import Settings
from duality.errors import DualityError
from duality.snapshot import build, maintain
from duality.spec import find_spec

log = logging.getLogger("duality.snapshot")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    snapshot_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings.from_env()
        # As `duality snapshot`: a store that is unreachable, refuses the key or lacks the
        # bucket stops the job before any work, naming the setting.
        object_store.preflight(settings)
        spec = find_spec(settings, args.pipeline)
        if args.maintain:
            result: build.SnapshotResult | maintain.Maintenance = maintain.maintain(
                settings, spec, retain_hours=args.retain_hours, progress=log.info
            )
        else:
            mode: build.Mode = (
                "full" if args.full else "incremental" if args.incremental else "auto"
            )
            result = build.build(settings, spec, mode, progress=log.info)
    except DualityError as error:
        log.error("%s", error)
        return error.exit_code
    print(json.dumps(dataclasses.asdict(result), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
