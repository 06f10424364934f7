"""Operators: each step of a DAG as `execute`, which turns its arguments into a `duality` command
that the hook runs (Spark work: snapshot, validate, publish, skew, repartition, reset), and
`on_kill`, which ends it. Supervising a stream is quick and runs in the task itself: it starts the
stream detached and returns, so the stream's life never holds a worker slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from duality_airflow.hooks import DualityHook, execution_timeout


class DualityTask(BaseOperator):
    """A task of duality's: its execution timeout is the settings field `<timeout_kind>_timeout_s`,
    and its Spark work runs as `duality` commands through its hook, which `on_kill` ends."""

    timeout_kind = ""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("execution_timeout") is None:
            kwargs["execution_timeout"] = execution_timeout(self.timeout_kind)
        super().__init__(**kwargs)

    @cached_property
    def hook(self) -> DualityHook:
        return DualityHook()

    def on_kill(self) -> None:
        self.hook.kill()


class SnapshotOperator(DualityTask):
    """Incremental snapshot of a pipeline; skips what follows when nothing new was written."""

    timeout_kind = "snapshot"
    ui_color = "#fdf3e1"

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline

    def execute(self, context: Context) -> Any:
        result = self.hook.run(["snapshot", self.pipeline])
        if result.get("fallback_reason"):
            self.log.warning("full rebuild instead of incremental: %s", result["fallback_reason"])
        if result.get("version") is None:
            pending = result.get("unvalidated_version")
            if pending is None:
                raise AirflowSkipException(
                    f"the changelog has not moved since version {result.get('previous_version')}:"
                    " nothing new to validate or publish"
                )
            # An earlier try or run built it and ended before its validation: finish its work.
            self.log.warning(
                "the changelog has not moved since version %s, which was never validated: "
                "passing it on to validation and publication",
                pending,
            )
            return {**result, "version": pending}
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


class ValidateOperator(DualityTask):
    """Great Expectations on one snapshot version; fails, visibly, when a check fails."""

    template_fields: Sequence[str] = ("version",)
    timeout_kind = "validate"
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
        report = self.hook.run(arguments)
        self.log.info(
            "version %s passed %s checks; report %s; Data Docs %s",
            report["version"],
            report["checks"],
            report["json_report"],
            report["data_docs"],
        )
        return report


class PublishOperator(DualityTask):
    """Publishes a version that passed validation; its outlet Asset tells readers."""

    template_fields: Sequence[str] = ("version",)
    timeout_kind = "publish"
    ui_color = "#dff0d8"

    def __init__(self, *, pipeline: str, version: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.version = version

    def execute(self, context: Context) -> Any:
        result = self.hook.run(["publish", self.pipeline, "--version", str(self.version)])
        for outlet in self.outlets:
            context["outlet_events"][outlet].extra = {
                "version": result["published_version"],
                "coverage": result["coverage"],
            }
        return result


class SuperviseStreamOperator(DualityTask):
    """One look of the stream supervisor: ensure (the schedule), or a person's start, stop,
    restart or rescale. Starts the stream detached and returns at once (a rescale waits for the
    stream it restarts). The run's `replicas` and `partitions` Params, when set, say how many
    drivers this host keeps (2: a warm standby) and the state partitions a rescale builds.
    Then it keeps the configured replicas of the tables running (`DUALITY_REPLICAS`,
    docs/serving.md): this host's is started again when it does not answer; a replica that
    stays down is a warning in the log and its result, never the stream's failure."""

    template_fields: Sequence[str] = ("action",)
    timeout_kind = "supervise"
    ui_color = "#ece4f7"

    def __init__(self, *, pipeline: str, action: str = "ensure", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.action = action

    def execute(self, context: Context) -> dict[str, Any]:
        from duality.errors import DualityError, UsageError
        from duality.spec import find_spec
        from duality.stream import health

        settings = self.hook.settings()
        params = context["params"]
        try:
            spec = find_spec(settings, self.pipeline)
            if self.action == "rescale":
                snapshot = spec.dag_id("snapshot")
                if context["ti"].get_dr_count(dag_id=snapshot, states=["running"]):
                    raise UsageError(
                        f"a run of {snapshot} is running: rescale {spec.name} after it ends "
                        "(a snapshot reads the changelog the rescale rebuilds from); nothing "
                        "was changed"
                    )
            result = health.supervise_once(
                settings,
                spec,
                self.action,  # type: ignore[arg-type]
                replicas=params.get("replicas"),
                partitions=params.get("partitions"),
            )
        except UsageError as error:
            raise AirflowFailException(str(error)) from None
        except DualityError as error:
            raise AirflowException(str(error)) from None
        self.log.info(
            "%s: %s (%s); action: %s",
            self.pipeline,
            result.health or result.state,
            result.reason or "",
            result.action,
        )
        return {
            **{k: v for k, v in vars(result).items() if k != "heartbeat"},
            "replicas": self._replicas(settings),
        }

    def _replicas(self, settings: Any) -> list[dict[str, Any]]:
        import dataclasses

        from duality.serve import control

        try:
            states = control.ensure(settings)
        except Exception as error:  # a replica never fails the stream's supervision
            self.log.warning("the replicas were not checked: %s", error)
            return []
        for state in states:
            if not state.healthy:
                self.log.warning("replica %s does not answer (%s)", state.url, state.action)
            elif state.action == "started":
                self.log.info("replica %s started again", state.url)
        return [dataclasses.asdict(state) for state in states]


class RepartitionOperator(DualityTask):
    """Skew check, then the exactly-once copy of one topic's new records (`move` is a dict of
    source, target, partitions, strategy, hot_keys, salts and dry_run)."""

    template_fields: Sequence[str] = ("move",)
    timeout_kind = "repartition"
    ui_color = "#fbe9e7"

    def __init__(self, *, move: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.move = move

    def execute(self, context: Context) -> dict[str, Any]:
        move = dict(self.move)
        source = move["source"]
        plots = self.hook.settings().reports / "skew"
        plots.mkdir(parents=True, exist_ok=True)
        # A daily check: the rate over the last hour says more than over the last minute.
        before = self.hook.run(
            ["skew", source, "--window", "1h", "--plot", str(plots / f"{source}.png")]
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
        moved = self.hook.run(arguments)
        return {"source": source, "target": move["target"], "skew": before, "result": moved}


class ResetOperator(DualityTask):
    """The application reset tool, after the person typed the pipeline name into `confirm`."""

    timeout_kind = "reset"
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
        return self.hook.run(arguments)
