"""The Airflow client of `duality demo` and the tests, against a real HTTP server: a request that
changes nothing twice is asked again when Airflow's database was busy, others are not."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from duality.airflow_api import AirflowClient
from duality.errors import LocalStackError

BUSY = json.dumps({"detail": {"reason": "Database error", "statement": "hidden"}}).encode()


class _Airflow(BaseHTTPRequestHandler):
    """Answers a token, and "Database error" to the first two PATCHes and every run asked for."""

    calls: ClassVar[list[str]] = []

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.calls.append(f"POST {self.path}")
        if self.path == "/auth/token":
            self._answer(201, json.dumps({"access_token": "t"}).encode())
        else:
            self._answer(500, BUSY)

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.calls.append(f"PATCH {self.path}")
        patches = sum(call.startswith("PATCH") for call in self.calls)
        if patches <= 2:
            self._answer(500, BUSY)
        else:
            self._answer(200, b'{"is_paused": false}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def airflow() -> Iterator[str]:
    _Airflow.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Airflow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_busy_database_is_asked_again_only_for_idempotent_requests(airflow: str):
    client = AirflowClient(airflow, "admin", "pw")
    client.set_paused("duality_x_snapshot", False)  # 500, 500, then 200
    assert _Airflow.calls.count("PATCH /api/v2/dags/duality_x_snapshot") == 3
    with pytest.raises(LocalStackError, match="answered 500 to POST /api/v2/dags/d/dagRuns"):
        client.trigger("d")  # a run started twice would be two runs: not asked again
    assert _Airflow.calls.count("POST /api/v2/dags/d/dagRuns") == 1
