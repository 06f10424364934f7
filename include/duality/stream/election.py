"""Which of a pipeline's drivers is active (docs/decisions/0029-warm-standby.md): the member of
the consumer group `duality-<pipeline>-active` that holds the one partition of `_duality-drivers`.
Kafka's group coordinator decides, across hosts; the transactional producer's fencing is the
safety net behind it."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from duality.config import Settings
from duality.kafka import client, topics

log = logging.getLogger("duality.stream")

DRIVERS_TOPIC = "_duality-drivers"
# The coordinator takes a silent driver for dead after its session, and a standby is assigned:
# this long, or the brokers' group.min.session.timeout.ms where that is longer (Kafka's default
# is 6 s; duality's local brokers allow this). Shorter would fail over on a busy host's pauses.
SESSION_TIMEOUT_MS = 3_000
# Kafka's default group.min.session.timeout.ms, assumed where the cluster does not tell.
KAFKA_MIN_SESSION_TIMEOUT_MS = 6_000
# A standby hears of the rebalance with its next heartbeat.
HEARTBEAT_INTERVAL_MS = 500
# A member is told its assignment (the partition, or nothing for a standby) within a second or
# two of joining. librdkafka's group client has been seen never to join at all (a pipeline's only
# driver, on a three-broker cluster just started, waited 4 minutes as a standby): a driver told
# nothing for this long leaves and joins again with a new consumer.
REJOIN_AFTER_S = 30.0


def session_timeout_ms(settings: Settings) -> int:
    floor = topics.broker_setting(settings, "group.min.session.timeout.ms")
    return max(SESSION_TIMEOUT_MS, int(floor) if floor else KAFKA_MIN_SESSION_TIMEOUT_MS)


def ensure_topic(settings: Settings) -> None:
    topics.create_topic(settings, DRIVERS_TOPIC, 1, exist_ok=True)


class Election:
    """This driver's membership: `active` is set while it holds the partition, `lost` once the
    coordinator took the partition from it for another driver (this one must stop)."""

    def __init__(self, settings: Settings, pipeline: str):
        ensure_topic(settings)
        self.settings = settings
        self.pipeline = pipeline
        self.active = threading.Event()
        self.lost = threading.Event()
        self.told = threading.Event()  # set once the group told this member its assignment
        self.session_timeout_ms = session_timeout_ms(settings)
        self._join()

    def _join(self) -> None:
        self.told.clear()
        self._closing = threading.Event()
        # Sticky assignment: a standby that joins never takes the partition from the active.
        self._consumer = client.consumer(
            self.settings,
            f"duality-{self.pipeline}-active",
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
            partition_assignment_strategy="cooperative-sticky",
            enable_partition_eof=False,
        )
        self._consumer.subscribe(
            [DRIVERS_TOPIC], on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost
        )
        self._joined_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._poll,
            args=(self._consumer, self._closing),
            name="duality-election",
            daemon=True,
        )
        self._thread.start()

    def _poll(self, consumer: Any, closing: threading.Event) -> None:
        # The group's callbacks run inside poll(); the records themselves are not read.
        while not closing.is_set():
            try:
                consumer.poll(0.2)
            except Exception as error:  # a closed consumer, or Kafka away: the next poll says
                if closing.is_set():
                    return
                log.warning("%s: the election's poll failed: %s", self.pipeline, error)

    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        self.told.set()
        if partitions:
            log.info("%s: this driver is now the active one", self.pipeline)
            self.active.set()

    def _revoked(self, consumer: Any, partitions: list[Any]) -> None:
        if partitions and self.active.is_set():
            log.warning("%s: this driver is no longer the active one", self.pipeline)
            self.active.clear()
            self.lost.set()

    def _lost(self, consumer: Any, partitions: list[Any]) -> None:
        # No answer from the group's coordinator for a session (a broker's loss moves it): the
        # query goes on, and the driver rejoins. Given the partition back, nothing happened;
        # if another driver got it meanwhile, its transactional producer fences this one's
        # commits, and this driver, not active, waits instead of restarting its query.
        if partitions:
            log.warning(
                "%s: lost touch with the group coordinator; the query goes on, and the driver "
                "rejoins the election",
                self.pipeline,
            )
            self.active.clear()

    def wait_active(self, stopping: threading.Event, waiting: Any = None) -> bool:
        """Block until this driver is the active one (True) or `stopping` is set (False);
        `waiting()` is called about every 5 s meanwhile."""
        while not stopping.is_set():
            if self.active.wait(5):
                return True
            if waiting is not None:
                waiting()
            if not self.told.is_set() and time.monotonic() - self._joined_at > REJOIN_AFTER_S:
                log.warning(
                    "%s: the election's group told this driver nothing within %.0fs of joining; "
                    "joining again",
                    self.pipeline,
                    REJOIN_AFTER_S,
                )
                self.close()
                self._join()
        return False

    def close(self) -> None:
        """Leave the group at once: a standby is assigned without waiting for the timeout."""
        self._closing.set()
        self._thread.join(timeout=5)
        try:
            self._consumer.close()
        except Exception as error:
            log.warning("%s: leaving the election failed: %s", self.pipeline, error)
