"""A replica's store: one SQLite file per pipeline holding the table's rows and, in the same
write transaction as the rows, the next changelog offset of each partition applied (decision
36). Written by one process (the replica's writer), read by another (the API's), in WAL mode so
that readers never wait for the writer and each read sees one committed transaction."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import queue
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from duality.errors import UsageError
from duality.serve.keys import Position

# Seconds a new store waits for the lock of another `duality serve` to go.
LOCK_WAIT_S = 5.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (
    group_key TEXT NOT NULL,
    window_start TEXT NOT NULL,  -- '' when the table has no window
    changelog_key BLOB NOT NULL,
    value TEXT NOT NULL,         -- the changelog record's value, JSON
    partition INTEGER,           -- partition and offset null: a row of the published snapshot
    offset INTEGER,
    PRIMARY KEY (group_key, window_start)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS positions (
    partition INTEGER PRIMARY KEY,
    next_offset INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS about (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclasses.dataclass(frozen=True)
class Change:
    """A changelog record to apply: a row's new value, or None for a tombstone."""

    group_key: str
    window_start: str
    changelog_key: bytes
    value: bytes | None
    partition: int | None  # partition and offset None: a row of the published snapshot
    offset: int | None


# A row of the published snapshot: (group key, window start, changelog key, value as JSON).
SnapshotRow = tuple[str, str, bytes, str]


@dataclasses.dataclass(frozen=True)
class StoredRow:
    """A row as the replica holds it, with the changelog record it came from (its offset
    unknown for a row of the published snapshot)."""

    window_start: str
    value: dict[str, Any]
    partition: int | None
    offset: int | None


@dataclasses.dataclass(frozen=True)
class Read:
    """What one read transaction saw: the key's rows (one unless windowed) and the position."""

    rows: list[StoredRow]
    position: Position


class Store:
    """The SQLite file `path` of a replica of the changelog `topic`. The writer's connection is
    this object's; readers take one from a pool (a thread per request would otherwise open a
    connection per request).

    One `duality serve` per file: the API's process holds an exclusive lock on `<path>.lock`
    and passes it to its writer's process (`locked=False` there), so that a second `duality
    serve` on the same folder is refused while either of them lives."""

    def __init__(self, path: Path, topic: str, *, locked: bool = True) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.topic = path, topic
        self._lock = _take_lock(path) if locked else None
        self._readers: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._writer = self._connect()
        self._writer.executescript(_SCHEMA)
        found = self._writer.execute("SELECT value FROM about WHERE name = 'topic'").fetchone()
        if found is not None and found[0] != topic:
            # The spec now names another changelog: this file's rows are not its rows.
            self.clear()
        self._writer.execute("INSERT OR REPLACE INTO about VALUES ('topic', ?)", (topic,))

    @property
    def lock_fd(self) -> int | None:
        """The descriptor of the store's lock, for a child process to inherit."""
        return None if self._lock is None else self._lock.fileno()

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        connection.execute("PRAGMA journal_mode = WAL")
        # A commit survives the process's death (SIGKILL); only the machine's could lose the
        # last transactions, never split one (the rows and their offsets stay together).
        connection.execute("PRAGMA synchronous = NORMAL")
        connection.execute("PRAGMA busy_timeout = 5000")
        return connection

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        try:
            connection = self._readers.get_nowait()
        except queue.Empty:
            connection = self._connect()
        try:
            yield connection
        finally:
            self._readers.put(connection)

    def apply(self, changes: Iterable[Change], position: Position) -> int:
        """Apply `changes` and set the partitions' next offsets to `position`, in one
        transaction; the number of changes applied."""
        count = 0
        cursor = self._writer.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        try:
            for change in changes:
                count += 1
                if change.value is None:
                    cursor.execute(
                        "DELETE FROM rows WHERE group_key = ? AND window_start = ?",
                        (change.group_key, change.window_start),
                    )
                else:
                    cursor.execute(
                        "INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?, ?, ?)",
                        (
                            change.group_key,
                            change.window_start,
                            change.changelog_key,
                            change.value.decode(),
                            change.partition,
                            change.offset,
                        ),
                    )
            cursor.executemany(
                "INSERT OR REPLACE INTO positions VALUES (?, ?)", sorted(position.items())
            )
            cursor.execute("COMMIT")
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
        return count

    def load_snapshot(self, rows: Iterable[SnapshotRow], coverage: Position) -> int:
        """A new replica's rows from the published snapshot (no partition, no offset), with the
        changelog offsets it covers as the position and as its record, in one transaction;
        the rows loaded."""
        before = self._writer.total_changes
        cursor = self._writer.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        try:
            cursor.executemany("INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?, NULL, NULL)", rows)
            loaded = self._writer.total_changes - before
            cursor.executemany(
                "INSERT OR REPLACE INTO positions VALUES (?, ?)", sorted(coverage.items())
            )
            document = json.dumps({str(p): o for p, o in coverage.items()})
            cursor.execute("INSERT OR REPLACE INTO about VALUES ('snapshot', ?)", (document,))
            cursor.execute("COMMIT")
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
        return loaded

    def snapshot_coverage(self) -> Position:
        """The changelog offsets the snapshot it started from covered (none: it did not)."""
        found = self._writer.execute("SELECT value FROM about WHERE name = 'snapshot'").fetchone()
        return {} if found is None else {int(p): int(o) for p, o in json.loads(found[0]).items()}

    def position(self) -> Position:
        """The next offset of each partition applied (none: read from the start)."""
        with self._reader() as connection:
            rows = connection.execute("SELECT partition, next_offset FROM positions")
            return {int(p): int(o) for p, o in rows}

    def read(self, group_key: str, window_from: str = "", window_to: str = "") -> Read:
        """The rows of `group_key` (windows from `window_from` to `window_to`, inclusive, when
        given) and the position, seen by one read transaction."""
        with self._reader() as connection:
            connection.execute("BEGIN")
            try:
                query = (
                    "SELECT window_start, value, partition, offset FROM rows WHERE group_key = ?"
                    " AND window_start >= ?"
                )
                arguments: list[str] = [group_key, window_from]
                if window_to:
                    query += " AND window_start <= ?"
                    arguments.append(window_to)
                found = connection.execute(query + " ORDER BY window_start", arguments).fetchall()
                offsets = connection.execute("SELECT partition, next_offset FROM positions")
                position = {int(p): int(o) for p, o in offsets}
            finally:
                connection.execute("COMMIT")
        rows = [
            StoredRow(
                w, json.loads(v), None if p is None else int(p), None if o is None else int(o)
            )
            for w, v, p, o in found
        ]
        return Read(rows, position)

    def rows(self) -> dict[bytes, dict[str, Any]]:
        """Every row by its changelog key (tests compare them with the changelog)."""
        with self._reader() as connection:
            found = connection.execute("SELECT changelog_key, value FROM rows").fetchall()
        return {bytes(key): json.loads(value) for key, value in found}

    def count(self) -> int:
        with self._reader() as connection:
            return int(connection.execute("SELECT count(*) FROM rows").fetchone()[0])

    def prune(self, firsts: Position) -> int:
        """Drop the rows whose record lies below its partition's first offset still stored:
        retention deleted it (a windowed changelog's expired windows); the rows of the
        snapshot, once every record it covered is gone. The rows dropped."""
        covered = self.snapshot_coverage()
        before = self._writer.total_changes
        cursor = self._writer.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        for partition, first in firsts.items():
            cursor.execute(
                "DELETE FROM rows WHERE partition = ? AND offset < ?", (partition, first)
            )
        if covered and all(firsts.get(p, 0) >= offset for p, offset in covered.items()):
            cursor.execute("DELETE FROM rows WHERE offset IS NULL")
        cursor.execute("COMMIT")
        return self._writer.total_changes - before

    def clear(self) -> None:
        """Forget every row and position (the changelog was recreated)."""
        self._writer.executescript(
            "BEGIN; DELETE FROM rows; DELETE FROM positions; "
            "DELETE FROM about WHERE name = 'snapshot'; COMMIT;"
        )

    def close(self) -> None:
        while True:
            try:
                self._readers.get_nowait().close()
            except queue.Empty:
                break
        self._writer.close()
        if self._lock is not None:
            self._lock.close()


def _take_lock(path: Path) -> IO[str]:
    """The exclusive lock of `path`'s store, waited for LOCK_WAIT_S (a SIGKILLed serve's
    writer dies a moment after it)."""
    lock = open(path.with_name(path.name + ".lock"), "w")  # noqa: SIM115
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() >= deadline:
                lock.close()
                raise UsageError(
                    f"{path} is the store of another running `duality serve`: give this one a "
                    "folder of its own (DUALITY_SERVE_DIR)"
                ) from None
            time.sleep(0.1)
