"""The arguments of each command, declared once: the `duality` command line and the entry
points under `jobs/` both build their parsers from these (and never import the CLI itself)."""

from __future__ import annotations

import argparse

from duality.stream.options import StreamOptions


def at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def not_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more")
    return int(text)


def stream_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `duality stream start` and `python -m duality.stream`."""
    parser.add_argument("pipeline", help="pipeline name or spec file")
    StreamOptions.add_arguments(parser)


def snapshot_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `duality snapshot` and `jobs/rebuild_snapshot.py`."""
    parser.add_argument("pipeline", help="pipeline name or spec file")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--full", action="store_true", help="rebuild from the whole changelog")
    how.add_argument(
        "--incremental",
        action="store_true",
        help="merge only what the changelog got since the last version (the default; falls "
        "back to a full rebuild when it cannot, and says why)",
    )
    how.add_argument(
        "--maintain", action="store_true", help="OPTIMIZE and VACUUM the snapshot table"
    )
    parser.add_argument(
        "--retain-hours",
        type=float,
        default=168.0,
        help="with --maintain: VACUUM retention; never less than the published version needs",
    )


def repartition_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `duality repartition` and `jobs/repartition.py`."""
    from duality.repartition import TRANSACTION_RECORDS

    parser.add_argument("source", help="the topic to copy")
    parser.add_argument("--to", required=True, dest="target", help="target topic")
    parser.add_argument("--partitions", type=int, required=True, help="partitions of the target")
    parser.add_argument(
        "--strategy", choices=("key-hash", "salted"), default="key-hash", help="where keys go"
    )
    parser.add_argument("--hot-keys", help="salted: auto, or the keys to salt (k1,k2)")
    parser.add_argument(
        "--salts", type=int, help="salted: partitions a hot key spreads over (default N)"
    )
    parser.add_argument(
        "--continuous", action="store_true", help="keep mirroring new records until stopped"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the plan and say what it would copy"
    )
    parser.add_argument(
        "--transaction-records",
        type=at_least_one,
        default=TRANSACTION_RECORDS,
        help="records per Kafka transaction (default %(default)s)",
    )
    parser.add_argument(
        "--throttle", type=float, help="at most this many records per second per source partition"
    )
