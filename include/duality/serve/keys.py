"""A pipeline's table key as a replica holds it, and the position token.

A changelog key (design §6) is the UTF-8 value of a single group field, or a JSON array of the
group fields with, for a windowed table, the window start (ISO-8601 UTC) last. A replica stores
each row under its group key in a canonical form (each field's value parsed as its type and
written back as text) and its window start, so that a key asked for as `42`, `042` or `42.0`
finds the row the stream wrote as `42`.

A position is the next changelog offset of each partition that a replica has applied; its
token is the position as URL-safe base64 of JSON, which a client sends back (`at=`) to read
nothing older than what it has seen.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from duality.errors import UsageError
from duality.spec import PipelineSpec

Position = dict[int, int]


class KeyMismatch(UsageError):
    """A key that does not fit the table's key type (the API answers 400)."""


class TokenError(UsageError):
    """A position token that is not one, or is another changelog's (the API answers 400)."""


@dataclasses.dataclass(frozen=True)
class TableKey:
    """The key of a pipeline's table: its group fields and their types, and whether a window
    start follows them."""

    pipeline: str
    fields: tuple[tuple[str, str], ...]  # (name, type) of each group field, in key order
    windowed: bool

    @classmethod
    def of(cls, spec: PipelineSpec) -> TableKey:
        types = spec.field_types
        # A key naming a joined table's column (`customers.tier`) is text in the changelog.
        fields = tuple((name, types.get(name, "string")) for name in spec.source.key)
        return cls(spec.name, fields, spec.window is not None)

    def describe(self) -> str:
        """The key as a user writes it: `product (string)`, or a JSON array of the fields."""
        named = ", ".join(f"{name} ({kind})" for name, kind in self.fields)
        return named if len(self.fields) == 1 else f"a JSON array of [{named}]"

    def decode(self, raw: bytes) -> tuple[str, str]:
        """(canonical group key, window start or '') of a changelog key."""
        text = raw.decode()
        parts: list[Any] = [text] if self._single_text() else json.loads(text)
        if not isinstance(parts, list) or len(parts) != len(self.fields) + self.windowed:
            raise ValueError(f"changelog key {text!r} is not a key of {self.pipeline}")
        window = str(parts[-1]) if self.windowed else ""
        return self._canonical(parts[: len(self.fields)]), window

    def parse(self, text: str) -> str:
        """The canonical group key of a key asked for: the value of a single group field, or a
        JSON array of the group fields' values; KeyMismatch naming the key type when it does
        not fit."""
        if len(self.fields) == 1:
            parts: Any = [text]
        else:
            try:
                parts = json.loads(text)
            except ValueError:
                parts = None
            if not isinstance(parts, list) or len(parts) != len(self.fields):
                raise KeyMismatch(self._unfit(text))
        try:
            return self._canonical(parts)
        except ValueError:
            raise KeyMismatch(self._unfit(text)) from None

    def _single_text(self) -> bool:
        return len(self.fields) == 1 and not self.windowed

    def canonical(self, parts: list[Any]) -> str:
        """The canonical group key of the group fields' values `parts` (ValueError when one
        is not of its field's type)."""
        return self._canonical(parts)

    def _canonical(self, parts: list[Any]) -> str:
        kinds = [kind for _, kind in self.fields]
        values = [_canonical(kind, value) for kind, value in zip(kinds, parts, strict=True)]
        return values[0] if len(values) == 1 else json.dumps(values, separators=(",", ":"))

    def _unfit(self, text: str) -> str:
        return f"key {text!r} does not fit the key of pipeline {self.pipeline}: {self.describe()}"


def _canonical(kind: str, value: Any) -> str:
    """`value` (text, or a JSON value) parsed as a field of type `kind`, written as text;
    ValueError when it is not one."""
    if value is None:
        raise ValueError("null key field")
    if kind in ("long", "int"):
        if isinstance(value, bool):
            raise ValueError("a boolean")
        if isinstance(value, int):
            return str(value)
        text = str(value).strip()
        try:
            return str(int(text))
        except ValueError:
            number = float(text)  # 42.0, 4.2e1; ValueError when not a number
        if not number.is_integer():
            raise ValueError("a fraction") from None
        return str(int(number))
    if kind == "double":
        if isinstance(value, bool):
            raise ValueError("boolean")
        number = float(value) if isinstance(value, int | float) else float(str(value).strip())
        if not math.isfinite(number):
            raise ValueError("not finite")
        return repr(number)
    if kind == "boolean":
        if isinstance(value, bool):
            return "true" if value else "false"
        word = str(value).strip().lower()
        if word not in ("true", "false"):
            raise ValueError("not a boolean")
        return word
    return value if isinstance(value, str) else json.dumps(value)


def token(topic: str, position: Mapping[int, int]) -> str:
    """The position token of `position` on the changelog `topic`."""
    document = {"topic": topic, "offsets": {str(p): o for p, o in sorted(position.items())}}
    text = json.dumps(document, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(text).decode().rstrip("=")


def parse_token(text: str, topic: str) -> Position:
    """The position a token holds; TokenError when it is not a token of `topic`."""
    try:
        padded = text + "=" * (-len(text) % 4)
        document = json.loads(base64.urlsafe_b64decode(padded.encode()))
        offsets = {int(p): int(o) for p, o in document["offsets"].items()}
        found = document["topic"]
    except (ValueError, TypeError, KeyError, AttributeError, binascii.Error):
        raise TokenError(f"at={text!r} is not a position token of a duality replica") from None
    if found != topic:
        raise TokenError(
            f"at= holds a position of the changelog {found!r}, not of {topic!r}: send a token "
            "that a query of this pipeline answered"
        )
    return offsets


def reached(position: Mapping[int, int], wanted: Mapping[int, int]) -> bool:
    """Whether `position` is at or past `wanted` on every partition `wanted` names."""
    return all(position.get(p, 0) >= offset for p, offset in wanted.items())
