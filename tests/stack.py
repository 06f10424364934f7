"""The whole local stack as `duality up` starts it (broker + Airflow standalone), on free ports
in a temporary folder, with the pipelines and repartition config the test writes there."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from duality.airflow_api import AirflowClient
from duality.config import Settings
from duality.local.airflow import AIRFLOW_USER, LocalAirflow
from duality.local.ports import free_port
from tests.harness import UP_TIMEOUT_S, duality_json, run_duality


@dataclass
class Stack:
    root: Path
    env: dict[str, str]
    settings: Settings
    client: AirflowClient
    password: str

    def duality(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return run_duality(self.env, *args, timeout=timeout)


def stack_env(root: Path) -> dict[str, str]:
    (root / "pipelines").mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "DUALITY_LOCAL_DIR": str(root / "local"),
        "DUALITY_WAREHOUSE": str(root / "warehouse"),
        "DUALITY_CHECKPOINT_ROOT": str(root / "checkpoints"),
        "DUALITY_REPORTS": str(root / "reports"),
        "DUALITY_PIPELINES": str(root / "pipelines"),
        "DUALITY_REPARTITION_CONFIG": str(root / "repartition.yaml"),
        "DUALITY_BOOTSTRAP_SERVERS": f"localhost:{free_port()}",
        "DUALITY_CONTROLLER_PORT": str(free_port()),
        "DUALITY_AIRFLOW_URL": f"http://localhost:{free_port()}",
    }


@contextlib.contextmanager
def running_stack(root: Path, env: dict[str, str] | None = None, *options: str) -> Iterator[Stack]:
    """`duality up [OPTIONS]` before, `duality down` after (also when the test failed)."""
    env = env or stack_env(root)

    try:
        started = duality_json(env, "up", *options, timeout=UP_TIMEOUT_S)
        settings = Settings.from_env(env)  # with what the stack recorded
        password = started["airflow"]["password"]
        client = AirflowClient(settings.airflow_url, started["airflow"]["user"], password)
        yield Stack(root, env, settings, client, password)
    finally:
        duality_json(env, "down", timeout=600)


@contextlib.contextmanager
def running_airflow(settings: Settings) -> Iterator[AirflowClient]:
    """Airflow standalone as `duality up` starts it (for the broker, folders and connections of
    `settings`), on a broker that is already running; stopped after."""
    airflow = LocalAirflow(settings)
    started = airflow.start()
    try:
        yield AirflowClient(settings.airflow_url, AIRFLOW_USER, str(started.password))
    finally:
        airflow.stop()


def task_logs(client: AirflowClient, dag_id: str, run_id: str, tail: int = 1500) -> str:
    """Each task of a run with its state, and the end of each try's log: why a run failed."""
    lines = []
    for task in client.task_instances(dag_id, run_id):
        lines.append(f"{task['task_id']}: {task['state']} (try {task['try_number']})")
        for attempt in range(1, int(task["try_number"] or 0) + 1):
            log = client.task_log(dag_id, run_id, task["task_id"], attempt)
            lines.append(f"--- {task['task_id']} try {attempt}:\n{log[-tail:]}")
    return "\n".join(lines)
