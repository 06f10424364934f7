"""The local stack's Prometheus and Pushgateway (`duality up --monitoring`) in a temporary
folder: a stream's target file is discovered and scraped, a batch step's push is scraped with
its own labels, the shipped alert rules are evaluated on both, and stopping leaves nothing; a
real stream under load watched by it: its metrics read back through Prometheus equal what was
produced, its endpoint answers while the broker is down, its SIGKILL fires "stream down", and
its restart resolves it."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import start_http_server

from duality import metrics, workload
from duality.config import Settings
from duality.errors import LocalStackError
from duality.kafka import topics
from duality.local.broker import LocalBroker, ephemeral_broker
from duality.local.monitoring import STREAMS_JOB, LocalMonitoring
from duality.metrics import StreamMetrics, push_step, target_files, write_target
from tests import truth
from tests.harness import (
    ROOT,
    StreamProcess,
    assert_eventually,
    duality_json,
    make_pipeline,
    read_topic,
)

EVENTS, LOAD_EVENTS, KEYS = 3_000, 3_000, 100
RULE_FOR_S = 60  # `for:` of DualityStreamDown in monitoring/alerts.yml
EVALUATION_S = 5  # scrape and rule evaluation interval of the local stack's Prometheus
WATCH_S = 0.25  # how often `_AlertWatch` asks Prometheus


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


def _one(monitoring: LocalMonitoring, query: str) -> float | None:
    """The value of a query that gives one series, else None."""
    values = [value for _, value in _samples(monitoring, query)]
    return values[0] if len(values) == 1 else None


def _epoch(text: str) -> float:
    """Epoch seconds of Prometheus' RFC 3339 times (nanoseconds cut to microseconds)."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    moment = datetime.fromisoformat(whole).replace(tzinfo=UTC)
    return moment.timestamp() + float(f"0.{fraction or 0}"[:8])


class _AlertWatch:
    """The state of one alert of one pipeline as Prometheus' /api/v1/alerts says it, asked
    every `WATCH_S` from the moment the watch is made (first in the caller's thread, then in
    a thread of its own): (wall time of the answer, state or None, the alert's `activeAt`)."""

    def __init__(self, monitoring: LocalMonitoring, alert: str, pipeline: str):
        self.monitoring, self.alert, self.pipeline = monitoring, alert, pipeline
        self.seen: list[tuple[float, str | None, float | None]] = []
        self._probe()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _probe(self) -> None:
        alerts = _api(self.monitoring, "alerts")["alerts"]
        answered = time.time()
        mine = [
            a
            for a in alerts
            if a["labels"]["alertname"] == self.alert
            and a["labels"].get("pipeline") == self.pipeline
        ]
        assert len(mine) <= 1, mine
        state = mine[0]["state"] if mine else None
        self.seen.append((answered, state, _epoch(mine[0]["activeAt"]) if mine else None))

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_S):
            with contextlib.suppress(OSError):  # a slow answer: the next one says
                self._probe()

    def first(self, state: str) -> tuple[float, float | None] | None:
        """(when, activeAt) of the first answer in `state`, or None."""
        return next(((t, at) for t, s, at in self.seen if s == state), None)

    def stop(self) -> list[tuple[float, str | None, float | None]]:
        self.stopping.set()
        self.thread.join(timeout=30)
        return self.seen


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
    watched = StreamMetrics("watched")
    watched.records_read.labels("watched").inc(1234)
    watched.dead_letters.labels("watched", "malformed_json").inc(7)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=watched.registry)
    settings = monitoring.settings
    try:
        write_target(
            target_files(settings, "watched")[0], f"127.0.0.1:{server.server_port}", "watched"
        )
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


def _scrape(settings: Settings, pipeline: str) -> str:
    """The stream's /metrics, at the address its target file names."""
    addresses = [address for name, address in metrics.stream_targets(settings) if name == pipeline]
    assert len(addresses) == 1, addresses
    with urllib.request.urlopen(f"http://{addresses[0]}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def test_prometheus_watches_a_stream_and_alerts_when_it_dies(
    base_settings: Settings, tmp_path: Path
):
    with ephemeral_broker(base_settings) as on_broker:
        broker = LocalBroker(on_broker)  # found in its own folder, under the session's
        monitoring = LocalMonitoring(on_broker.replace(local_dir=tmp_path / "local"))
        monitoring.start()
        # As `duality up --monitoring` records it: streams then serve Spark's metrics too.
        settings = monitoring.settings.replace(prometheus_url=monitoring.prometheus_url)
        api = monitoring
        pipelines = tmp_path / "pipelines"
        spec = make_pipeline(settings, pipelines, "product_sales")
        stream = StreamProcess(
            settings, spec, pipelines, tmp_path / "stream.log", max_offsets_per_trigger=1_000
        )
        try:
            topics.create_topic(settings, spec.source.topic, 3)
            workload.produce(settings, spec, events=EVENTS, keys=KEYS, bad_fraction=0.08, seed=3)
            stream.start()
            load = threading.Thread(
                target=workload.produce,
                args=(settings, spec),
                kwargs={
                    "events": LOAD_EVENTS,
                    "keys": KEYS,
                    "bad_fraction": 0.08,
                    "rate": 600,
                    "seed": 4,
                },
            )
            load.start()
            load.join(timeout=120)
            stream.wait_caught_up(timeout=180)

            source = read_topic(settings, spec.source.topic)
            assert len(source) == EVENTS + LOAD_EVENTS
            _, bad = truth.expected(spec, source)
            by_reason = Counter(metrics.reason_kind(reason) for reason in bad.values())
            assert len(by_reason) >= 4, by_reason  # several kinds of bad record
            name = spec.name
            assert_eventually(
                lambda: _one(api, f'sum(duality_records_read_total{{pipeline="{name}"}})'),
                float(len(source)),
                timeout=60,
                message="records read, as Prometheus scraped them",
            )
            assert_eventually(
                lambda: _one(api, f'sum(duality_consumer_lag_records{{pipeline="{name}"}})'),
                0.0,
                timeout=60,
                message="the lag, as Prometheus scraped it",
            )
            scraped = _samples(api, f'duality_dead_letters_total{{pipeline="{name}"}}')
            dead = {labels["reason"]: int(value) for labels, value in scraped}
            assert dead == {kind: by_reason.get(kind, 0) for kind in metrics.REASON_KINDS}
            assert_eventually(
                lambda: _one(api, f'duality_state_rows{{pipeline="{name}"}}'),
                float(len(truth.expected(spec, source)[0])),
                timeout=30,
            )
            assert _samples(api, f'up{{job="duality-spark", pipeline="{name}"}}'), (
                "Prometheus found no Spark driver target"
            )

            # The broker away: the endpoint still answers, and says so.
            broker.stop()
            try:
                assert_eventually(
                    lambda: f'duality_kafka_up{{pipeline="{name}"}} 0.0' in _scrape(settings, name),
                    timeout=60,
                    message="duality_kafka_up did not fall to 0 while the broker was down",
                )
            finally:
                broker.start()
            assert_eventually(
                lambda: f'duality_kafka_up{{pipeline="{name}"}} 1.0' in _scrape(settings, name),
                timeout=60,
            )

            # The stream SIGKILLed: its target stays and does not answer. The alert is watched
            # from the moment of the kill (its first answer comes before it).
            watch = _AlertWatch(api, "DualityStreamDown", name)
            killed = time.time()
            stream.kill()

            # Meanwhile (the alert waits out its minute), the batch steps as users run them push
            # their figures where Prometheus finds them.
            steps = settings.replace(
                pushgateway=monitoring.pushgateway_address,
                pipelines=pipelines,
                warehouse=tmp_path / "warehouse",
                reports=tmp_path / "reports",
            )
            built = duality_json(steps, "snapshot", name)
            duality_json(steps, "validate", name)
            pushed = assert_eventually(
                lambda: {
                    labels["step"]: value
                    for labels, value in _samples(api, f'duality_step_success{{pipeline="{name}"}}')
                },
                lambda found: set(found) == {"snapshot", "validate"},
                timeout=60,
            )
            assert pushed == {"snapshot": 1.0, "validate": 1.0}
            rows = _one(api, f'duality_step_rows{{pipeline="{name}", step="snapshot"}}')
            assert rows == built["rows"]
            age = _one(
                api, f'time() - duality_snapshot_published_timestamp_seconds{{pipeline="{name}"}}'
            )
            assert age is not None and 0 <= age < 300, age
            assert (
                _one(api, f'duality_snapshot_published_version{{pipeline="{name}"}}')
                == (built["version"])
            )

            assert_eventually(
                lambda: watch.first("firing"),
                timeout=RULE_FOR_S + 6 * EVALUATION_S + 30,
                interval=1,
                message="DualityStreamDown did not fire",
            )
            seen = watch.stop()
            _assert_fired_after_pending(seen, killed)
            assert _alerts(api, "DualityStreamDown") == [(name, "firing")]
            stream.start()
            assert_eventually(
                lambda: _alerts(api, "DualityStreamDown"),
                [],
                timeout=180,
                interval=1,
                message="DualityStreamDown did not resolve after the restart",
            )
        finally:
            stream.kill()
            monitoring.stop()


def _assert_fired_after_pending(
    seen: list[tuple[float, str | None, float | None]], killed: float
) -> None:
    """No alert until the kill; then pending, from an evaluation soon after the kill, without a
    break; then firing, no earlier than the rule's `for:` after it became pending (Prometheus'
    `activeAt`, and the watch's own first answer saying pending), and within three evaluations
    after that."""
    assert seen[0][0] <= killed and seen[0][1] is None, seen[:3]
    states = [state for _, state, _ in seen]
    changes = [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]
    assert changes == [None, "pending", "firing"], changes
    pending_seen, pending_at = next((t, at) for t, s, at in seen if s == "pending")
    firing_seen, firing_at = next((t, at) for t, s, at in seen if s == "firing")
    assert pending_at is not None and firing_at == pending_at, (pending_at, firing_at)
    # Found down by the first scrape after the kill, made pending by the next evaluation.
    assert killed - 1 <= pending_at <= killed + 4 * EVALUATION_S, (killed, pending_at)
    assert firing_seen - pending_at >= RULE_FOR_S, (pending_at, firing_seen)
    assert firing_seen - pending_seen >= RULE_FOR_S - 2 * WATCH_S - 1, (pending_seen, firing_seen)
    late = firing_seen - pending_at - RULE_FOR_S
    assert late <= 3 * EVALUATION_S, f"fired {late:.1f}s after its `for:` had passed"
