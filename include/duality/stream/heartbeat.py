"""Stream heartbeats on the compacted `_duality-status` topic: written by a running stream's
driver, read by `duality stream status` and the Airflow supervisor."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from duality.config import Settings
from duality.kafka import client, offsets, records, topics

log = logging.getLogger("duality.stream")

STATUS_TOPIC = "_duality-status"
# The last hour of heartbeats stays whole (the pipelines page charts it); the cleaner compacts
# older ones to each pipeline's latest.
HISTORY_S = 3600
_KEPT = {"min.compaction.lag.ms": str(HISTORY_S * 1000)}


def ensure_topic(settings: Settings) -> None:
    """Create the topic, or give one created before the hour was kept that setting."""
    config = {**topics.FAST_COMPACTION, **_KEPT}
    created = topics.create_topic(settings, STATUS_TOPIC, 1, config=config, exist_ok=True)
    if not created and _KEPT.items() - topics.topic_overrides(settings, STATUS_TOPIC).items():
        topics.set_topic_config(settings, STATUS_TOPIC, _KEPT)


class Heartbeat:
    """Publishes a pipeline's state and progress."""

    def __init__(
        self,
        settings: Settings,
        pipeline: str,
        metrics_port: int | None = None,
        state_partitions: int | None = None,
    ):
        self.pipeline = pipeline
        self.ended = False
        self.producer = client.producer(settings, linger_ms=0)
        # ppid: the supervisor that `duality stream start` launched (`supervisor.supervise`).
        self.base = dict(
            pipeline=pipeline,
            host=socket.gethostname(),
            pid=os.getpid(),
            ppid=os.getppid(),
            metrics_port=metrics_port,
            state_partitions=state_partitions,
        )

    def publish(self, state: str, **details: Any) -> None:
        if self.ended:  # a listener's late beat never follows the driver's last word
            return
        now_ms = int(time.time() * 1000)
        document = {**self.base, "state": state, "last_progress_ms": now_ms, **details}
        try:
            self.producer.produce(
                STATUS_TOPIC, key=self.pipeline.encode(), value=json.dumps(document, default=str)
            )
        except BufferError:
            # The producer's queue is full: the broker has been away a while, which the query
            # finds out for itself. This beat is dropped; the next one says the state.
            log.warning(
                "%s: heartbeat %r dropped, the producer's queue is full", self.pipeline, state
            )
        self.producer.poll(0)

    def end(self, state: str, **details: Any) -> None:
        """Publish the driver's last state (stopped, say): later beats are dropped, such as
        the query listener's progress for a batch that ended as the query stopped."""
        self.publish(state, **details)
        self.ended = True

    def close(self) -> None:
        self.producer.flush(5)


def latest(settings: Settings) -> dict[str, dict[str, Any]]:
    """The latest heartbeat of every pipeline (a record that is no JSON object is skipped)."""
    if not topics.topic_exists(settings, STATUS_TOPIC):
        return {}
    return dict(_beats(settings))


def history(settings: Settings, since_ms: int) -> dict[str, list[dict[str, Any]]]:
    """Every pipeline's heartbeats written since `since_ms` (epoch ms), oldest first: all of
    the last `HISTORY_S`; of older ones, only those the topic's cleaner has not compacted yet."""
    if not topics.topic_exists(settings, STATUS_TOPIC):
        return {}
    beats: dict[str, list[dict[str, Any]]] = {}
    start = offsets.offsets_for_time(settings, STATUS_TOPIC, since_ms)
    for pipeline, document in _beats(settings, start):
        if document.get("last_progress_ms", 0) >= since_ms:
            beats.setdefault(pipeline, []).append(document)
    return beats


def _beats(
    settings: Settings, start: dict[int, int] | None = None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(pipeline, heartbeat) of each record of the topic in order, from the offsets `start`."""
    for message in records.read_to_end(settings, STATUS_TOPIC, start=start, timeout=60):
        key, value = message.key(), message.value()
        if key is None or value is None:
            continue
        try:
            document = json.loads(value)
            pipeline = key.decode()
        except (UnicodeDecodeError, ValueError):
            continue
        if isinstance(document, dict):
            yield pipeline, document
