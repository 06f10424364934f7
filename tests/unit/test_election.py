"""The election's session timeout (its own 3 s, or the brokers' floor where that is longer), and
a member its group never answers joining again."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from duality.config import Settings
from duality.kafka import client, topics
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

    monkeypatch.setattr(topics, "broker_setting", broker_setting)
    assert election.session_timeout_ms(Settings.from_env()) == expected
    assert asked == ["group.min.session.timeout.ms"]


class _Member:
    """A consumer whose group answers only from its `answered_from`-th join on: it then
    assigns the drivers partition at the first poll."""

    joins = 0
    answered_from = 2

    def __init__(self) -> None:
        _Member.joins += 1
        self.join = _Member.joins
        self.on_assign: Any = None
        self.closed = False

    def subscribe(self, topics: list[str], on_assign: Any, **callbacks: Any) -> None:
        self.on_assign = on_assign

    def poll(self, timeout: float) -> None:
        if self.join >= self.answered_from and self.on_assign is not None:
            assign, self.on_assign = self.on_assign, None
            assign(self, [election.DRIVERS_TOPIC])
        time.sleep(timeout)

    def close(self) -> None:
        self.closed = True


def test_a_driver_the_group_tells_nothing_joins_again(monkeypatch: pytest.MonkeyPatch):
    members: list[_Member] = []

    def consumer(settings: Settings, group: str, **config: Any) -> _Member:
        members.append(_Member())
        return members[-1]

    monkeypatch.setattr(client, "consumer", consumer)
    monkeypatch.setattr(topics, "broker_setting", lambda settings, name: "3000")
    monkeypatch.setattr(election, "ensure_topic", lambda settings: None)
    monkeypatch.setattr(election, "REJOIN_AFTER_S", 0.5)
    _Member.joins = 0
    voter = election.Election(Settings.from_env(), "p")
    try:
        stopping = threading.Event()
        threading.Timer(30, stopping.set).start()
        assert voter.wait_active(stopping), "never active"
        stopping.set()
    finally:
        voter.close()
    assert len(members) == 2 and members[0].closed, "the silent member was not replaced"
