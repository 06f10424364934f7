"""A replica of a pipeline's table: the changelog reader that applies the changelog, read
committed, to the replica's store, each partition's next offset in the same transaction as its
rows (Kafka Streams calls this role the ChangelogReader). Without a store it reads the changelog
from its start; a restart resumes from the offsets in its store.

Two threads per replica: the reader (a consumer assigned to every partition of the changelog,
writing what each poll returned as one transaction) and the end watcher (the changelog's last
stable offsets every `END_REFRESH_S`, from which the lag is reckoned; its first offsets, below
which the rows of a windowed table's expired windows are dropped as retention dropped them).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duality.config import Settings
from duality.kafka import client, offsets, records, topics
from duality.metrics import ServingMetrics
from duality.serve import bootstrap
from duality.serve.keys import Position, TableKey, reached
from duality.serve.store import Change, Store
from duality.spec import PipelineSpec

log = logging.getLogger("duality.serve")

# Seconds between two reads of the changelog's end offsets: a replica's lag is at most this old.
END_REFRESH_S = 0.5
# Seconds between two reads of the changelog's first offsets (retention of a windowed table).
START_REFRESH_S = 30.0
# Records one poll returns at most, written as one transaction.
POLL_RECORDS = 5_000
POLL_TIMEOUT_S = 0.1
# Backoff after a failure of the reader (Kafka away, the changelog not created yet), from the
# first after a reader that had run for the longest of them.
RETRY_S = (1.0, 10.0)


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
        self.settings, self.spec = settings, spec
        self.pipeline, self.topic = spec.name, spec.changelog_topic
        self.key = TableKey.of(spec)
        self.from_snapshot = from_snapshot  # a new replica starts from the published snapshot
        self.store = Store(folder / f"{spec.name}.sqlite", self.topic)
        self.metrics = metrics or ServingMetrics()
        self.metrics.add(self.pipeline)
        self._position: Position = self.store.position()
        self._ends: Position = {}
        self._starts: Position | None = None
        self.kafka_up = False
        self.error: str | None = None  # the reader's last failure, until it reads again
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, name=f"replica-{spec.name}", daemon=True),
            threading.Thread(target=self._watch, name=f"replica-ends-{spec.name}", daemon=True),
        ]

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
        return all(thread.is_alive() for thread in self._threads)

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
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop both threads (the reader after its current write) and close the store."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout)
        self.store.close()

    def _read(self) -> None:
        pause = RETRY_S[0]
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._follow()
                return
            except Exception as error:  # Kafka away, the changelog not made yet: again later
                if time.monotonic() - started > RETRY_S[1]:
                    pause = RETRY_S[0]
                self.error = f"{type(error).__name__}: {error}"
                log.warning(
                    "replica of %s: %s; reading again in %.0f s", self.pipeline, error, pause
                )
                self._stop.wait(pause)
                pause = min(pause * 2, RETRY_S[1])

    def _follow(self) -> None:
        """Assign a consumer to every partition at the store's offsets (the first offset still
        stored where it has none) and apply what each poll returns as one transaction."""
        partitions = topics.partition_count(self.settings, self.topic)
        ends = offsets.end_offsets(self.settings, self.topic)
        firsts = offsets.beginning_offsets(self.settings, self.topic)
        stored = self.store.position() or self._bootstrap()
        if any(offset > ends.get(p, 0) for p, offset in stored.items()):
            # Offsets past the end: the changelog was deleted and made again (`duality reset`).
            log.warning(
                "replica of %s: its offsets %s are past the end of %s (%s): the topic was made "
                "again; reading it from the start",
                self.pipeline,
                stored,
                self.topic,
                ends,
            )
            self.store.clear()
            stored = {}
        starts = {p: max(stored.get(p, 0), firsts.get(p, 0)) for p in range(partitions)}
        with self._changed:
            self._position = dict(starts)
            self._ends = {p: max(e, starts.get(p, 0)) for p, e in ends.items()}
            self._changed.notify_all()
        reader = client.consumer(self.settings, f"duality-serve-{self.pipeline}-{uuid.uuid4().hex}")
        try:
            reader.assign([offsets.TopicPartition(self.topic, p, o) for p, o in starts.items()])
            self.error = None
            while not self._stop.is_set():
                self._apply(reader.consume(num_messages=POLL_RECORDS, timeout=POLL_TIMEOUT_S))
                lows, self._starts = self._starts, None
                if lows is not None and self.spec.window is not None:
                    self.store.prune(lows)
        finally:
            reader.close()

    def _bootstrap(self) -> Position:
        """A new (empty) replica's rows from the published snapshot and the offsets it covers;
        {} (read the changelog from its start) when there is none to use."""
        if not self.from_snapshot:
            return {}
        started = time.monotonic()
        topic_id = topics.describe_topic(self.settings, self.topic).topic_id
        found = bootstrap.published(self.settings, self.spec, topic_id)
        if found is None:
            return {}
        coverage, changes = found
        loaded = self.store.load_snapshot(changes, coverage.changelog)
        log.info(
            "replica of %s: %d rows from the published snapshot (covering %s) in %.1f s",
            self.pipeline,
            loaded,
            coverage.changelog,
            time.monotonic() - started,
        )
        return dict(coverage.changelog)

    def _apply(self, messages: list[Any]) -> None:
        position = self.position()
        changes = []
        for message in messages:
            eof = records.end_of_partition(message)
            partition, offset = message.partition(), message.offset()
            if eof:  # past the transaction markers, at the committed end
                position[partition] = max(position.get(partition, 0), offset)
                continue
            position[partition] = offset + 1
            key = message.key()
            if key is None:
                continue
            try:
                group_key, window = self.key.decode(key)
            except ValueError as error:
                log.warning("replica of %s: skipped: %s", self.pipeline, error)
                continue
            changes.append(Change(group_key, window, key, message.value(), partition, offset))
        if position == self._position and not changes:
            return
        applied = self.store.apply(changes, position)
        with self._changed:
            self._position = position
            lag = self._lag()
            self._changed.notify_all()
        self.metrics.replica(self.pipeline, applied, lag if self.kafka_up else None, True)

    def _watch(self) -> None:
        """Read the changelog's committed end every END_REFRESH_S (and its first offsets every
        START_REFRESH_S) until stopped; Kafka away leaves the last ones and `kafka_up` false."""
        next_starts = time.monotonic() + START_REFRESH_S
        while not self._stop.is_set():
            try:
                ends = offsets.end_offsets(self.settings, self.topic)
                if time.monotonic() >= next_starts:
                    self._starts = offsets.beginning_offsets(self.settings, self.topic)
                    next_starts = time.monotonic() + START_REFRESH_S
                self.kafka_up = True
            except Exception as error:  # Kafka away, the changelog not made yet
                log.debug("replica of %s: end offsets not read: %s", self.pipeline, error)
                self.kafka_up, ends = False, None
            with self._changed:
                if ends is not None:
                    self._ends = ends
                lag = self._lag()
                self._changed.notify_all()
            self.metrics.replica(self.pipeline, 0, lag if ends is not None else None, False)
            self._stop.wait(END_REFRESH_S)
