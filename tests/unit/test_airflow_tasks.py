"""What duality's Airflow tasks guarantee about their child processes and their trigger's
arguments, without an Airflow: the operators and the trigger used directly."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import psutil
import pytest

from duality.config import Settings
from tests.harness import ROOT, assert_eventually, own_airflow_home

LOG = logging.getLogger("test")


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """duality_airflow importable, with an Airflow home of its own and no connections."""
    own_airflow_home()
    monkeypatch.syspath_prepend(str(ROOT / "plugins"))
    from duality_airflow import hooks, operators, triggers

    monkeypatch.setattr(hooks, "settings", lambda *_: Settings.from_env())
    return operators, triggers


def test_a_task_whose_child_exits_0_without_a_json_result_fails(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    operators, _ = plugins
    from airflow.sdk.exceptions import AirflowException

    monkeypatch.setattr(operators, "duality_command", lambda _: [sys.executable, "-c", "pass"])
    task = operators.SnapshotOperator(task_id="snapshot", pipeline="product_sales")
    with pytest.raises(AirflowException, match="exited with code 0 but printed no JSON result"):
        task.execute({})


def test_stopping_a_child_ends_its_whole_group_sigkill_after_the_grace(plugins):  # type: ignore[no-untyped-def]
    operators, _ = plugins
    # The child starts a grandchild that ignores SIGTERM, then waits.
    script = (
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "time.sleep(600)\n"
    )
    child = operators.ChildProcess([sys.executable, "-c", script], dict(os.environ), LOG, 1.0)
    ended: list[BaseException] = []

    def run() -> None:
        try:
            child.run()
        except BaseException as error:
            ended.append(error)

    running = threading.Thread(target=run, daemon=True)
    running.start()
    group = assert_eventually(lambda: child.process and child.process.pid, timeout=10)
    tree = assert_eventually(lambda: psutil.Process(group).children(), timeout=10)
    child.stop()  # what on_kill does
    running.join(10)
    assert not running.is_alive() and "ended by SIGTERM" in str(ended[0])
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_the_trigger_carries_connection_ids_not_settings(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    _, triggers = plugins
    monkeypatch.setenv("DUALITY_SASL_PASSWORD", "s3cret")
    classpath, arguments = triggers.StreamRunningTrigger("product_sales").serialize()
    assert classpath == "duality_airflow.triggers.StreamRunningTrigger"
    assert arguments == {
        "pipeline": "product_sales",
        "kafka_conn_id": "kafka_default",
        "spark_conn_id": "spark_default",
        "poll_s": 3.0,
    }
    assert "s3cret" not in json.dumps(arguments)
