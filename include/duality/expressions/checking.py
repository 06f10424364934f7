"""Type checking: the types, functions and aggregates of the language, and `check`, which types
a tree against a scope of field types or raises an ExpressionError naming the position."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from duality.expressions.parsing import KEYWORDS, parse
from duality.expressions.tree import (
    Between,
    Binary,
    Call,
    Case,
    Expression,
    ExpressionError,
    Field,
    In,
    IsNull,
    Literal,
    Node,
    Unary,
)

NUMERIC = ("int", "long", "double")
# name: (fewest, most arguments; None for any number)
FUNCTIONS: dict[str, tuple[int, int | None]] = {
    "coalesce": (1, None),
    "abs": (1, 1),
    "round": (1, 2),
    "floor": (1, 1),
    "ceil": (1, 1),
    "lower": (1, 1),
    "upper": (1, 1),
    "length": (1, 1),
    "substr": (2, 3),
    "concat": (1, None),
}
AGGREGATES = (
    "count", "sum", "min", "max", "avg", "count_distinct", "latest", "earliest", "stddev",
    "count_if",
)  # fmt: skip
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1


def unify(a: str, b: str) -> str | None:
    """The type both fit in, or None: null fits anything, int in long, int and long in double."""
    if a == b or b == "null":
        return a
    if a == "null":
        return b
    if a in NUMERIC and b in NUMERIC:
        return "double" if "double" in (a, b) else "long"
    return None


class _Checker:
    def __init__(self, scope: Mapping[str, str], key: str, unknown: Callable[[str], str] | None):
        self.scope, self.key, self.unknown = scope, key, unknown

    def fail(self, node: Node, detail: str) -> ExpressionError:
        return ExpressionError(detail, self.key, node.pos)

    def want(self, node: Node, allowed: tuple[str, ...], what: str) -> None:
        if node.type not in (*allowed, "null"):
            raise self.fail(node, f"{what}, got a {node.type}")

    def unify_all(self, node: Node, items: list[Node], what: str) -> str:
        kind = "null"
        for item in items:
            joined = unify(kind, item.type)
            if joined is None:
                raise self.fail(item, f"{what}: a {item.type} does not go with a {kind}")
            kind = joined
        return kind

    def check(self, node: Node) -> Node:
        method = getattr(self, f"_{type(node).__name__.lower()}")
        return method(node)

    def _literal(self, node: Literal) -> Node:
        value = node.value
        if value is None:
            kind = "null"
        elif isinstance(value, bool):
            kind = "boolean"
        elif isinstance(value, int):
            if not LONG_MIN <= value <= LONG_MAX:
                raise self.fail(node, f"the integer {value} does not fit in a long")
            kind = "long"
        elif isinstance(value, float):
            if value != value or abs(value) == float("inf"):
                raise self.fail(node, "the number does not fit in a double")
            kind = "double"
        else:
            kind = "string"
        return dataclasses.replace(node, type=kind)

    def _field(self, node: Field) -> Node:
        if node.name not in self.scope:
            if node.name.lower() in KEYWORDS:
                raise self.fail(node, f"unexpected keyword {node.name!r}")
            detail = self.unknown(node.name) if self.unknown else ""
            known = ", ".join(self.scope) or "none"
            raise self.fail(node, detail or f"unknown field {node.name!r} (known: {known})")
        return dataclasses.replace(node, type=self.scope[node.name])

    def _unary(self, node: Unary) -> Node:
        operand = self.check(node.operand)
        if node.op == "not":
            self.want(operand, ("boolean",), "'not' needs a boolean")
            kind = "boolean"
        else:
            self.want(operand, NUMERIC, "'-' needs a number")
            kind = "long" if operand.type == "int" else operand.type
        return dataclasses.replace(node, operand=operand, type=kind)

    def _binary(self, node: Binary) -> Node:
        left, right = self.check(node.left), self.check(node.right)
        op = node.op
        if op in ("and", "or"):
            for side in (left, right):
                self.want(side, ("boolean",), f"'{op}' needs booleans")
            kind = "boolean"
        elif op in ("=", "!=", "<", "<=", ">", ">="):
            if unify(left.type, right.type) is None:
                raise self.fail(node, f"'{op}' cannot compare a {left.type} with a {right.type}")
            kind = "boolean"
        else:
            for side in (left, right):
                if side.type not in (*NUMERIC, "null"):
                    raise self.fail(
                        node, f"'{op}' needs numbers, got a {left.type} and a {right.type}"
                    )
            joined = unify(left.type, right.type)
            kind = "double" if op == "/" and joined != "null" else joined or "null"
            kind = "long" if kind == "int" else kind
        return dataclasses.replace(node, left=left, right=right, type=kind)

    def _in(self, node: In) -> Node:
        operand = self.check(node.operand)
        options = tuple(self.check(o) for o in node.options)
        self.unify_all(node, [operand, *options], "'in' compares values of one type")
        return dataclasses.replace(node, operand=operand, options=options, type="boolean")

    def _between(self, node: Between) -> Node:
        parts = [self.check(n) for n in (node.operand, node.low, node.high)]
        self.unify_all(node, parts, "'between' compares values of one type")
        operand, low, high = parts
        return dataclasses.replace(node, operand=operand, low=low, high=high, type="boolean")

    def _isnull(self, node: IsNull) -> Node:
        return dataclasses.replace(node, operand=self.check(node.operand), type="boolean")

    def _case(self, node: Case) -> Node:
        branches = []
        for condition, value in node.branches:
            condition = self.check(condition)
            self.want(condition, ("boolean",), "a 'when' condition must be a boolean")
            branches.append((condition, self.check(value)))
        default = None if node.default is None else self.check(node.default)
        values = [v for _, v in branches] + ([default] if default else [])
        kind = self.unify_all(node, values, "the branches of 'case' must have one type")
        return dataclasses.replace(node, branches=tuple(branches), default=default, type=kind)

    def _call(self, node: Call) -> Node:
        name = node.name
        if name not in FUNCTIONS:
            if name in AGGREGATES:
                raise self.fail(
                    node,
                    f"{name}() is an aggregate: it may only be a whole aggregate, as in "
                    f"`total: {name}(...)`, not part of an expression",
                )
            known = ", ".join(sorted(FUNCTIONS))
            raise self.fail(node, f"unknown function {name!r} (known: {known})")
        fewest, most = FUNCTIONS[name]
        if not fewest <= len(node.args) <= (most if most is not None else len(node.args)):
            count = f"{fewest}" if fewest == most else f"{fewest} to {most}"
            count = f"at least {fewest}" if most is None else count
            plural = "" if count == "1" else "s"
            raise self.fail(node, f"{name}() takes {count} argument{plural}, got {len(node.args)}")
        args = tuple(self.check(a) for a in node.args)
        first = args[0]
        if name == "coalesce":
            kind = self.unify_all(node, list(args), "coalesce() needs arguments of one type")
        elif name in ("abs", "floor", "ceil", "round"):
            self.want(first, NUMERIC, f"{name}() needs a number")
            kind = first.type if name in ("abs", "round") else "long"
            kind = "long" if kind == "int" else kind
            if name == "round" and len(args) == 2:
                digits = args[1]
                if not (isinstance(digits, Literal) and digits.type == "long"):
                    raise self.fail(digits, "round(x, n): n must be a whole number, as 2")
                if not -18 <= digits.value <= 18:
                    raise self.fail(digits, "round(x, n): n must be between -18 and 18")
        elif name in ("lower", "upper", "length", "concat"):
            for arg in args:
                self.want(arg, ("string",), f"{name}() needs strings")
            kind = "long" if name == "length" else "string"
        else:  # substr
            self.want(first, ("string",), "substr(s, start, length): s must be a string")
            for arg in args[1:]:
                self.want(arg, ("int", "long"), "substr(s, start, length) needs whole numbers")
            kind = "string"
        return dataclasses.replace(node, args=args, type=kind)


def check(
    expression: Expression,
    scope: Mapping[str, str],
    unknown: Callable[[str], str] | None = None,
) -> Expression:
    """`expression` with its tree typed against `scope` (field name -> type); `unknown` may
    explain an unknown field name (return "" for the default message)."""
    tree = _Checker(scope, expression.key, unknown).check(expression.tree)
    return dataclasses.replace(expression, tree=tree)


def typed(
    text: str, key: str, scope: Mapping[str, str], unknown: Callable[[str], str] | None = None
) -> Expression:
    """Parse and check in one step."""
    return check(parse(text, key), scope, unknown)
