"""What the tests share: waiting for conditions, reading topics whole, unique names."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from duality import kafka
from duality.config import Settings

T = TypeVar("T")


def assert_eventually(
    probe: Callable[[], T],
    expected: Any = None,
    *,
    timeout: float = 60.0,
    interval: float = 0.25,
    message: str = "",
) -> T:
    """Call `probe` until it returns `expected` (or anything truthy when expected is None)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if (expected is None and last) or (expected is not None and last == expected):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"condition not met within {timeout:g}s{': ' + message if message else ''}; "
                f"last value: {last!r}"
                + (f", expected: {expected!r}" if expected is not None else "")
            )
        time.sleep(interval)


def unique_name(label: str) -> str:
    """A topic or group name no other test uses."""
    clean = re.sub(r"[^a-zA-Z0-9._-]+", "-", label)[:60].strip("-")
    return f"{clean}-{uuid.uuid4().hex[:8]}"


def read_topic(
    settings: Settings,
    topic: str,
    *,
    isolation: kafka.Isolation = "read_committed",
    timeout: float = 60.0,
) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of `topic` up to its current end: (partition, offset, key, value)."""
    return [
        (m.partition(), m.offset(), m.key(), m.value())
        for m in kafka.read_to_end(settings, topic, isolation=isolation, timeout=timeout)
    ]
