"""A small client of Airflow's REST API (v2), for `duality demo` and the tests.

It logs in through the auth manager's `/auth/token`, and then unpauses DAGs, triggers runs with
a configuration (the DAG's Params), and waits for runs to end, all as a user of the UI would.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from duality.errors import LocalStackError

_FINISHED = ("success", "failed")
# A request that changes nothing twice is asked again when Airflow's database was busy (SQLite,
# the local stack's default, answers "database is locked" under load; Airflow shows it as a 500
# "Database error"): after 1, 2, 4 and 8 s.
_IDEMPOTENT = ("GET", "PATCH")
_BUSY_RETRIES = 4


class AirflowClient:
    def __init__(self, url: str, username: str, password: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.username = username
        self.password = password
        self.timeout = timeout
        self._token: str | None = None

    def _call(self, method: str, path: str, body: Any = None, auth: bool = True) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, method=method, headers=headers
        )
        for attempt in range(_BUSY_RETRIES + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read()
                break
            except urllib.error.HTTPError as error:
                detail = error.read().decode(errors="replace")[:500]
                busy = error.code == 500 and "Database error" in detail
                if busy and method in _IDEMPOTENT and attempt < _BUSY_RETRIES:
                    time.sleep(2.0**attempt)
                    continue
                raise LocalStackError(
                    f"Airflow at {self.url} answered {error.code} to {method} {path}: {detail}"
                ) from None
            except OSError as error:
                raise LocalStackError(
                    f"Airflow does not answer at {self.url} ({error}): start it with `duality "
                    "up`, or point DUALITY_AIRFLOW_URL at it"
                ) from None
        return json.loads(text) if text else None

    def token(self) -> str:
        if self._token is None:
            answer = self._call(
                "POST",
                "/auth/token",
                {"username": self.username, "password": self.password},
                auth=False,
            )
            self._token = str(answer["access_token"])
        return self._token

    def dag(self, dag_id: str) -> dict[str, Any] | None:
        try:
            return dict(self._call("GET", f"/api/v2/dags/{dag_id}"))
        except LocalStackError as error:
            if " 404 " in str(error):
                return None
            raise

    def wait_for_dag(self, dag_id: str, timeout: float = 180.0) -> dict[str, Any]:
        """Wait until the DAG processor has parsed `dag_id`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.dag(dag_id)
            if found is not None:
                return found
            time.sleep(1)
        errors = self.import_errors()
        raise LocalStackError(
            f"DAG {dag_id} did not appear in Airflow within {timeout:g}s"
            + (f"; import errors: {errors}" if errors else "")
        )

    def import_errors(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/v2/importErrors").get("import_errors", []))

    def set_paused(self, dag_id: str, paused: bool) -> None:
        self._call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": paused})

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        """Start a run now with `conf` (the Params); returns its run id."""
        answer = self._call(
            "POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}}
        )
        return str(answer["dag_run_id"])

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        quoted = urllib.parse.quote(run_id, safe="")
        return dict(self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quoted}"))

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        answer = self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns?order_by=-start_date&limit=50")
        return list(answer.get("dag_runs", []))

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        quoted = urllib.parse.quote(run_id, safe="")
        answer = self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quoted}/taskInstances")
        return list(answer.get("task_instances", []))

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, state: str) -> None:
        """Set a task instance's state (`failed`, `success`, `skipped`), as the UI's buttons do."""
        quoted = urllib.parse.quote(run_id, safe="")
        self._call(
            "PATCH",
            f"/api/v2/dags/{dag_id}/dagRuns/{quoted}/taskInstances/{task_id}",
            {"new_state": state},
        )

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """The log of one try of a task instance, as text."""
        quoted = urllib.parse.quote(run_id, safe="")
        answer = self._call(
            "GET",
            f"/api/v2/dags/{dag_id}/dagRuns/{quoted}/taskInstances/{task_id}/logs/{try_number}"
            "?full_content=true",
        )
        return json.dumps(answer.get("content"), default=str)

    def xcom(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> Any:
        quoted = urllib.parse.quote(run_id, safe="")
        answer = self._call(
            "GET",
            f"/api/v2/dags/{dag_id}/dagRuns/{quoted}/taskInstances/{task_id}/xcomEntries/"
            f"return_value?map_index={map_index}&deserialize=true",
        )
        return answer.get("value")

    def wait_run(
        self,
        dag_id: str,
        run_id: str,
        timeout: float = 900.0,
        progress: Callable[[str], None] = lambda _: None,
    ) -> dict[str, Any]:
        """Wait until the run ends; returns it (its `state` says how)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.run(dag_id, run_id)
            if found.get("state") in _FINISHED:
                return found
            if time.monotonic() > deadline:
                raise LocalStackError(
                    f"run {run_id} of {dag_id} did not finish within {timeout:g}s "
                    f"(state {found.get('state')}); see {self.url}/dags/{dag_id}"
                )
            tasks = self.task_instances(dag_id, run_id)
            busy = [t["task_id"] for t in tasks if t.get("state") in ("running", "deferred")]
            progress(f"{dag_id}: {found.get('state')}" + (f" ({', '.join(busy)})" if busy else ""))
            time.sleep(2)
