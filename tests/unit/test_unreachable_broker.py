"""A command pointed at a closed port fails fast with a message that says what to do."""

from __future__ import annotations

import json

from duality.local.ports import free_port
from tests.harness import run_duality


def test_closed_port_fails_with_clear_message():
    address = f"localhost:{free_port()}"  # nothing listens there
    # The 15 s limit is the requirement itself: a hang fails the test with TimeoutExpired.
    result = run_duality({"DUALITY_BOOTSTRAP_SERVERS": address}, "lag", timeout=15)
    assert result.returncode == 2
    assert address in result.stderr
    assert "duality up" in result.stderr
    assert "DUALITY_BOOTSTRAP_SERVERS" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_closed_port_json_error():
    address = f"localhost:{free_port()}"
    env = {"DUALITY_BOOTSTRAP_SERVERS": address, "DUALITY_CONNECT_TIMEOUT_S": "2"}
    result = run_duality(env, "lag", "--json", timeout=15)
    assert result.returncode == 2
    error = json.loads(result.stdout)
    assert error["exit_code"] == 2
    assert address in error["error"]


def test_status_reports_the_cluster_the_settings_name():
    """Whatever runs locally, `status` checks DUALITY_BOOTSTRAP_SERVERS and exits 1 when it is
    closed, naming the address, within 15 s."""
    address = "127.0.0.1:1"
    result = run_duality({"DUALITY_BOOTSTRAP_SERVERS": address}, "status", "--json", timeout=15)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["broker"]["reachable"] is False and address in report["error"]
