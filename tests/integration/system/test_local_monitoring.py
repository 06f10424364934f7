"""The local stack's Prometheus and Pushgateway (`duality up --monitoring`) in a temporary
folder: a stream's target file is discovered and scraped, a batch step's push is scraped with
its own labels, the shipped alert rules are evaluated on both, and stopping leaves nothing."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import start_http_server

from duality.config import Settings
from duality.errors import LocalStackError
from duality.local.monitoring import STREAMS_JOB, LocalMonitoring
from duality.metrics import StreamMetrics, push_step, target_file, write_target
from tests.harness import ROOT, assert_eventually


def _processes_under(folder: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(str(folder) in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.fixture
def monitoring(tmp_path: Path) -> Iterator[LocalMonitoring]:
    settings = Settings.from_env().replace(local_dir=tmp_path / "local")
    local = LocalMonitoring(settings)
    try:
        yield local
    finally:
        local.stop()
    assert _processes_under(tmp_path) == [], "Prometheus or the Pushgateway was left running"


def _api(monitoring: LocalMonitoring, path: str, **query: str) -> Any:
    url = f"{monitoring.prometheus_url}/api/v1/{path}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=5) as answer:
        document = json.load(answer)
    assert document["status"] == "success", document
    return document["data"]


def _samples(monitoring: LocalMonitoring, query: str) -> list[tuple[dict[str, str], float]]:
    result = _api(monitoring, "query", query=query)["result"]
    return [(series["metric"], float(series["value"][1])) for series in result]


def _alerts(monitoring: LocalMonitoring, name: str) -> list[tuple[str, str]]:
    """(pipeline, state) of each alert `name`, pending or firing."""
    return sorted(
        (alert["labels"].get("pipeline", ""), alert["state"])
        for alert in _api(monitoring, "alerts")["alerts"]
        if alert["labels"]["alertname"] == name
    )


def test_streams_and_batch_steps_are_scraped_and_alerted_on(monitoring: LocalMonitoring):
    started = monitoring.start()
    assert started.already_running is False
    assert started.prometheus.ready and started.pushgateway.ready
    again = monitoring.start()
    assert again.already_running is True
    assert (again.prometheus.pid, again.pushgateway.pid) == (
        started.prometheus.pid,
        started.pushgateway.pid,
    )
    groups = _api(monitoring, "rules")["groups"]
    rules = [rule["name"] for group in groups for rule in group["rules"]]
    assert "DualityStreamDown" in rules and "DualityValidationFailed" in rules
    # Prometheus takes every query of the shipped dashboard.
    for dashboard in (ROOT / "monitoring" / "grafana" / "dashboards").glob("*.json"):
        for panel in json.loads(dashboard.read_text())["panels"]:
            for target in panel["targets"]:
                query = target["expr"].replace("$pipeline", ".*")
                _api(monitoring, "query", query=query.replace("$__rate_interval", "1m"))

    # A stream's endpoint, found through its target file as a stream writes it.
    metrics = StreamMetrics("watched")
    metrics.records_read.labels("watched").inc(1234)
    metrics.dead_letters.labels("watched", "malformed_json").inc(7)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    settings = monitoring.settings
    try:
        write_target(target_file(settings, "watched"), f"127.0.0.1:{server.server_port}", "watched")
        read = assert_eventually(
            lambda: _samples(monitoring, 'duality_records_read_total{pipeline="watched"}'),
            timeout=60,
            message="the stream's records read never reached Prometheus",
        )
        assert [(labels["job"], value) for labels, value in read] == [(STREAMS_JOB, 1234.0)]
        dead = _samples(monitoring, 'duality_dead_letters_total{reason="malformed_json"}')
        assert [value for _, value in dead] == [7.0]

        # A failed validation, pushed: scraped with the push's own labels, and alerted on.
        pushed = settings.replace(pushgateway=monitoring.pushgateway_address)
        push_step(pushed, "validate", "watched", seconds=2.5, success=False)
        verdict = assert_eventually(
            lambda: _samples(monitoring, 'duality_validation_success{pipeline="watched"}'),
            timeout=60,
            message="the pushed verdict never reached Prometheus",
        )
        ((labels, value),) = verdict
        assert (labels["job"], labels["step"], value) == ("duality", "validate", 0.0)
        assert_eventually(
            lambda: _alerts(monitoring, "DualityValidationFailed"),
            [("watched", "firing")],
            timeout=60,
        )
        assert _alerts(monitoring, "DualityStreamDown") == []
    finally:
        server.shutdown()
        server.server_close()
    # The stream's endpoint is gone but its target stays (a killed driver's does): it is down,
    # and the alert is pending for its minute.
    assert_eventually(
        lambda: _alerts(monitoring, "DualityStreamDown"), [("watched", "pending")], timeout=60
    )

    stopped = monitoring.stop()
    assert stopped.pids == {
        "prometheus": started.prometheus.pid,
        "pushgateway": started.pushgateway.pid,
    }
    assert monitoring.status().state == "stopped"
    assert monitoring.stop().was_running is False


def test_missing_programs_name_the_make_target(
    monitoring: LocalMonitoring, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("PATH", str(monitoring.root))  # a folder without Prometheus
    missing = r"prometheus is not installed: run `make monitoring`"
    with pytest.raises(LocalStackError, match=missing):
        monitoring.start()
    assert monitoring.status().state == "stopped"
