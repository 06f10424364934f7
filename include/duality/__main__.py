"""`duality` and `python -m duality`: a batch step goes straight to the batch server when one is
configured, without importing the command line (its parser and every command's modules: 0.35 s
of each Airflow task's process, docs/decisions/0026-warm-spark-for-batch-steps.md). The server
parses its arguments, so a bad one is refused there, before any work; everything else runs in
`duality.cli`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from duality.batch_server import BATCH_COMMANDS, run_remote
from duality.config import Settings
from duality.errors import DualityError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in BATCH_COMMANDS:
        try:
            settings = Settings.from_env()
        except Exception:  # the command line says what is wrong with them
            settings = None
        if settings is not None and settings.batch_server:
            try:
                return run_remote(settings, argv, argv[0])
            except (DualityError, KeyboardInterrupt) as error:
                from duality.cli import failed

                return failed(error, argv[0], as_json="--json" in argv)
    from duality.cli import main as command_line

    return command_line(argv)


if __name__ == "__main__":
    sys.exit(main())
