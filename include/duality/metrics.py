"""Prometheus metrics (docs/monitoring.md): a stream's endpoint, served from its driver, and the
figures batch steps push to a Pushgateway. Every metric duality exports is defined here."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from duality.config import Settings

if TYPE_CHECKING:
    from duality.stream.changelog_writer import BatchResult

log = logging.getLogger("duality.metrics")
# No `_created` series beside each counter and histogram: Prometheus does not use them.
disable_created_metrics()

# Where a Spark driver's UI serves Spark's own metrics (`spark_ui_config`).
SPARK_METRICS_PATH = "/metrics/prometheus"
# Seconds between two reads of the source topic's end offsets for the lag gauges: a scrape
# reads the last values and never waits on Kafka.
LAG_REFRESH_S = 5.0

# A dead letter's reason, as the stream words it (duality.stream.query.classify, the expression
# language's run-time errors, ChangelogWriter's late events), in a few kinds for a label.
_REASON_KINDS = (
    ("null value", "null_value"),
    ("oversized", "oversized"),
    ("malformed JSON", "malformed_json"),
    ("not a JSON object", "not_an_object"),
    ("wrong type", "wrong_type"),
    ("missing field", "missing_field"),
    ("null key field", "null_key"),
    ("late event", "late"),
    ("table ", "bad_table_record"),  # "table customers (topic customers): ..." (a join's)
)
REASON_KINDS = (*(kind for _, kind in _REASON_KINDS), "run_time_error")


def reason_kind(reason: str) -> str:
    """The `reason` label of a dead letter: its kind, not its text (which names values)."""
    for prefix, kind in _REASON_KINDS:
        if reason.startswith(prefix):
            return kind
    return "run_time_error"  # an expression's error: "<key>: position N: ..."


class StreamMetrics:
    """One stream driver's metrics, in a registry of its own, labelled with its pipeline."""

    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline
        self.registry = registry = CollectorRegistry()
        labels = ["pipeline"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=registry)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels + list(extra), registry=registry)

        self.records_read = counter(
            "duality_records_read_total", "Source records covered by committed micro-batches."
        )
        self.records_aggregated = counter(
            "duality_records_aggregated_total",
            "Source records that reached the aggregation (neither filtered nor dead-lettered).",
        )
        self.records_filtered = counter(
            "duality_records_filtered_total", "Source records the spec's `where` skipped."
        )
        self.records_unmatched = counter(
            "duality_records_unmatched_total",
            "Source records an inner join found no table row for (not aggregated).",
        )
        self.dead_letters = counter(
            "duality_dead_letters_total", "Records sent to the dead-letter topic.", ("reason",)
        )
        self.late_records = counter(
            "duality_late_records_total", "Records dead-lettered as late for all their windows."
        )
        self.late_windows = counter(
            "duality_late_windows_total",
            "(record, window) pairs dropped as late while the record counted in other windows.",
        )
        self.changelog_records = counter(
            "duality_changelog_records_total", "Records written to the changelog topic."
        )
        self.batch_seconds = Histogram(
            "duality_batch_duration_seconds",
            "Duration of a micro-batch's write in the driver (its Kafka transaction included).",
            labels,
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.batch_records = Histogram(
            "duality_batch_records",
            "Source records per committed micro-batch.",
            labels,
            registry=registry,
            buckets=(1, 10, 100, 1_000, 10_000, 100_000, 1_000_000),
        )
        self.commit_seconds = Histogram(
            "duality_transaction_commit_seconds",
            "Duration of a micro-batch's Kafka transaction commit (offsets sent and committed).",
            labels,
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.lag = gauge(
            "duality_consumer_lag_records",
            "Source records not yet committed by the stream, per source partition.",
            ("partition",),
        )
        self.kafka_up = gauge(
            "duality_kafka_up", "1 when the last read of the source's end offsets succeeded."
        )
        self.state_rows = gauge("duality_state_rows", "Rows in Spark's state store.")
        self.state_memory = gauge(
            "duality_state_memory_bytes", "Memory Spark's state store reports using."
        )
        self.last_batch = gauge(
            "duality_last_batch_timestamp_seconds",
            "When the last micro-batch committed (Unix time).",
        )
        self.restarts = counter(
            "duality_query_restarts_total",
            "Restarts of the streaming query inside this driver after a failure.",
        )
        self.started = gauge(
            "duality_driver_start_timestamp_seconds",
            "When this driver process started (Unix time): each change is a driver restart.",
        )
        self.started.labels(pipeline).set(time.time())
        self.kafka_up.labels(pipeline).set(0)
        self.restarts.labels(pipeline)
        for kind in REASON_KINDS:  # each reason exists from the start, at 0
            self.dead_letters.labels(pipeline, kind)
        for metric in (
            self.records_read,
            self.records_aggregated,
            self.records_filtered,
            self.records_unmatched,
            self.late_records,
            self.late_windows,
            self.changelog_records,
        ):
            metric.labels(pipeline)
        self._ends: dict[int, int] = {}
        self._committed: dict[int, int] = {}
        self._lock = threading.Lock()

    def batch(self, result: BatchResult) -> None:
        """A committed micro-batch: its counts, its dead letters by reason kind, its timings."""
        p = self.pipeline
        self.records_read.labels(p).inc(result.records)
        skipped = result.dead_lettered - result.table_dead + result.filtered + result.unmatched
        self.records_aggregated.labels(p).inc(max(0, result.records - skipped))
        self.records_filtered.labels(p).inc(result.filtered)
        self.records_unmatched.labels(p).inc(result.unmatched)
        for kind, count in result.reasons.items():
            self.dead_letters.labels(p, kind).inc(count)
        self.late_records.labels(p).inc(result.late)
        self.late_windows.labels(p).inc(result.late_windows)
        self.changelog_records.labels(p).inc(result.updated_keys)
        self.batch_seconds.labels(p).observe(result.seconds)
        self.batch_records.labels(p).observe(result.records)
        self.commit_seconds.labels(p).observe(result.commit_seconds)
        self.last_batch.labels(p).set(time.time())

    def committed(self, offsets: dict[int, int]) -> None:
        with self._lock:
            self._committed = dict(offsets)
            self._publish_lag()

    def state(self, rows: int | None, memory_bytes: int | None) -> None:
        if rows is not None:
            self.state_rows.labels(self.pipeline).set(rows)
        if memory_bytes is not None:
            self.state_memory.labels(self.pipeline).set(memory_bytes)

    def end_offsets(self, ends: dict[int, int] | None) -> None:
        """The source topic's end offsets as last read, or None when Kafka did not answer."""
        self.kafka_up.labels(self.pipeline).set(0 if ends is None else 1)
        if ends is None:
            return
        with self._lock:
            self._ends = dict(ends)
            self._publish_lag()

    def _publish_lag(self) -> None:
        for partition, end in self._ends.items():
            lag = max(0, end - self._committed.get(partition, 0))
            self.lag.labels(self.pipeline, str(partition)).set(lag)


class ServingMetrics:
    """A `duality serve` process's metrics (docs/serving.md), in a registry of its own: each
    replica's apply and lag, and the pull queries answered, labelled with the pipeline."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        labels = ["pipeline"]
        self.applied = Counter(
            "duality_replica_records_applied_total",
            "Changelog records a replica applied to its store.",
            labels,
            registry=registry,
        )
        self.lag = Gauge(
            "duality_replica_lag_records",
            "Changelog records up to its committed end not yet in the replica, per partition.",
            [*labels, "partition"],
            registry=registry,
        )
        self.last_apply = Gauge(
            "duality_replica_last_apply_timestamp_seconds",
            "When the replica last committed a write to its store (Unix time).",
            labels,
            registry=registry,
        )
        self.kafka_up = Gauge(
            "duality_replica_kafka_up",
            "1 when the replica's last read of the changelog's end offsets succeeded.",
            labels,
            registry=registry,
        )
        self.requests = Counter(
            "duality_pull_requests_total",
            "Pull queries answered, by HTTP status code.",
            [*labels, "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "duality_pull_request_duration_seconds",
            "Time to answer a pull query, waits for `at`, `max_lag` included.",
            labels,
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        )

    def add(self, pipeline: str) -> None:
        """Series of a replica's pipeline, at 0 from the start."""
        self.applied.labels(pipeline)
        self.kafka_up.labels(pipeline).set(0)
        for code in ("200", "400", "404", "503"):
            self.requests.labels(pipeline, code)

    def replica(self, pipeline: str, applied: int, lag: dict[int, int] | None, wrote: bool) -> None:
        """A replica's step: records applied, its lag per partition (None: Kafka did not
        answer), whether it wrote to its store."""
        if applied:
            self.applied.labels(pipeline).inc(applied)
        if wrote:
            self.last_apply.labels(pipeline).set(time.time())
        self.kafka_up.labels(pipeline).set(0 if lag is None else 1)
        for partition, records in (lag or {}).items():
            self.lag.labels(pipeline, str(partition)).set(records)


class MetricsEndpoint:
    """The stream's /metrics on `settings.metrics_port` (0: a free port), the refresher of its
    lag gauges, and its file in the folder Prometheus discovers targets from."""

    def __init__(
        self,
        settings: Settings,
        metrics: StreamMetrics,
        end_offsets: Callable[[], dict[int, int]],
        spark_ui: str | None = None,
    ) -> None:
        from prometheus_client import start_http_server

        self.metrics = metrics
        self._end_offsets = end_offsets
        self._stop = threading.Event()
        self.server, _ = start_http_server(settings.metrics_port, registry=metrics.registry)
        self.port = int(self.server.server_port)
        self.settings = settings
        self.target, self.spark_target = target_files(settings, metrics.pipeline)
        self._refresher = threading.Thread(
            target=self._refresh, name="duality-metrics-lag", daemon=True
        )
        self._refresher.start()
        write_target(self.target, f"{socket.gethostname()}:{self.port}", metrics.pipeline)
        if spark_ui is not None:  # Spark's own metrics of the driver (its PrometheusServlet)
            address = spark_ui.split("://", 1)[-1].rstrip("/")
            write_target(self.spark_target, address, metrics.pipeline, SPARK_METRICS_PATH)

    def _refresh(self) -> None:
        while not self._stop.is_set():
            try:
                ends = self._end_offsets()
            except Exception as error:  # Kafka away: the gauges keep their last values
                log.debug("%s: end offsets not read: %s", self.metrics.pipeline, error)
                ends = None
            self.metrics.end_offsets(ends)
            self._stop.wait(LAG_REFRESH_S)

    def close(self) -> None:
        self._stop.set()
        forget_targets(self.settings, self.metrics.pipeline)
        self.server.shutdown()
        self.server.server_close()


def spark_ui_config() -> dict[str, str]:
    """Spark settings of a stream whose metrics are on: the driver's UI on a free port, serving
    Spark's metrics in Prometheus' format at SPARK_METRICS_PATH, and keeping little history."""
    sink = "spark.metrics.conf.*.sink.prometheusServlet"
    return {
        "spark.ui.enabled": "true",
        "spark.ui.port": "0",
        # Spark's metric names start with this instead of the application's id, which changes
        # with every start.
        "spark.metrics.namespace": "duality",
        f"{sink}.class": "org.apache.spark.metrics.sink.PrometheusServlet",
        f"{sink}.path": SPARK_METRICS_PATH,
        "spark.ui.retainedJobs": "100",
        "spark.ui.retainedStages": "100",
        "spark.sql.ui.retainedExecutions": "20",
        "spark.sql.streaming.ui.retainedProgressUpdates": "100",
    }


def targets_folder(settings: Settings) -> Path:
    """Where each running stream writes its scrape target (Prometheus' file-based discovery)."""
    return settings.local_dir / "monitoring" / "targets"


def target_files(settings: Settings, pipeline: str) -> tuple[Path, Path]:
    """The files of a pipeline's stream and of its Spark driver."""
    folder = targets_folder(settings)
    return folder / f"stream-{pipeline}.json", folder / f"spark-{pipeline}.json"


def forget_targets(settings: Settings, pipeline: str) -> None:
    """A stream stopped on purpose is no target any more (a killed one stays, and is down)."""
    for path in target_files(settings, pipeline):
        path.unlink(missing_ok=True)


def write_target(
    path: Path, address: str, pipeline: str | None, metrics_path: str | None = None
) -> None:
    """One target in the file_sd format, written whole (a reader never sees half of it); a
    target of several pipelines (`duality serve`) has no `pipeline` label: its series do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = {} if pipeline is None else {"pipeline": pipeline}
    if metrics_path is not None:
        labels["__metrics_path__"] = metrics_path
    document = [{"targets": [address], "labels": labels}]
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(document))
    partial.replace(path)


def serve_target(settings: Settings, host: str, port: int) -> tuple[Path, str]:
    """The target file of a `duality serve` on (host, port), and the address Prometheus scrapes
    it at: the loopback address when it listens there only, else this machine's name."""
    if host in ("127.0.0.1", "localhost", "::1"):
        address = f"127.0.0.1:{port}"
    elif host in ("0.0.0.0", "::", ""):
        address = f"{socket.gethostname()}:{port}"
    else:
        address = f"{host}:{port}"
    return targets_folder(settings) / f"serve-{address.replace(':', '-')}.json", address


def stream_targets(settings: Settings) -> Iterator[tuple[str, str]]:
    """(pipeline, host:port) of every stream target on file."""
    folder = targets_folder(settings)
    for path in sorted(folder.glob("stream-*.json")) if folder.is_dir() else []:
        try:
            for group in json.loads(path.read_text()):
                for address in group["targets"]:
                    yield group["labels"]["pipeline"], address
        except (ValueError, KeyError, TypeError, OSError):
            continue


# --- batch steps -------------------------------------------------------------------------

# Every metric `push_step` pushes (the compose tests check dashboards and alerts against them).
PUSHED_METRICS = (
    "duality_step_duration_seconds",
    "duality_step_success",
    "duality_step_last_run_timestamp_seconds",
    "duality_step_rows",
    "duality_step_records_read",
    "duality_step_version",
    "duality_validation_success",
    "duality_snapshot_published_version",
    "duality_snapshot_published_timestamp_seconds",
)


def push_step(
    settings: Settings,
    step: str,
    pipeline: str,
    *,
    seconds: float,
    success: bool,
    figures: dict[str, Any] | None = None,
) -> None:
    """A batch step's figures, pushed to the Pushgateway as the group (job=duality, pipeline,
    step), replacing the step's previous push. Without a Pushgateway, nothing; a push that
    fails is a warning, never the step's failure."""
    if settings.pushgateway is None:
        return
    from prometheus_client import push_to_gateway

    registry = CollectorRegistry()
    labels = ["pipeline", "step"]
    values = [pipeline, step]

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(name, doc, labels, registry=registry).labels(*values).set(value)

    gauge("duality_step_duration_seconds", "Duration of the batch step's last run.", seconds)
    gauge("duality_step_success", "1 when the batch step's last run succeeded, else 0.", success)
    gauge("duality_step_last_run_timestamp_seconds", "When the step last ran.", time.time())
    figures = figures or {}
    if figures.get("rows") is not None:
        gauge("duality_step_rows", "Rows of the table the step wrote or read.", figures["rows"])
    if figures.get("records_read") is not None:
        gauge(
            "duality_step_records_read",
            "Kafka records the step read.",
            figures["records_read"],
        )
    if figures.get("version") is not None:
        gauge("duality_step_version", "Delta version the step wrote or read.", figures["version"])
    if step == "validate":
        Gauge(
            "duality_validation_success",
            "1 when the last validation passed, else 0.",
            ["pipeline"],
            registry=registry,
        ).labels(pipeline).set(success)
    if figures.get("published_version") is not None:
        published = Gauge(
            "duality_snapshot_published_version",
            "The published version.",
            ["pipeline"],
            registry=registry,
        )
        published.labels(pipeline).set(figures["published_version"])
        at = Gauge(
            "duality_snapshot_published_timestamp_seconds",
            "When the published version was written (its commit's time): the published "
            "snapshot's age is time() minus this.",
            ["pipeline"],
            registry=registry,
        )
        at.labels(pipeline).set(figures["published_at"])
    assert {metric.name for metric in registry.collect()} <= set(PUSHED_METRICS)
    try:
        push_to_gateway(
            settings.pushgateway,
            job="duality",
            grouping_key={"pipeline": pipeline, "step": step},
            registry=registry,
            timeout=settings.connect_timeout_s,
        )
    except OSError as error:
        log.warning(
            "%s: %s's metrics were not pushed to the Pushgateway %s: %s",
            pipeline,
            step,
            settings.pushgateway,
            error,
        )
