"""The stream supervisor's rules, and how Airflow connections become settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from duality.errors import BrokerUnavailable, UsageError
from duality.stream.health import STALL_AFTER_S, backoff_s, diagnose
from duality.stream.supervisor import BROKER_AWAY_EXIT, entry_point
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


class FakeSlots:
    """This host's two stream slots as `control` sees them, without processes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, primary: bool, standby: bool):
        from duality.stream import control, health

        self.running = {False: primary, True: standby}
        self.started: list[list[str]] = []
        self.stopped = 0
        monkeypatch.setattr(
            control,
            "running_pid",
            lambda settings, spec, standby=False: 10 + standby if self.running[standby] else None,
        )
        monkeypatch.setattr(control, "stream_options", lambda pid: ["--trigger-seconds", "2"])
        monkeypatch.setattr(health, "start", self.start)
        monkeypatch.setattr(control, "stop_standby", self.stop_standby)

    def start(self, settings, spec, *, wait=True, job_args=()):  # type: ignore[no-untyped-def]
        self.started.append(list(job_args))
        self.running["--standby" in job_args] = True

    def stop_standby(self, settings, spec) -> bool:  # type: ignore[no-untyped-def]
        self.stopped += 1
        self.running[True] = False
        return True


@pytest.mark.parametrize(
    ("desired", "replicas", "primary", "standby", "expected", "started", "stopped"),
    [
        ("running", 2, True, False, "started", [["--trigger-seconds", "2", "--standby"]], 0),
        ("running", 2, True, True, None, [], 0),
        ("running", 2, False, False, None, [], 0),  # no stream: no standby on its own
        ("running", 1, True, True, "stopped", [], 1),
        ("stopped", 2, False, True, "stopped", [], 1),
        ("running", 1, True, False, None, [], 0),
    ],
)
def test_the_standby_follows_the_wanted_replicas(  # type: ignore[no-untyped-def]
    monkeypatch, tmp_path, desired, replicas, primary, standby, expected, started, stopped
):
    from duality.config import Settings
    from duality.spec import find_spec
    from duality.stream import control, health

    settings = Settings.from_env().replace(local_dir=tmp_path)
    spec = find_spec(settings, "product_sales")
    control.Wanted(desired, [], replicas).save(settings, spec)
    slots = FakeSlots(monkeypatch, primary, standby)
    assert health._match_replicas(settings, spec) == expected
    assert slots.started == started and slots.stopped == stopped


def test_replicas_are_kept_and_checked(tmp_path):  # type: ignore[no-untyped-def]
    from duality.config import Settings
    from duality.errors import UsageError
    from duality.spec import find_spec
    from duality.stream import control, health

    settings = Settings.from_env().replace(local_dir=tmp_path)
    spec = find_spec(settings, "product_sales")
    with pytest.raises(UsageError, match="replicas 3"):
        health.supervise_once(settings, spec, "stop", replicas=3)
    assert control.Wanted.load(settings, spec).replicas == 1
    control.set_desired(settings, spec, "running")
    control.set_replicas(settings, spec, 2)
    control.set_desired(settings, spec, "stopped")
    assert control.Wanted.load(settings, spec) == control.Wanted("stopped", [], 2)


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


def test_a_rescale_waits_for_a_running_snapshot(hooks, monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """Asked while a run of the pipeline's snapshot DAG runs, the supervisor's task fails
    with the reason and changes nothing (the rescale is never planned)."""
    from airflow.sdk.exceptions import AirflowFailException
    from duality_airflow.operators import SuperviseStreamOperator

    from duality.stream import health

    asked: list[tuple[str, list[str]]] = []

    class TaskInstance:
        @staticmethod
        def get_dr_count(dag_id: str, states: list[str]) -> int:
            asked.append((dag_id, states))
            return 1

    monkeypatch.setenv("DUALITY_LOCAL_DIR", str(tmp_path))
    monkeypatch.setattr(health, "supervise_once", lambda *a, **k: pytest.fail("it went ahead"))
    task = SuperviseStreamOperator(task_id="supervise", pipeline="product_sales", action="rescale")
    with pytest.raises(AirflowFailException, match="duality_product_sales_snapshot is running"):
        task.execute({"params": {"replicas": None, "partitions": 8}, "ti": TaskInstance()})  # type: ignore[arg-type]
    assert asked == [("duality_product_sales_snapshot", ["running"])]


def _takeover(monkeypatch, answers, wait_s: float = 60.0) -> list[int]:  # type: ignore[no-untyped-def]
    """Run `await_takeover` for the ended driver 5 over heartbeat histories `answers` (one per
    look, the last repeated); the number of looks it took."""
    import threading
    import time

    from duality.stream import supervisor
    from duality.stream.supervisor import await_takeover

    looks: list[int] = []

    def history(_settings, since_ms):  # type: ignore[no-untyped-def]
        assert since_ms < time.time() * 1000 - 10_000, "a waiting standby beats every 5 s"
        looks.append(1)
        answer = answers[min(len(looks), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(supervisor.heartbeat, "history", history)
    monkeypatch.setattr(supervisor, "TAKEOVER_POLL_S", 0.0)
    monkeypatch.setattr(supervisor, "TAKEOVER_WAIT_S", wait_s)
    spec = type("Spec", (), {"name": "p"})()
    await_takeover(None, spec, 5, threading.Event())  # type: ignore[arg-type]
    return looks


def test_a_replacement_waits_for_the_standby_to_take_over(monkeypatch):
    import time

    later = time.time() * 1000 + 60_000
    standby = {"p@standby": [{"pid": 8, "state": "standby"}]}
    taken = {"p@standby": [{"pid": 8, "state": "active"}]}
    progress = {"state": "running", "last_progress_ms": later, "committed_offsets": {}}
    running = {**taken, "p": [{"pid": 5, **progress}]}
    started = {**taken, "p": [{"pid": 8, "state": "running", "last_progress_ms": later}]}
    ran = {**taken, "p": [{"pid": 8, **progress}]}
    # Waits while the standby waits, takes over and starts its query (no progress yet); the
    # ended driver's beats do not count.
    assert len(_takeover(monkeypatch, [standby, taken, running, started, ran])) == 5


def test_a_replacement_starts_at_once_without_a_standby(monkeypatch):
    assert len(_takeover(monkeypatch, [{}])) == 1
    # The ended driver was the standby itself, or the standby said it stopped.
    assert len(_takeover(monkeypatch, [{"p@standby": [{"pid": 5, "state": "standby"}]}])) == 1
    assert len(_takeover(monkeypatch, [{"p@standby": [{"pid": 8, "state": "stopped"}]}])) == 1
    assert len(_takeover(monkeypatch, [RuntimeError("Kafka away")])) == 1


def test_a_replacement_waits_no_longer_than_its_limit(monkeypatch):
    # A standby that waits on (the first test's first answer) but never takes over: looked at
    # again and again, then given up on.
    standby = {"p@standby": [{"pid": 8, "state": "standby"}]}
    assert len(_takeover(monkeypatch, [standby], wait_s=0.05)) > 1


def test_a_driver_that_finds_no_broker_exits_for_a_new_one_not_for_good():
    """Kafka away at a driver's start is an outage to wait out: the driver exits with the code
    its supervisor restarts on, not with a usage error's, which would end the stream."""

    def broker_away(*_: object) -> int:
        raise BrokerUnavailable("timed out after 10s waiting for Kafka")

    def bad_spec(*_: object) -> int:
        raise UsageError("bad spec")

    argv = ["product_sales"]
    assert entry_point("driver", broker_away, argv) == BROKER_AWAY_EXIT != UsageError.exit_code
    assert entry_point("driver", bad_spec, argv) == UsageError.exit_code


def test_the_supervisor_keeps_the_replicas_and_never_fails_for_them(hooks, monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """After the stream's look, the supervisor's task runs `serve.control.ensure` and returns
    the replicas' states; a replica down, or the check failing, leaves the task a success."""
    from duality_airflow.operators import SuperviseStreamOperator

    from duality.serve import control
    from duality.stream import health

    result = type("Result", (), {"state": "running", "health": "healthy", "reason": None})()
    result.action = "none"  # type: ignore[attr-defined]
    monkeypatch.setenv("DUALITY_LOCAL_DIR", str(tmp_path))
    monkeypatch.setattr(health, "supervise_once", lambda *a, **k: result)
    states = [
        control.ReplicaState("http://127.0.0.1:7080", True, "started"),
        control.ReplicaState("http://10.0.0.2:7080", False, "down"),
    ]
    monkeypatch.setattr(control, "ensure", lambda settings: states)
    task = SuperviseStreamOperator(task_id="supervise", pipeline="product_sales")
    done = task.execute({"params": {}, "ti": None})  # type: ignore[arg-type]
    assert done["replicas"] == [
        {"url": "http://127.0.0.1:7080", "healthy": True, "action": "started"},
        {"url": "http://10.0.0.2:7080", "healthy": False, "action": "down"},
    ]

    def broken(settings):  # type: ignore[no-untyped-def]
        raise OSError("no route")

    monkeypatch.setattr(control, "ensure", broken)
    assert task.execute({"params": {}, "ti": None})["replicas"] == []  # type: ignore[arg-type]


_SUPERVISOR = """
import subprocess, sys
from duality.stream.supervisor import _driver_setup
probe = (
    "import os, pathlib; group = pathlib.Path('/proc/self/autogroup'); "
    "print(os.nice(0), group.read_text().split()[-1] if group.exists() else 'none')"
)
if sys.argv[1] == "nested":  # the supervisor is not its session's leader
    command = [sys.executable, "-c", sys.argv[2], "leads", sys.argv[2]]
    print(subprocess.run(command, capture_output=True, text=True).stdout, end="")
else:
    done = subprocess.run(
        [sys.executable, "-c", probe], preexec_fn=_driver_setup(7), capture_output=True, text=True
    )
    print(done.stdout, end="")
"""


def test_a_nice_stream_lowers_its_own_session_not_a_terminal_s():
    """DUALITY_STREAM_NICE: the driver is nice, and so is its session's autogroup when the
    supervisor leads the session (as `duality stream start` runs it), which it shares with no
    one else; a supervisor in another's session (a terminal's) leaves the session as it is. Each
    case in a session of its own, so the test's session is never touched."""
    import subprocess

    def run(how: str) -> list[str]:
        command = [sys.executable, "-c", _SUPERVISOR, how, _SUPERVISOR]
        done = subprocess.run(command, capture_output=True, text=True, start_new_session=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    grouped = Path("/proc/self/autogroup").exists()  # a kernel with autogroups
    assert run("leads") == ["7", "7" if grouped else "none"]
    assert run("nested") == ["7", "0" if grouped else "none"]


def test_a_stalled_driver_logs_where_each_thread_waits():
    """What a driver logs as it exits stalled (decision 33): every thread by name, each with
    the stack of where it is, down to the call it waits in."""
    import threading

    from duality.stream.driver import thread_stacks

    waiting, release = threading.Event(), threading.Event()

    def commit_transaction() -> None:  # a thread that waits, as a hung commit would
        waiting.set()
        release.wait(30)

    waiter = threading.Thread(target=commit_transaction, name="waiting-commit")
    waiter.start()
    try:
        assert waiting.wait(30)
        stacks = thread_stacks()
    finally:
        release.set()
        waiter.join(30)
    assert "--- thread MainThread:" in stacks and "in test_a_stalled_driver_logs" in stacks
    assert "--- thread waiting-commit:" in stacks and "in commit_transaction" in stacks
