"""The expression language of pipeline specs (`fields`, `where`, aggregate arguments).

Text is parsed by a lark LALR grammar into a small tree of frozen dataclasses, typed against a
scope of field types, and compiled into Spark `Column`s built with `pyspark.sql.functions` only:
spec text is never pasted into SQL nor evaluated. The language is described in docs/streams.md
(#expressions); pyspark is imported only by `to_column`, so specs load without it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import lark

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
NUMERIC = ("int", "long", "double")
_WORDS = "and or not in between is null true false case when then else end"
KEYWORDS = frozenset(_WORDS.split(" "))
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

_GRAMMAR = r"""
?expr: disjunction
?disjunction: conjunction | disjunction OR conjunction -> logical
?conjunction: negation | conjunction AND negation -> logical
?negation: predicate | NOT negation -> not_
?predicate: sum
    | sum (EQ | NE | LT | LE | GT | GE) sum -> compare
    | sum NOT? IN LPAR expr (COMMA expr)* RPAR -> in_
    | sum NOT? BETWEEN sum AND sum -> between
    | sum IS NOT? NULL -> is_null
?sum: product | sum (PLUS | MINUS) product -> arithmetic
?product: unary | product (STAR | SLASH | PERCENT) unary -> arithmetic
?unary: atom | MINUS unary -> negate
?atom: INTEGER -> integer
    | DECIMAL -> decimal
    | STRING -> string
    | TRUE -> boolean
    | FALSE -> boolean
    | NULL -> null
    | NAME -> field
    | QUALIFIED -> field
    | NAME LPAR [expr (COMMA expr)*] RPAR -> call
    | CASE (WHEN expr THEN expr)+ [ELSE expr] END -> case
    | LPAR expr RPAR

AND: "and"i
OR: "or"i
NOT: "not"i
IN: "in"i
BETWEEN: "between"i
IS: "is"i
NULL: "null"i
TRUE: "true"i
FALSE: "false"i
CASE: "case"i
WHEN: "when"i
THEN: "then"i
ELSE: "else"i
END: "end"i
NAME: /[a-z][a-z0-9_]*/i
// A joined table's column: customers.tier (docs/streams.md#joins).
QUALIFIED.2: /[a-z][a-z0-9_]*\.[a-z_][a-z0-9_]*/i
DECIMAL: /[0-9]+\.[0-9]*|\.[0-9]+/
INTEGER: /[0-9]+/
STRING: /'(?:[^']|'')*'/
EQ: "="
NE: "!=" | "<>"
LT: "<"
LE: "<="
GT: ">"
GE: ">="
PLUS: "+"
MINUS: "-"
STAR: "*"
SLASH: "/"
PERCENT: "%"
LPAR: "("
RPAR: ")"
COMMA: ","
%import common.WS
%ignore WS
"""

# How expected tokens are named in an error message.
_SHOWN = {
    "RPAR": "')'", "LPAR": "'('", "COMMA": "','", "THEN": "'then'", "WHEN": "'when'",
    "ELSE": "'else'", "END": "'end'", "$END": "the end of the expression",
}  # fmt: skip
_VALUE = {"NAME", "INTEGER", "DECIMAL", "STRING", "TRUE", "FALSE", "NULL", "CASE", "LPAR", "NOT"}
_OPERATOR = {"PLUS", "MINUS", "STAR", "SLASH", "PERCENT", "EQ", "NE", "LT", "LE", "GT", "GE"}
_OPERATOR |= {"AND", "OR", "NOT", "IN", "BETWEEN", "IS"}


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


# -- the tree ---------------------------------------------------------------------------------


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


# -- parsing ----------------------------------------------------------------------------------


@functools.cache
def _parser() -> lark.Lark:
    return lark.Lark(_GRAMMAR, start="expr", parser="lalr", lexer="basic")


def _pos(token: lark.Token) -> int:
    return (token.start_pos or 0) + 1


class _Build(lark.Transformer[lark.Token, Node]):
    """The parse tree into `Node`s; positions are those of the operator or first token."""

    def integer(self, items: list[lark.Token]) -> Node:
        return Literal(pos=_pos(items[0]), value=int(items[0]))

    def decimal(self, items: list[lark.Token]) -> Node:
        return Literal(pos=_pos(items[0]), value=float(items[0]))

    def string(self, items: list[lark.Token]) -> Node:
        return Literal(pos=_pos(items[0]), value=items[0][1:-1].replace("''", "'"))

    def boolean(self, items: list[lark.Token]) -> Node:
        return Literal(pos=_pos(items[0]), value=items[0].lower() == "true")

    def null(self, items: list[lark.Token]) -> Node:
        return Literal(pos=_pos(items[0]), value=None)

    def field(self, items: list[lark.Token]) -> Node:
        return Field(pos=_pos(items[0]), name=str(items[0]))

    def call(self, items: list[Any]) -> Node:
        args = tuple(i for i in items[2:-1] if isinstance(i, Node))
        return Call(pos=_pos(items[0]), name=items[0].lower(), args=args)

    def atom(self, items: list[Any]) -> Node:
        """`( expr )`: the expression (the parentheses are kept as tokens)."""
        return next(item for item in items if isinstance(item, Node))

    def negate(self, items: list[Any]) -> Node:
        operator, operand = items
        number = isinstance(operand, Literal) and type(operand.value) in (int, float)
        if number:
            return Literal(pos=_pos(operator), value=-operand.value)
        return Unary(pos=_pos(operator), op="-", operand=operand)

    def not_(self, items: list[Any]) -> Node:
        return Unary(pos=_pos(items[0]), op="not", operand=items[1])

    def arithmetic(self, items: list[Any]) -> Node:
        left, operator, right = items
        return Binary(pos=_pos(operator), op=str(operator), left=left, right=right)

    def compare(self, items: list[Any]) -> Node:
        left, operator, right = items
        op = "!=" if operator == "<>" else str(operator)
        return Binary(pos=_pos(operator), op=op, left=left, right=right)

    def logical(self, items: list[Any]) -> Node:
        left, operator, right = items
        return Binary(pos=_pos(operator), op=operator.lower(), left=left, right=right)

    def in_(self, items: list[Any]) -> Node:
        keyword = next(t for t in items if isinstance(t, lark.Token) and t.type == "IN")
        options = tuple(i for i in items[1:] if isinstance(i, Node))
        negated = any(isinstance(t, lark.Token) and t.type == "NOT" for t in items)
        return In(pos=_pos(keyword), operand=items[0], options=options, negated=negated)

    def between(self, items: list[Any]) -> Node:
        keyword = next(t for t in items if isinstance(t, lark.Token) and t.type == "BETWEEN")
        operand, low, high = (i for i in items if isinstance(i, Node))
        negated = any(isinstance(t, lark.Token) and t.type == "NOT" for t in items)
        return Between(pos=_pos(keyword), operand=operand, low=low, high=high, negated=negated)

    def is_null(self, items: list[Any]) -> Node:
        negated = any(isinstance(t, lark.Token) and t.type == "NOT" for t in items)
        return IsNull(pos=_pos(items[1]), operand=items[0], negated=negated)

    def case(self, items: list[Any]) -> Node:
        parts = [i for i in items if isinstance(i, Node)]
        has_else = any(isinstance(t, lark.Token) and t.type == "ELSE" for t in items)
        default = parts.pop() if has_else else None
        branches = tuple(zip(parts[::2], parts[1::2], strict=True))
        return Case(pos=_pos(items[0]), branches=branches, default=default)


def _expected(names: set[str]) -> str:
    shown = []
    if "NAME" in names:  # where a value goes, '(', '-' and 'not' start one
        shown.append("a value (a field, a number, a 'string', a function call or '(')")
        names = names - _VALUE - {"MINUS"}
    if names & _OPERATOR:
        shown.append("an operator")
    shown += sorted(_SHOWN[n] for n in names if n in _SHOWN)
    return ", ".join(shown[:-1]) + (" or " if len(shown) > 1 else "") + shown[-1]


def _balance(tokens: list[lark.Token]) -> None:
    """Unbalanced parentheses named where they are, before the parser sees them."""
    opened: list[lark.Token] = []
    for token in tokens:
        if token.type == "LPAR":
            opened.append(token)
        elif token.type == "RPAR":
            if not opened:
                raise ExpressionError(
                    "unbalanced parentheses: ')' closes nothing", None, _pos(token)
                )
            opened.pop()
    if opened:
        raise ExpressionError("unbalanced parentheses: '(' is never closed", None, _pos(opened[-1]))


def _accepts(text: str) -> set[str]:
    """The tokens the parser would accept after `text`, or none when `text` is no prefix."""
    try:
        interactive = _parser().parse_interactive(text)
        interactive.exhaust_lexer()
        return set(interactive.accepts())
    except lark.LarkError:
        return set()


def parse(text: str, key: str | None = None) -> Expression:
    """`text` as an untyped expression; an ExpressionError names `key` and the position."""
    text = str(text)
    try:
        _balance(list(_parser().lex(text)))
        tree = _Build().transform(_parser().parse(text))
    except lark.UnexpectedCharacters as error:
        offset = error.pos_in_stream or 0
        position, char = offset + 1, text[offset]
        if char == "'":
            detail = "unbalanced quotes: the string that starts here is never closed"
        elif char == '"':
            detail = "unexpected character '\"': write strings in single quotes, as 'paid'"
        else:
            detail = f"unexpected character {char!r}"
            accepted = _accepts(text[:offset])
            detail += f"; expected {_expected(accepted)}" if accepted else ""
        raise ExpressionError(detail, key, position) from None
    except lark.UnexpectedToken as error:
        token: lark.Token = error.token
        expected = _expected(set(error.interactive_parser.accepts()) or set(error.expected))
        if token.type == "$END":
            detail, position = f"the expression ends early; expected {expected}", len(text) + 1
        else:
            detail, position = f"unexpected {str(token)!r}; expected {expected}", _pos(token)
        raise ExpressionError(detail, key, position) from None
    except lark.UnexpectedEOF as error:  # an empty expression
        raise ExpressionError(f"empty; expected {_expected(set(error.expected))}", key, 1) from None
    except ExpressionError as error:
        raise (error.at(key) if key else error) from None
    return Expression(text, key or "", tree)


# -- types ------------------------------------------------------------------------------------


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


# -- Spark columns ----------------------------------------------------------------------------


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
