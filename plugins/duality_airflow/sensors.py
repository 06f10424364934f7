"""Sensors: deferrable, so waiting for a stream holds no worker slot."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, Context
from airflow.sdk.exceptions import AirflowException

from duality_airflow.hooks import DualityHook, execution_timeout
from duality_airflow.triggers import StreamRunningTrigger, stream_health


class StreamRunningSensor(BaseSensorOperator):
    """Waits, in the triggerer, until the pipeline's stream reports `running`.

    Passes at once when the stream is healthy, or when it is meant to be stopped (a person
    stopped it); fails when the stream did not come up, so the supervisor's next run acts.
    """

    template_fields: Sequence[str] = ()
    ui_color = "#f3e5f5"

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        kwargs.setdefault("timeout", timedelta(minutes=5).total_seconds())
        if kwargs.get("execution_timeout") is None:
            kwargs["execution_timeout"] = execution_timeout("supervise")
        super().__init__(**kwargs)
        self.pipeline = pipeline

    def execute(self, context: Context) -> Any:
        health = stream_health(DualityHook().settings(), self.pipeline)
        if health["health"] == "healthy" or health["desired"] == "stopped":
            return self._done(health)
        self.defer(
            trigger=StreamRunningTrigger(self.pipeline),
            method_name="execute_complete",
            timeout=timedelta(seconds=float(self.timeout)),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        if event["health"] != "healthy" and event["desired"] != "stopped":
            raise AirflowException(
                f"the stream of {self.pipeline} did not come up: {event['health']} "
                f"({event['reason']}); the supervisor's next run acts on it"
            )
        return self._done(event)

    def _done(self, health: dict[str, Any]) -> dict[str, Any]:
        self.log.info("%s: %s (%s)", self.pipeline, health["health"], health["reason"])
        return health
