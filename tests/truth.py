"""Ground truth for stream tests, in plain Python from the source records read back (DESIGN §7);
for windows, the batches' offsets come from the checkpoint and the watermark is recomputed."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from duality.spec import PipelineSpec

Record = tuple[int, int, bytes | None, bytes | None]

# The tests' own meaning, in Python, of each expression of the specs this truth serves (the
# shipped product_sales and its copies); a spec using others has a truth of its own
# (tests/integration/spark/test_rich_pipeline.py).
EXPRESSIONS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "amount / quantity": lambda d: d["amount"] / d["quantity"],
    "unit_price >= 1": lambda d: d["unit_price"] >= 1,
}


def filtered(spec: PipelineSpec, records: list[Record]) -> int:
    """How many good records the spec's filter skips: neither counted nor dead-lettered."""
    skipped = 0
    for *_, value in records:
        reason, document = classify_record(spec, value)
        skipped += reason is None and not _kept(spec, document)
    return skipped


def _kept(spec: PipelineSpec, document: dict[str, Any]) -> bool:
    """Whether the spec's filter keeps a good record; adds its computed fields to `document`."""
    for name, expression in spec.computed_fields.items():
        document[name] = EXPRESSIONS[expression.text](document)
    where = spec.where_expression
    return where is None or EXPRESSIONS[where.text](document) is True


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
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "timestamp":
        return _ts_ms(value) is not None
    return True


@dataclasses.dataclass(frozen=True)
class Batch:
    """One micro-batch as the checkpoint's offset log records it."""

    end_offsets: dict[int, int]
    watermark_ms: int


def batches_from_checkpoint(checkpoint: Path, topic: str) -> list[Batch]:
    """Each micro-batch's end offsets of `topic` and recorded watermark, in batch order."""
    batches = []
    files = sorted(
        (f for f in (checkpoint / "offsets").iterdir() if f.name.isdigit()),
        key=lambda f: int(f.name),
    )
    assert [int(f.name) for f in files] == list(range(len(files))), "offset log was purged"
    for path in files:
        lines = path.read_text().splitlines()
        watermark = json.loads(lines[1])["batchWatermarkMs"]
        ends = next(json.loads(line)[topic] for line in lines[2:] if topic in line)
        batches.append(Batch({int(p): o for p, o in ends.items()}, watermark))
    return batches


def classify_record(spec: PipelineSpec, value: bytes | None) -> tuple[str | None, Any]:
    """(the kind of bad record or None, the parsed document): every source field the spec
    uses must be present with its type."""
    if value is None:
        return "null value", None
    if len(value) > spec.source.max_record_bytes:
        return "oversized", None
    try:
        # NaN and Infinity are not JSON, though Python accepts them by default.
        document = json.loads(value, parse_constant=_reject)
    except ValueError:
        return "malformed JSON", None
    if not isinstance(document, dict):
        return "not a JSON object", None
    for field in spec.required_fields:
        if document.get(field) is None:
            return "missing field", None
        if not _typed(spec.source.fields[field], document[field]):
            return "wrong type", None
    return None, document


def _reject(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def expected(
    spec: PipelineSpec, records: list[Record], batches: list[Batch] | None = None
) -> tuple[dict[tuple, dict], dict]:
    """(table, bad): the expected aggregates per key, and the reason kind per bad (p, offset).

    A windowed pipeline needs `batches`: a record is late when its window ends at or before
    the watermark of its micro-batch, the largest event time of the good records of earlier
    batches minus the spec's watermark delay.
    """
    bad: dict[tuple[int, int], str] = {}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    ordered = sorted(records, key=lambda r: (r[0], r[1]))
    if spec.window is None:
        phases = [ordered]
    else:
        assert batches is not None, "a windowed pipeline's truth needs the micro-batches"
        phases = [[] for _ in batches]
        for record in ordered:
            index = next(i for i, b in enumerate(batches) if record[1] < b.end_offsets[record[0]])
            phases[index].append(record)
    watermark = 0
    for index, phase in enumerate(phases):
        if spec.window is not None:
            assert batches is not None
            assert batches[index].watermark_ms == watermark, (index, batches[index], watermark)
        latest = None
        for partition, offset, _, value in phase:
            reason, document = classify_record(spec, value)
            if reason is None and not _kept(spec, document):
                continue  # filtered: neither counted nor dead-lettered
            if reason is None and spec.window is not None:
                ts = _ts_ms(document[spec.source.event_time])
                assert ts is not None
                latest = ts if latest is None else max(latest, ts)
                size = spec.window.size_seconds * 1000
                if ts - ts % size + size <= watermark:
                    reason = "late event"
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
        if spec.window is not None and latest is not None:
            watermark = max(watermark, latest - spec.window.watermark_seconds * 1000)

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
