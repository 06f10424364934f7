"""A stream watched by a real Prometheus (Debian's, started as `duality up --monitoring` does):
its metrics read back through Prometheus' HTTP API equal what was produced; the endpoint keeps
answering while the broker is down; the stream's SIGKILL fires the "stream down" alert, and its
restart resolves it."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from duality import kafka, metrics, workload
from duality.config import Settings
from duality.local.broker import LocalBroker, ephemeral_broker
from duality.local.monitoring import LocalMonitoring
from tests import truth
from tests.harness import StreamProcess, assert_eventually, make_pipeline, read_topic

EVENTS, LOAD_EVENTS, KEYS = 3_000, 3_000, 100
RULE_FOR_S = 60  # `for:` of DualityStreamDown in monitoring/alerts.yml
EVALUATION_S = 5  # scrape and rule evaluation interval of the local stack's Prometheus


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())


def _query(prometheus: str, expression: str) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant query's result: its series' labels and values."""
    answer = _get(f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expression})}")
    assert answer["status"] == "success", answer
    return {
        tuple(sorted(series["metric"].items())): float(series["value"][1])
        for series in answer["data"]["result"]
    }


def _one(prometheus: str, expression: str) -> float | None:
    values = list(_query(prometheus, expression).values())
    return values[0] if len(values) == 1 else None


def _stream_down(prometheus: str, pipeline: str) -> list[str]:
    """The states (pending, firing) of DualityStreamDown alerts for `pipeline`."""
    alerts = _get(f"{prometheus}/api/v1/alerts")["data"]["alerts"]
    return [
        alert["state"]
        for alert in alerts
        if alert["labels"].get("alertname") == "DualityStreamDown"
        and alert["labels"].get("pipeline") == pipeline
    ]


def _scrape(settings: Settings, pipeline: str) -> str:
    """The stream's /metrics, at the address its target file names."""
    addresses = [address for name, address in metrics.stream_targets(settings) if name == pipeline]
    assert len(addresses) == 1, addresses
    with urllib.request.urlopen(f"http://{addresses[0]}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def test_prometheus_watches_a_stream_and_alerts_when_it_dies(
    base_settings: Settings, tmp_path: Path
):
    with ephemeral_broker(base_settings) as settings:
        settings = settings.replace(local_dir=tmp_path / "local")
        monitoring = LocalMonitoring(settings)
        monitoring.start()
        pipelines = tmp_path / "pipelines"
        spec = make_pipeline(settings, pipelines, "product_sales")
        stream = StreamProcess(
            settings, spec, pipelines, tmp_path / "stream.log", max_offsets_per_trigger=1_000
        )
        try:
            prometheus = monitoring.prometheus_url
            kafka.create_topic(settings, spec.source.topic, 3)
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
                lambda: _one(prometheus, f'sum(duality_records_read_total{{pipeline="{name}"}})'),
                float(len(source)),
                timeout=60,
                message="records read, as Prometheus scraped them",
            )
            assert_eventually(
                lambda: _one(prometheus, f'sum(duality_consumer_lag_records{{pipeline="{name}"}})'),
                0.0,
                timeout=60,
                message="the lag, as Prometheus scraped it",
            )
            scraped = _query(prometheus, f'duality_dead_letters_total{{pipeline="{name}"}}')
            dead = {dict(labels)["reason"]: int(value) for labels, value in scraped.items()}
            assert dead == {kind: by_reason.get(kind, 0) for kind in metrics.REASON_KINDS}
            assert _one(prometheus, f'duality_state_rows{{pipeline="{name}"}}') == len(
                truth.expected(spec, source)[0]
            )
            assert _query(prometheus, f'up{{job="duality-spark", pipeline="{name}"}}'), (
                "Prometheus found no Spark driver target"
            )

            # The broker away: the endpoint still answers, and says so.
            broker = LocalBroker(settings)
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

            # The stream SIGKILLed: its target stays and does not answer.
            stream.kill()
            killed = time.monotonic()
            assert_eventually(
                lambda: _stream_down(prometheus, name),
                ["firing"],
                timeout=RULE_FOR_S + 6 * EVALUATION_S + 30,
                interval=1,
                message="DualityStreamDown did not fire",
            )
            fired_after = time.monotonic() - killed
            assert fired_after >= RULE_FOR_S, fired_after  # not before the rule's `for:`
            stream.start()
            assert_eventually(
                lambda: _stream_down(prometheus, name),
                [],
                timeout=180,
                interval=1,
                message="DualityStreamDown did not resolve after the restart",
            )
        finally:
            stream.kill()
            monitoring.stop()
