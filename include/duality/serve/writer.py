"""A replica's writer: the changelog reader that applies the changelog, read committed, to the
replica's store, each partition's next offset in the same transaction as its rows (Kafka
Streams calls this role the ChangelogReader), in a process of its own (decision 36): a thread
beside the API held Python's lock while it applied a poll, and the API's answers waited for it.

`python -m duality.serve.writer PIPELINE FOLDER [--changelog-only]`, started by
`duality.serve.replica.Replica` with the settings in its environment; it dies with its parent
and ends after its current write when its standard input closes. It writes one JSON object a
line to its standard output: `{"position": ..., "applied": n}` after each write,
`{"ends": ..., "kafka_up": b}` after each read of the changelog's end, `{"error": ...}` when
its reader fails (and reads again later).

Two threads: the reader (a consumer assigned to every partition of the changelog, writing what
each poll returned as one transaction) and the end watcher (the changelog's last stable offsets
every `END_REFRESH_S`, from which the lag is reckoned; its first offsets, below which the rows
of a windowed table's expired windows are dropped as retention dropped them). Without rows in
its store it starts from the published snapshot, or else the changelog's start; a restart
resumes from the offsets in its store.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duality import process
from duality.config import Settings
from duality.kafka import client, offsets, records, topics
from duality.serve import bootstrap
from duality.serve.keys import Position, TableKey
from duality.serve.store import Change, Store
from duality.spec import PipelineSpec, find_spec

log = logging.getLogger("duality.serve")

# Seconds between two reads of the changelog's end offsets: a replica's lag is at most this old.
END_REFRESH_S = 0.5
# Seconds between two reads of the changelog's first offsets (retention of a windowed table).
START_REFRESH_S = 30.0
POLL_TIMEOUT_S = 0.1
# Backoff after a failure of the reader (Kafka away, the changelog not created yet), from the
# first after a reader that had run for the longest of them.
RETRY_S = (1.0, 10.0)

Report = Callable[[dict[str, Any]], None]


class Writer:
    """Keeps `store` (the replica of `spec`'s table) up with the changelog until `stop` is set,
    telling `report` what it did."""

    def __init__(
        self,
        settings: Settings,
        spec: PipelineSpec,
        store: Store,
        report: Report,
        stop: threading.Event,
        *,
        from_snapshot: bool = True,
    ) -> None:
        self.settings, self.spec, self.store = settings, spec, store
        self.pipeline, self.topic = spec.name, spec.changelog_topic
        self.key = TableKey.of(spec)
        self.report, self.stop, self.from_snapshot = report, stop, from_snapshot
        self._position: Position = store.position()
        self._starts: Position | None = None

    def run(self) -> None:
        watcher = threading.Thread(target=self._watch, name="replica-ends", daemon=True)
        watcher.start()
        self._read()
        watcher.join()

    def _read(self) -> None:
        pause = RETRY_S[0]
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self._follow()
                return
            except Exception as error:  # Kafka away, the changelog not made yet: again later
                if time.monotonic() - started > RETRY_S[1]:
                    pause = RETRY_S[0]
                self.report({"error": f"{type(error).__name__}: {error}"})
                log.warning(
                    "replica of %s: %s; reading again in %.0f s", self.pipeline, error, pause
                )
                self.stop.wait(pause)
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
        self._position = dict(starts)
        ends = {p: max(e, starts.get(p, 0)) for p, e in ends.items()}
        self.report({"position": _json(starts), "ends": _json(ends), "error": None})
        reader = client.consumer(self.settings, f"duality-serve-{self.pipeline}-{uuid.uuid4().hex}")
        try:
            reader.assign([offsets.TopicPartition(self.topic, p, o) for p, o in starts.items()])
            while not self.stop.is_set():
                self._apply(
                    reader.consume(
                        num_messages=self.settings.serve_write_records, timeout=POLL_TIMEOUT_S
                    )
                )
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
        position = dict(self._position)
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
        self._position = position
        self.report({"position": _json(position), "applied": applied})

    def _watch(self) -> None:
        """Read the changelog's committed end every END_REFRESH_S (and its first offsets every
        START_REFRESH_S) until stopped; Kafka away reports `kafka_up` false."""
        next_starts = time.monotonic() + START_REFRESH_S
        while not self.stop.is_set():
            try:
                ends = offsets.end_offsets(self.settings, self.topic)
                if time.monotonic() >= next_starts:
                    self._starts = offsets.beginning_offsets(self.settings, self.topic)
                    next_starts = time.monotonic() + START_REFRESH_S
                self.report({"ends": _json(ends), "kafka_up": True})
            except Exception as error:  # Kafka away, the changelog not made yet
                log.debug("replica of %s: end offsets not read: %s", self.pipeline, error)
                self.report({"kafka_up": False})
            self.stop.wait(END_REFRESH_S)


def _json(position: Position) -> dict[str, int]:
    return {str(p): o for p, o in sorted(position.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duality.serve.writer", description=__doc__)
    parser.add_argument("pipeline")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--changelog-only", action="store_true", help="never from a snapshot")
    args = parser.parse_args(argv)
    process.die_with_parent()
    # The parent stops it (SIGTERM and Ctrl-C reach the whole process group): its write ends.
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    settings = Settings.from_env()
    spec = find_spec(settings, args.pipeline)
    stop = threading.Event()
    lock = threading.Lock()
    out = sys.stdout

    def report(message: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(message) + "\n")
            out.flush()

    def watch_parent() -> None:  # its standard input closes: the parent is stopping it
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=watch_parent, name="replica-parent", daemon=True).start()
    # The parent holds the store's lock (and passed it down): this process only writes.
    store = Store(args.folder / f"{spec.name}.sqlite", spec.changelog_topic, locked=False)
    try:
        Writer(settings, spec, store, report, stop, from_snapshot=not args.changelog_only).run()
    except BrokenPipeError:  # the parent is gone
        return 1
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
