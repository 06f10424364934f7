"""Compilation into Spark columns: a typed tree's value over the source's columns, built with
`pyspark.sql.functions` only, and an error column for what goes wrong at run time
(docs/decisions/0025-rich-aggregates-at-run-time.md)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from duality.expressions.checking import LONG_MIN, unify
from duality.expressions.tree import (
    Between,
    Binary,
    Call,
    Case,
    Expression,
    Field,
    In,
    IsNull,
    Literal,
    Node,
    Unary,
)

if TYPE_CHECKING:
    from pyspark.sql import Column

# Each type as a Spark SQL type; "null" is the type of the `null` literal only.
SPARK_TYPES = {
    "string": "string",
    "long": "bigint",
    "int": "int",
    "double": "double",
    "boolean": "boolean",
    "timestamp": "timestamp",
}


def to_column(expression: Expression, columns: Mapping[str, Column]) -> tuple[Column, Column]:
    """The value of a typed expression over `columns` (every field it names), and an error
    column: null when fine, else `key: position N: what went wrong`. Nothing raises under ANSI
    mode: a division by zero, a long overflow or a NaN or infinite double gives a null value and
    an error; null operands give null with no error. The error of a `case` branch, of the right
    side of `and`/`or` and of a later `coalesce` argument counts only when it is evaluated."""
    if not expression.type:
        raise ValueError(f"{expression.key}: expression not type-checked")
    from pyspark.sql import functions as F

    value, error = _Compiler(expression.key, columns).compile(expression.tree)
    return value, (error if error is not None else F.lit(None).cast("string"))


Compiled = tuple["Column", "Column | None"]


class _Compiler:
    def __init__(self, key: str, columns: Mapping[str, Column]):
        from pyspark.sql import functions as F

        self.F, self.key, self.columns = F, key, columns

    def message(self, node: Node, detail: str) -> Column:
        return self.F.lit(f"{self.key}: position {node.pos}: {detail}")

    def first(self, *errors: Column | None) -> Column | None:
        present = [e for e in errors if e is not None]
        return (
            None if not present else present[0] if len(present) == 1 else self.F.coalesce(*present)
        )

    def only_when(self, condition: Column, error: Column | None) -> Column | None:
        return None if error is None else self.F.when(condition, error)

    def as_type(self, node: Node, value: Column, kind: str) -> Column:
        if node.type == kind or kind == "null":
            return value
        return value.cast(SPARK_TYPES[kind])

    def typed(self, node: Node, kind: str) -> Compiled:
        value, error = self.compile(node)
        return self.as_type(node, value, kind), error

    def finite(self, node: Node, value: Column, what: str) -> tuple[Column, Column]:
        """A double value, null when NaN or infinite, and the error then."""
        F = self.F
        bad = F.isnan(value) | (F.abs(value) == F.lit(float("inf")))
        error = F.when(bad, self.message(node, f"{what} gives a NaN or infinite double"))
        return F.when(~bad, value), error

    def overflowed(self, node: Node, inputs: list[Column], value: Column, what: str) -> Column:
        present = functools.reduce(lambda a, b: a & b, [i.isNotNull() for i in inputs])
        return self.F.when(present & value.isNull(), self.message(node, f"{what}: long overflow"))

    def compile(self, node: Node) -> Compiled:
        method = getattr(self, f"_{type(node).__name__.lower()}")
        return method(node)

    def _literal(self, node: Literal) -> Compiled:
        value = self.F.lit(node.value)
        return (value if node.type == "null" else value.cast(SPARK_TYPES[node.type])), None

    def _field(self, node: Field) -> Compiled:
        return self.columns[node.name], None

    def _unary(self, node: Unary) -> Compiled:
        F = self.F
        if node.op == "not":
            value, error = self.typed(node.operand, "boolean")
            return ~value, error
        if node.type == "null":
            return F.lit(None), self.compile(node.operand)[1]
        value, error = self.typed(node.operand, node.type)
        if node.type == "double":
            return -value, error
        result = F.try_subtract(F.lit(0).cast("bigint"), value)
        return result, self.first(error, self.overflowed(node, [value], result, "'-'"))

    def _binary(self, node: Binary) -> Compiled:
        F, op = self.F, node.op
        if op in ("and", "or"):
            (left, left_error), (right, right_error) = (
                self.typed(node.left, "boolean"),
                self.typed(node.right, "boolean"),
            )
            # The right side's error counts when the left does not decide the result.
            undecided = (
                F.coalesce(left, F.lit(True)) if op == "and" else ~F.coalesce(left, F.lit(False))
            )
            value = left & right if op == "and" else left | right
            return value, self.first(left_error, self.only_when(undecided, right_error))
        if op in ("=", "!=", "<", "<=", ">", ">="):
            kind = unify(node.left.type, node.right.type) or "null"
            (left, left_error), (right, right_error) = (
                self.typed(node.left, kind),
                self.typed(node.right, kind),
            )
            value = {
                "=": lambda: left == right,
                "!=": lambda: left != right,
                "<": lambda: left < right,
                "<=": lambda: left <= right,
                ">": lambda: left > right,
                ">=": lambda: left >= right,
            }[op]()
            return value, self.first(left_error, right_error)
        return self._arithmetic(node)

    def _arithmetic(self, node: Binary) -> Compiled:
        F, op, kind = self.F, node.op, node.type
        if "null" in (node.left.type, node.right.type):  # null operands: null, no error
            errors = self.first(self.compile(node.left)[1], self.compile(node.right)[1])
            return F.lit(None).cast(SPARK_TYPES.get(kind, "double")), errors
        (left, left_error), (right, right_error) = (
            self.typed(node.left, kind),
            self.typed(node.right, kind),
        )
        errors = self.first(left_error, right_error)
        if op in ("/", "%"):
            value = F.try_divide(left, right) if op == "/" else F.try_mod(left, right)
            zero = left.isNotNull() & (right == 0)
            own = F.when(zero, self.message(node, f"'{op}' by zero"))
            if kind == "double":
                value, not_finite = self.finite(node, value, f"'{op}'")
                own = F.coalesce(own, not_finite)
            return value, self.first(errors, own)
        if kind == "double":
            value = {"+": left + right, "-": left - right, "*": left * right}[op]
            value, not_finite = self.finite(node, value, f"'{op}'")
            return value, self.first(errors, not_finite)
        function = {"+": F.try_add, "-": F.try_subtract, "*": F.try_multiply}[op]
        value = function(left, right)
        return value, self.first(errors, self.overflowed(node, [left, right], value, f"'{op}'"))

    def _in(self, node: In) -> Compiled:
        kind = "null"
        for item in (node.operand, *node.options):
            kind = unify(kind, item.type) or kind
        operand, error = self.typed(node.operand, kind)
        options = [self.typed(o, kind) for o in node.options]
        value = operand.isin(*[v for v, _ in options])
        return (~value if node.negated else value), self.first(error, *[e for _, e in options])

    def _between(self, node: Between) -> Compiled:
        kind = "null"
        for item in (node.operand, node.low, node.high):
            kind = unify(kind, item.type) or kind
        (value, e1), (low, e2), (high, e3) = (
            self.typed(n, kind) for n in (node.operand, node.low, node.high)
        )
        inside = (value >= low) & (value <= high)
        return (~inside if node.negated else inside), self.first(e1, e2, e3)

    def _isnull(self, node: IsNull) -> Compiled:
        value, error = self.compile(node.operand)
        return (value.isNotNull() if node.negated else value.isNull()), error

    def _case(self, node: Case) -> Compiled:
        F, kind = self.F, node.type
        conditions = [self.typed(c, "boolean") for c, _ in node.branches]
        results = [self.typed(v, kind) for _, v in node.branches]
        otherwise: Column = F.lit(None)
        error: Column | None = None
        if node.default is not None:
            otherwise, error = self.typed(node.default, kind)
        value = F.when(conditions[0][0], results[0][0])
        for (condition, _), (result, _) in zip(conditions[1:], results[1:], strict=True):
            value = value.when(condition, result)
        value = value.otherwise(otherwise if kind == "null" else otherwise.cast(SPARK_TYPES[kind]))
        # A branch's error counts when it is taken; a condition's when it is evaluated.
        null = F.lit(None).cast("string")
        for (condition, condition_error), (_, result_error) in reversed(
            list(zip(conditions, results, strict=True))
        ):
            if result_error is not None or error is not None:
                taken = F.coalesce(condition, F.lit(False))
                error = F.when(taken, null if result_error is None else result_error).otherwise(
                    null if error is None else error
                )
            error = self.first(condition_error, error)
        return value, error

    def _call(self, node: Call) -> Compiled:
        F, name, kind = self.F, node.name, node.type
        if name == "coalesce":
            parts = [self.typed(a, kind) for a in node.args]
            return F.coalesce(*[v for v, _ in parts]), self._coalesce_errors(parts)
        if name in ("lower", "upper", "length", "concat"):
            parts = [self.typed(a, "string") for a in node.args]
            errors = self.first(*[e for _, e in parts])
            values = [v for v, _ in parts]
            if name == "concat":
                return F.concat(*values), errors
            if name == "length":
                return F.length(values[0]).cast("bigint"), errors
            return (F.lower if name == "lower" else F.upper)(values[0]), errors
        if name == "substr":
            text, error = self.typed(node.args[0], "string")
            bounds = [self.typed(a, "long") for a in node.args[1:]]
            # Spark takes int positions: clamping a long to the int range changes no result.
            start, length = [
                F.least(F.greatest(v, F.lit(-(2**31))), F.lit(2**31 - 1)).cast("int")
                for v, _ in bounds
            ] + ([F.lit(2**31 - 1)] if len(bounds) == 1 else [])
            return text.substr(start, length), self.first(error, *[e for _, e in bounds])
        if node.args[0].type == "null":
            return F.lit(None).cast(SPARK_TYPES.get(kind, "double")), self.compile(node.args[0])[1]
        value, error = self.typed(
            node.args[0], "double" if node.args[0].type == "double" else "long"
        )
        own: Column | None = None
        if name == "abs":
            if kind == "double":
                result = F.abs(value)
            else:
                result = F.when(
                    value < 0, F.try_subtract(F.lit(0).cast("bigint"), value)
                ).otherwise(value)
                own = self.overflowed(node, [value], result, "abs()")
        elif name == "round":
            digits = node.args[1].value if len(node.args) == 2 else 0  # type: ignore[attr-defined]
            if kind == "double":
                result, own = self.finite(node, F.round(value, digits), "round()")
            elif digits >= 0:
                result = value
            else:
                result = F.round(value.cast("decimal(20,0)"), digits).try_cast("bigint")
                own = self.overflowed(node, [value], result, "round()")
        else:  # floor, ceil
            if node.args[0].type == "double":
                # Only doubles in [-2^63, 2^63) have a floor and a ceiling that are longs.
                fits = (value >= F.lit(float(LONG_MIN))) & (value < F.lit(2.0**63))
                result = F.when(fits, (F.floor if name == "floor" else F.ceil)(value))
                own = self.overflowed(node, [value], result, f"{name}()")
            else:
                result = value
        return result, self.first(error, own)

    def _coalesce_errors(self, parts: list[Compiled]) -> Column | None:
        """An argument's error counts when every argument before it is null."""
        error: Column | None = parts[-1][1]
        for value, part_error in reversed(parts[:-1]):
            error = self.first(part_error, self.only_when(value.isNull(), error))
        return error


def once(expression: Column) -> Column:
    """`expression`, computed once per row however often later filters and columns use it:
    Spark would paste it into each filter pushed below it, but not past a non-deterministic
    guard (the partition id, always at least 0)."""
    from pyspark.sql import functions as F

    return F.when(F.spark_partition_id() >= 0, expression)
