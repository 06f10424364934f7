"""The pipelines page's HTML (`duality.overview_page`): a row per pipeline with what its stream and
snapshot say, a joined table and its lag, Kafka down said, links to the DAGs and Data Docs,
charts as inline SVG, text escaped, and nothing loaded from elsewhere."""

from __future__ import annotations

import html.parser
import re

from duality.overview import Overview, PipelineView, Point, SnapshotView, StreamView
from duality.overview_page import age, chart, render
from duality.stream.control import TableLag

NOW = 1_800_000_000.0
DAGS = {"stream": "duality_a_stream", "snapshot": "duality_a_snapshot", "reset": "duality_a_reset"}


def _overview(*pipelines: PipelineView, kafka_up: bool = True) -> Overview:
    return Overview(
        generated_at=NOW,
        window_s=3600.0,
        kafka_up=kafka_up,
        kafka_error=None if kafka_up else "timed out after 2s waiting for Kafka at localhost:9",
        history_source="heartbeats" if kafka_up else "none",
        history_note="from the heartbeats" if kafka_up else "no history: Kafka does not answer",
        pipelines=list(pipelines),
    )


RUNNING = PipelineView(
    name="a",
    source_topic="orders",
    dags=DAGS,
    stream=StreamView(
        state="running",
        heartbeat_age_s=4.0,
        input_rate=1234.5,
        lag=12000,
        last_batch=17,
        last_batch_age_s=75.0,
        dead_letters=367,
        state_rows=951,
    ),
    snapshot=SnapshotView(
        exists=True,
        latest_version=3,
        published_version=2,
        published_age_s=7300.0,
        published_rows=951,
        verdict="passed",
        verdict_version=2,
        verdict_age_s=7000.0,
        checks=16,
        data_docs="a/data_docs/index.html",
    ),
    rate=[Point(NOW - 600, 100.0), Point(NOW - 300, 250.0), Point(NOW - 10, 0.0)],
    lag=[Point(NOW - 600, 40.0), Point(NOW - 10, 0.0)],
)
NEVER_RAN = PipelineView(
    name="b",
    source_topic="readings",
    dags={"stream": "duality_b_stream"},
    stream=StreamView(state="never ran"),
    snapshot=SnapshotView(exists=False),
)


class _Cells(html.parser.HTMLParser):
    """The text of each `data-field` cell per pipeline row, and every URL the page loads."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.loads: list[str] = []
        self._row: str | None = None
        self._field: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr" and found.get("data-pipeline"):
            self._row = found["data-pipeline"]
            self.rows[self._row] = {}
        if tag in ("script", "img", "link", "iframe") or "src" in found:
            self.loads.append(f"{tag} {found}")
        if tag == "td" and found.get("data-field") and self._row:
            self._field.append(found["data-field"] or "")
            self.rows[self._row][self._field[-1]] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._field:
            self._field.pop()

    def handle_data(self, data: str) -> None:
        if self._row and self._field:
            cells = self.rows[self._row]
            cells[self._field[-1]] = " ".join((cells[self._field[-1]] + " " + data).split())


def _cells(page: str) -> _Cells:
    parser = _Cells()
    parser.feed(page)
    return parser


def test_a_running_pipeline_and_one_that_never_ran():
    page = render(_overview(RUNNING, NEVER_RAN), airflow_root="", reports_url="reports")
    cells = _cells(page)
    assert cells.rows["a"] == {
        "pipeline": "a orders DAGs: stream snapshot reset",
        "state": "running heartbeat 4s ago",
        "input-rate": "1,234.5/s",
        "lag": "12,000",
        "last-batch": "#17 1m ago",
        "dead-letters": "367",
        "state-rows": "951",
        "snapshot": "version 2, 951 rows written 2h 1m ago",
        "validation": "passed version 2, 16 checks 1h 56m ago Data Docs",
    }
    assert cells.rows["b"]["state"] == "never ran"
    assert cells.rows["b"]["snapshot"] == "no snapshot yet"
    assert cells.rows["b"]["last-batch"] == cells.rows["b"]["lag"] == "\N{EN DASH}"
    assert cells.loads == [], "the page loads nothing: no script, image or stylesheet"
    assert 'href="/dags/duality_a_stream"' in page and 'href="/dags/duality_b_stream"' in page
    assert 'href="reports/a/data_docs/index.html"' in page
    assert 'href="pipelines.json"' in page
    assert 'id="kafka-down"' not in page
    assert "from the heartbeats" in page


def test_a_joined_pipeline_names_its_table_and_its_lag():
    inner = PipelineView(
        "j",
        "orders",
        {},
        StreamView(state="running", lag=0, unmatched=152),
        None,
        tables=[TableLag("customers", "customers", "inner", lag=1234)],
    )
    left = PipelineView(
        "l",
        "orders",
        {},
        StreamView(state="running", unmatched=0),
        None,
        tables=[TableLag("tiers", "tiers-changelog", "left", pipeline="tiers")],
    )
    down = PipelineView(
        "d", "orders", {}, None, None, tables=[TableLag("customers", "customers", "inner")]
    )
    cells = _cells(render(_overview(inner, left, down))).rows
    assert cells["j"]["pipeline"] == (
        "j orders joins customers (topic customers, inner): lag 1,234, 152 events without a row "
        "DAGs:"
    )
    assert cells["j"]["lag"] == "0"  # the source's
    # A left join has no unmatched events; another pipeline's table says whose it is.
    assert cells["l"]["pipeline"] == (
        "l orders joins tiers (topic tiers-changelog, the table of pipeline tiers, left): lag "
        "\N{EN DASH} DAGs:"
    )
    assert (
        "joins customers (topic customers, inner): lag \N{EN DASH} DAGs:" in cells["d"]["pipeline"]
    )


def test_airflow_under_a_path_gets_its_dag_links_there():
    page = render(_overview(RUNNING), airflow_root="/airflow")
    assert 'href="/airflow/dags/duality_a_snapshot"' in page


def test_kafka_down_is_said_and_the_snapshot_still_shown():
    down = PipelineView("a", "orders", DAGS, None, RUNNING.snapshot)
    page = render(_overview(down, kafka_up=False))
    assert 'id="kafka-down"' in page and "Kafka is down" in page and "localhost:9" in page
    cells = _cells(page).rows["a"]
    assert cells["state"] == "unknown Kafka is down"
    assert cells["snapshot"].startswith("version 2, 951 rows")
    assert "no history: Kafka does not answer" in page


def test_silent_failed_and_unloadable_pipelines():
    silent = PipelineView(
        "s", "t", {}, StreamView(state="running", heartbeat_age_s=900.0, silent=True), None
    )
    failed = PipelineView(
        "f",
        "t",
        {},
        StreamView(state="failed", error="<boom>"),
        SnapshotView(
            exists=True,
            latest_version=0,
            verdict="failed",
            verdict_version=0,
            checks=3,
            failed=["expect_x [spec]"],
        ),
    )
    broken = PipelineView("x", None, {}, None, None, spec_error="x.yaml: source: not an object")
    page = render(_overview(silent, failed, broken))
    cells = _cells(page).rows
    assert cells["s"]["state"] == "silent heartbeat 15m ago"
    assert (
        cells["f"]["state"] == "failed <boom>" and "&lt;boom&gt;" in page and "<boom>" not in page
    )
    assert cells["f"]["snapshot"] == "none published (latest version 0)"
    assert cells["f"]["validation"].startswith("failed version 0, 3 checks")
    assert "expect_x [spec]" in cells["f"]["validation"]
    assert "x.yaml: source: not an object" in page


def test_names_are_escaped():
    hostile = PipelineView(
        '"><script>', "<t>", {"stream": "d<"}, StreamView(state="never ran"), None
    )
    page = render(_overview(hostile))
    assert "<script>" not in page and "<t>" not in page
    assert "/dags/d%3C" in page


def test_the_chart_draws_each_series_in_its_half():
    svg = chart(RUNNING.rate, RUNNING.lag, _overview())
    lines = re.findall(r'points="([^"]+)"', svg)
    assert len(lines) == 2
    rate, lag = ([tuple(map(float, p.split(","))) for p in line.split()] for line in lines)
    assert len(rate) == 3 and len(lag) == 2
    assert all(0 <= x <= 220 for x, _ in rate + lag)
    assert all(0 <= y <= 32 for _, y in rate) and all(32 <= y <= 66 for _, y in lag)
    peak = min(rate, key=lambda p: p[1])  # SVG's y grows downwards
    assert peak[0] == max(x for x, _ in rate[:2])  # 250/s, the second point
    assert "rate 0/s (max 250/s)" in svg and "lag 0 (max 40)" in svg
    assert ">60 min ago</text>" in svg and ">now</text>" in svg
    assert chart([], [], _overview()) == '<span class="small">no data</span>'
    assert "rate 0/s (max 0/s)" in chart([Point(NOW - 10, 0.0)], [], _overview())
    assert "lag: no data" in chart(RUNNING.rate, [], _overview())


def test_ages_read_as_people_read_them():
    assert [age(s) for s in (0, 59.9, 60, 3599, 3600, 7260, 86400, 90000)] == [
        "0s",
        "59s",
        "1m",
        "59m",
        "1h 0m",
        "2h 1m",
        "1d 0h",
        "1d 1h",
    ]
