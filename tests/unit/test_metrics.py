"""duality.metrics without a stream: reason kinds, a batch's counts, lag, the push of a step."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from duality import metrics
from duality.config import Settings
from duality.errors import UsageError
from duality.stream.changelog_writer import BatchResult


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("null value", "null_value"),
        ("oversized: 2000000 bytes, the limit is 1000000", "oversized"),
        ("malformed JSON: not one JSON value", "malformed_json"),
        ("not a JSON object", "not_an_object"),
        ("wrong type for quantity: expected long", "wrong_type"),
        ("missing field product", "missing_field"),
        ("null key field region", "null_key"),
        ("late event: its window ended at 2026-01-01T00:00:00Z, not after ...", "late"),
        ("fields.unit_price: position 7: division by zero", "run_time_error"),
    ],
)
def test_a_reason_has_a_kind_for_its_label(reason: str, kind: str):
    assert metrics.reason_kind(reason) == kind
    assert kind in metrics.REASON_KINDS


def _values(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # type: ignore[no-untyped-def]
    from prometheus_client import generate_latest

    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_a_batch_counts_its_records_dead_letters_and_lag():
    stream = metrics.StreamMetrics("orders")
    p = (("pipeline", "orders"),)
    values = _values(stream.registry)
    # Every reason exists before its first dead letter, at 0, so a rate() has a start.
    for kind in metrics.REASON_KINDS:
        assert values[("duality_dead_letters_total", (*p, ("reason", kind)))] == 0
    assert values[("duality_kafka_up", p)] == 0

    result = BatchResult(3, records=100, dead_lettered=7, late=2, filtered=5, updated_keys=40)
    result.reasons = {"late": 2, "wrong_type": 5}
    result.seconds, result.commit_seconds = 0.8, 0.05
    stream.batch(result)
    stream.batch(result)
    stream.committed({0: 150, 1: 50})
    stream.end_offsets({0: 160, 1: 50, 2: 3})
    stream.state(1234, 5678)
    values = _values(stream.registry)
    assert values[("duality_records_read_total", p)] == 200
    assert values[("duality_records_aggregated_total", p)] == 2 * (100 - 7 - 5)
    assert values[("duality_records_filtered_total", p)] == 10
    assert values[("duality_dead_letters_total", (*p, ("reason", "wrong_type")))] == 10
    assert values[("duality_dead_letters_total", (*p, ("reason", "late")))] == 4
    assert values[("duality_late_records_total", p)] == 4
    assert values[("duality_changelog_records_total", p)] == 80
    assert values[("duality_batch_duration_seconds_count", p)] == 2
    assert values[("duality_batch_records_sum", p)] == 200
    assert values[("duality_transaction_commit_seconds_sum", p)] == pytest.approx(0.1)
    lag = {
        partition: values[("duality_consumer_lag_records", (("partition", partition), *p))]
        for partition in ("0", "1", "2")
    }
    assert lag == {"0": 10, "1": 0, "2": 3}
    assert values[("duality_kafka_up", p)] == 1
    assert values[("duality_state_rows", p)] == 1234
    # Kafka away: the lag keeps its last values, and says so.
    stream.end_offsets(None)
    values = _values(stream.registry)
    assert values[("duality_kafka_up", p)] == 0
    assert values[("duality_consumer_lag_records", (("partition", "0"), *p))] == 10


class _Gateway(BaseHTTPRequestHandler):
    pushes: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.pushes.append(("PUT", self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    server = HTTPServer(("127.0.0.1", 0), _Gateway)
    _Gateway.pushes = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}", _Gateway.pushes
    finally:
        server.shutdown()
        server.server_close()


def test_a_step_pushes_its_figures_to_its_own_group(tmp_path: Path, gateway):  # type: ignore[no-untyped-def]
    address, pushes = gateway
    settings = Settings(home=tmp_path, pushgateway=address)
    metrics.push_step(
        settings,
        "validate",
        "orders",
        seconds=4.5,
        success=True,
        figures={"rows": 10, "version": 7, "published_version": 7, "published_at": 1.7e9},
    )
    ((method, path, body),) = pushes
    assert (method, path) == ("PUT", "/metrics/job/duality/pipeline/orders/step/validate")
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }
    assert samples == {
        "duality_step_duration_seconds": 4.5,
        "duality_step_success": 1,
        "duality_step_last_run_timestamp_seconds": pytest.approx(time.time(), abs=60),
        "duality_step_rows": 10,
        "duality_step_version": 7,
        "duality_validation_success": 1,
        "duality_snapshot_published_version": 7,
        "duality_snapshot_published_timestamp_seconds": 1.7e9,
    }
    assert set(samples) <= set(metrics.PUSHED_METRICS)


def test_a_push_that_fails_is_a_warning_not_the_steps_failure(tmp_path: Path, caplog):  # type: ignore[no-untyped-def]
    # Nothing listens on port 9 here (discard), so the push is refused at once.
    settings = Settings(home=tmp_path, pushgateway="127.0.0.1:9", connect_timeout_s=1)
    metrics.push_step(settings, "snapshot", "orders", seconds=1, success=False)
    assert "were not pushed to the Pushgateway 127.0.0.1:9" in caplog.text


def test_metrics_settings_are_checked(tmp_path: Path):
    with pytest.raises(UsageError, match="DUALITY_PUSHGATEWAY='http://x:9091' is not host:port"):
        Settings(home=tmp_path, pushgateway="http://x:9091")
    with pytest.raises(UsageError, match="DUALITY_METRICS_PORT=-2"):
        Settings(home=tmp_path, metrics_port=-2)
    assert Settings.from_env({"DUALITY_METRICS_PORT": "-1"}).metrics_port == -1
