"""Triggers: waiting happens in the triggerer, not in a worker slot.

A trigger's arguments are stored in Airflow's database and shown in its UI, so they carry only
the pipeline's name and connection ids; the triggerer resolves the settings (the environment's,
with the connections applied) itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from duality_airflow.hooks import KAFKA_CONN_ID, SPARK_CONN_ID, DualityHook

if TYPE_CHECKING:
    from duality.config import Settings


def stream_health(settings: Settings, pipeline: str) -> dict[str, Any]:
    """The supervisor's diagnosis of a stream, without acting on it (blocking; run in a thread)."""
    from duality.spec import find_spec
    from duality.stream import control, health

    spec = find_spec(settings, pipeline)
    state, diagnosis, reason = health.check(settings, spec)
    return {
        "pipeline": pipeline,
        "health": diagnosis,
        "reason": reason,
        "pid": state.pid,
        "desired": control.desired(settings, spec),
        "lag": state.lag,
    }


class StreamRunningTrigger(BaseTrigger):
    """Fires once the pipeline's stream reports `running` from its own process, or once it is
    clearly not coming up (no process, or stalled)."""

    def __init__(
        self,
        pipeline: str,
        kafka_conn_id: str = KAFKA_CONN_ID,
        spark_conn_id: str = SPARK_CONN_ID,
        poll_s: float = 3.0,
    ):
        super().__init__()
        self.pipeline = pipeline
        self.kafka_conn_id = kafka_conn_id
        self.spark_conn_id = spark_conn_id
        self.poll_s = poll_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "duality_airflow.triggers.StreamRunningTrigger",
            {
                "pipeline": self.pipeline,
                "kafka_conn_id": self.kafka_conn_id,
                "spark_conn_id": self.spark_conn_id,
                "poll_s": self.poll_s,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        settings = await DualityHook(self.kafka_conn_id, self.spark_conn_id).asettings()
        while True:
            try:
                health = await asyncio.to_thread(stream_health, settings, self.pipeline)
            except Exception as error:  # the broker may be restarting: look again
                self.log.warning("cannot read the health of %s yet: %s", self.pipeline, error)
                await asyncio.sleep(self.poll_s)
                continue
            if health["health"] in ("healthy", "stopped", "stalled"):
                yield TriggerEvent(health)
                return
            self.log.info("%s: %s", self.pipeline, health["reason"])
            await asyncio.sleep(self.poll_s)
