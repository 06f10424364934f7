"""What a spec's `schema:` may say, for a source and a joined table alike: the field types and
their Spark SQL types, the types a key may have, and what a field name may be."""

from __future__ import annotations

import re
from typing import Literal

FIELD = r"^[A-Za-z_][A-Za-z0-9_]*$"
FieldType = Literal["string", "long", "int", "double", "boolean", "timestamp"]
# Each field type as a Spark SQL type.
SQL_TYPES = {
    "string": "string",
    "long": "bigint",
    "int": "int",
    "double": "double",
    "boolean": "boolean",
    "timestamp": "timestamp",
}
KEY_TYPES = ("string", "long", "int", "boolean")


def field_names(value: dict[str, FieldType]) -> dict[str, FieldType]:
    for name in value:
        if not re.match(FIELD, name):
            raise ValueError(f"field name {name!r} must match {FIELD}")
        if name.startswith("_"):
            raise ValueError(f"field name {name!r}: names starting with _ are duality's own")
    return value
