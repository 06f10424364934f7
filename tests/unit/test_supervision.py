"""The stream supervisor's rules, and how Airflow connections become settings."""

from __future__ import annotations

import sys

import pytest

from duality.stream.health import STALL_AFTER_S, backoff_s, diagnose
from tests.harness import ROOT

NOW = 1_000_000.0


def beat(pid: int, state: str = "running", age: float = 5.0, **extra) -> dict:  # type: ignore[no-untyped-def]
    progress_ms = (NOW - age) * 1000
    return {"pid": pid + 1, "ppid": pid, "state": state, "last_progress_ms": progress_ms, **extra}


def test_no_process_is_stopped():
    assert diagnose(None, None, beat(1), 0, NOW)[0] == "stopped"


def test_a_fresh_beat_of_its_own_is_healthy_even_with_lag():
    assert diagnose(7, NOW - 600, beat(7), 5000, NOW)[0] == "healthy"


def test_a_beat_saying_stalled_or_failed_is_stalled():
    for state in ("stalled", "failed"):
        health, reason = diagnose(7, NOW - 600, beat(7, state, error="broker gone"), 0, NOW)
        assert health == "stalled" and state in reason


def test_silence_is_stalled_only_while_records_wait():
    old = STALL_AFTER_S + 10
    assert diagnose(7, NOW - 9999, beat(7, age=old), 0, NOW)[0] == "healthy"
    assert diagnose(7, NOW - 9999, beat(7, age=old), 12, NOW)[0] == "stalled"


def test_a_beat_of_an_earlier_process_does_not_count():
    assert diagnose(9, NOW - 30, beat(3), 0, NOW)[0] == "starting"
    assert diagnose(9, NOW - STALL_AFTER_S - 1, beat(3), 0, NOW)[0] == "stalled"


def test_backoff_first_restart_at_once_then_doubling_up_to_fifteen_minutes():
    assert backoff_s([], NOW) == 0
    assert backoff_s([NOW - 100], NOW) == 0
    assert backoff_s([NOW - 200, NOW - 100], NOW) == 60
    assert backoff_s([NOW - 300, NOW - 200, NOW - 100], NOW) == 120
    assert backoff_s([NOW - 10 * i for i in range(1, 30)], NOW) == 900
    assert backoff_s([NOW - 7200, NOW - 5000], NOW) == 0  # older than an hour: forgotten


def test_unknown_action_is_a_usage_error(tmp_path):
    from duality.config import Settings
    from duality.errors import UsageError
    from duality.spec import find_spec
    from duality.stream.health import supervise_once

    settings = Settings.from_env().replace(local_dir=tmp_path)
    with pytest.raises(UsageError, match="unknown"):
        supervise_once(settings, find_spec(settings, "product_sales"), "reboot")  # type: ignore[arg-type]


@pytest.fixture
def hooks():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "plugins"))
    from duality_airflow import hooks

    yield hooks
    sys.path.remove(str(ROOT / "plugins"))


def test_connections_take_over_kafka_and_spark(hooks):  # type: ignore[no-untyped-def]
    from duality.config import Settings

    changes = hooks.overrides(
        {
            "bootstrap.servers": "k1:9092,k2:9092",
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "PLAIN",
            "sasl.username": "u",
            "sasl.password": "p",
        },
        ("spark://master", 7077),
    )
    settings = Settings.from_env({}).replace(**changes)
    assert settings.bootstrap_servers == "k1:9092,k2:9092"
    assert settings.security_protocol == "SASL_SSL" and settings.sasl_username == "u"
    assert settings.spark_master == "spark://master:7077"
    assert hooks.overrides(None, ("local[2]", None)) == {"spark_master": "local[2]"}
    assert hooks.overrides({}, None) == {}
