"""A micro-batch's write that runs past SLOW_WRITE_S logs where every thread of the driver is
(decision 33, "Not solved yet"), once; a write that ends in time logs nothing."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from duality.stream import changelog_writer
from duality.stream.changelog_writer import BatchResult, ChangelogWriter


class _Writer(ChangelogWriter):
    """The writer's watch over a write that waits for `release` (no Kafka, no Spark)."""

    def __init__(self) -> None:  # none of the real writer's connections
        self.spec = SimpleNamespace(name="p")  # type: ignore[assignment]
        self.release = threading.Event()

    def _write(self, batch: Any, batch_id: int) -> BatchResult:
        assert self.release.wait(30), "the slow write was never logged"
        return BatchResult(batch_id)

    def _slow(self, batch_id: int) -> None:  # the write goes on once the watch has logged
        super()._slow(batch_id)
        self.release.set()


def test_a_slow_write_logs_every_thread_s_stack_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(changelog_writer, "SLOW_WRITE_S", 0.2)
    writer = _Writer()
    caplog.set_level(logging.WARNING, "duality.stream")
    assert writer.write(None, 7) == BatchResult(7)
    slow = [r.getMessage() for r in caplog.records if "has been writing" in r.getMessage()]
    assert len(slow) == 1, slow
    assert "p: batch 7 has been writing for 0s" in slow[0]
    # The stack of the thread that writes, down to where it waits.
    assert "--- thread MainThread:" in slow[0] and "in _write" in slow[0], slow[0]


def test_a_write_in_time_logs_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(changelog_writer, "SLOW_WRITE_S", 5.0)
    writer = _Writer()
    writer.release.set()
    caplog.set_level(logging.WARNING, "duality.stream")
    assert writer.write(None, 8) == BatchResult(8)
    assert not [r for r in caplog.records if "has been writing" in r.getMessage()]
