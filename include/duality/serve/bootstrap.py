"""A new replica's first rows from the pipeline's published Delta snapshot, read without Spark
(the table's log replayed by `snapshot.delta_log`, its Parquet files by pyarrow, less the rows
their deletion vectors delete), with the changelog offsets the snapshot covers: the replica
then reads the changelog from there. A snapshot holds no `_state` and no record offsets, so a
row from it has neither until the changelog updates it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from duality.changelog import window_iso
from duality.config import Settings
from duality.partitioning import key_partition
from duality.serve.keys import TableKey
from duality.serve.store import Change
from duality.snapshot import delta_log, dv_commit, publish
from duality.snapshot.coverage import Coverage
from duality.spec import PipelineSpec

log = logging.getLogger("duality.serve")


def published(
    settings: Settings, spec: PipelineSpec, topic_id: str
) -> tuple[Coverage, Iterator[Change]] | None:
    """The published snapshot's coverage and its rows as changes to apply; None when there is
    none, it covers another incarnation of the changelog (not `topic_id`), or its log cannot be
    replayed without Spark."""
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
    return found.coverage, _changes(spec, path, state, len(found.coverage.changelog))


def _changes(
    spec: PipelineSpec, path: Path, state: delta_log.TableState, partitions: int
) -> Iterator[Change]:
    import pyarrow.parquet as pq

    key = TableKey.of(spec)
    for name, add in state.files.items():
        deleted = dv_commit.read_vector(path, add.get("deletionVector"))
        table = pq.read_table(path / unquote(name), columns=spec.snapshot_columns)
        for index, row in enumerate(table.to_pylist()):
            if index in deleted:
                continue
            yield _change(spec, key, row, partitions)


def _millis(moment: Any) -> int:
    if isinstance(moment, datetime):
        aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
        return round(aware.timestamp() * 1000)
    return int(moment)


def _change(spec: PipelineSpec, key: TableKey, row: dict[str, Any], partitions: int) -> Change:
    """A snapshot row as the changelog wrote its record: key fields (the window start as ISO
    text), aggregates, `_updated_at` in epoch milliseconds."""
    values = [row[name] for name, _ in key.fields]
    window = window_iso(_millis(row["window_start"])) if key.windowed else ""
    parts: list[Any] = [*values, window] if key.windowed else values
    raw = (str(parts[0]) if len(parts) == 1 else json.dumps(parts, separators=(",", ":"))).encode()
    document = {**dict(zip(spec.key_columns, parts, strict=True))}
    document.update({column: row[column] for column in spec.aggregates})
    document["_updated_at"] = _millis(row["_updated_at"])
    group_key, _ = key.decode(raw)
    value = json.dumps(document, separators=(",", ":")).encode()
    return Change(group_key, window, raw, value, key_partition(raw, partitions), None)
