"""Ground truth for stream tests, computed in plain Python from the source records.

Independent of duality's stream code: it reads the records back from the source topic and
applies the contract of DESIGN §7 (which records are bad, how late is defined, what each
aggregate means) record by record.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from duality.spec import PipelineSpec

Record = tuple[int, int, bytes | None, bytes | None]


def _ts_ms(text: Any) -> int | None:
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def _typed(kind: str, value: Any) -> bool:
    if kind in ("long", "int"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "double":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "timestamp":
        return _ts_ms(value) is not None
    return True


def required(spec: PipelineSpec) -> list[str]:
    fields = list(spec.source.key)
    fields += [a.field for a in spec.aggregates.values() if a.field and a.field not in fields]
    if spec.source.event_time and spec.source.event_time not in fields:
        fields.append(spec.source.event_time)
    return fields


def expected(spec: PipelineSpec, records: list[Record]) -> tuple[dict[tuple, dict], dict]:
    """(table, bad): the expected aggregates per key, and the reason kind per bad (p, offset)."""
    bad: dict[tuple[int, int], str] = {}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    stream_time: dict[int, int] = {}
    for partition, offset, _, value in sorted(records, key=lambda r: (r[0], r[1])):
        reason = None
        document: Any = None
        if value is None:
            reason = "null value"
        elif len(value) > spec.source.max_record_bytes:
            reason = "oversized"
        else:
            try:
                document = json.loads(value)
            except ValueError:
                reason = "malformed JSON"
            if reason is None and not isinstance(document, dict):
                reason = "not a JSON object"
        if reason is None:
            for field in required(spec):
                if document.get(field) is None:
                    reason = "missing field"
                    break
                if not _typed(spec.source.fields[field], document[field]):
                    reason = "wrong type"
                    break
        if reason is None and spec.window is not None:
            ts = _ts_ms(document[spec.source.event_time])
            assert ts is not None
            current = stream_time.get(partition)
            if current is not None and ts < current - spec.window.watermark_seconds * 1000:
                reason = "late event"
            else:
                stream_time[partition] = ts if current is None else max(current, ts)
        if reason is not None:
            bad[(partition, offset)] = reason
            continue
        key = tuple(document[f] for f in spec.source.key)
        if spec.window is not None:
            size = spec.window.size_seconds * 1000
            ts = _ts_ms(document[spec.source.event_time])
            assert ts is not None
            start = ts - ts % size
            key = (
                *key,
                datetime.fromtimestamp(start / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z"),
            )
        groups[key].append(document)

    table = {}
    for key, documents in groups.items():
        row: dict[str, Any] = {}
        for column, aggregate in spec.aggregates.items():
            values = [d[aggregate.field] for d in documents] if aggregate.field else []
            if aggregate.function == "count":
                row[column] = len(documents)
            elif aggregate.function == "sum":
                row[column] = sum(values)
            elif aggregate.function == "min":
                row[column] = min(values)
            elif aggregate.function == "max":
                row[column] = max(values)
            else:
                row[column] = sum(values) / len(values)
        table[key] = row
    return table, bad


def changelog_table(spec: PipelineSpec, latest: dict[bytes, dict]) -> dict[tuple, dict]:
    """The changelog's latest values, keyed like `expected`, aggregate columns only."""
    table = {}
    for raw_key, value in latest.items():
        key = tuple(value[c] for c in spec.key_columns)
        encoded = raw_key.decode()
        if len(spec.key_columns) == 1:
            assert encoded == str(key[0]), (raw_key, key)
        else:
            assert json.loads(encoded) == list(key), (raw_key, key)
        table[key] = {column: value[column] for column in spec.aggregates}
    return table


def assert_tables_equal(actual: dict[tuple, dict], wanted: dict[tuple, dict]) -> None:
    missing, extra = wanted.keys() - actual.keys(), actual.keys() - wanted.keys()
    assert not missing and not extra, f"keys missing: {list(missing)[:5]}, extra: {list(extra)[:5]}"
    wrong = []
    for key, row in wanted.items():
        for column, value in row.items():
            got = actual[key][column]
            if isinstance(value, float) or isinstance(got, float):
                ok = math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-9)
            else:
                ok = got == value
            if not ok:
                wrong.append((key, column, got, value))
    assert not wrong, f"{len(wrong)} wrong values, first: {wrong[:5]}"
