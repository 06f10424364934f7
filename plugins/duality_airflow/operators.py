"""Operators: each step of a DAG is one `duality` library call.

Spark work (snapshot, validate, publish, skew, repartition, reset) runs as a `duality ... --json`
child process with the task's settings, so a JVM never lives in an Airflow worker, its log lines
stream into the task log, and its JSON result becomes the task's XCom. Exit code 1 (a check
failed) fails the task and may be retried; exit code 2 (bad input) fails it without retries.
Supervising a stream is quick and runs in the task itself: it starts the stream detached and
returns, so the stream's life never holds a worker slot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from duality_airflow import hooks

if TYPE_CHECKING:
    from duality.config import Settings


def run_duality(arguments: Sequence[str], log: Any, settings: Settings | None = None) -> Any:
    """Run `duality ARGUMENTS --json` with the task's settings; its JSON result, or an error."""
    settings = settings or hooks.settings()
    command = [sys.executable, "-m", "duality.cli", *map(str, arguments), "--json"]
    log.info("running %s", " ".join(command[2:]))
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **settings.as_env()},
    )

    def relay() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            if line.strip():
                log.info("%s", line.rstrip())

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    assert process.stdout is not None
    output = process.stdout.read()
    code = process.wait()
    relay_thread.join(10)
    try:
        result = json.loads(output) if output.strip() else None
    except json.JSONDecodeError:
        result = None
    if code == 0:
        return result
    message = (result or {}).get("error") if isinstance(result, dict) else None
    message = message or f"`duality {' '.join(map(str, arguments))}` exited with code {code}"
    if code == 2:
        raise AirflowFailException(message)  # bad input: retrying cannot help
    raise AirflowException(message)


class DualityOperator(BaseOperator):
    """Runs one `duality` command (templated arguments) and returns its JSON result."""

    template_fields: Sequence[str] = ("arguments",)
    ui_color = "#e8f1fb"

    def __init__(self, *, arguments: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.arguments = list(arguments)

    def execute(self, context: Context) -> Any:
        return run_duality([a for a in self.arguments if a not in ("", None)], self.log)


class SnapshotOperator(BaseOperator):
    """Incremental snapshot of a pipeline; skips what follows when nothing new was written."""

    ui_color = "#fdf3e1"

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline

    def execute(self, context: Context) -> Any:
        result = run_duality(["snapshot", self.pipeline], self.log)
        if result.get("fallback_reason"):
            self.log.warning("full rebuild instead of incremental: %s", result["fallback_reason"])
        if result.get("version") is None:
            raise AirflowSkipException(
                f"the changelog has not moved since version {result.get('previous_version')}: "
                "nothing new to validate or publish"
            )
        self.log.info(
            "version %s (%s): %s rows; %s inserted, %s updated, %s deleted",
            result["version"],
            result["mode"],
            result["rows"],
            result["inserted"],
            result["updated"],
            result["deleted"],
        )
        return result


class ValidateOperator(BaseOperator):
    """Great Expectations on one snapshot version; fails, visibly, when a check fails."""

    template_fields: Sequence[str] = ("version",)
    ui_color = "#e3f4e8"

    def __init__(self, *, pipeline: str, version: str, reconcile: bool = False, **kw: Any):
        super().__init__(**kw)
        self.pipeline = pipeline
        self.version = version
        self.reconcile = reconcile

    def execute(self, context: Context) -> Any:
        arguments = ["validate", self.pipeline, "--version", str(self.version), "--no-publish"]
        if self.reconcile:
            arguments.append("--reconcile")
        report = run_duality(arguments, self.log)
        self.log.info(
            "version %s passed %s checks; report %s; Data Docs %s",
            report["version"],
            report["checks"],
            report["json_report"],
            report["data_docs"],
        )
        return report


class PublishOperator(BaseOperator):
    """Publishes a version that passed validation; its outlet Asset tells readers."""

    template_fields: Sequence[str] = ("version",)
    ui_color = "#dff0d8"

    def __init__(self, *, pipeline: str, version: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.version = version

    def execute(self, context: Context) -> Any:
        result = run_duality(["publish", self.pipeline, "--version", str(self.version)], self.log)
        for outlet in self.outlets:
            context["outlet_events"][outlet].extra = {
                "version": result["published_version"],
                "coverage": result["coverage"],
            }
        return result


class SuperviseStreamOperator(BaseOperator):
    """One look of the stream supervisor: ensure (the schedule), or a person's start, stop or
    restart. Starts the stream detached and returns at once."""

    template_fields: Sequence[str] = ("action",)
    ui_color = "#ece4f7"

    def __init__(self, *, pipeline: str, action: str = "ensure", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.action = action

    def execute(self, context: Context) -> dict[str, Any]:
        from duality import stream_control
        from duality.errors import DualityError, UsageError
        from duality.spec import find_spec

        settings = hooks.settings()
        try:
            spec = find_spec(settings, self.pipeline)
            result = stream_control.supervise_once(settings, spec, self.action)  # type: ignore[arg-type]
        except UsageError as error:
            raise AirflowFailException(str(error)) from None
        except DualityError as error:
            raise AirflowException(str(error)) from None
        self.log.info(
            "%s: %s (%s); action: %s",
            self.pipeline,
            result.get("health", result.get("state")),
            result.get("reason", ""),
            result["action"],
        )
        return {k: v for k, v in result.items() if k != "heartbeat"}


class RepartitionOperator(BaseOperator):
    """Skew check, then the exactly-once copy of one topic's new records (`move` is a dict of
    source, target, partitions, strategy, hot_keys, salts and dry_run)."""

    template_fields: Sequence[str] = ("move",)
    ui_color = "#fbe9e7"

    def __init__(self, *, move: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.move = move

    def execute(self, context: Context) -> dict[str, Any]:
        move = dict(self.move)
        source = move["source"]
        settings = hooks.settings()
        plots = settings.reports / "skew"
        plots.mkdir(parents=True, exist_ok=True)
        # A daily check: the rate over the last hour says more than over the last minute.
        before = run_duality(
            ["skew", source, "--window", "1h", "--plot", str(plots / f"{source}.png")],
            self.log,
            settings,
        )
        self.log.info(
            "%s: skew (max/mean) rate %.2f, size %.2f; hot partitions %s; advice: %s",
            source,
            before["skew_rate"],
            before["skew_size"],
            before["hot_partitions"],
            before["recommendation"].get("reason"),
        )
        arguments = [
            "repartition",
            source,
            "--to",
            move["target"],
            "--partitions",
            str(move["partitions"]),
            "--strategy",
            move["strategy"],
        ]
        if move.get("hot_keys"):
            arguments += ["--hot-keys", move["hot_keys"]]
        if move.get("salts"):
            arguments += ["--salts", str(move["salts"])]
        if move.get("dry_run"):
            arguments.append("--dry-run")
        moved = run_duality(arguments, self.log, settings)
        return {"source": source, "target": move["target"], "skew": before, "result": moved}


class ResetOperator(BaseOperator):
    """The application reset tool, after the person typed the pipeline name into `confirm`."""

    ui_color = "#fdecea"

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline

    def execute(self, context: Context) -> Any:
        params = context["params"]
        if params.get("confirm") != self.pipeline:
            raise AirflowFailException(
                f"not confirmed: type {self.pipeline!r} into the confirm field to reset it "
                f"(got {params.get('confirm')!r}); nothing was changed"
            )
        arguments = ["reset", self.pipeline]
        if params.get("to_datetime"):
            arguments += ["--to-datetime", str(params["to_datetime"])]
        if params.get("dry_run"):
            arguments.append("--dry-run")
        return run_duality(arguments, self.log)
