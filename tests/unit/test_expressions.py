"""The spec expression language: parsing, types, and one test per spec error kind of issue #29,
each naming the file, the spec key and the position in the expression."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from duality.config import SHIPPED_PIPELINES
from duality.errors import UsageError
from duality.expressions.checking import typed
from duality.expressions.parsing import parse
from duality.expressions.tree import (
    Between,
    Binary,
    Call,
    Case,
    ExpressionError,
    Field,
    In,
    IsNull,
    Literal,
    Unary,
)
from duality.spec import load_spec

FIXTURE = SHIPPED_PIPELINES / "regional_sales.yaml"
SCOPE = {
    "price": "double",
    "quantity": "long",
    "small": "int",
    "status": "string",
    "paid": "boolean",
    "ts": "timestamp",
}


def _type(text: str) -> str:
    return typed(text, "fields.x", SCOPE).type


def _spec_error(tmp_path: Path, change: dict) -> str:
    """The message of loading the issue's example spec with `change` applied (a path of keys
    separated by dots -> a value)."""
    data = yaml.safe_load(FIXTURE.read_text())
    for dotted, value in change.items():
        *parents, last = dotted.split(".")
        target = data
        for part in parents:
            target = target[part]
        target[last] = value
    path = tmp_path / "regional_sales.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(UsageError) as error:
        load_spec(path)
    message = str(error.value)
    assert str(path) in message and "Traceback" not in message
    return message


# -- parsing ----------------------------------------------------------------------------------


def test_literals_fields_and_positions():
    assert parse("42").tree == Literal(pos=1, value=42)
    assert parse("-2.5").tree == Literal(pos=1, value=-2.5)
    assert parse("'it''s'").tree == Literal(pos=1, value="it's")
    assert parse("TRUE").tree == Literal(pos=1, value=True)
    assert parse("Null").tree == Literal(pos=1, value=None)
    tree = parse("quantity  * price").tree
    assert tree == Binary(
        pos=11, op="*", left=Field(pos=1, name="quantity"), right=Field(pos=13, name="price")
    )


def test_precedence_follows_sql():
    # or < and < not < comparison < + - < * / % < unary minus
    tree = parse("not a = 1 or b and c").tree
    assert isinstance(tree, Binary) and tree.op == "or"
    assert isinstance(tree.left, Unary) and tree.left.op == "not"
    assert isinstance(tree.left.operand, Binary) and tree.left.operand.op == "="
    assert isinstance(tree.right, Binary) and tree.right.op == "and"
    arithmetic = parse("a + b * -c % d").tree
    assert isinstance(arithmetic, Binary) and arithmetic.op == "+"
    assert isinstance(arithmetic.right, Binary) and arithmetic.right.op == "%"
    assert isinstance(arithmetic.right.left, Binary) and arithmetic.right.left.op == "*"
    assert arithmetic.right.left.right == Unary(pos=9, op="-", operand=Field(pos=10, name="c"))
    assert parse("a - b - c").tree.left.op == "-"  # type: ignore[attr-defined]  # left-assoc


def test_predicates_case_and_calls():
    assert parse("a NOT IN (1, 2)").tree == In(
        pos=7,
        operand=Field(pos=1, name="a"),
        options=(Literal(pos=11, value=1), Literal(pos=14, value=2)),
        negated=True,
    )
    between = parse("a between 1 and 2 and b").tree
    assert isinstance(between, Binary) and isinstance(between.left, Between)
    assert parse("a is not null").tree == IsNull(
        pos=3, operand=Field(pos=1, name="a"), negated=True
    )
    case = parse("CASE WHEN a THEN 1 WHEN b THEN 2 END").tree
    assert isinstance(case, Case) and len(case.branches) == 2 and case.default is None
    assert parse("Round(a, 2)").tree == Call(
        pos=1, name="round", args=(Field(pos=7, name="a"), Literal(pos=10, value=2))
    )
    assert parse("a <> b").tree.op == "!="  # type: ignore[attr-defined]
    assert parse("andy or notes").tree.op == "or"  # type: ignore[attr-defined]  # not keywords


def test_referenced_fields_in_order():
    assert parse("coalesce(b, a) + a * c").fields == ["b", "a", "c"]
    assert parse("a").field == "a" and parse("a + 1").field is None


# -- types ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("quantity + small", "long"),
        ("small * small", "long"),  # int arithmetic is long
        ("quantity / 2", "double"),  # / is always a double, as in Spark SQL
        ("quantity % 3", "long"),
        ("quantity * price", "double"),
        ("-small", "long"),
        ("price > 3 and not paid", "boolean"),
        ("status in ('a', 'b')", "boolean"),
        ("quantity between 1 and 2.5", "boolean"),
        ("ts is null", "boolean"),
        ("case when paid then quantity else price end", "double"),
        ("case when paid then 'x' end", "string"),
        ("coalesce(null, small, quantity)", "long"),
        ("abs(small)", "long"),
        ("abs(price)", "double"),
        ("round(price, 2)", "double"),
        ("round(quantity, -1)", "long"),
        ("floor(price)", "long"),
        ("ceil(price)", "long"),
        ("lower(status)", "string"),
        ("length(upper(status))", "long"),
        ("substr(status, 2, small)", "string"),
        ("concat(status, '-', status)", "string"),
        ("quantity = null", "boolean"),
        ("ts >= ts", "boolean"),
    ],
)
def test_types(text: str, kind: str):
    assert _type(text) == kind


@pytest.mark.parametrize(
    ("text", "position", "reason"),
    [
        ("'a' + 1", 5, "'+' needs numbers, got a string and a long"),
        ("status > 1", 8, "cannot compare a string with a long"),
        ("paid and price", 10, "'and' needs booleans, got a double"),
        ("not status", 5, "'not' needs a boolean"),
        ("case when price then 1 end", 11, "a 'when' condition must be a boolean"),
        ("case when paid then 1 else 'x' end", 28, "branches of 'case' must have one type"),
        ("coalesce(status, 1)", 18, "coalesce() needs arguments of one type"),
        ("status in (1, 2)", 12, "'in' compares values of one type"),
        ("round(price, quantity)", 14, "n must be a whole number"),
        ("length(price)", 8, "length() needs strings, got a double"),
        ("substr(status, 1.5)", 16, "needs whole numbers"),
        ("abs(price, 2)", 1, "abs() takes 1 argument, got 2"),
        ("substr(status)", 1, "substr() takes 2 to 3 arguments, got 1"),
        ("sum(price)", 1, "sum() is an aggregate"),
        ("99999999999999999999", 1, "does not fit in a long"),
        ("ts + 1", 4, "'+' needs numbers, got a timestamp"),
    ],
)
def test_type_errors_name_key_and_position(text: str, position: int, reason: str):
    with pytest.raises(ExpressionError) as error:
        typed(text, "fields.x", SCOPE)
    assert str(error.value).startswith(f"fields.x: position {position}: ")
    assert reason in str(error.value)
    assert (error.value.key, error.value.position) == ("fields.x", position)


# -- the example spec -------------------------------------------------------------------------


def test_the_issues_example_spec_loads_with_its_types():
    spec = load_spec(FIXTURE)
    assert {n: e.type for n, e in spec.computed_fields.items()} == {
        "revenue": "double",
        "band": "string",
    }
    assert spec.where_expression is not None and spec.where_expression.type == "boolean"
    assert spec.key_columns == ["region", "band", "window_start"]
    assert spec.field_type("band") == "string" and spec.field_type("quantity") == "long"
    shape = {c: (a.function, a.field, a.type) for c, a in spec.aggregates.items()}
    assert shape == {
        "orders": ("count", None, "long"),
        "revenue": ("sum", "revenue", "double"),
        "avg_line": ("avg", None, "double"),
        "customers": ("count_distinct", "customer", "long"),
        "last_price": ("latest", "price", "double"),
        "first_price": ("earliest", "price", "double"),
        "price_sd": ("stddev", "price", "double"),
        "bulk_orders": ("count_if", None, "long"),
    }
    arguments = {c: a.argument.type for c, a in spec.aggregates.items() if a.argument}
    assert arguments["avg_line"] == "double" and arguments["bulk_orders"] == "boolean"
    assert spec.required_fields == ["region", "quantity", "price", "status", "customer", "ts"]
    assert spec.window is not None
    assert (spec.window.size_seconds, spec.window.slide_seconds) == (3600, 900)


def test_aggregate_result_types(tmp_path: Path):
    data = yaml.safe_load(FIXTURE.read_text())
    data["aggregates"] = {
        "a": "sum(quantity)",
        "b": "min(ts)",
        "c": "max(quantity)",
        "d": "latest(region)",
        "e": "earliest(quantity > 1)",
        "f": "count_distinct(band)",
    }
    path = tmp_path / "regional_sales.yaml"
    path.write_text(yaml.safe_dump(data))
    types = {c: a.type for c, a in load_spec(path).aggregates.items()}
    expected = {"a": "long", "b": "timestamp", "c": "long", "d": "string", "e": "boolean"}
    assert types == {**expected, "f": "long"}


def test_a_tumbling_window_dumps_as_before_slide_existed():
    spec = load_spec(FIXTURE)
    assert spec.window is not None and "slide" in spec.window.model_dump()
    tumbling = spec.window.model_copy(update={"slide": None})
    assert tumbling.model_dump() == {"size": "1 hour", "watermark": "10 minutes"}
    assert tumbling.slide_seconds == tumbling.size_seconds


# -- one test per spec error kind of the issue ------------------------------------------------


def test_unknown_field(tmp_path: Path):
    message = _spec_error(
        tmp_path, {"fields.band": "case when prise >= 100 then 'premium' else 'standard' end"}
    )
    assert "fields.band: position 11: unknown field 'prise' (known: order_id, region" in message


def test_unknown_function(tmp_path: Path):
    message = _spec_error(tmp_path, {"fields.revenue": "quantity * sqrt(price)"})
    assert "fields.revenue: position 12: unknown function 'sqrt' (known: abs, ceil" in message


def test_unknown_aggregate_function(tmp_path: Path):
    message = _spec_error(tmp_path, {"aggregates.price_sd": "median(price)"})
    assert "aggregates.price_sd: position 1: unknown function 'median'" in message


def test_type_mismatch_string_plus_number(tmp_path: Path):
    message = _spec_error(tmp_path, {"fields.revenue": "'a' + 1"})
    assert "fields.revenue: position 5: '+' needs numbers, got a string and a long" in message


def test_type_mismatch_sum_of_a_string(tmp_path: Path):
    message = _spec_error(tmp_path, {"aggregates.revenue": "sum(customer)"})
    assert "aggregates.revenue: position 5: sum() needs a number; customer is a string" in message


def test_where_that_is_not_boolean(tmp_path: Path):
    message = _spec_error(tmp_path, {"where": "quantity * price"})
    assert "where: position 1: where must be a boolean condition" in message
    assert "got a double" in message


def test_field_used_before_it_is_defined(tmp_path: Path):
    message = _spec_error(
        tmp_path, {"fields": {"band": "case when revenue > 100 then 'a' end", "revenue": "price"}}
    )
    assert "fields.band: position 11: field 'revenue' is used before it is defined" in message
    assert "define revenue above band" in message


def test_computed_field_shadowing_a_source_field(tmp_path: Path):
    message = _spec_error(tmp_path, {"fields": {"price": "price * 2"}})
    assert "fields.price: 'price' is a source field: a computed field may not shadow it" in message


def test_slide_that_does_not_divide_the_size(tmp_path: Path):
    message = _spec_error(tmp_path, {"window.slide": "7 minutes"})
    assert "window.slide: '7 minutes' does not divide the size '1 hour'" in message


def test_unbalanced_parentheses(tmp_path: Path):
    opened = _spec_error(tmp_path, {"fields.revenue": "quantity * (price + 1"})
    assert "fields.revenue: position 12: unbalanced parentheses: '(' is never closed" in opened
    closed = _spec_error(tmp_path, {"where": "status = 'paid')"})
    assert "where: position 16: unbalanced parentheses: ')' closes nothing" in closed


def test_unbalanced_quotes(tmp_path: Path):
    message = _spec_error(tmp_path, {"where": "status = 'paid and quantity > 0"})
    assert "where: position 10: unbalanced quotes: the string that starts here is never closed" in (
        message
    )


@pytest.mark.parametrize(
    ("text", "position", "reason"),
    [
        ("'); drop table x; --", 1, "unbalanced quotes"),
        ("status = 'paid')", 16, "unbalanced parentheses: ')' closes nothing"),
        ("status = 'paid'); drop table x; --", 17, "unexpected character ';'"),
        ("status = 'paid' --", 19, "the expression ends early"),
        ("__import__('os') = 1", 1, "unexpected character '_'"),
        ("`status` = 'paid'", 1, "unexpected character '`'"),
        ("status = 'paid'; select 1", 16, "unexpected character ';'"),
        ('status = "paid"', 10, "unexpected character '\"': write strings in single quotes"),
        ("status = 'paid' union select", 17, "unexpected 'union'; expected an operator"),
    ],
)
def test_text_that_tries_to_escape_fails_at_parse(
    tmp_path: Path, text: str, position: int, reason: str
):
    message = _spec_error(tmp_path, {"where": text})
    assert f"where: position {position}: {reason}" in message


def test_escape_attempts_in_an_aggregate(tmp_path: Path):
    message = _spec_error(tmp_path, {"aggregates.orders": "count(); drop table x"})
    assert "aggregates.orders: position 8: unexpected character ';'" in message


def test_every_error_of_the_model_is_an_expression_error():
    data = yaml.safe_load(FIXTURE.read_text())
    broken = copy.deepcopy(data)
    broken["source"]["key"] = ["region", "revenue"]
    from duality.spec import parse_spec

    with pytest.raises(UsageError, match=r"source\.key: key field 'revenue' is a double"):
        parse_spec(broken, "regional_sales.yaml")


# -- the state the runtime keeps (docs/decisions/0025) ----------------------------------------


def test_partials_of_the_example_and_the_state_layout(tmp_path: Path):
    from duality.stream.query import partials_of
    from duality.stream.seeding import state_layout

    spec = load_spec(FIXTURE)
    ORDERED = "struct<`ts`:bigint,`partition`:int,`offset`:bigint,`value`:double>"
    assert [(p.name, p.type) for p in partials_of(spec)] == [
        ("count", "bigint"),
        ("sum.revenue", "double"),
        ("sum.quantity * price", "double"),
        ("n.quantity * price", "bigint"),
        ("count_distinct.customer", "binary"),
        ("latest.price", ORDERED),
        ("earliest.price", ORDERED),
        ("sum.price", "double"),
        ("sumsq.price", "double"),
        ("count_if.quantity >= 10", "bigint"),
    ]
    data = yaml.safe_load(FIXTURE.read_text())
    changes = {
        "fields.revenue": "quantity * price * 2",
        "where": "status = 'paid'",
        "source.key": ["band", "region"],
        "window.slide": "30 minutes",
        "aggregates.price_sd": "stddev(quantity)",
    }
    layouts = {state_layout(spec)}
    for dotted, value in changes.items():
        changed = yaml.safe_load(FIXTURE.read_text())
        *parents, last = dotted.split(".")
        target = changed
        for part in parents:
            target = target[part]
        target[last] = value
        path = tmp_path / "regional_sales.yaml"
        path.write_text(yaml.safe_dump(changed))
        layouts.add(state_layout(load_spec(path)))
    assert len(layouts) == len(changes) + 1 and data["name"] == "regional_sales"


def test_parentheses_leave_no_trace_in_the_tree():
    inner = Binary(pos=4, op="+", left=Field(pos=2, name="a"), right=Field(pos=6, name="b"))
    assert parse("(a + b) * c").tree == Binary(
        pos=9, op="*", left=inner, right=Field(pos=11, name="c")
    )
    assert parse("not ((x is null))").tree == Unary(
        pos=1, op="not", operand=IsNull(pos=9, operand=Field(pos=7, name="x"))
    )
