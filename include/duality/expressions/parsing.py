"""Parsing: the lark LALR grammar of the language, its words, and `parse`, which gives an
untyped tree or an ExpressionError naming the position and what was expected there."""

from __future__ import annotations

import functools
from typing import Any

import lark

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

_WORDS = "and or not in between is null true false case when then else end"
KEYWORDS = frozenset(_WORDS.split(" "))

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
