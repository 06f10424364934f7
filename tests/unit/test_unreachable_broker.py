"""A command pointed at a closed port fails fast with a message that says what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from duality.local.ports import free_port


def test_closed_port_fails_with_clear_message():
    address = f"localhost:{free_port()}"  # nothing listens there
    env = {**os.environ, "DUALITY_BOOTSTRAP_SERVERS": address}
    # The 15 s limit is the requirement itself: a hang fails the test with TimeoutExpired.
    result = subprocess.run(
        [sys.executable, "-m", "duality.cli", "lag"],
        env=env,
        capture_output=True,
        text=True,
        timeout=15,
    )
    assert result.returncode == 2
    assert address in result.stderr
    assert "duality up" in result.stderr
    assert "DUALITY_BOOTSTRAP_SERVERS" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_closed_port_json_error():
    address = f"localhost:{free_port()}"
    env = {**os.environ, "DUALITY_BOOTSTRAP_SERVERS": address, "DUALITY_CONNECT_TIMEOUT_S": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "duality.cli", "lag", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=15,
    )
    assert result.returncode == 2
    error = json.loads(result.stdout)
    assert error["exit_code"] == 2
    assert address in error["error"]


def test_status_reports_the_cluster_the_settings_name():
    """Whatever runs locally, `status` checks DUALITY_BOOTSTRAP_SERVERS and exits 1 when it is
    closed, naming the address, within 15 s."""
    address = "127.0.0.1:1"
    env = {**os.environ, "DUALITY_BOOTSTRAP_SERVERS": address}
    result = subprocess.run(
        [sys.executable, "-m", "duality.cli", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=15,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["broker"]["reachable"] is False and address in report["error"]
