"""What users see of a joined pipeline outside its stream: `duality stream status` names the
table, its lag and the heartbeat's unmatched events; the demo's table rows carry the keys its
orders do; the demo's summary reports every pipeline it ran and the pipelines page's address.
Kafka is faked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from duality import workload
from duality.cli.stack import demo_summary
from duality.cli.streams import stream_status_line
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, offsets, records, topics
from duality.spec import PipelineSpec
from duality.stream import control, heartbeat
from tests.harness import make_pipeline


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, pipelines=tmp_path / "pipelines", local_dir=tmp_path / "local")


@pytest.fixture
def joined(settings: Settings) -> PipelineSpec:
    return make_pipeline(settings, settings.pipelines, "tier_sales")  # orders x customers


class FakeKafka:
    """Topics' end offsets and the groups' committed offsets, and what was produced."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ends: dict[str, dict[int, int]]):
        self.ends = ends
        self.committed: dict[tuple[str, str], dict[int, int]] = {}
        self.created: dict[str, tuple[int, dict[str, str]]] = {}
        self.sent: list[tuple[str, str, str]] = []
        monkeypatch.setattr(client, "ensure_reachable", lambda settings: 1)
        monkeypatch.setattr(topics, "topic_exists", self.topic_exists)
        monkeypatch.setattr(offsets, "end_offsets", lambda settings, topic: dict(self.ends[topic]))
        monkeypatch.setattr(offsets, "committed_offsets", self.committed_offsets)
        monkeypatch.setattr(topics, "create_topic", self.create_topic)
        monkeypatch.setattr(client, "producer", lambda settings, **_: self)
        monkeypatch.setattr(records, "send", self.send)

    def topic_exists(self, settings: Settings, name: str, **_: Any) -> bool:
        return name in self.ends

    def committed_offsets(
        self, settings: Settings, group: str, topic: str
    ) -> dict[int, tuple[int, None]]:
        return {p: (o, None) for p, o in self.committed.get((group, topic), {}).items()}

    def create_topic(
        self, settings: Settings, name: str, partitions: int, *, config: Any, exist_ok: bool
    ) -> None:
        self.created[name] = (partitions, dict(config))
        self.ends.setdefault(name, {})

    def send(self, producer: Any, topic: str, key: str, value: str) -> None:
        self.sent.append((topic, key, value))

    def poll(self, _: float) -> int:
        return 0

    def flush(self, _: float) -> int:
        return 0


def test_status_names_the_table_its_lag_and_the_unmatched(settings, joined, monkeypatch):
    fake = FakeKafka(monkeypatch, {joined.source.topic: {0: 100, 1: 50}, "customers": {0: 40}})
    fake.committed[(joined.consumer_group, joined.source.topic)] = {0: 100, 1: 45}
    fake.committed[(joined.consumer_group, "customers")] = {0: 38}
    beat = {"state": "running", "last_progress_ms": 0, "batch_id": 4, "unmatched": 1234}
    monkeypatch.setattr(heartbeat, "latest", lambda settings: {joined.name: beat})

    state = control.describe(settings, joined)
    assert state.lag == 5
    assert state.tables == [control.TableLag("customers", "customers", "inner", None, 2)]
    line = stream_status_line(state)
    assert "; lag 5; table customers (topic customers, inner join): lag 2; 1,234 events " in line
    assert "unmatched" in line
    assert json.loads(json.dumps(control.dataclasses.asdict(state)))["tables"][0]["lag"] == 2

    # The table's topic gone: its lag unknown, said so.
    del fake.ends["customers"]
    assert control.table_lag(settings, joined) is None
    line = stream_status_line(control.describe(settings, joined))
    assert "table customers (topic customers, inner join): lag unknown (no topic)" in line


def test_status_of_a_pipeline_without_a_join_says_no_table(settings, monkeypatch):
    plain = make_pipeline(settings, settings.pipelines, "product_sales")
    FakeKafka(monkeypatch, {plain.source.topic: {0: 10}})
    beat = {"state": "running", "last_progress_ms": 0, "unmatched": 0}
    monkeypatch.setattr(heartbeat, "latest", lambda settings: {plain.name: beat})
    state = control.describe(settings, plain)
    assert state.tables == [] and control.table_lag(settings, plain) is None
    line = stream_status_line(state)
    assert "lag 10" in line and "table" not in line and "unmatched" not in line


def test_the_demo_table_has_a_row_for_the_orders_customers_but_the_last(
    settings, joined, monkeypatch
):
    fake = FakeKafka(monkeypatch, {})
    values = {"tier": ["gold", "silver"], "region": ["north"]}
    report = workload.produce_table(settings, joined, rows=950, values=values, seed=7)
    assert report.topic == "customers" and report.produced == 950
    assert fake.created["customers"][1]["cleanup.policy"] == "compact"
    rows = {key: json.loads(value) for _, key, value in fake.sent}
    assert sorted(rows) == [f"customer-{i:03d}" for i in range(950)]
    assert all(row["customer"] == key for key, row in rows.items())  # the record key is the row's
    assert {row["tier"] for row in rows.values()} == {"gold", "silver"}
    assert {row["region"] for row in rows.values()} == {"north"}
    # The orders' customers are the same values: 1,000 of them, the last 50 without a row.
    orders = workload.Workload(joined, keys=10, zipf=1.0, bad_fraction=0.1, seed=7)
    assert "missing_key" not in orders.kinds  # the key is the table's: no order misses it
    valid = [json.loads(v or b"") for _, v, kind in orders.records(5000) if kind == "valid"]
    customers = {order["customer"] for order in valid}
    assert customers <= {f"customer-{i:03d}" for i in range(1000)} and len(customers) > 950
    # Again with the seed: the same rows.
    fake.sent.clear()
    workload.produce_table(settings, joined, rows=950, values=values, seed=7)
    assert {key: json.loads(value) for _, key, value in fake.sent} == rows


def test_the_demo_table_needs_a_join(settings, monkeypatch):
    FakeKafka(monkeypatch, {})
    plain = make_pipeline(settings, settings.pipelines, "product_sales")
    with pytest.raises(UsageError, match="joins no table"):
        workload.produce_table(settings, plain)


def _published(rows: int) -> dict[str, Any]:
    return {
        "run_id": "r",
        "version": 0,
        "rows": rows,
        "mode": "full",
        "validation": "passed",
        "checks": 12,
        "report": "/r/latest.json",
        "data_docs": "/r/data_docs/index.html",
    }


def _produced(topic: str) -> dict[str, Any]:
    return {"topic": topic, "produced": 3000, "valid": 2940, "bad": {"malformed": 60}}


def test_the_demo_summary_reports_every_pipeline_and_the_page():
    stream = {"source_records": 3000, "keys": 3, "pid": 1}
    result = {
        "pipeline": "product_sales",
        "airflow": "http://localhost:8080",
        "pipelines_page": "http://localhost:8080/plugin/duality-pipelines",
        "seconds": 95.0,
        "dead_letters": 60,
        "repartition": {
            "source": "orders",
            "target": "orders-12",
            "partitions": "6 -> 12",
            "copied_this_run": 3000,
            "target_records": 3000,
            "skew_before": 3.1,
            "skew_after": 1.2,
            "plot": "/r/skew/orders.png",
        },
        "pipelines": {
            "product_sales": {
                "source": "orders",
                "produced": _produced("orders"),
                "stream": {**stream, "keys": 495},
                "snapshot": _published(495),
                "dead_letters": 60,
            },
            "regional_sales": {
                "source": "regional_orders",
                "produced": _produced("regional_orders"),
                "stream": {**stream, "keys": 120},
                "snapshot": _published(120),
                "dead_letters": 61,
            },
            "tier_sales": {
                "source": "orders",
                "produced": _produced("orders"),
                "stream": {**stream, "unmatched": 147},
                "snapshot": _published(3),
                "dead_letters": 58,
                "table": {"name": "customers", "topic": "customers", "join": "inner", "rows": 950},
            },
        },
    }
    console = Console(record=True, width=400)
    console.print(demo_summary(result))
    text = " ".join(console.export_text().split())
    assert "3 pipelines in 95s" in text
    for name in ("product_sales", "regional_sales", "tier_sales"):
        assert name in text
    assert "3,000 to orders (60 bad); 3,000 to regional_orders (60 bad); 950 table rows to " in text
    assert "inner join with table customers (customers), 147 events without a row" in text
    assert "version 0 published (120 rows, full)" in text  # regional_sales's snapshot
    assert "http://localhost:8080/plugin/duality-pipelines" in text
