"""The expression language compiled to Spark columns: every operator and function against
Python values, SQL null semantics, and the run-time errors that must dead-letter a record rather
than stop a query under ANSI mode (division by zero, long overflow, NaN or infinite doubles)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from duality.expressions.checking import typed
from duality.expressions.columns import to_column

SCOPE = {
    "q": "long",
    "n": "int",
    "p": "double",
    "s": "string",
    "ok": "boolean",
    "ts": "timestamp",
    "zero": "long",
    "big": "long",
}
MAX, MIN = 2**63 - 1, -(2**63)
T = dt.datetime(2026, 1, 1, 12, 0)
ROWS = [
    (7, 2, 2.5, "Paid", True, T, 0, MAX),
    (-3, 5, -1.25, "it's", False, T, 0, MIN),
    (None, None, None, None, None, None, None, None),
]
HUGE = "1" + "0" * 308 + ".0"  # 1e308 (the language has no exponents)

# expression -> its value on each row of ROWS
VALUES: dict[str, list[Any]] = {
    "q + n": [9, 2, None],
    "q - n": [5, -8, None],
    "q * n": [14, -15, None],
    "n * n": [4, 25, None],
    "q / n": [3.5, -0.6, None],
    "q % n": [1, -3, None],  # the sign of the dividend, as in SQL
    "p % 2": [0.5, -1.25, None],
    "p * 2": [5.0, -2.5, None],
    "p + q": [9.5, -4.25, None],
    "-q": [-7, 3, None],
    "-p": [-2.5, 1.25, None],
    "q > n": [True, False, None],
    "q = 7": [True, False, None],
    "q <> 7": [False, True, None],
    "q != 7": [False, True, None],
    "p <= 2.5": [True, True, None],
    "q >= 7.0": [True, False, None],
    "q < n": [False, True, None],
    "s = 'Paid'": [True, False, None],
    "s = 'it''s'": [False, True, None],
    "q = null": [None, None, None],
    "q + null": [None, None, None],
    "ok and q > 0": [True, False, None],
    "ok or q > 0": [True, False, None],
    "not ok": [False, True, None],
    "false and ok": [False, False, False],
    "true or ok": [True, True, True],
    "ts >= ts and ts is not null": [True, True, False],
    "q in (7, 8)": [True, False, None],
    "q not in (7, 8)": [False, True, None],
    "q in (1, null)": [None, None, None],
    "s in ('Paid', 'x')": [True, False, None],
    "q between -3 and 7": [True, True, None],
    "q not between 0 and 10": [False, True, None],
    "p between 0 and q": [True, False, None],
    "s is null": [False, False, True],
    "s is not null": [True, True, False],
    "case when q > 0 then 'pos' when q < 0 then 'neg' end": ["pos", "neg", None],
    "case when ok then p else q end": [2.5, -3.0, None],
    "case when q is null then 'none' else 'some' end": ["some", "some", "none"],
    "coalesce(q, n, 0)": [7, -3, 0],
    "coalesce(null, p)": [2.5, -1.25, None],
    "abs(q)": [7, 3, None],
    "abs(p)": [2.5, 1.25, None],
    "round(p)": [3.0, -1.0, None],  # half up, as Spark
    "round(p, 1)": [2.5, -1.3, None],
    "round(q, -1)": [10, 0, None],
    "floor(p)": [2, -2, None],
    "ceil(p)": [3, -1, None],
    "floor(q)": [7, -3, None],
    "lower(s)": ["paid", "it's", None],
    "upper(s)": ["PAID", "IT'S", None],
    "length(s)": [4, 4, None],
    "substr(s, 2, 2)": ["ai", "t'", None],
    "substr(s, 2)": ["aid", "t's", None],
    "substr(s, -2, 9999999999)": ["id", "'s", None],
    "concat(s, '-', 'x')": ["Paid-x", "it's-x", None],
    # An error in what is not evaluated counts for nothing.
    "case when zero = 0 then 0 else q / zero end": [0.0, 0.0, None],
    "zero <> 0 and q / zero > 1": [False, False, None],
    "zero = 0 or q / zero > 1": [True, True, None],
    "coalesce(q, big + 1)": [7, -3, None],
}
# expression -> (value on each row, the error on each row: part of the message or None)
ERRORS: dict[str, tuple[list[Any], list[str | None]]] = {
    "q / zero": ([None, None, None], ["position 3: '/' by zero", "position 3: '/' by zero", None]),
    "p / zero": ([None, None, None], ["position 3: '/' by zero", "position 3: '/' by zero", None]),
    "q % zero": ([None, None, None], ["position 3: '%' by zero", "position 3: '%' by zero", None]),
    "big + 1": ([None, MIN + 1, None], ["position 5: '+': long overflow", None, None]),
    "big - 1": ([MAX - 1, None, None], [None, "position 5: '-': long overflow", None]),
    "big * 2": ([None, None, None], ["'*': long overflow", "'*': long overflow", None]),
    "-big": ([-MAX, None, None], [None, "position 1: '-': long overflow", None]),
    "abs(big)": ([MAX, None, None], [None, "position 1: abs(): long overflow", None]),
    "round(big, -1)": ([None, None, None], ["round(): long overflow", "round(): long", None]),
    f"p * {HUGE}": (
        [None, -1.25e308, None],
        ["position 3: '*' gives a NaN or infinite double", None, None],
    ),
    "floor(p * 10000000000000000000.0)": (
        [None, None, None],
        ["position 1: floor(): long overflow", "position 1: floor(): long overflow", None],
    ),
    "1 + q / zero": ([None, None, None], ["position 7: '/' by zero", "position 7: '/'", None]),
    "case when ok then q / zero else 0 end": ([None, 0.0, 0.0], ["'/' by zero", None, None]),
}


@pytest.fixture(scope="module")
def evaluated(local_spark) -> dict[str, list[tuple[Any, Any]]]:  # type: ignore[no-untyped-def]
    """(value, error) of each expression on each row, from one query."""
    assert local_spark.conf.get("spark.sql.ansi.enabled") == "true"
    schema = (
        "q bigint, n int, p double, s string, ok boolean, ts timestamp, zero bigint, big bigint"
    )
    frame = local_spark.createDataFrame(ROWS, schema)
    columns = {name: frame[name] for name in SCOPE}
    texts = [*VALUES, *ERRORS]
    selected = []
    for index, text in enumerate(texts):
        value, error = to_column(typed(text, "fields.x", SCOPE), columns)
        selected += [value.alias(f"v{index}"), error.alias(f"e{index}")]
    rows = frame.select(*selected).collect()
    return {text: [(row[f"v{i}"], row[f"e{i}"]) for row in rows] for i, text in enumerate(texts)}


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        return abs(got - want) <= 1e-12 * max(1.0, abs(want))
    return got == want and type(got) is type(want)


@pytest.mark.parametrize("text", list(VALUES))
def test_values_and_null_semantics(evaluated: dict, text: str):
    got = evaluated[text]
    assert [error for _, error in got] == [None] * len(ROWS), got
    values = [value for value, _ in got]
    assert all(_same(g, w) for g, w in zip(values, VALUES[text], strict=True)), (values, text)


@pytest.mark.parametrize("text", list(ERRORS))
def test_run_time_errors_give_null_and_a_reason(evaluated: dict, text: str):
    values, errors = ERRORS[text]
    got = evaluated[text]
    assert all(_same(g, w) for (g, _), w in zip(got, values, strict=True)), (got, text)
    for (_, error), wanted in zip(got, errors, strict=True):
        if wanted is None:
            assert error is None, (text, error)
        else:
            assert error is not None and error.startswith("fields.x: position "), (text, error)
            assert wanted in error, (text, error)


def test_the_types_spark_computes_are_the_checked_ones(local_spark):  # type: ignore[no-untyped-def]
    frame = local_spark.createDataFrame(
        ROWS,
        "q bigint, n int, p double, s string, ok boolean, ts timestamp, zero bigint, big bigint",
    )
    columns = {name: frame[name] for name in SCOPE}
    spark_names = {"long": "bigint", "double": "double", "string": "string", "boolean": "boolean"}
    texts = [t for t in VALUES if typed(t, "k", SCOPE).type != "null"]
    selected = [
        to_column(typed(t, "k", SCOPE), columns)[0].alias(f"c{i}") for i, t in enumerate(texts)
    ]
    types = dict(frame.select(*selected).dtypes)
    for index, text in enumerate(texts):
        assert types[f"c{index}"] == spark_names[typed(text, "k", SCOPE).type], text
