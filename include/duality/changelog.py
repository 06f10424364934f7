"""The changelog topic's record format (DESIGN §6) and reading its latest value per key.

Key: the UTF-8 value of a single group field; a JSON array for several fields or a window (the
window start, ISO-8601 UTC, last). Value: a JSON object with the key fields, the aggregate
columns, `_updated_at` (epoch ms) and `_state`, the partial aggregates (counts, sums, minima,
maxima) from which the stream restores its state exactly; null is a tombstone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from duality.config import Settings
from duality.kafka import records
from duality.spec import PipelineSpec


def window_iso(epoch_ms: int) -> str:
    """Epoch milliseconds as ISO-8601 UTC to the millisecond ('2026-11-21T10:00:00.000Z')."""
    moment = datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def encode_key(spec: PipelineSpec, key: Sequence[Any]) -> bytes:
    """`key` holds the group fields' values, then the window start (ISO text) when windowed."""
    if len(key) == 1:
        return str(key[0]).encode()
    return json.dumps(list(key), separators=(",", ":")).encode()


def encode_value(
    spec: PipelineSpec,
    key: Sequence[Any],
    aggregates: Mapping[str, Any],
    state: Mapping[str, Any],
    updated_at_ms: int,
) -> bytes:
    value: dict[str, Any] = dict(zip(spec.key_columns, key, strict=True))
    value.update(aggregates)
    value["_updated_at"] = updated_at_ms
    value["_state"] = dict(state)
    return json.dumps(value, separators=(",", ":")).encode()


def read_latest(
    settings: Settings, spec: PipelineSpec, *, timeout: float = 300.0
) -> dict[bytes, dict[str, Any]]:
    """The latest live value per key of the changelog (read_committed).

    Tombstones remove their key. Keys are the raw changelog keys.
    """
    latest: dict[bytes, dict[str, Any]] = {}
    for message in records.read_to_end(settings, spec.changelog_topic, timeout=timeout):
        key, value = message.key(), message.value()
        if key is None:
            continue
        if value is None:
            latest.pop(key, None)
        else:
            latest[key] = json.loads(value)
    return latest
