"""The pipelines page's data (`duality.overview`) with fakes of Kafka and Prometheus: every spec
gets a row, a running stream, one that never ran, Kafka down (faked, and a closed port for
real, within seconds), a spec that does not load, the snapshot read from a Delta log written by
hand, the charts from the heartbeats or Prometheus, and a joined pipeline's table and its lag."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from duality import overview
from duality.config import Settings
from duality.errors import BrokerUnavailable, DualityError
from duality.local.ports import free_port
from duality.overview import Point, Sources
from duality.spec import PipelineSpec
from duality.stream.control import TableLag
from duality.stream.health import STALL_AFTER_S
from tests.harness import make_pipeline

NOW = 1_800_000_000.0


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path,
        pipelines=tmp_path / "pipelines",
        warehouse=tmp_path / "warehouse",
        reports=tmp_path / "reports",
        local_dir=tmp_path / "local",
    )


@pytest.fixture
def specs(settings: Settings) -> tuple[PipelineSpec, PipelineSpec]:
    running = make_pipeline(settings, settings.pipelines, "product_sales")
    idle = make_pipeline(settings, settings.pipelines, "product_sales")
    return running, idle


def _beat(**fields: Any) -> dict[str, Any]:
    return {"state": "running", "last_progress_ms": int((NOW - 5) * 1000), **fields}


def _sources(
    beats: dict[str, dict[str, Any]] | None = None,
    history: dict[str, list[dict[str, Any]]] | None = None,
    lag: int | None = 7,
    **overrides: Any,
) -> Sources:
    fakes: dict[str, Any] = {
        "reachable": lambda settings: 1,
        "heartbeats": lambda settings: beats or {},
        "history": lambda settings, since_ms: history or {},
        "lag": lambda settings, spec: lag,
        "table_lag": _no_table_lag,
        "prometheus": _no_prometheus,
        "clock": lambda: NOW,
    }
    return Sources(**{**fakes, **overrides})


def _no_table_lag(_: Settings, spec: PipelineSpec) -> int | None:
    raise AssertionError(f"a table's lag was read for {spec.name}, which joins no table")


def _no_prometheus(*_: Any) -> overview.Series:
    raise AssertionError("Prometheus was asked although no DUALITY_PROMETHEUS_URL is set")


def _row(found: overview.Overview, spec: PipelineSpec) -> overview.PipelineView:
    return next(p for p in found.pipelines if p.name == spec.name)


def test_a_running_stream_and_one_that_never_ran(settings, specs):
    running, idle = specs
    beat = _beat(
        batch_id=12,
        last_batch_ms=int((NOW - 20) * 1000),
        input_rows_per_second=250.5,
        dead_lettered=3,
        state_rows=40,
    )
    found = overview.overview(settings, _sources({running.name: beat}))
    assert found.kafka_up and found.kafka_error is None
    assert [p.name for p in found.pipelines] == sorted([running.name, idle.name])
    stream = _row(found, running).stream
    assert stream == overview.StreamView(
        state="running",
        heartbeat_age_s=5.0,
        input_rate=250.5,
        lag=7,
        last_batch=12,
        last_batch_age_s=20.0,
        dead_letters=3,
        state_rows=40,
    )
    never = _row(found, idle)
    assert never.stream == overview.StreamView(state="never ran", lag=7)
    assert never.snapshot == overview.SnapshotView(exists=False)
    assert never.dags == {
        "stream": f"duality_{idle.name}_stream",
        "snapshot": f"duality_{idle.name}_snapshot",
        "reset": f"duality_{idle.name}_reset",
    }
    assert never.source_topic == idle.source.topic


def test_an_idle_stream_reads_nothing_and_keeps_its_last_batch(settings, specs):
    running, _ = specs
    beat = _beat(idle=True, batch_id=4, last_batch_ms=int((NOW - 90) * 1000))
    stream = _row(overview.overview(settings, _sources({running.name: beat})), running).stream
    assert stream is not None
    assert stream.input_rate == 0.0 and stream.last_batch == 4 and stream.last_batch_age_s == 90


def test_a_silent_or_failed_stream_is_said(settings, specs):
    running, idle = specs
    old = int((NOW - STALL_AFTER_S - 1) * 1000)
    beats = {
        running.name: _beat(last_progress_ms=old),
        idle.name: _beat(state="failed", error="the query died"),
    }
    found = overview.overview(settings, _sources(beats))
    silent, failed = _row(found, running).stream, _row(found, idle).stream
    assert silent is not None and silent.silent and silent.state == "running"
    assert failed is not None and failed.state == "failed" and failed.error == "the query died"
    assert not failed.silent


def test_a_joined_pipeline_names_its_table_its_lag_and_the_unmatched(settings, specs):
    plain, _ = specs
    joined = make_pipeline(settings, settings.pipelines, "tier_sales")  # an inner join
    beats = {joined.name: _beat(batch_id=3, unmatched=11), plain.name: _beat(unmatched=0)}
    asked: list[str] = []

    def table_lag(_: Settings, spec: PipelineSpec) -> int:
        asked.append(spec.name)
        return 5

    found = overview.overview(settings, _sources(beats, table_lag=table_lag))
    row = _row(found, joined)
    assert row.tables == [TableLag("customers", "customers", "inner", None, 5)]
    assert asked == [joined.name]  # read for the joined pipeline alone
    assert row.stream is not None and row.stream.unmatched == 11 and row.stream.lag == 7
    unjoined = _row(found, plain)
    assert unjoined.tables == [] and unjoined.stream is not None
    assert unjoined.stream.unmatched is None  # joins nothing: not said
    shown = json.loads(json.dumps(found.as_dict()))  # what pipelines.json serves
    (table,) = next(p for p in shown["pipelines"] if p["name"] == joined.name)["tables"]
    assert table == {
        "name": "customers",
        "topic": "customers",
        "join": "inner",
        "pipeline": None,
        "lag": 5,
    }

    def down(_: Settings) -> int:
        raise BrokerUnavailable("timed out after 2s waiting for Kafka at localhost:9")

    # Kafka down: the table is still named, its lag unknown.
    found = overview.overview(settings, _sources(reachable=down, table_lag=table_lag))
    row = _row(found, joined)
    assert row.stream is None and row.tables == [TableLag("customers", "customers", "inner")]


def _write_delta_log(path: Path, spec: PipelineSpec, *, passed: bool = True) -> None:
    """A snapshot's Delta log as duality leaves it: version 0 written, version 1 the validation
    of version 0 (publishing it when it passed); the commit files only."""
    log = path / "_delta_log"
    log.mkdir(parents=True)
    coverage = {
        "changelog_topic": spec.changelog_topic,
        "changelog_topic_id": "id",
        "changelog": {"0": 5},
        "source_topic": spec.source.topic,
        "source": {"0": 9},
    }
    verdict = {
        "version": 0,
        "success": passed,
        "checks": 16,
        "failed": [] if passed else ["expect_column_values_to_be_between [spec]"],
        "reconciled": False,
        "validated_at": "2027-01-15T08:00:00Z",
        "json_report": "/reports/latest.json",
    }
    commits = [
        ("WRITE", NOW - 7200, {"kind": "snapshot", "mode": "full", "coverage": coverage}),
        ("SET TBLPROPERTIES", NOW - 3600, {"kind": "validation", "validation": verdict}),
    ]
    schema = {"type": "struct", "fields": [{"name": "product"}, {"name": "orders"}]}
    for version, (operation, at, metadata) in enumerate(commits):
        info = {
            "timestamp": int(at * 1000),
            "operation": operation,
            "userMetadata": json.dumps({"duality": metadata}),
        }
        properties = {}
        if passed and version == 1:
            properties = {
                "duality.published.version": "0",
                "duality.published.coverage": json.dumps(coverage),
            }
        actions: list[dict[str, Any]] = [
            {"commitInfo": info},
            {"metaData": {"schemaString": json.dumps(schema), "configuration": properties}},
        ]
        if version == 0:
            add = {"path": "part-0.parquet", "stats": json.dumps({"numRecords": 951})}
            actions += [{"protocol": {"minReaderVersion": 1}}, {"add": add}]
        (log / f"{version:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))


def test_kafka_down_still_shows_the_published_snapshot(settings, specs):
    running, idle = specs
    _write_delta_log(running.snapshot_path(settings), running)
    docs = settings.reports / running.name / "data_docs" / "index.html"
    docs.parent.mkdir(parents=True)
    docs.write_text("<html>Data Docs</html>")

    def down(_: Settings) -> int:
        raise BrokerUnavailable("timed out after 2s waiting for Kafka at localhost:9")

    found = overview.overview(settings, _sources(reachable=down))
    assert not found.kafka_up and "localhost:9" in (found.kafka_error or "")
    assert found.history_source == "none" and "Kafka" in found.history_note
    row = _row(found, running)
    assert row.stream is None
    assert row.snapshot == overview.SnapshotView(
        exists=True,
        latest_version=0,
        published_version=0,
        published_age_s=7200.0,
        published_rows=951,
        verdict="passed",
        verdict_version=0,
        verdict_age_s=3600.0,
        checks=16,
        data_docs=f"{running.name}/data_docs/index.html",
    )
    assert _row(found, idle).snapshot == overview.SnapshotView(exists=False)


def test_a_failed_validation_publishes_nothing(settings, specs):
    running, _ = specs
    _write_delta_log(running.snapshot_path(settings), running, passed=False)
    snapshot = _row(overview.overview(settings, _sources()), running).snapshot
    assert snapshot is not None and snapshot.published_version is None
    assert snapshot.verdict == "failed" and snapshot.failed and snapshot.data_docs is None


def test_kafka_down_for_real_answers_within_seconds(settings, specs):
    running, _ = specs
    _write_delta_log(running.snapshot_path(settings), running)
    closed = settings.replace(bootstrap_servers=f"localhost:{free_port()}")
    started = time.monotonic()
    found = overview.overview(closed)
    assert time.monotonic() - started < 8
    assert not found.kafka_up and closed.bootstrap_servers in (found.kafka_error or "")
    row = _row(found, running)
    assert row.stream is None and row.snapshot is not None
    assert row.snapshot.published_version == 0


def test_a_spec_that_does_not_load_gets_a_row_that_says_why(settings, specs):
    (settings.pipelines / "broken.yaml").write_text("name: broken\nsource: 3\n")
    found = overview.overview(settings, _sources())
    broken = next(p for p in found.pipelines if p.name == "broken")
    assert broken.spec_error and "broken.yaml" in broken.spec_error
    assert broken.stream is None and broken.snapshot is None
    assert len(found.pipelines) == 3


def test_history_from_the_heartbeats(settings, specs):
    running, idle = specs
    topic = running.source.topic
    beats = [
        _beat(
            last_progress_ms=int((NOW - 600) * 1000),
            input_rows_per_second=100.0,
            num_input_rows=15,
            source_offsets={topic: {"0": 50, "1": 40}},
            source_latest_offsets={topic: {"0": 80, "1": 45}},
        ),
        _beat(last_progress_ms=int((NOW - 300) * 1000), idle=True),
        _beat(state="restoring", last_progress_ms=int((NOW - 200) * 1000)),
        _beat(last_progress_ms=int((NOW - 60) * 1000), input_rows_per_second=20.0),
    ]
    found = overview.overview(settings, _sources(history={running.name: beats}))
    assert found.history_source == "heartbeats" and "last hour" in found.history_note
    row = _row(found, running)
    assert row.rate == [Point(NOW - 600, 100.0), Point(NOW - 300, 0.0), Point(NOW - 60, 20.0)]
    # 15 records in the batch, 35 past its end: 50 waited when it was planned.
    assert row.lag == [Point(NOW - 600, 50.0), Point(NOW - 300, 0.0)]
    assert _row(found, idle).rate == [] and _row(found, idle).lag == []


class _FakePrometheus(http.server.BaseHTTPRequestHandler):
    """Prometheus' query_range API: the queries it was asked, and series by query."""

    asked: ClassVar[list[dict[str, list[str]]]] = []
    answers: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        url = urllib.parse.urlparse(self.path)
        arguments = urllib.parse.parse_qs(url.query)
        self.asked.append(arguments)
        body = json.dumps(self.answers[arguments["query"][0]]).encode()
        self.send_response(200 if url.path == "/api/v1/query_range" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakePrometheus.asked = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _matrix(pipeline: str, values: list[tuple[float, str]]) -> dict[str, Any]:
    series = {"metric": {"pipeline": pipeline}, "values": values}
    return {"status": "success", "data": {"resultType": "matrix", "result": [series]}}


def test_history_from_prometheus(settings, specs, prometheus):
    running, _ = specs
    _FakePrometheus.answers = {
        overview.RATE_QUERY: _matrix(running.name, [(NOW - 60, "12.5"), (NOW - 30, "NaN")]),
        overview.LAG_QUERY: _matrix(running.name, [(NOW - 60, "300"), (NOW - 30, "0")]),
    }
    sources = _sources(history={running.name: [_beat(input_rows_per_second=1.0)]})
    sources.prometheus = overview.query_range
    found = overview.overview(settings.replace(prometheus_url=prometheus), sources)
    assert found.history_source == "prometheus" and prometheus in found.history_note
    row = _row(found, running)
    assert row.rate == [Point(NOW - 60, 12.5)]  # NaN: no data then
    assert row.lag == [Point(NOW - 60, 300.0), Point(NOW - 30, 0.0)]
    asked = {a["query"][0]: a for a in _FakePrometheus.asked}
    assert set(asked) == {overview.RATE_QUERY, overview.LAG_QUERY}
    assert float(asked[overview.RATE_QUERY]["end"][0]) - float(
        asked[overview.RATE_QUERY]["start"][0]
    ) == pytest.approx(overview.WINDOW_S)


def test_kafka_down_still_charts_from_prometheus(settings, specs):
    running, _ = specs

    def down(_: Settings) -> int:
        raise BrokerUnavailable("timed out after 2s waiting for Kafka at localhost:9")

    def prometheus(url: str, query: str, *_: float) -> overview.Series:
        return {running.name: [Point(NOW - 30, 4.0 if query == overview.RATE_QUERY else 9.0)]}

    sources = _sources(reachable=down, prometheus=prometheus)
    found = overview.overview(settings.replace(prometheus_url="http://prometheus:9090"), sources)
    assert not found.kafka_up and found.history_source == "prometheus"
    row = _row(found, running)
    assert row.stream is None
    assert row.rate == [Point(NOW - 30, 4.0)] and row.lag == [Point(NOW - 30, 9.0)]


def test_prometheus_down_falls_back_to_the_heartbeats(settings, specs):
    running, _ = specs
    closed = f"http://127.0.0.1:{free_port()}"
    sources = _sources(history={running.name: [_beat(input_rows_per_second=5.0)]})
    sources.prometheus = overview.query_range
    found = overview.overview(settings.replace(prometheus_url=closed), sources)
    assert found.history_source == "heartbeats"
    assert closed in found.history_note and "heartbeats" in found.history_note
    assert _row(found, running).rate == [Point(NOW - 5, 5.0)]


def test_prometheus_refusing_a_query_is_an_error_naming_it(prometheus):
    _FakePrometheus.answers = {"up": {"status": "error", "error": "parse error"}}
    with pytest.raises(DualityError, match="parse error"):
        overview.query_range(prometheus, "up", NOW - 60, NOW, 30)
