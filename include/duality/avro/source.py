"""An Avro source resolved against its registry when its spec loads: the subject, the reader
schema the stream decodes every record into, and the columns (docs/streams.md#formats)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from duality.avro import schema
from duality.avro.registry import NotFound, Registry, authorization

if TYPE_CHECKING:
    from duality.config import Settings
    from duality.schema import FieldType


@dataclasses.dataclass(frozen=True)
class AvroSource:
    subject: str
    # The reader schema's JSON text, as the decoder parses it.
    reader: str
    # The spec's columns: its `schema:`, else the latest version's fields of a spec's types.
    columns: dict[str, FieldType]
    # Where they came from, e.g. "subject orders-value, version 3 (schema id 3)".
    origin: str
    # The latest version's fields that are no column (types a spec has no column for).
    left_out: tuple[str, ...] = ()
    # The registry's Confluent API, and the Authorization header for it (never shown).
    registry: str = ""
    authorization: str | None = dataclasses.field(default=None, repr=False)
    # Whether the columns are the spec's `schema:` (else the subject's latest version's).
    listed: bool = False


def resolve(
    settings: Settings, topic: str, subject: str | None, fields: dict[str, FieldType]
) -> AvroSource:
    """The source's subject (`<topic>-value` unless named) looked up in the registry: raises
    a UsageError naming the setting when the registry cannot be reached, ValueError naming the
    field when `fields` cannot read a version of the subject."""
    subject = subject or f"{topic}-value"
    registry = Registry(settings)
    try:
        numbers = registry.versions(subject)
    except NotFound as error:
        raise ValueError(str(error)) from None
    latest = registry.version(subject, numbers[-1])
    origin = f"subject {subject}, version {latest.version} (schema id {latest.id})"
    if not fields:
        columns, left_out = schema.columns(latest.schema)
        if not columns:
            raise ValueError(
                f"{origin} has no field of a type a spec column can have (string, long, int, "
                "double, boolean, timestamp)"
            )
        reader = json.dumps(latest.schema)
        return AvroSource(
            subject, reader, columns, origin, tuple(left_out), registry.url, authorization(settings)
        )
    versions = [latest if n == latest.version else registry.version(subject, n) for n in numbers]
    schema.check_compatible(fields, versions)
    reader = json.dumps(schema.reader_schema(fields, latest.schema))
    origin = f"the spec's schema, read from {origin}"
    return AvroSource(
        subject, reader, dict(fields), origin, (), registry.url, authorization(settings), True
    )
