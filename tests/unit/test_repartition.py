"""Skew arithmetic, hot keys and the repartition plan and argument checks: no services."""

from __future__ import annotations

from collections import Counter

import pytest

from duality import repartition, skew
from duality.errors import UsageError
from duality.repartition import Plan, check_arguments


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("s", "s", 3, "key-hash", None, None), "is the source itself"),
        (("s", "t", 0, "key-hash", None, None), "--partitions must be at least 1"),
        (("s", "t", 3, "range", None, None), "--strategy 'range' is unknown"),
        (("s", "t", 3, "key-hash", "a", None), "apply to --strategy salted only"),
        (("s", "t", 3, "salted", None, 2), "--salts needs hot keys"),
        (("s", "t", 3, "salted", None, None), "needs --hot-keys"),
        (("s", "t", 3, "salted", "a", 1), "--salts must be between 2 and --partitions (3)"),
        (("s", "t", 3, "salted", "a", 4), "--salts must be between 2 and --partitions (3)"),
    ],
)
def test_bad_arguments_name_the_argument(arguments: tuple, message: str):
    with pytest.raises(UsageError) as error:
        check_arguments(*arguments)
    assert message in str(error.value)


def test_good_arguments_pass():
    check_arguments("s", "t", 1, "key-hash", None, None)
    check_arguments("s", "t", 4, "salted", "auto", None)
    check_arguments("s", "t", 4, "salted", "a,b", 4)


def test_plan_metadata_names_everything_that_places_records():
    plan = Plan("s", "t", 6, "salted", ("a", "b"), 3)
    assert plan.metadata() == (
        '{"source":"s","strategy":"salted","partitions":6,"hot_keys":["a","b"],"salts":3}'
    )
    assert plan.group == "duality-repartition-t"
    assert plan.transactional_id(2) != plan.transactional_id(3)


def test_the_stored_plan_is_read_from_bytes_and_other_metadata_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
):
    """Committed metadata comes as bytes, possibly followed by a few that were never committed
    (duality.kafka.offsets._metadata_bytes); another client's, binary, is no plan."""
    plan = Plan("s", "t", 6, "salted", ("a",), 2)
    committed = {
        0: (5, b"\x02\xff\xfe binary, not UTF-8"),
        1: (7, plan.metadata().encode() + b"\xa5\x7f"),
        2: (9, None),
    }
    monkeypatch.setattr(repartition.offsets, "committed_offsets", lambda *_, **__: committed)
    assert repartition.stored_plan(None, Plan("s", "t", 6)) == plan  # type: ignore[arg-type]
    committed.pop(1)
    assert repartition.stored_plan(None, Plan("s", "t", 6)) is None  # type: ignore[arg-type]


def test_skew_ratio_and_hot_partitions():
    assert skew.ratio([10, 10, 10]) == 1.0
    assert skew.ratio([30, 10, 10, 10]) == pytest.approx(2.0)
    assert skew.ratio([0, 0]) == 1.0
    assert skew.hot([30, 10, 10, 10]) == [0]


@pytest.mark.parametrize(("text", "seconds"), [("60s", 60), ("5m", 300), ("1h", 3600), ("90", 90)])
def test_window_parses(text: str, seconds: float):
    assert skew.parse_window(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5s", "0"])
def test_bad_window_is_a_usage_error(text: str):
    with pytest.raises(UsageError, match="--window"):
        skew.parse_window(text)


def test_hot_keys_salt_the_dominant_key_and_even_the_prediction():
    counts: Counter[bytes | None] = Counter({b"hot": 3000})
    counts.update({f"k{i}".encode(): 7 for i in range(1000)})
    keys = skew.hot_keys(counts, 6)
    assert keys[0] == "hot"
    assert skew.ratio(skew.predicted_loads(counts, 6, keys, 6)) <= skew.SALTED_GOAL
    uniform: Counter[bytes | None] = Counter({f"k{i}".encode(): 10 for i in range(1000)})
    assert skew.hot_keys(uniform, 6) == []


def test_a_slice_result_comes_back_whole_from_its_task():
    """A copy task's result crosses Arrow as JSON, whose keys are strings."""
    import dataclasses
    import json

    sent = repartition.SliceResult(3, 10, 25, 15, 2, {0: 7, 11: 8}, 0.5)
    document = json.loads(json.dumps(dataclasses.asdict(sent)))
    assert repartition.SliceResult.from_dict(document) == sent
