"""A new replica's first rows from the pipeline's published Delta snapshot, read without Spark
(the table's log replayed by `snapshot.delta_log`, its Parquet files by pyarrow a batch at a
time, less the rows their deletion vectors delete), with the changelog offsets the snapshot
covers: the replica then reads the changelog from there. A snapshot holds no `_state` and no
record's place (partition, offset), so a row from it has none of them until the changelog
updates it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from duality.changelog import window_iso
from duality.config import Settings
from duality.serve.keys import TableKey
from duality.serve.store import SnapshotRow
from duality.snapshot import delta_log, dv_commit, publish
from duality.snapshot.coverage import Coverage
from duality.spec import PipelineSpec
from duality.storage import Location, arrow

log = logging.getLogger("duality.serve")


def published(
    settings: Settings, spec: PipelineSpec, topic_id: str
) -> tuple[Coverage, Iterator[SnapshotRow]] | None:
    """The published snapshot's coverage and its rows; None when there is none, it covers
    another incarnation of the changelog (not `topic_id`), or its log cannot be replayed
    without Spark."""
    path = spec.snapshot_path(settings)
    if not delta_log.is_table(path):
        return None
    found = publish.published_in_log(path)
    if found is None:
        return None
    if found.coverage.changelog_topic_id != topic_id:
        log.info("%s: the published snapshot covers an earlier changelog; not used", spec.name)
        return None
    state = delta_log.table_state(path, found.version)
    if state is None:
        return None
    return found.coverage, _rows(spec, path, state)


def _rows(spec: PipelineSpec, path: Location, state: delta_log.TableState) -> Iterator[SnapshotRow]:
    """Each live row of the version, as the changelog wrote its record: key fields (the window
    start as ISO text), aggregates, `_updated_at` in epoch milliseconds. A column at a time
    where it can (timestamps to milliseconds by pyarrow): a million rows is a new replica's
    start."""
    import pyarrow.parquet as pq

    key = TableKey.of(spec)
    fields = [name for name, _ in key.fields]
    # Timestamps are read as integers a column at a time: made into datetimes, they cost more
    # than the rest of the row.
    plain = [c for c in spec.snapshot_columns if c not in ("window_start", "_updated_at")]
    encode = json.JSONEncoder(separators=(",", ":")).encode
    # A text key is its own canonical form: asked per row, the general rule costs seconds.
    canonical = (
        (lambda values: values[0]) if [kind for _, kind in key.fields] == ["string"] else None
    ) or key.canonical
    for name, add in state.files.items():
        deleted = set(dv_commit.read_vector(path, add.get("deletionVector")))
        index = 0
        filesystem, where = arrow(path / unquote(name))
        data = pq.ParquetFile(where, filesystem=filesystem)
        for batch in data.iter_batches(batch_size=65_536, columns=spec.snapshot_columns):
            updated = _millis(batch.column("_updated_at"))
            windows = (
                [window_iso(ms) for ms in _millis(batch.column("window_start"))]
                if key.windowed
                else None
            )
            for row, document in enumerate(batch.select(plain).to_pylist()):
                if deleted and index + row in deleted:
                    continue
                values = [document[field] for field in fields]
                window = ""
                if windows is not None:
                    window = document["window_start"] = windows[row]
                document["_updated_at"] = updated[row]
                parts = [*values, window] if windows is not None else values
                raw = str(parts[0]) if len(parts) == 1 else encode(parts)
                yield canonical(values), window, raw.encode(), encode(document)
            index += batch.num_rows


def _millis(moments: Any) -> list[int]:
    """A timestamp column (any unit, with or without a time zone: UTC) as epoch milliseconds."""
    import pyarrow as pa

    per_milli = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}[moments.type.unit]
    counts = moments.view(pa.int64()).to_pylist()
    if per_milli is None:
        return [count * 1000 for count in counts]
    return [count // per_milli for count in counts]
