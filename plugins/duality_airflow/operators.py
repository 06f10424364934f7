"""Operators: each step of a DAG is one `duality` library call.

Spark work (snapshot, validate, publish, skew, repartition, reset) runs as a `duality ... --json`
child process with the task's settings, so a JVM never lives in an Airflow worker, its log lines
stream into the task log, and its JSON result becomes the task's XCom. The child runs in a
process group of its own and dies with the task: a task that is stopped (set to failed, say) or
reaches its `execution_timeout` ends the whole group, SIGTERM first and SIGKILL after
`kill_grace_s` (docs/decisions/0009-airflow-task-processes.md). Exit code 1 (a check failed)
fails the task and may be retried; exit code 2 (bad input) fails it without retries; exit code
0 without a JSON result fails it too. Supervising a stream is quick and runs in the task itself:
it starts the stream detached and returns, so the stream's life never holds a worker slot.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from duality_airflow import hooks

if TYPE_CHECKING:
    from duality.config import Settings

_PR_SET_PDEATHSIG = 1
try:  # resolved here: the child between fork and exec should only make the call
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_task() -> None:
    """In the child, before exec: the kernel kills it when the task's process dies, even by
    SIGKILL (its Spark JVM then sees its stdin close and exits)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ChildProcess:
    """A command a task runs: in its own process group, ended as a group when the task stops."""

    def __init__(self, command: Sequence[str], env: dict[str, str], log: Any, grace_s: float):
        self.command = list(command)
        self.env = env
        self.log = log
        self.grace_s = grace_s
        self.process: subprocess.Popen[str] | None = None

    def run(self) -> Any:
        """Run the command to its end; its JSON result, or an Airflow exception saying why not."""
        self.log.info("running %s", " ".join(self.command[2:]))
        process = self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,  # not the task's own stdin (Airflow's channel to it)
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
            start_new_session=True,  # its own process group (and session): one signal for all
            preexec_fn=_die_with_task,
        )

        def relay() -> None:
            assert process.stderr is not None
            for line in process.stderr:
                if line.strip():
                    self.log.info("%s", line.rstrip())

        relay_thread = threading.Thread(target=relay, daemon=True)
        relay_thread.start()
        assert process.stdout is not None
        try:
            output = process.stdout.read()
            code = process.wait()
        finally:
            # Also when the execution timeout's exception interrupts the read: nothing the
            # command started outlives the task's attempt.
            self.stop()
        relay_thread.join(10)
        return _result(self.command, code, output)

    def stop(self) -> None:
        """SIGTERM to the group, up to `grace_s` for it to exit, then SIGKILL to what is left."""
        process = self.process
        if process is None:
            return
        group = process.pid  # the leader of its own group
        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            return  # the whole group has exited
        self.log.info("stopping process group %s (%s)", group, " ".join(self.command[2:]))
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, so it no longer counts
            if not _group_alive(group):
                return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
            self.log.warning("process group %s killed after %.1fs", group, self.grace_s)
        process.poll()


def _group_alive(group: int) -> bool:
    """Whether a process of the group still runs (zombies waiting to be reaped do not count)."""
    import psutil

    for candidate in psutil.process_iter(["status"]):
        try:
            if os.getpgid(candidate.pid) == group and candidate.info["status"] != "zombie":
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def _result(command: Sequence[str], code: int, output: str) -> Any:
    """The JSON result of a command that exited with `code`, or the exception failing the task."""
    try:
        result = json.loads(output) if output.strip() else None
    except json.JSONDecodeError:
        result = None
    what = f"`{' '.join(command[2:])}`"
    if code == 0:
        if result is None:
            raise AirflowException(f"{what} exited with code 0 but printed no JSON result")
        return result
    message = result.get("error") if isinstance(result, dict) else None
    if code < 0:
        with contextlib.suppress(ValueError):
            message = f"{what} was ended by {signal.Signals(-code).name}"
    message = message or f"{what} exited with code {code}"
    if code == 2:
        raise AirflowFailException(message)  # bad input: retrying cannot help
    raise AirflowException(message)


def duality_command(arguments: Sequence[Any]) -> list[str]:
    return [sys.executable, "-m", "duality.cli", *map(str, arguments), "--json"]


class DualityTask(BaseOperator):
    """A task of duality's: its execution timeout is the settings field `<timeout_kind>_timeout_s`
    and its Spark work runs as `duality` commands in child processes (`run_duality`)."""

    timeout_kind = ""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("execution_timeout") is None:
            kwargs["execution_timeout"] = hooks.execution_timeout(self.timeout_kind)
        super().__init__(**kwargs)
        self._child: ChildProcess | None = None

    def run_duality(self, arguments: Sequence[Any], settings: Settings | None = None) -> Any:
        """Run `duality ARGUMENTS --json` with the task's settings; its JSON result."""
        settings = settings or hooks.settings()
        self._child = ChildProcess(
            duality_command([a for a in arguments if a not in ("", None)]),
            {**os.environ, **settings.as_env()},
            self.log,
            settings.kill_grace_s,
        )
        return self._child.run()

    def on_kill(self) -> None:
        if self._child is not None:
            self._child.stop()


class SnapshotOperator(DualityTask):
    """Incremental snapshot of a pipeline; skips what follows when nothing new was written."""

    timeout_kind = "snapshot"
    ui_color = "#fdf3e1"

    def __init__(self, *, pipeline: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline

    def execute(self, context: Context) -> Any:
        result = self.run_duality(["snapshot", self.pipeline])
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
        report = self.run_duality(arguments)
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
        result = self.run_duality(["publish", self.pipeline, "--version", str(self.version)])
        for outlet in self.outlets:
            context["outlet_events"][outlet].extra = {
                "version": result["published_version"],
                "coverage": result["coverage"],
            }
        return result


class SuperviseStreamOperator(DualityTask):
    """One look of the stream supervisor: ensure (the schedule), or a person's start, stop or
    restart. Starts the stream detached and returns at once."""

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

        settings = hooks.settings()
        try:
            spec = find_spec(settings, self.pipeline)
            result = health.supervise_once(settings, spec, self.action)  # type: ignore[arg-type]
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
        return {k: v for k, v in vars(result).items() if k != "heartbeat"}


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
        settings = hooks.settings()
        plots = settings.reports / "skew"
        plots.mkdir(parents=True, exist_ok=True)
        # A daily check: the rate over the last hour says more than over the last minute.
        before = self.run_duality(
            ["skew", source, "--window", "1h", "--plot", str(plots / f"{source}.png")], settings
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
        moved = self.run_duality(arguments, settings)
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
        return self.run_duality(arguments)
