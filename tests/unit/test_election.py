"""The election's session timeout: its own 3 s, or the brokers' floor where that is longer."""

from __future__ import annotations

import pytest

from duality import kafka
from duality.config import Settings
from duality.stream import election


@pytest.mark.parametrize(
    ("floor", "expected"),
    [
        ("3000", 3_000),  # duality's local brokers
        ("6000", 6_000),  # Kafka's default
        ("1000", 3_000),  # never shorter than its own: a busy host's pause is no failover
        (None, 6_000),  # the cluster does not tell: Kafka's default assumed
    ],
)
def test_the_session_follows_the_brokers_floor(
    monkeypatch: pytest.MonkeyPatch, floor: str | None, expected: int
):
    asked: list[str] = []

    def broker_setting(settings: Settings, name: str) -> str | None:
        asked.append(name)
        return floor

    monkeypatch.setattr(kafka, "broker_setting", broker_setting)
    assert election.session_timeout_ms(Settings.from_env()) == expected
    assert asked == ["group.min.session.timeout.ms"]
