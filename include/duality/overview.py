"""What the pipelines page shows (docs/pipelines-page.md): every pipeline's stream, from its
latest heartbeat and lag, the table it joins and that table's lag, its published snapshot and
last verdict, from the Delta log without Spark, and its input rate and lag over the last hour,
from Prometheus or the heartbeats."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from duality.config import Settings
from duality.errors import DualityError
from duality.kafka import client
from duality.snapshot import delta_log, publish
from duality.spec import DAG_KINDS, PipelineSpec, load_spec, spec_files
from duality.stream import control, heartbeat
from duality.stream.control import TableLag
from duality.stream.health import STALL_AFTER_S

# The page answers within a few seconds when Kafka is down: it waits this long for a broker.
KAFKA_TIMEOUT_S = 2.0
PROMETHEUS_TIMEOUT_S = 3.0
WINDOW_S = float(heartbeat.HISTORY_S)  # the charts' span: the heartbeats kept whole
_STEP_S = 30.0  # Prometheus' resolution over that span: 120 points
# PromQL of the two charted series, per pipeline (the streams' metrics, duality.metrics).
RATE_QUERY = "sum by (pipeline) (rate(duality_records_read_total[1m]))"
LAG_QUERY = "sum by (pipeline) (duality_consumer_lag_records)"
# Where Airflow's UI shows the page (the plugin's navigation entry, plugins/duality_airflow).
PAGE_ROUTE = "/plugin/duality-pipelines"

HistorySource = Literal["prometheus", "heartbeats", "none"]
_FROM_HEARTBEATS = "from the heartbeats on _duality-status, which keeps the last hour of them whole"
_NO_HISTORY = "no history: Kafka does not answer"


@dataclasses.dataclass(frozen=True)
class Point:
    at: float  # epoch seconds
    value: float


@dataclasses.dataclass(frozen=True)
class StreamView:
    """A pipeline's stream as its latest heartbeat tells it, and its lag now."""

    state: str  # the heartbeat's (running, restoring, restarting, failed, stopped), or "never ran"
    heartbeat_age_s: float | None = None
    silent: bool = False  # says running, but has not beaten for STALL_AFTER_S
    input_rate: float | None = None  # records/s of its last micro-batch
    lag: int | None = None  # source records its committed offsets do not cover yet
    last_batch: int | None = None
    last_batch_age_s: float | None = None
    dead_letters: int | None = None  # since its driver started
    state_rows: int | None = None
    error: str | None = None
    unmatched: int | None = None  # events an inner join found no row for, since its start


@dataclasses.dataclass(frozen=True)
class SnapshotView:
    """A pipeline's Delta snapshot: the version readers get and the last verdict."""

    exists: bool
    latest_version: int | None = None
    published_version: int | None = None
    published_age_s: float | None = None  # since that version was written
    published_rows: int | None = None
    verdict: str | None = None  # passed or failed; None when never validated
    verdict_version: int | None = None
    verdict_age_s: float | None = None
    checks: int | None = None
    failed: list[str] = dataclasses.field(default_factory=list)
    data_docs: str | None = None  # relative to DUALITY_REPORTS, when the site exists
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class PipelineView:
    name: str
    source_topic: str | None
    dags: dict[str, str]  # kind (stream, snapshot, reset) -> DAG id
    stream: StreamView | None  # None when Kafka could not be read
    snapshot: SnapshotView | None  # None when the spec does not load
    rate: list[Point] = dataclasses.field(default_factory=list)  # records/s
    lag: list[Point] = dataclasses.field(default_factory=list)  # records
    spec_error: str | None = None
    tables: list[TableLag] = dataclasses.field(default_factory=list)  # the table it joins


@dataclasses.dataclass(frozen=True)
class Overview:
    generated_at: float  # epoch seconds
    window_s: float
    kafka_up: bool
    kafka_error: str | None
    history_source: HistorySource  # where the charts come from
    history_note: str  # what the reader should know of them
    pipelines: list[PipelineView]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Series = dict[str, list[Point]]  # pipeline -> points


def page_url(airflow_url: str) -> str:
    """The pipelines page inside Airflow's UI at `airflow_url`."""
    return airflow_url.rstrip("/") + PAGE_ROUTE


def query_range(
    url: str,
    query: str,
    start: float,
    end: float,
    step: float,
    timeout: float = PROMETHEUS_TIMEOUT_S,
) -> Series:
    """Prometheus' `query_range` of a query summed by pipeline: its points per pipeline."""
    arguments = urllib.parse.urlencode(
        {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    )
    address = f"{url.rstrip('/')}/api/v1/query_range?{arguments}"
    try:
        with urllib.request.urlopen(address, timeout=timeout) as response:
            answer = json.loads(response.read())
    except (OSError, ValueError) as error:
        raise DualityError(f"Prometheus at {url} did not answer ({error})") from None
    if answer.get("status") != "success":
        raise DualityError(f"Prometheus at {url} refused {query!r}: {answer.get('error')}")
    series: Series = {}
    for result in answer.get("data", {}).get("result", []):
        pipeline = result.get("metric", {}).get("pipeline")
        if pipeline is None:
            continue
        points = [Point(float(at), float(value)) for at, value in result.get("values", [])]
        series[pipeline] = [p for p in points if p.value == p.value]  # NaN: no data then
    return series


@dataclasses.dataclass
class Sources:
    """Where the overview reads Kafka and Prometheus (the library's readers; tests give fakes)."""

    reachable: Callable[[Settings], object] = client.ensure_reachable
    heartbeats: Callable[[Settings], dict[str, dict[str, Any]]] = heartbeat.latest
    history: Callable[[Settings, int], dict[str, list[dict[str, Any]]]] = heartbeat.history
    lag: Callable[[Settings, PipelineSpec], int | None] = control.lag
    table_lag: Callable[[Settings, PipelineSpec], int | None] = control.table_lag
    prometheus: Callable[[str, str, float, float, float], Series] = query_range
    clock: Callable[[], float] = time.time


def overview(settings: Settings, sources: Sources | None = None) -> Overview:
    """Every pipeline of `settings.pipelines`: what its stream and snapshot say now, and its rate
    and lag over the last hour. Kafka down or a spec that does not load is said, never raised."""
    sources = sources or Sources()
    now = sources.clock()
    # A short wait for the broker, however patient the commands are configured to be.
    quick = settings.replace(connect_timeout_s=min(settings.connect_timeout_s, KAFKA_TIMEOUT_S))
    specs = _specs(settings)
    beats: dict[str, dict[str, Any]] = {}
    kafka_error = None
    try:
        sources.reachable(quick)
        beats = sources.heartbeats(quick)
    except DualityError as error:
        kafka_error = str(error)
    try:
        history_source, note, rate, lag = _history(settings, quick, sources, now, kafka_error)
    except DualityError as error:
        kafka_error = str(error)
        history_source, note, rate, lag = "none", _NO_HISTORY, {}, {}
    views = []
    for name, spec, spec_error in specs:
        if spec is None:
            views.append(PipelineView(name, None, {}, None, None, spec_error=spec_error))
            continue
        stream, tables = None, control.tables(spec)
        if kafka_error is None:
            try:
                stream = _stream(quick, spec, beats.get(name), sources, now)
                if tables:
                    lag_now = sources.table_lag(quick, spec)
                    tables = [dataclasses.replace(t, lag=lag_now) for t in tables]
            except DualityError as error:
                kafka_error = str(error)
        views.append(
            PipelineView(
                name,
                spec.source.topic,
                {kind: spec.dag_id(kind) for kind in DAG_KINDS},
                stream,
                _snapshot(settings, spec, now),
                rate.get(name, []),
                lag.get(name, []),
                tables=tables,
            )
        )
    if kafka_error is not None:
        # The api-server lives on: its admin client must not keep reconnecting (and logging).
        client.forget(quick)
    return Overview(now, WINDOW_S, kafka_error is None, kafka_error, history_source, note, views)


def _history(
    settings: Settings, quick: Settings, sources: Sources, now: float, kafka_error: str | None
) -> tuple[HistorySource, str, Series, Series]:
    """Rate and lag per pipeline over the window, where they come from and what to know of
    them: from Prometheus when it is set and answers, else from the heartbeats."""
    start, note = now - WINDOW_S, ""
    url = settings.prometheus_url
    if url:
        try:
            rate = sources.prometheus(url, RATE_QUERY, start, now, _STEP_S)
            lag = sources.prometheus(url, LAG_QUERY, start, now, _STEP_S)
            return "prometheus", f"from Prometheus at {url}", rate, lag
        except DualityError as error:
            note = f"{error}; "
    if kafka_error is not None:
        return "none", note + _NO_HISTORY, {}, {}
    rate, lag = _heartbeat_series(sources.history(quick, int(start * 1000)))
    return "heartbeats", note + _FROM_HEARTBEATS, rate, lag


def _specs(settings: Settings) -> list[tuple[str, PipelineSpec | None, str | None]]:
    """(name, spec, why it does not load) of every spec file."""
    try:
        files = spec_files(settings)
    except DualityError as error:
        return [(settings.pipelines.name, None, str(error))]
    found: list[tuple[str, PipelineSpec | None, str | None]] = []
    for path in files:
        try:
            # Not asking an Avro source's registry: the page needs no columns, and renders
            # while the registry is down (as the DAG file parses).
            spec = load_spec(path, registry=False)
        except DualityError as error:
            found.append((path.stem, None, str(error)))
            continue
        found.append((spec.name, spec, None))
    return found


def _stream(
    settings: Settings,
    spec: PipelineSpec,
    beat: dict[str, Any] | None,
    sources: Sources,
    now: float,
) -> StreamView:
    lag = sources.lag(settings, spec)
    if beat is None:
        return StreamView("never ran", lag=lag)
    age = _age(now, beat.get("last_progress_ms"))
    state = str(beat.get("state", "unknown"))
    last_batch_ms = beat.get("last_batch_ms")
    if last_batch_ms is None and not beat.get("idle") and "batch_id" in beat:
        # A driver from before `last_batch_ms`: the beat of a batch is its time.
        last_batch_ms = beat.get("last_progress_ms")
    return StreamView(
        state=state,
        heartbeat_age_s=age,
        silent=state == "running" and age is not None and age > STALL_AFTER_S,
        # An idle beat: no records came since the last batch.
        input_rate=0.0 if beat.get("idle") else _number(beat.get("input_rows_per_second")),
        lag=lag,
        last_batch=beat.get("batch_id"),
        last_batch_age_s=_age(now, last_batch_ms),
        dead_letters=beat.get("dead_lettered"),
        state_rows=beat.get("state_rows"),
        error=str(beat["error"]) if beat.get("error") else None,
        unmatched=beat.get("unmatched") if spec.joined is not None else None,
    )


def _snapshot(settings: Settings, spec: PipelineSpec, now: float) -> SnapshotView:
    path = spec.snapshot_path(settings)
    docs = Path(spec.name) / "data_docs" / "index.html"
    data_docs = str(docs) if (settings.reports / docs).is_file() else None
    if not delta_log.is_table(path):
        return SnapshotView(exists=False, data_docs=data_docs)
    try:
        versions = delta_log.history(path)
        if not versions:
            return SnapshotView(exists=False, data_docs=data_docs)
        written = {v.version: v.timestamp_ms for v in versions}
        found = publish.published_in_log(path)
        verdict = publish.validation(versions)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return SnapshotView(exists=True, error=f"the Delta log of {path} is unreadable: {error}")
    published_rows = None
    if found is not None:
        state = delta_log.table_state(path, found.version)
        published_rows = state.rows if state is not None else None
    return SnapshotView(
        exists=True,
        latest_version=delta_log.latest_data_version(versions),
        published_version=found.version if found else None,
        published_age_s=_age(now, written.get(found.version)) if found else None,
        published_rows=published_rows,
        verdict=("passed" if verdict[0].success else "failed") if verdict else None,
        verdict_version=verdict[0].version if verdict else None,
        verdict_age_s=_age(now, written.get(verdict[1])) if verdict else None,
        checks=verdict[0].checks if verdict else None,
        failed=list(verdict[0].failed) if verdict else [],
        data_docs=data_docs,
    )


def _heartbeat_series(recent: dict[str, list[dict[str, Any]]]) -> tuple[Series, Series]:
    """Input rate and lag per pipeline from its heartbeats: a batch's input rate, and the lag
    when it was planned, the records then waiting (its own, and those past its end offsets up
    to the source's latest then); an idle beat has caught up (rate 0, lag 0)."""
    rate: Series = {}
    lag: Series = {}
    for pipeline, beats in recent.items():
        for beat in beats:
            if beat.get("state") != "running" or "last_progress_ms" not in beat:
                continue
            at = beat["last_progress_ms"] / 1000
            if beat.get("idle"):
                rate.setdefault(pipeline, []).append(Point(at, 0.0))
                lag.setdefault(pipeline, []).append(Point(at, 0.0))
                continue
            records_per_s = _number(beat.get("input_rows_per_second"))
            if records_per_s is not None:
                rate.setdefault(pipeline, []).append(Point(at, records_per_s))
            behind = _offsets_behind(beat.get("source_latest_offsets"), beat.get("source_offsets"))
            if behind is not None:
                waiting = behind + (beat.get("num_input_rows") or 0)
                lag.setdefault(pipeline, []).append(Point(at, float(waiting)))
    return rate, lag


def _offsets_behind(latest: Any, end: Any) -> int | None:
    """Records between a batch's end offsets and the latest ones (Spark's offsets JSON:
    {topic: {partition: offset}})."""
    if not isinstance(latest, dict) or not isinstance(end, dict):
        return None
    total = 0
    for topic, partitions in latest.items():
        ended = end.get(topic) or {}
        if not isinstance(partitions, dict) or not isinstance(ended, dict):
            return None
        for partition, offset in partitions.items():
            total += max(0, int(offset) - int(ended.get(partition, 0)))
    return total


def _age(now: float, epoch_ms: Any) -> float | None:
    if not isinstance(epoch_ms, int | float):
        return None
    return round(max(0.0, now - epoch_ms / 1000), 1)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None
