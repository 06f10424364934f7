"""Writing an Avro source's records in the Confluent wire format (`duality produce`, the demo):
the writer schema, registered in the settings' registry, and each record framed with its id.

A spec that lists `schema:` is written with a schema of those fields (each nullable, with a null
default, as the reader schema is), registered under the source's subject: registering the same
schema again returns its id, so producing twice adds no version. A spec without `schema:` is
written with its subject's latest version, which must exist."""

from __future__ import annotations

import dataclasses
import io
import struct
from datetime import datetime
from typing import TYPE_CHECKING, Any

import fastavro

from duality.avro import schema
from duality.avro.registry import NotFound, Registry
from duality.errors import UsageError

if TYPE_CHECKING:
    from duality.config import Settings
    from duality.spec import PipelineSpec

MAGIC = b"\x00"
NAMESPACE = "dev.duality"


def _record_name(pipeline: str) -> str:
    return "".join(part.capitalize() for part in pipeline.split("_")) + "Event"


def spec_schema(spec: PipelineSpec) -> dict[str, Any]:
    """The writer schema of a spec's `schema:`: a record named after the pipeline, each field
    nullable with a null default (a timestamp as `timestamp-millis`)."""
    latest = {"type": "record", "name": _record_name(spec.name), "namespace": NAMESPACE}
    return schema.reader_schema(spec.source.fields, {**latest, "fields": []})


@dataclasses.dataclass(frozen=True)
class AvroWriter:
    """Frames records of one writer schema, registered as `schema_id` under `subject`."""

    subject: str
    schema_id: int
    schema: dict[str, Any]
    # Each enum field's symbols: the only values it may be written with.
    symbols: dict[str, list[str]]
    # The writer's fields that may be written as null.
    nullable: frozenset[str]
    _parsed: Any = dataclasses.field(repr=False, compare=False, default=None)

    def frame(self, record: dict[str, Any]) -> bytes:
        """The record (ISO-8601 text for a timestamp, as the JSON workload has it) in the
        Confluent wire format: magic byte 0, the schema id (4 bytes, big-endian), the record."""
        return confluent_frame(self.schema_id, self._parsed, _avro_values(self.schema, record))


def confluent_frame(schema_id: int, parsed: Any, record: dict[str, Any]) -> bytes:
    """`record` written with the parsed schema `parsed` (fastavro's) as a Confluent frame:
    magic byte 0, the schema id (4 bytes, big-endian), the Avro binary record."""
    out = io.BytesIO()
    out.write(MAGIC + struct.pack(">I", schema_id))
    fastavro.schemaless_writer(out, parsed, record)
    return out.getvalue()


def _avro_values(writer: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """A timestamp field's ISO-8601 text as the datetime fastavro writes."""
    out = dict(record)
    for field in writer["fields"]:
        value = out.get(field["name"])
        if isinstance(value, str) and schema.kind(field["type"]) == "timestamp":
            out[field["name"]] = datetime.fromisoformat(value)
    return out


def writer_for(settings: Settings, spec: PipelineSpec) -> AvroWriter:
    """The writer of an Avro spec's records: its `schema:` registered under its subject, or
    the subject's latest version (refused when a field the workload cannot fill has no
    default). Errors name the setting (registry unreachable) or the field."""
    subject = spec.source.subject or f"{spec.source.topic}-value"
    registry = Registry(settings)
    if spec.source.avro is None or spec.source.avro.listed:  # None: loaded without registry
        if not spec.source.fields:
            raise UsageError(f"pipeline {spec.name}: its Avro source's columns are not loaded")
        written = spec_schema(spec)
        schema_id = registry.register(subject, written)
    else:
        try:
            latest = registry.version(subject)
        except NotFound:
            raise UsageError(
                f"pipeline {spec.name}: the schema registry has no subject {subject!r} to write "
                "with: list the fields under source.schema (`duality produce` then registers "
                "them), or register the subject's schema first"
            ) from None
        written, schema_id = latest.schema, latest.id
        for field in written["fields"]:
            if field["name"] not in spec.source.fields and "default" not in field:
                raise UsageError(
                    f"pipeline {spec.name}: field {field['name']!r} of subject {subject!r} "
                    f"(version {latest.version}) is no column and has no default, so "
                    "`duality produce` cannot write it; list the fields under source.schema"
                )
    symbols: dict[str, list[str]] = {}
    nullable = set()
    for field in written["fields"]:
        branches = field["type"] if isinstance(field["type"], list) else [field["type"]]
        if "null" in branches:
            nullable.add(field["name"])
        for branch in branches:
            if isinstance(branch, dict) and branch.get("type") == "enum":
                symbols[field["name"]] = list(branch["symbols"])
    return AvroWriter(
        subject,
        schema_id,
        written,
        symbols,
        frozenset(nullable),
        fastavro.parse_schema(written),
    )
