"""A batch step on a table on object storage that stops because the store stopped answering
(a server down, a network gone) says so, naming the endpoint, instead of ending in pyarrow's
or Spark's stack trace. The store's own clients retry transient errors with backoff first
(`storage.objects.filesystem`, S3A's `fs.s3a.retry.*`); what reaches here outlasted them. No
partial version is left behind: a commit file is created whole or not at all, and data files
written before it are referenced by no version (VACUUM removes them)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from duality.config import Settings
from duality.errors import DualityError
from duality.spec import PipelineSpec
from duality.storage import ObjectPath, s3

P = ParamSpec("P")
T = TypeVar("T")


def unreachable(settings: Settings, location: object) -> s3.Unreachable | None:
    """The store's error when `location` is on object storage and its endpoint does not
    answer now; None otherwise."""
    if not isinstance(location, ObjectPath):
        return None
    try:
        s3.request(settings.store(), "HEAD", f"/{location.bucket}")
    except s3.Unreachable as error:
        return error
    return None


def reported(
    command: str,
) -> Callable[
    [Callable[Concatenate[Settings, PipelineSpec, P], T]],
    Callable[Concatenate[Settings, PipelineSpec, P], T],
]:
    """A step `(settings, spec, ...)` whose failure, when the snapshot is on object storage that
    no longer answers, is an `s3.Unreachable` naming the endpoint and saying to run `duality
    COMMAND PIPELINE` again once it answers."""

    def wrap(
        step: Callable[Concatenate[Settings, PipelineSpec, P], T],
    ) -> Callable[Concatenate[Settings, PipelineSpec, P], T]:
        @functools.wraps(step)
        def run(settings: Settings, spec: PipelineSpec, *args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return step(settings, spec, *args, **kwargs)
            except DualityError:
                raise
            except Exception as error:
                where = (spec.snapshot_path(settings), settings.reports)
                down = next(filter(None, (unreachable(settings, at) for at in where)), None)
                if down is None:
                    raise
                raise s3.Unreachable(
                    f"`duality {command} {spec.name}` stopped: {down}; no partial version is "
                    f"left in {spec.snapshot_path(settings)}: run it again once the store answers"
                ) from error

        return run

    return wrap
