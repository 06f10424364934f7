"""The pipelines page as HTML (docs/pipelines-page.md): an `Overview` rendered on the server, its
charts inline SVG; no script, and nothing loaded from elsewhere."""

from __future__ import annotations

import html
import time
import urllib.parse

from duality.overview import Overview, PipelineView, Point, SnapshotView, StreamView
from duality.stream.control import TableLag

REFRESH_S = 30
_CHART_W, _CHART_H = 220, 64  # one chart: rate above, lag below, each half of the height

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #1f2328; background: #fff; }
h1 { font-size: 20px; margin: 0 0 8px; }
.note { color: #59636e; margin: 4px 0; }
.banner { background: #fff1e5; border: 1px solid #d1242f; color: #82071e; padding: 8px 12px;
  margin: 8px 0; border-radius: 6px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 6px 8px; border-bottom: 1px solid #d1d9e0;
  vertical-align: top; }
th { font-weight: 600; background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { display: inline-block; padding: 1px 8px; border-radius: 10px; font-weight: 600; }
.state-running { background: #dafbe1; color: #116329; }
.state-failed, .state-silent, .state-verdict-failed { background: #ffebe9; color: #82071e; }
.state-never-ran, .state-stopped, .state-unknown { background: #eff2f5; color: #59636e; }
.state-restoring, .state-restarting { background: #fff8c5; color: #7d4e00; }
.state-verdict-passed { background: #dafbe1; color: #116329; }
.dags a { margin-right: 6px; }
.small { font-size: 12px; color: #59636e; }
svg text { font: 10px system-ui, sans-serif; fill: #59636e; }
"""


def render(overview: Overview, *, airflow_root: str = "", reports_url: str = "reports") -> str:
    """The whole page. `airflow_root`: the path Airflow's UI is served under (its DAG pages are
    `<airflow_root>/dags/<dag id>`); `reports_url`: where DUALITY_REPORTS is served."""
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(overview.generated_at))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{REFRESH_S}">',
        "<title>duality pipelines</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>Pipelines</h1>",
        f'<p class="note">As of {generated}; this page refreshes every {REFRESH_S}s. '
        f'JSON: <a href="pipelines.json">pipelines.json</a>.</p>',
    ]
    if not overview.kafka_up:
        parts.append(
            '<div class="banner" id="kafka-down"><strong>Kafka is down:</strong> the streams\' '
            f"state and lag are unknown. {_text(overview.kafka_error or '')} "
            "The snapshots below are read from their Delta logs.</div>"
        )
    parts.append(
        f'<p class="note" id="history-note">Charts of the last '
        f"{overview.window_s / 60:g} minutes (input records/s above, lag below): "
        f"{_text(overview.history_note)}.</p>"
    )
    parts.append(
        "<table><thead><tr><th>Pipeline</th><th>Stream</th><th>Input rate</th><th>Lag</th>"
        "<th>Last batch</th><th>Dead letters</th><th>State rows</th><th>Published snapshot</th>"
        "<th>Validation</th><th>Last hour</th></tr></thead><tbody>"
    )
    parts.extend(_row(p, overview, airflow_root, reports_url) for p in overview.pipelines)
    parts.append("</tbody></table></body></html>")
    return "\n".join(parts)


def _row(pipeline: PipelineView, overview: Overview, airflow_root: str, reports_url: str) -> str:
    name = _text(pipeline.name)
    dags = " ".join(
        f'<a href="{_text(airflow_root)}/dags/{_url(dag)}" title="{_text(dag)}">{_text(kind)}</a>'
        for kind, dag in pipeline.dags.items()
    )
    unmatched = pipeline.stream.unmatched if pipeline.stream is not None else None
    tables = "".join(_table(t, unmatched) for t in pipeline.tables)
    first = (
        f'<td data-field="pipeline"><strong>{name}</strong><div class="small">'
        f"{_text(pipeline.source_topic or '')}</div>{tables}"
        f'<div class="dags small">DAGs: {dags}</div></td>'
    )
    if pipeline.spec_error is not None:
        cells = f'<td colspan="9">the spec does not load: {_text(pipeline.spec_error)}</td>'
        return f'<tr id="pipeline-{name}" data-pipeline="{name}">{first}{cells}</tr>'
    cells = _stream_cells(pipeline.stream, overview.kafka_up)
    cells += _snapshot_cells(pipeline.snapshot, reports_url)
    cells += f'<td class="chart">{chart(pipeline.rate, pipeline.lag, overview)}</td>'
    return f'<tr id="pipeline-{name}" data-pipeline="{name}">{first}{cells}</tr>'


def _table(table: TableLag, unmatched: int | None) -> str:
    """A joined table: its name, topic and join, its lag and, for an inner join, the events
    that found no row."""
    name = _text(table.name)
    whose = f", the table of pipeline {_text(table.pipeline)}" if table.pipeline else ""
    line = (
        f"joins {name} (topic {_text(table.topic)}{whose}, {_text(table.join)}): "
        f"lag {_count(table.lag)}"
    )
    if table.join == "inner" and unmatched is not None:
        line += f", {_count(unmatched)} events without a row"
    return f'<div class="small" data-table="{name}">{line}</div>'


def _stream_cells(stream: StreamView | None, kafka_up: bool) -> str:
    if stream is None:
        why = "Kafka is down" if not kafka_up else "not read"
        return f'<td data-field="state">{_badge("unknown")}<div class="small">{why}</div></td>' + (
            '<td class="num">&ndash;</td>' * 5
        )
    state = "silent" if stream.silent else stream.state
    detail = ""
    if stream.heartbeat_age_s is not None:
        detail = f"heartbeat {age(stream.heartbeat_age_s)} ago"
    if stream.error:
        detail += f"<br>{_text(stream.error[:200])}"
    batch = "&ndash;"
    if stream.last_batch is not None or stream.last_batch_age_s is not None:
        number = f"#{stream.last_batch} " if stream.last_batch is not None else ""
        when = f"{age(stream.last_batch_age_s)} ago" if stream.last_batch_age_s is not None else ""
        batch = _text(f"{number}{when}".strip())
    return (
        f'<td data-field="state">{_badge(state)}'
        f'<div class="small">{detail}</div></td>'
        f'<td class="num" data-field="input-rate">{_rate(stream.input_rate)}</td>'
        f'<td class="num" data-field="lag">{_count(stream.lag)}</td>'
        f'<td class="num" data-field="last-batch">{batch}</td>'
        f'<td class="num" data-field="dead-letters">{_count(stream.dead_letters)}</td>'
        f'<td class="num" data-field="state-rows">{_count(stream.state_rows)}</td>'
    )


def _snapshot_cells(snapshot: SnapshotView | None, reports_url: str) -> str:
    if snapshot is None or not snapshot.exists:
        return (
            '<td data-field="snapshot">no snapshot yet</td><td data-field="validation">&ndash;</td>'
        )
    if snapshot.error is not None:
        return f'<td data-field="snapshot" colspan="2">{_text(snapshot.error)}</td>'
    if snapshot.published_version is None:
        published = f"none published (latest version {snapshot.latest_version})"
    else:
        rows = f", {_count(snapshot.published_rows)} rows" if snapshot.published_rows else ""
        when = ""
        if snapshot.published_age_s is not None:
            when = f"written {age(snapshot.published_age_s)} ago"
        published = f"version {snapshot.published_version}{rows}<div class='small'>{when}</div>"
    if snapshot.verdict is None:
        verdict = "never validated"
    else:
        verdict = (
            f"{_badge(snapshot.verdict, 'verdict-' + snapshot.verdict)} version "
            f"{snapshot.verdict_version}, {snapshot.checks} checks"
        )
        if snapshot.verdict_age_s is not None:
            verdict += f"<div class='small'>{age(snapshot.verdict_age_s)} ago</div>"
        if snapshot.failed:
            verdict += f"<div class='small'>failed: {_text('; '.join(snapshot.failed[:3]))}</div>"
    if snapshot.data_docs:
        href = f"{_text(reports_url)}/{_url(snapshot.data_docs)}"
        verdict += f'<div><a href="{href}" data-field="data-docs">Data Docs</a></div>'
    return f'<td data-field="snapshot">{published}</td><td data-field="validation">{verdict}</td>'


def chart(rate: list[Point], lag: list[Point], overview: Overview) -> str:
    """Input rate (above) and lag (below) over the overview's window, each scaled to its own
    maximum, which its label gives."""
    if not rate and not lag:
        return '<span class="small">no data</span>'
    end = overview.generated_at
    start = end - overview.window_s
    half = _CHART_H // 2
    shapes = [
        f'<svg class="history" width="{_CHART_W}" height="{_CHART_H + 12}" '
        f'viewBox="0 0 {_CHART_W} {_CHART_H + 12}" role="img" '
        f'aria-label="input rate and lag over the last hour">',
        f'<line x1="0" y1="{half}" x2="{_CHART_W}" y2="{half}" stroke="#d1d9e0"/>',
    ]
    for points, top, colour, label, unit in (
        (rate, 0, "#0969da", "rate", "/s"),
        (lag, half, "#bc4c00", "lag", ""),
    ):
        if not points:
            shapes.append(f'<text x="2" y="{top + 11}">{label}: no data</text>')
            continue
        peak = max(p.value for p in points)
        scale = peak or 1.0  # all zero: a flat line at the bottom
        xy = [
            (
                (p.at - start) / overview.window_s * _CHART_W,
                top + half - 2 - p.value / scale * (half - 14),
            )
            for p in points
            if start <= p.at <= end
        ]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
        shapes.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'
        )
        if xy:  # the latest value, visible even when it is the only one
            x, y = xy[-1]
            shapes.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{colour}"/>')
        latest = points[-1].value
        shapes.append(
            f'<text x="2" y="{top + 11}">{label} {_short(latest)}{unit} '
            f"(max {_short(peak)}{unit})</text>"
        )
    # The time axis: the window's start on the left, now on the right.
    shapes.append(f'<text x="0" y="{_CHART_H + 11}">{overview.window_s / 60:g} min ago</text>')
    shapes.append(f'<text x="{_CHART_W}" y="{_CHART_H + 11}" text-anchor="end">now</text>')
    shapes.append("</svg>")
    return "".join(shapes)


def age(seconds: float) -> str:
    """A duration as people read it: 42s, 5m, 3h 20m, 2d 4h."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60}m"
    return f"{whole // 86400}d {whole % 86400 // 3600}h"


def _badge(label: str, kind: str | None = None) -> str:
    css = (kind or label).replace(" ", "-")
    return f'<span class="state state-{_text(css)}">{_text(label)}</span>'


def _rate(value: float | None) -> str:
    return "&ndash;" if value is None else f"{value:,.1f}/s"


def _count(value: int | None) -> str:
    return "&ndash;" if value is None else f"{value:,}"


def _short(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.1f}{suffix}"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def _text(value: str) -> str:
    return html.escape(value, quote=True)


def _url(path: str) -> str:
    return urllib.parse.quote(path)
