"""A replica of a pipeline's table, as the API's process sees it: its store (read only here),
its writer (`duality.serve.writer`, a process of its own that applies the changelog to the
store and reports each write and each read of the changelog's end), and what those reports say:
the position, the changelog's committed end, whether Kafka answers, the reader's last error.
A writer that dies is started again (with backoff) until the replica stops.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from duality import process
from duality.config import Settings
from duality.metrics import ServingMetrics
from duality.serve.keys import Position, TableKey, reached
from duality.serve.store import Store
from duality.spec import PipelineSpec

log = logging.getLogger("duality.serve")

# Backoff before a writer that died is started again, from the first after one that had run
# for the longest of them.
RESTART_S = (1.0, 10.0)
# Seconds a stopping writer gets to end its write before it is killed.
STOP_GRACE_S = 30.0


class Replica:
    """The replica of `spec`'s table in `folder/<pipeline>.sqlite`, kept by `start()` until
    `stop()`."""

    def __init__(
        self,
        settings: Settings,
        spec: PipelineSpec,
        folder: Path,
        metrics: ServingMetrics | None = None,
        *,
        from_snapshot: bool = True,
    ) -> None:
        self.settings, self.spec, self.folder = settings, spec, folder
        self.pipeline, self.topic = spec.name, spec.changelog_topic
        self.key = TableKey.of(spec)
        self.from_snapshot = from_snapshot  # a new replica starts from the published snapshot
        self.store = Store(folder / f"{spec.name}.sqlite", self.topic)
        self.metrics = metrics or ServingMetrics()
        self.metrics.add(self.pipeline)
        self._position: Position = self.store.position()
        self._ends: Position = {}
        self.kafka_up = False
        self.error: str | None = None  # the reader's last failure, until it reads again
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._writer: subprocess.Popen[bytes] | None = None
        self._keeper = threading.Thread(
            target=self._keep_writer, name=f"replica-{spec.name}", daemon=True
        )

    # -- what the API asks ---------------------------------------------------------------------

    def position(self) -> Position:
        with self._changed:
            return dict(self._position)

    def lag(self, position: Position | None = None) -> dict[int, int]:
        """Records per partition between the replica's position (or `position`, one it had)
        and the changelog's committed end as last read."""
        with self._changed:
            return self._lag(position)

    def _lag(self, position: Position | None = None) -> dict[int, int]:
        at = self._position if position is None else position
        partitions = set(self._ends) | set(at)
        return {p: max(0, self._ends.get(p, 0) - at.get(p, 0)) for p in sorted(partitions)}

    def wait_until(
        self, condition: Callable[[Position, dict[int, int]], bool], timeout: float
    ) -> bool:
        """Whether `condition(position, lag)` holds within `timeout` seconds (checked at each
        write of the store and each read of the end offsets)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: condition(dict(self._position), self._lag()), timeout=max(0.0, timeout)
            )

    def caught_up_to(self, wanted: Position, timeout: float) -> bool:
        return self.wait_until(lambda position, _: reached(position, wanted), timeout)

    def alive(self) -> bool:
        writer = self._writer
        return self._keeper.is_alive() and writer is not None and writer.poll() is None

    def describe(self) -> dict[str, Any]:
        """The replica's state for /healthz and the API."""
        with self._changed:
            lag = self._lag()
            return {
                "pipeline": self.pipeline,
                "topic": self.topic,
                "position": {str(p): o for p, o in sorted(self._position.items())},
                "lag": sum(lag.values()),
                "kafka_up": self.kafka_up,
                "error": self.error,
            }

    # -- running -------------------------------------------------------------------------------

    def start(self) -> Replica:
        self._keeper.start()
        return self

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop the writer (after its current write) and close the store."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        writer = self._writer
        if writer is not None and writer.stdin is not None:
            writer.stdin.close()  # the writer ends its write and exits
        if self._keeper.is_alive():
            self._keeper.join(timeout + 5)
        self.store.close()

    def _keep_writer(self) -> None:
        """Run the writer, and again after a pause when it dies, until stopped."""
        pause = RESTART_S[0]
        while not self._stop.is_set():
            started = time.monotonic()
            code = self._run_writer()
            if self._stop.is_set():
                return
            if time.monotonic() - started > RESTART_S[1]:
                pause = RESTART_S[0]
            self.error = f"the writer exited with {code}"
            log.warning(
                "replica of %s: its writer exited with %s; starting it again in %.0f s",
                self.pipeline,
                code,
                pause,
            )
            self._stop.wait(pause)
            pause = min(pause * 2, RESTART_S[1])

    def _run_writer(self) -> int:
        command = [sys.executable, "-m", "duality.serve.writer", self.pipeline, str(self.folder)]
        if not self.from_snapshot:
            command.append("--changelog-only")
        lock = self.store.lock_fd
        writer = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.settings.process_env(),
            pass_fds=() if lock is None else (lock,),
            preexec_fn=process.die_with_parent,
        )
        self._writer = writer
        if self._stop.is_set() and writer.stdin is not None:  # stopped while it started
            writer.stdin.close()
        assert writer.stdout is not None
        try:
            self._follow(writer.stdout)
        finally:
            if writer.stdin is not None and not writer.stdin.closed:
                writer.stdin.close()
            try:
                writer.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                writer.kill()
                writer.wait()
        return writer.returncode

    def _follow(self, reports: IO[bytes]) -> None:
        """Take in the writer's reports until it ends them (docs in duality.serve.writer)."""
        for line in reports:
            report = json.loads(line)
            applied, wrote = int(report.get("applied", 0)), "applied" in report
            with self._changed:
                if "position" in report:
                    self._position = {int(p): o for p, o in report["position"].items()}
                if "ends" in report:
                    self._ends = {int(p): o for p, o in report["ends"].items()}
                if "kafka_up" in report:
                    self.kafka_up = bool(report["kafka_up"])
                if "error" in report:
                    self.error = report["error"]
                elif wrote:
                    self.error = None
                lag = self._lag()
                self._changed.notify_all()
            if wrote or "ends" in report or "kafka_up" in report:
                self.metrics.replica(self.pipeline, applied, lag if self.kafka_up else None, wrote)
