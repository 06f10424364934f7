"""Demo workloads (`duality produce`): events for a pipeline's source with Zipf-skewed keys, an
optional rate limit, and a fraction of bad records of every kind the stream must dead-letter;
and the rows of a table a pipeline joins, keyed by the values its events carry (`duality demo`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from duality.avro.writer import AvroWriter, writer_for
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, records, topics
from duality.spec import PipelineSpec

BAD_KINDS = (
    "malformed",
    "trailing",
    "missing_key",
    "wrong_type",
    "non_finite",
    "null_value",
    "oversized",
    "late",
)
# An Avro source's bad records: frames the decoder refuses (decision 38), then a decoded record
# the stream refuses as it would a JSON one.
AVRO_BAD_KINDS = (
    "short_frame",
    "no_magic_byte",
    "unknown_schema_id",
    "undecodable",
    "missing_key",
    "null_value",
    "late",
)
# A schema id no registry hands out soon.
UNKNOWN_SCHEMA_ID = 2_000_000_000
# A JSON object followed by more text, each a way a producer can get it wrong.
_TRAILING = (" {}", "x", ',{"second":1}', "\n]")
# Doubles that JSON cannot hold: literals JSON does not have, strings, and an overflow.
_NON_FINITE = ("NaN", "Infinity", "-Infinity", '"NaN"', '"Infinity"', "1e999")
# The values of an event's string field (not its key): `<field>-000` to `<field>-999`.
STRING_VALUES = 1000


def string_value(field: str, index: int) -> str:
    """The `index`th value the workload gives string field `field` (`customer-007`)."""
    return f"{field}-{index:03d}"


@dataclasses.dataclass
class WorkloadReport:
    topic: str
    produced: int = 0
    valid: int = 0
    bad: Counter[str] = dataclasses.field(default_factory=Counter)
    keys: int = 0
    seconds: float = 0.0
    # An Avro workload's writer schema: "subject orders_avro-value, schema id 3".
    schema: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "produced": self.produced,
            "valid": self.valid,
            "bad": dict(self.bad),
            "keys": self.keys,
            "seconds": round(self.seconds, 3),
            **({"schema": self.schema} if self.schema else {}),
        }


def _key_value(field_type: str, index: int, field: str) -> Any:
    if field_type in ("long", "int"):
        return index
    if field_type == "boolean":
        return index % 2 == 0
    return f"{field}-{index:06d}"


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Workload:
    """Generates one pipeline's source records; deterministic for a seed (but for timestamps)."""

    def __init__(
        self,
        spec: PipelineSpec,
        *,
        keys: int,
        zipf: float,
        bad_fraction: float,
        seed: int | None = None,
        values: Mapping[str, Sequence[Any]] | None = None,
        writer: AvroWriter | None = None,
    ):
        """`writer`: an Avro source's records are framed with it (else written as JSON)."""
        if keys < 1:
            raise UsageError(f"--keys must be at least 1, got {keys}")
        if zipf < 0:
            raise UsageError(f"--zipf must be 0 (uniform) or more, got {zipf}")
        if not 0 <= bad_fraction <= 1:
            raise UsageError(f"--bad-fraction must be between 0 and 1, got {bad_fraction}")
        self.spec = spec
        self.keys = keys
        self.values = dict(values or {})  # a field's values to draw from, for a spec's filter
        self.writer = writer
        if writer is not None:  # an enum field is written with its symbols
            self.values = {**writer.symbols, **self.values}
        self.bad_fraction = bad_fraction
        self.rng = np.random.default_rng(seed)
        weights = 1.0 / np.arange(1, keys + 1) ** zipf
        self.key_probabilities = weights / weights.sum()
        fields = spec.source.fields
        # The records' Kafka key: the first key field, or the first field of a source keyed by
        # a joined table's column (`key: customers.tier`), which no record carries to leave out.
        first_key = spec.source.key[0]
        self.key_field = first_key if first_key in fields else next(iter(fields))
        self.doubles = [f for f, t in fields.items() if t == "double" and f in spec.required_fields]
        self.kinds = [
            k
            for k in (BAD_KINDS if writer is None else AVRO_BAD_KINDS)
            if (k != "late" or spec.window is not None)
            and (k != "non_finite" or self.doubles)
            and (k != "missing_key" or first_key in fields)
            and (k != "missing_key" or writer is None or first_key in writer.nullable)
        ]
        self.typed_fields = [
            f
            for f, t in fields.items()
            if t in ("long", "int", "double") and f not in spec.source.key
        ]

    def _valid(self, key_index: int, now: datetime) -> dict[str, Any]:
        record: dict[str, Any] = {}
        for field, kind in self.spec.source.fields.items():
            if field in self.spec.source.key:
                record[field] = _key_value(kind, key_index, field)
            elif field in self.values:
                choices = self.values[field]
                record[field] = choices[int(self.rng.integers(0, len(choices)))]
            elif kind in ("long", "int"):
                record[field] = int(self.rng.integers(1, 10))
            elif kind == "double":
                record[field] = round(float(self.rng.uniform(0, 500)), 2)
            elif kind == "boolean":
                record[field] = bool(self.rng.integers(0, 2))
            elif kind == "timestamp":
                jitter = float(self.rng.uniform(0, 30))  # a little disorder, inside any watermark
                record[field] = _iso(now - timedelta(seconds=jitter))
            else:
                record[field] = string_value(field, int(self.rng.integers(0, STRING_VALUES)))
        return record

    def _bad(self, kind: str, record: dict[str, Any]) -> bytes | None:
        spec = self.spec
        if kind == "malformed":
            return json.dumps(record)[:-7].encode()  # cut off mid-object
        if kind == "trailing":
            tail = _TRAILING[int(self.rng.integers(0, len(_TRAILING)))]
            return (json.dumps(record) + tail).encode()
        if kind == "non_finite":
            field = self.doubles[0]
            literal = _NON_FINITE[int(self.rng.integers(0, len(_NON_FINITE)))]
            record[field] = "__non_finite__"
            return json.dumps(record).replace('"__non_finite__"', literal).encode()
        if kind == "missing_key":
            record.pop(spec.source.key[0])
        elif kind == "wrong_type":
            target = self.typed_fields[0] if self.typed_fields else spec.source.key[0]
            record[target] = "not-a-number" if target in self.typed_fields else {"nested": 1}
        elif kind == "null_value":
            return None
        elif kind == "oversized":
            record["_padding"] = "x" * (spec.source.max_record_bytes + 1)
        elif kind == "late":
            assert spec.window is not None and spec.source.event_time is not None
            lateness = spec.window.watermark_seconds + 2 * spec.window.size_seconds
            late = datetime.now(UTC) - timedelta(seconds=lateness)
            record[spec.source.event_time] = _iso(late)
        return json.dumps(record).encode()

    def _bad_avro(self, kind: str, record: dict[str, Any]) -> bytes | None:
        writer = self.writer
        assert writer is not None
        if kind == "null_value":
            return None
        if kind == "missing_key":
            record[self.spec.source.key[0]] = None
        if kind == "late":
            self._bad("late", record)  # its event time moved back, then framed as Avro
        frame = writer.frame(record)
        if kind == "short_frame":
            return frame[: int(self.rng.integers(0, 5))]
        if kind == "no_magic_byte":
            return b"\x01" + frame[1:]
        if kind == "unknown_schema_id":
            return b"\x00" + UNKNOWN_SCHEMA_ID.to_bytes(4, "big") + frame[5:]
        if kind == "undecodable":
            return frame + b"\x00"  # bytes after the record
        return frame

    def _encode(self, record: dict[str, Any]) -> bytes:
        if self.writer is not None:
            return self.writer.frame(record)
        return json.dumps(record).encode()

    def records(self, count: int) -> list[tuple[bytes | None, bytes | None, str]]:
        """`count` records as (key, value, kind) where kind is 'valid' or a bad kind."""
        indexes = self.rng.choice(self.keys, size=count, p=self.key_probabilities)
        bad_draws = self.rng.random(count) < self.bad_fraction
        kinds = self.rng.integers(0, len(self.kinds), size=count)
        key_field = self.key_field
        now = datetime.now(UTC)
        out: list[tuple[bytes | None, bytes | None, str]] = []
        for i in range(count):
            record = self._valid(int(indexes[i]), now)
            key = str(record[key_field]).encode()
            if bad_draws[i]:
                kind = self.kinds[int(kinds[i])]
                bad = self._bad if self.writer is None else self._bad_avro
                out.append((key, bad(kind, record), kind))
            else:
                out.append((key, self._encode(record), "valid"))
        return out


def produce(
    settings: Settings,
    spec: PipelineSpec,
    *,
    events: int,
    keys: int,
    zipf: float = 1.1,
    bad_fraction: float = 0.02,
    rate: float | None = None,
    seed: int | None = None,
    partitions: int = 6,
    progress: Callable[[int], None] | None = None,
    values: Mapping[str, Sequence[Any]] | None = None,
) -> WorkloadReport:
    """Produce `events` records to the spec's source topic (created if missing). An Avro
    source's are in the Confluent wire format, their schema registered (`avro.writer`)."""
    if events < 0:
        raise UsageError(f"--events must be 0 or more, got {events}")
    if rate is not None and rate <= 0:
        raise UsageError(f"--rate must be positive, got {rate}")
    writer = writer_for(settings, spec) if spec.source.format == "avro" else None
    workload = Workload(
        spec,
        keys=keys,
        zipf=zipf,
        bad_fraction=bad_fraction,
        seed=seed,
        values=values,
        writer=writer,
    )
    topic = spec.source.topic
    topics.create_topic(settings, topic, partitions, exist_ok=True)
    producer = client.producer(settings, queue_buffering_max_messages=500_000)
    report = WorkloadReport(topic=topic, keys=keys)
    if writer is not None:
        report.schema = f"subject {writer.subject}, schema id {writer.schema_id}"
    start = time.monotonic()
    chunk = 10_000 if rate is None else max(1, int(rate // 10))
    produced = 0
    while produced < events:
        batch = workload.records(min(chunk, events - produced))
        for key, value, kind in batch:
            records.send(producer, topic, key=key, value=value)
            if kind == "valid":
                report.valid += 1
            else:
                report.bad[kind] += 1
        produced += len(batch)
        producer.poll(0)
        if progress is not None:
            progress(produced)
        if rate is not None:
            # Pace the producer: sleep until the moment `produced` events are due.
            due = start + produced / rate
            time.sleep(max(0.0, due - time.monotonic()))
    undelivered = producer.flush(120)
    if undelivered:
        raise RuntimeError(f"{undelivered} records to {topic} were not delivered")
    report.produced = produced
    report.seconds = time.monotonic() - start
    return report


def produce_table(
    settings: Settings,
    spec: PipelineSpec,
    *,
    rows: int = STRING_VALUES,
    values: Mapping[str, Sequence[Any]] | None = None,
    seed: int | None = None,
    partitions: int = 3,
) -> WorkloadReport:
    """Rows of the table `spec` joins, for the events its workload makes: the join's `on` is a
    string source field, whose values are `<field>-000` to `<field>-999`; the first `rows` of
    them get a row (the others none: an inner join finds nothing for their events), its other
    columns drawn from `values`, or made as an event's are. To the table's topic, created
    compacted when missing; producing again writes the same rows (for a seed)."""
    joined = spec.joined
    if joined is None:
        raise UsageError(f"pipeline {spec.name} joins no table")
    if joined.pipeline is not None:
        raise UsageError(
            f"table {joined.name} of pipeline {spec.name} is pipeline {joined.pipeline}'s: its "
            "stream writes it"
        )
    on = joined.on.text.strip()
    if spec.source.fields.get(on) != "string" or on in spec.source.key:
        raise UsageError(
            f"pipeline {spec.name} joins on {joined.on.text!r}: the demo's table rows are for "
            "a join on a string field of the source that is not its key"
        )
    if not 0 <= rows <= STRING_VALUES:
        raise UsageError(f"rows must be between 0 and {STRING_VALUES}, got {rows}")
    choices = dict(values or {})
    rng = np.random.default_rng(seed)
    topics.create_topic(
        settings, joined.topic, partitions, config={"cleanup.policy": "compact"}, exist_ok=True
    )
    producer = client.producer(settings)
    start = time.monotonic()
    now = _iso(datetime.now(UTC))
    for index in range(rows):
        row: dict[str, Any] = {}
        for column, kind in joined.columns.items():
            if column == joined.key:
                row[column] = string_value(on, index)
            elif column in choices:
                row[column] = choices[column][int(rng.integers(0, len(choices[column])))]
            elif kind in ("long", "int"):
                row[column] = int(rng.integers(1, 10))
            elif kind == "double":
                row[column] = round(float(rng.uniform(0, 500)), 2)
            elif kind == "boolean":
                row[column] = bool(rng.integers(0, 2))
            elif kind == "timestamp":
                row[column] = now
            else:
                row[column] = string_value(column, int(rng.integers(0, STRING_VALUES)))
        records.send(producer, joined.topic, key=str(row[joined.key]), value=json.dumps(row))
        producer.poll(0)
    undelivered = producer.flush(120)
    if undelivered:
        raise RuntimeError(f"{undelivered} records to {joined.topic} were not delivered")
    return WorkloadReport(
        topic=joined.topic,
        produced=rows,
        valid=rows,
        keys=rows,
        seconds=time.monotonic() - start,
    )
