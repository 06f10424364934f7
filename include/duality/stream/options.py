"""How a stream runs: the options the supervisor takes and hands on to its driver."""

from __future__ import annotations

import argparse
import dataclasses

from duality.errors import UsageError

# Larger micro-batches read a backlog faster, but one that changed 1,000,000 keys ran the
# driver's 1 GB heap out of memory (docs/decisions/0018-stream-latency.md).
MAX_OFFSETS_PER_TRIGGER = 500_000
# A micro-batch running longer than this is taken as stalled (a lost broker connection that
# never recovers): the query is stopped and restarted from the changelog.
STALL_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a stream runs: the same options for the supervisor and its driver."""

    max_offsets_per_trigger: int = MAX_OFFSETS_PER_TRIGGER
    stall_timeout_s: float = STALL_TIMEOUT_S
    trigger_seconds: float = 1.0
    # A second instance on this host: its driver starts Spark, then waits to become the active
    # one (docs/decisions/0029-warm-standby.md).
    standby: bool = False

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        numbers = dataclasses.fields(StreamOptions)[: len(_ARGUMENTS)]
        for (flag, what), field in zip(_ARGUMENTS, numbers, strict=True):
            parser.add_argument(
                flag,
                type=type(field.default),
                default=field.default,
                help=f"{what} (default %(default)s)",
            )
        parser.add_argument(
            "--standby",
            action="store_true",
            help="a warm standby: another instance of the stream, whose driver takes over when "
            "the active one dies",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StreamOptions:
        if args.max_offsets_per_trigger < 1:
            raise UsageError("--max-offsets-per-trigger must be at least 1")
        if args.trigger_seconds < 0 or args.stall_timeout <= 0:
            raise UsageError("--trigger-seconds must be 0 or more and --stall-timeout positive")
        return cls(
            args.max_offsets_per_trigger, args.stall_timeout, args.trigger_seconds, args.standby
        )

    def to_args(self) -> list[str]:
        pairs = zip(_ARGUMENTS, dataclasses.astuple(self)[: len(_ARGUMENTS)], strict=True)
        numbers = [part for (flag, _), value in pairs for part in (flag, str(value))]
        return [*numbers, "--standby"] if self.standby else numbers


# Each field's flag and help, in the fields' order.
_ARGUMENTS = (
    ("--max-offsets-per-trigger", "the most source records one micro-batch reads"),
    ("--stall-timeout", "seconds after which a running micro-batch is stalled"),
    ("--trigger-seconds", "the micro-batch trigger interval in seconds"),
)
