"""Errors a user can cause or fix, each carrying the exit code the command line returns."""

from __future__ import annotations


class DualityError(Exception):
    """An error with a message for people: what was wrong and what to do about it."""

    exit_code = 2


class UsageError(DualityError):
    """Bad input: a wrong argument, setting or spec. Raised before any work is done."""

    exit_code = 2


class TopicMissing(UsageError):
    """A topic that the command reads does not exist."""


class BrokerUnavailable(DualityError):
    """Kafka did not answer at the configured address."""

    exit_code = 2


class CheckFailed(DualityError):
    """A check ran and its result is negative (validation, reconciliation, a stopped service).

    `details` is the check's machine-readable result; `--json` prints it with the error.
    """

    exit_code = 1

    def __init__(self, message: str, details: dict[str, object] | None = None):
        super().__init__(message)
        self.details = details or {}


class ConcurrentWrite(DualityError):
    """A Delta statement lost the race for its version to another writer whose commit conflicts
    with its change (one of Delta's concurrent modification exceptions): nothing was written,
    and the step may be run again."""

    exit_code = 1


class LocalStackError(DualityError):
    """The local stack could not be started or stopped."""

    exit_code = 1
