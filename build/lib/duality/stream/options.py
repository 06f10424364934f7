"""How a stream runs: the options the supervisor takes and hands on to its driver."""

from __future__ import annotations

import argparse
import dataclasses

from duality.errors import UsageError

# Larger micro-batches read a backlog faster, but one that changed 1,000,000 keys ran the
# driver's 1 GB heap out of memory (README, benchmark).
MAX_OFFSETS_PER_TRIGGER = 500_000
# A micro-batch running longer than this is taken as stalled (a lost broker connection that
# never recovers): the query is stopped and restarted from the changelog.
STALL_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a stream runs; the same arguments for the supervisor (`python -m duality.stream`)
    and its driver."""

    max_offsets_per_trigger: int = MAX_OFFSETS_PER_TRIGGER
    stall_timeout_s: float = STALL_TIMEOUT_S
    trigger_seconds: float = 1.0

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
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
            help="seconds after which a running micro-batch is stalled (default %(default)s)",
        )
        parser.add_argument(
            "--trigger-seconds",
            type=float,
            default=1.0,
            help="the micro-batch trigger interval in seconds (default %(default)s)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StreamOptions:
        if args.max_offsets_per_trigger < 1:
            raise UsageError("--max-offsets-per-trigger must be at least 1")
        if args.trigger_seconds < 0 or args.stall_timeout <= 0:
            raise UsageError("--trigger-seconds must be 0 or more and --stall-timeout positive")
        return cls(args.max_offsets_per_trigger, args.stall_timeout, args.trigger_seconds)

    def to_args(self) -> list[str]:
        return [
            "--max-offsets-per-trigger",
            str(self.max_offsets_per_trigger),
            "--stall-timeout",
            str(self.stall_timeout_s),
            "--trigger-seconds",
            str(self.trigger_seconds),
        ]
