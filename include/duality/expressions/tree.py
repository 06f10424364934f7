"""The expression tree: the nodes parsing gives and checking types, `Expression` (a spec's
text with its tree), and `ExpressionError`, the spec error of every step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any


class ExpressionError(ValueError):
    """A spec error: the spec key (`fields.band`), the 1-based position in the expression when
    there is one, and what is wrong or expected."""

    def __init__(self, detail: str, key: str | None = None, position: int | None = None):
        self.detail, self.key, self.position = detail, key, position
        super().__init__(str(self))

    def __str__(self) -> str:
        where = "" if self.position is None else f"position {self.position}: "
        return f"{self.key}: {where}{self.detail}" if self.key else f"{where}{self.detail}"

    def at(self, key: str) -> ExpressionError:
        return ExpressionError(self.detail, key, self.position)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Node:
    """`pos` is the 1-based position of the node's token; `type` is "" until checked."""

    pos: int
    type: str = ""

    def children(self) -> Iterator[Node]:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, Node):
                    yield item

    def walk(self) -> Iterator[Node]:
        yield self
        for child in self.children():
            yield from child.walk()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Literal(Node):
    value: Any  # int, float, str, bool or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Field(Node):
    name: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unary(Node):
    op: str  # "-" or "not"
    operand: Node


@dataclasses.dataclass(frozen=True, kw_only=True)
class Binary(Node):
    op: str  # + - * / % = != < <= > >= and or
    left: Node
    right: Node


@dataclasses.dataclass(frozen=True, kw_only=True)
class In(Node):
    operand: Node
    options: tuple[Node, ...]
    negated: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Between(Node):
    operand: Node
    low: Node
    high: Node
    negated: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class IsNull(Node):
    operand: Node
    negated: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case(Node):
    branches: tuple[tuple[Node, Node], ...]  # (condition, value)
    default: Node | None = None

    def children(self) -> Iterator[Node]:
        for condition, value in self.branches:
            yield condition
            yield value
        if self.default is not None:
            yield self.default


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call(Node):
    name: str  # lower case
    args: tuple[Node, ...]


@dataclasses.dataclass(frozen=True)
class Expression:
    """A parsed expression: its text, the spec key it came from, and its tree (typed once
    `check` has run)."""

    text: str
    key: str
    tree: Node

    @property
    def type(self) -> str:
        return self.tree.type

    @property
    def fields(self) -> list[str]:
        """The field names it uses, in order of first use."""
        return list(dict.fromkeys(n.name for n in self.tree.walk() if isinstance(n, Field)))

    @property
    def field(self) -> str | None:
        """The field name when the expression is just a field, else None."""
        return self.tree.name if isinstance(self.tree, Field) else None

    def __str__(self) -> str:
        return self.text
