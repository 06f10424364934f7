"""An Avro source's columns and reader schema, from its subject's versions in the registry.

Without `schema:`, the reader schema is the subject's latest version as the spec loads, and the
columns are its fields of a type a spec has (`columns`). With `schema:`, the reader schema is a
record of those fields, each nullable with a null default (a record whose writer lacks one
reads as one missing it, as a JSON record would), named like the latest version; each field
must read, by Avro's resolution, what every registered version of the subject writes there."""

from __future__ import annotations

import re
from typing import Any, cast

from duality.avro.registry import Version
from duality.schema import FIELD, FieldType

_PRIMITIVES: dict[str, FieldType] = {
    "string": "string",
    "long": "long",
    "int": "int",
    "double": "double",
    "float": "double",
    "boolean": "boolean",
}
_TIMESTAMPS = ("timestamp-millis", "timestamp-micros")
# What Avro's schema resolution lets a reader of each kind read (besides its own kind).
_PROMOTED: dict[str, tuple[str, ...]] = {
    "long": ("int",),
    "double": ("int", "long"),
    "timestamp": ("long",),
}
_AVRO_OF: dict[str, Any] = {
    "string": "string",
    "long": "long",
    "int": "int",
    "double": "double",
    "boolean": "boolean",
    "timestamp": {"type": "long", "logicalType": "timestamp-millis"},
}


def kind(avro: Any) -> str | None:
    """The spec type an Avro field type reads as, a nullable union's too; None if none does.
    Avro's `float` reads as double, an enum as string, a long of a timestamp logical type as
    timestamp."""
    if isinstance(avro, list):
        branches = [b for b in avro if b != "null"]
        return kind(branches[0]) if len(branches) == 1 else None
    if isinstance(avro, dict):
        if avro.get("type") == "long" and avro.get("logicalType") in _TIMESTAMPS:
            return "timestamp"
        if avro.get("type") == "enum":
            return "string"
        return kind(avro.get("type")) if isinstance(avro.get("type"), str) else None
    return _PRIMITIVES.get(avro) if isinstance(avro, str) else None


def _fields(schema: dict[str, Any]) -> list[dict[str, Any]]:
    if schema.get("type") != "record":
        raise ValueError(f"the subject's schema is an Avro {schema.get('type')}, not a record")
    return cast(list[dict[str, Any]], schema["fields"])


def columns(schema: dict[str, Any]) -> tuple[dict[str, FieldType], list[str]]:
    """The spec columns of a record schema's fields, and the fields left out (their type is
    none a spec has, or their name is not one a spec field may have)."""
    found: dict[str, FieldType] = {}
    left_out = []
    for field in _fields(schema):
        name, found_kind = field["name"], kind(field["type"])
        if found_kind is None or not re.match(FIELD, name) or name.startswith("_"):
            left_out.append(name)
        else:
            found[name] = cast(FieldType, found_kind)
    return found, left_out


def reader_schema(fields: dict[str, FieldType], latest: dict[str, Any]) -> dict[str, Any]:
    """The reader schema of a spec's `schema:`: named like the subject's latest version, each
    field nullable with a null default; a timestamp keeps the latest version's unit."""
    written = {f["name"]: f["type"] for f in _fields(latest)}
    out = []
    for name, spec_type in fields.items():
        avro = _AVRO_OF[spec_type]
        if spec_type == "timestamp" and kind(written.get(name)) == "timestamp":
            branch = written[name]
            if isinstance(branch, list):
                branch = next(b for b in branch if b != "null")
            avro = branch
        out.append({"name": name, "type": ["null", avro], "default": None})
    schema: dict[str, Any] = {"type": "record", "name": latest["name"], "fields": out}
    if latest.get("namespace"):
        schema["namespace"] = latest["namespace"]
    return schema


def check_compatible(fields: dict[str, FieldType], versions: list[Version]) -> None:
    """Refuse (ValueError naming the field) a spec field that no version of the subject has,
    or that cannot read what a version writes there."""
    seen: set[str] = set()
    for version in versions:
        for field in _fields(version.schema):
            name = field["name"]
            if name not in fields:
                continue
            seen.add(name)
            reader, writer = fields[name], kind(field["type"])
            if writer == reader or writer in _PROMOTED.get(reader, ()):
                continue
            if reader == "long" and writer == "timestamp":
                continue
            written = writer or f"Avro {field['type']!r}"
            raise ValueError(
                f"schema.{name} is a {reader}, but version {version.version} of subject "
                f"{version.subject!r} writes {name} as {written}: Avro's schema resolution "
                f"cannot read one as the other; make {name} a {writer or 'field of its type'} "
                "or leave schema: out to take the subject's columns"
            )
    missing = [name for name in fields if name not in seen]
    if missing:
        subject = versions[-1].subject if versions else "?"
        known = sorted({f["name"] for v in versions for f in _fields(v.schema)})
        raise ValueError(
            f"schema.{missing[0]} is in no version of subject {subject!r} "
            f"(its fields: {', '.join(known)})"
        )
