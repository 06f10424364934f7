"""Stream scenarios of `make bench`, measured on topics preloaded in the same run.

The stream is a black box here: it runs as users run it (`python -m duality.stream PIPELINE`,
tests.harness.StreamProcess, in a process group of its own, stopped with SIGTERM) and is
observed only from outside, through the committed offsets of its consumer group
`duality-<pipeline>` on the source, its heartbeats on `_duality-status`, its changelog topic,
and the memory of its process tree.

- `spark-aggregation` (a baseline): Spark's own streaming aggregation of the same backlog
  (bench/spark_aggregation.py), in a process and JVM of its own like the stream.
- `stream-throughput`: the stream consuming the baselines' backlog (1M events over 100k keys by
  default), from the query's start (its first `running` heartbeat) until the committed offsets
  cover the whole backlog; compared with `python-copy` (target: at least 0.8x).
- `stream-throughput-warm`: the same stream, still running once that backlog is covered, given
  as many events again over the same keys, made visible at once by one producer transaction;
  timed from that transaction's commit until the committed offsets cover it. It is the stream's
  rate once its JVM has compiled the query's code, compared only with the same stream cold (the
  baselines are all cold; the issue's target is on the run above).
- `stream-rich`: the same backlog (the same events, preloaded into a topic of its own) through
  the same pipeline plus a filter, a computed field in the key, `count_distinct`, `latest` and
  `stddev`, cold, from the query's start until the committed offsets cover the topic; compared
  with `stream-throughput` (target: at least 0.8x).
- `stream-metrics-on`, `stream-metrics-off`: the same backlog (each in a topic of its own)
  through the same pipeline with its Prometheus endpoint (the default, as every other stream
  scenario runs) and without it (`DUALITY_METRICS_PORT=-1`), one after the other, both measured
  as `stream-rich` is; target: `stream-metrics-on` at least 0.97x `stream-metrics-off`. Not
  `stream-throughput` against it: the first stream of a run was the slower in ad hoc runs
  (docs/benchmarks.md).
- `state-scale`: the same backlog run (100k keys) and a backlog of one event per key over 20
  times as many keys (2M); for each, the peak RSS of the stream's whole process tree (the
  supervisor, the driver, its JVM and Python workers, sampled every 0.25 s) and the RSS once the
  backlog is covered; then a restart with the checkpoint intact: stopped gracefully, 1,000 new
  events produced, started again, timed from the process start until the committed offsets cover
  them; then failover under a trickle of events: the lone driver SIGKILLed, which its supervisor
  replaces with a new driver that starts cold, then the same with a warm standby (`--standby`)
  beside it; each timed from the kill until a read_committed reader sees the next changelog
  transaction (`--state-scale-factor 50` makes the larger state 5M keys). Targets: peak RSS
  grows by at most 500 MB, the restart at the larger state takes at most 1.5x as long, failover
  with a standby at most 10 s at both sizes.
- `restore-from-changelog`: a backlog of one event per key (1M keys, the `--records` figure)
  streamed into the changelog; then the stream is stopped, its checkpoint folder deleted and
  started again, timed from the process start until its heartbeat's `state_rows` holds every key
  and the committed offsets cover the source. `recompute-from-source`: the same table computed
  again by a Spark batch aggregation of the whole source in a process of its own, timed from
  its start too (so both include a Python and a JVM start).
- `latency`: events produced at 5,000/s for 60 s to a running stream with a stated trigger
  interval; for each event, the moment its changelog update is first visible to a
  read_committed consumer minus the event's Kafka timestamp (CreateTime, set by the producer).
  Event n of key k is visible when a changelog record of k carries a count of at least n.
  Target: p99 at most 2 s.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import yaml
from rich.progress import Progress, TaskID
from spark_aggregation import spec_table

from baselines import Figure, order_events, preload, unique_events
from duality import storage
from duality.config import SHIPPED_PIPELINES, Settings
from duality.kafka import client, offsets, records, topics
from duality.process import kill_group
from duality.spec import PipelineSpec, parse_spec
from duality.stream import heartbeat
from duality.stream.options import MAX_OFFSETS_PER_TRIGGER

# The checkout, for the stream process the bench shares with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import StreamProcess, first_commit_after

SPEC = SHIPPED_PIPELINES / "product_sales.yaml"
SPARK_AGGREGATION = Path(__file__).resolve().parent / "spark_aggregation.py"
PARTITIONS = 6

# The larger state of `state-scale` has this many times the baselines' keys (2M by default).
STATE_SCALE_FACTOR = 20  # the default of --state-scale-factor
RESTART_EVENTS = 1_000
# The latency scenario's warm-up: a third of its measured time, at least 5 s and at most 20 s.
LATENCY_WARMUP_MAX_S = 20.0
LATENCY_WARMUP_MIN_S = 5.0
SAMPLE_INTERVAL_S = 0.25
POLL_S = 0.2

THROUGHPUT_TARGET = 0.8  # stream-throughput records/s over python-copy's
RICH_TARGET = 0.8  # stream-rich records/s over stream-throughput's
FAILOVER_TARGET_S = 10.0  # the active driver's SIGKILL -> the standby's first commit
METRICS_TARGET = 0.97  # stream-metrics-on over stream-metrics-off
RSS_GROWTH_TARGET_MB = 500.0
RESTART_RATIO_TARGET = 1.5
LATENCY_P99_TARGET_S = 2.0


def bench_spec(
    name: str,
    topic: str,
    folder: Path | None = None,
    rich: bool = False,
    table_topic: str | None = None,
    avro: Settings | None = None,
) -> PipelineSpec:
    """A copy of the product_sales spec's plain aggregation reading `topic`; written to
    `folder` when given, so that a stream process finds it there through DUALITY_PIPELINES.
    `avro`: the source is Avro (`format: avro`, the same `schema:`), its subject in the
    registry of these settings (bench/avro_source.py).
    `rich` adds a filter, a computed field in the key, `count_distinct`, `latest` and `stddev`
    (the `stream-rich` scenario). `table_topic` adds a left join on the events' product with the
    table `products` read from it (bench/joins.py) and an aggregate of its `list_price`."""
    data = yaml.safe_load(SPEC.read_text())
    # The plain aggregation: without the shipped spec's computed field and filter.
    data.pop("fields", None)
    data.pop("where", None)
    data["name"] = name
    data["source"]["topic"] = topic
    data["changelog"] = {"partitions": PARTITIONS}
    if avro is not None:
        data["source"]["format"] = "avro"
    if rich:
        data["fields"] = {"band": "case when amount >= 250 then 'high' else 'low' end"}
        data["where"] = "quantity > 1"
        data["source"]["key"] = [data["source"]["key"], "band"]  # product_sales: one field
        data["aggregates"] |= {
            "customers": "count_distinct(customer)",
            "last_amount": "latest(amount)",
            "amount_sd": "stddev(amount)",
        }
    if table_topic is not None:
        data["tables"] = {
            "products": {
                "topic": table_topic,
                "schema": {"product": "string", "category": "string", "list_price": "double"},
                "key": "product",
            }
        }
        data["join"] = [{"table": "products", "on": "product", "type": "left"}]
        data["aggregates"] |= {"list_value": "sum(quantity * products.list_price)"}
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return parse_spec(data, f"bench spec {name}", settings=avro)


# -- figures ---------------------------------------------------------------------------------


def target(description: str, value: float | None, met: bool) -> dict[str, Any]:
    """An issue's target: the measured value and whether it was met (a benchmark reports)."""
    return {
        "target": description,
        "value": None if value is None else round(value, 3),
        "met": bool(met),
    }


@dataclass
class StreamFigure(Figure):
    """A figure with scenario-specific details, a note for the table and issue targets."""

    details: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:  # type: ignore[override]
        document: dict[str, Any] = {**super().as_dict(), **self.details}
        if self.targets:
            document["targets"] = self.targets
            document["met"] = all(t["met"] for t in self.targets)
        return document

    def notes(self) -> str:
        return self.note

    def table_rows(self) -> list[tuple[Figure, str]]:
        return [(self, self.note)]


@dataclass
class Point:
    """One backlog run of `state-scale`, and the restart after it."""

    keys: int
    distinct_keys: int  # of the key space, the keys that occur in the backlog
    events: int
    megabytes: float
    startup_seconds: float  # process start -> the query's first `running` heartbeat
    seconds: float  # the query's start -> committed offsets cover the backlog
    peak_rss_mb: float
    covered_rss_mb: float
    state_rows: int | None
    # At the peak: MB per part of the tree (supervisor, driver, jvm, python workers), processes.
    peak_rss_parts: dict[str, float] = field(default_factory=dict)
    peak_processes: int = 0
    restart_seconds: float = 0.0
    restart_events: int = 0
    restart_peak_rss_mb: float = 0.0
    # The active driver SIGKILLed under a trickle of events: seconds until the next changelog
    # transaction commits, with a warm standby and without one (its supervisor's new driver).
    # None: not measured at this point (`--failover larger`).
    failover_standby_seconds: float | None = None
    failover_cold_seconds: float | None = None
    # A second backlog given to the running stream at once (stream-throughput-warm), if any.
    warm_events: int = 0
    warm_seconds: float = 0.0
    # The stream's last heartbeat before it was stopped (a join's state figures, bench/joins.py).
    heartbeat: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "distinct_keys": self.distinct_keys,
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "records_per_s": round(self.events / self.seconds, 1) if self.seconds else 0.0,
            "startup_seconds": round(self.startup_seconds, 3),
            "wall_seconds": round(self.startup_seconds + self.seconds, 3),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "covered_rss_mb": round(self.covered_rss_mb, 1),
            "peak_rss_parts_mb": self.peak_rss_parts,
            "peak_processes": self.peak_processes,
            "state_rows": self.state_rows,
            "restart_seconds": round(self.restart_seconds, 3),
            "restart_events": self.restart_events,
            "restart_peak_rss_mb": round(self.restart_peak_rss_mb, 1),
            "failover_standby_seconds": _rounded(self.failover_standby_seconds),
            "failover_cold_seconds": _rounded(self.failover_cold_seconds),
        }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _failover_notes(point: Point) -> str:
    if point.failover_standby_seconds is None or point.failover_cold_seconds is None:
        return "failover not measured"
    return (
        f"failover {point.failover_standby_seconds:.1f} s with a standby, "
        f"{point.failover_cold_seconds:.1f} s without"
    )


@dataclass
class StateScaleFigure(StreamFigure):
    points: list[Point] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {**super().as_dict(), "points": [p.as_dict() for p in self.points]}

    def table_rows(self) -> list[tuple[Figure, str]]:
        rows = [
            (
                Figure(f"state-scale ({p.keys:,} keys)", p.events, p.seconds, p.megabytes),
                f"peak RSS {p.peak_rss_mb:,.0f} MB, {p.covered_rss_mb:,.0f} MB when covered; "
                f"restart {p.restart_seconds:.1f} s, peak {p.restart_peak_rss_mb:,.0f} MB; "
                + _failover_notes(p),
            )
            for p in self.points
        ]
        if rows:
            first, notes = rows[0]
            rows[0] = (first, notes + " (the stream-throughput run)")
        return rows


def set_throughput_target(
    figure: StreamFigure, python_copy: Figure, spark_aggregation: Figure
) -> None:
    """The cold stream's throughput against `python-copy` on the same topic in the same run
    (the target), and beside `spark-aggregation` (Spark's own streaming aggregation of the same
    backlog, in a new JVM too)."""
    ratio = figure.records_per_s / python_copy.records_per_s if python_copy.records_per_s else 0.0
    spark = spark_aggregation.records_per_s
    versus_spark = figure.records_per_s / spark if spark else 0.0
    figure.details["vs_python_copy"] = round(ratio, 3)
    figure.details["vs_spark_aggregation"] = round(versus_spark, 3)
    figure.targets = [
        target(f"records/s >= {THROUGHPUT_TARGET}x python-copy", ratio, ratio >= THROUGHPUT_TARGET)
    ]
    figure.note = (
        f"{ratio:.2f}x python-copy (target {THROUGHPUT_TARGET}x), {versus_spark:.2f}x "
        "spark-aggregation"
    )


def set_warm_ratio(warm: StreamFigure, cold: Figure) -> None:
    """The warm stream against the same stream cold, and nothing else: every baseline is
    measured cold (a new process or JVM), so a ratio to one would compare warm with cold."""
    ratio = warm.records_per_s / cold.records_per_s if cold.records_per_s else 0.0
    warm.details["vs_stream_throughput"] = round(ratio, 3)
    warm.note = (
        f"{ratio:.2f}x stream-throughput: the same stream once warm, a second backlog made "
        "visible at once (no target, no cold baseline)"
    )


def set_throughput_ratio(figure: StreamFigure, cold: Figure, goal: float, what: str) -> None:
    """A pipeline's stream, cold too, against `stream-throughput` (`cold`): records/s at least
    `goal` times it; `what` the pipeline does beyond the plain one."""
    ratio = figure.records_per_s / cold.records_per_s if cold.records_per_s else 0.0
    figure.details["vs_stream_throughput"] = round(ratio, 3)
    figure.targets = [target(f"records/s >= {goal}x stream-throughput", ratio, ratio >= goal)]
    figure.note = f"{ratio:.2f}x stream-throughput (target {goal}x): {what}"


def set_metrics_ratio(off: StreamFigure, on: Figure) -> None:
    """`stream-metrics-on` (the default) against the same stream without its metrics."""
    ratio = on.records_per_s / off.records_per_s if off.records_per_s else 0.0
    off.details["metrics_on_vs_off"] = round(ratio, 3)
    goal = f"stream-metrics-on >= {METRICS_TARGET}x this"
    off.targets = [target(goal, ratio, ratio >= METRICS_TARGET)]
    off.note = (
        f"stream-metrics-on, with its metrics endpoint, is {ratio:.2f}x this (target "
        f"{METRICS_TARGET}x): the same backlog, DUALITY_METRICS_PORT=-1"
    )


def spark_aggregation(bench: Bench, spec: PipelineSpec, megabytes: float) -> Figure:
    """`spark-aggregation`: bench/spark_aggregation.py over the stream's backlog, in a process
    (a new JVM) of its own like the stream, timed from its query's start to its end."""
    settings = bench.settings
    target_topic = f"{spec.source.topic}-spark-aggregation"
    topics.create_topic(settings, target_topic, PARTITIONS)
    records = sum(offsets.end_offsets(settings, spec.source.topic).values())
    log = bench.logs / "spark-aggregation.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(SPARK_AGGREGATION),
        str(bench.pipelines / f"{spec.name}.yaml"),
        target_topic,
        str(bench.pipelines.parent / "spark-aggregation-checkpoint"),
        str(MAX_OFFSETS_PER_TRIGGER),
    ]
    env = {**os.environ, **settings.as_env()}
    with open(log, "ab") as errors:
        process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=errors, start_new_session=True
        )
        try:
            output, _ = process.communicate(timeout=backlog_timeout(records))
        finally:
            # The JVM is in the process's group: nothing of it outlives the baseline.
            kill_group(process.pid, reap=process)
    if process.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"spark-aggregation exited with {process.returncode}:\n{tail}")
    result = json.loads(output.decode().strip().splitlines()[-1])
    if result["records"] != records:
        raise RuntimeError(f"spark-aggregation read {result['records']:,} of {records:,} records")
    return Figure("spark-aggregation", result["records"], result["seconds"], megabytes)


# -- driving the stream as a black box --------------------------------------------------------


@dataclass
class Bench:
    """What every stream scenario shares."""

    settings: Settings
    pipelines: Path  # DUALITY_PIPELINES of the stream processes
    logs: Path
    progress: Progress
    stamp: int


def stream_process(
    bench: Bench, spec: PipelineSpec, trigger_seconds: float | None = None
) -> StreamProcess:
    """The pipeline's stream with the library's own batch size and stall timeout."""
    log = bench.logs / f"{spec.name}.log"
    return StreamProcess(
        bench.settings,
        spec,
        bench.pipelines,
        log,
        max_offsets_per_trigger=MAX_OFFSETS_PER_TRIGGER,
        stall_timeout=None,
        trigger_seconds=trigger_seconds,
    )


class Heartbeats:
    """One pipeline's heartbeats on `_duality-status` from now on, followed in a thread."""

    def __init__(self, settings: Settings, pipeline: str):
        self.pipeline = pipeline.encode()
        self.latest: dict[str, Any] = {}
        self.running_at: float | None = None  # perf_counter of the first `running` heartbeat
        self.error: BaseException | None = None
        heartbeat.ensure_topic(settings)
        ends = offsets.end_offsets(settings, heartbeat.STATUS_TOPIC, "read_uncommitted")
        self.consumer = client.consumer(
            settings,
            f"bench-status-{uuid.uuid4().hex}",
            isolation_level="read_uncommitted",
            enable_partition_eof=False,
        )
        self.consumer.assign(
            [
                offsets.TopicPartition(heartbeat.STATUS_TOPIC, p, offset)
                for p, offset in ends.items()
            ]
        )
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            while not self.stopping.is_set():
                for message in self.consumer.consume(num_messages=500, timeout=0.1):
                    if message.error() is not None or message.key() != self.pipeline:
                        continue
                    value = message.value()
                    if not value:
                        continue
                    beat = json.loads(value)
                    self.latest = beat
                    if beat.get("state") == "running" and self.running_at is None:
                        self.running_at = time.perf_counter()
        except BaseException as error:
            self.error = error

    def state_rows(self) -> int | None:
        """Rows in the stream's state store (`state_rows`; `keys` in engines before it)."""
        beat = self.latest
        value = beat.get("state_rows")
        return int(value) if isinstance(value, int | float) else None

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"following {heartbeat.STATUS_TOPIC} failed: {self.error}")

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.consumer.close()


class TreeMemory:
    """The RSS of a process and all its descendants, sampled in a thread; keeps the peak and
    what made it up (supervisor, driver, JVM, Python workers)."""

    def __init__(self, pid: int, interval: float = SAMPLE_INTERVAL_S):
        self.root = psutil.Process(pid)
        self.peak = 0
        self.peak_parts: dict[str, float] = {}
        self.peak_processes = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self.thread.start()

    def _part(self, process: psutil.Process) -> str:
        if process.pid == self.root.pid:
            return "supervisor"
        name = process.name()
        if name.startswith("java"):
            return "jvm"
        if name.startswith("python"):
            return "driver" if process.ppid() == self.root.pid else "python workers"
        return "other"

    @staticmethod
    def _forked_helper(process: psutil.Process) -> bool:
        """A JVM's child other than a Python worker: a command Hadoop's file system forks for a
        moment (`chmod`, `df`), whose RSS before its exec repeats the whole JVM's."""
        parent = process.parent()
        return (
            parent is not None
            and parent.name().startswith("java")
            and not process.name().startswith("python")
        )

    def sample(self) -> int:
        """Bytes resident now, summed over the tree (pages shared by forks count in each)."""
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return 0
        parts: dict[str, float] = {}
        total = 0
        for process in processes:
            try:
                if self._forked_helper(process):
                    continue
                rss = process.memory_info().rss
                part = self._part(process)
            except psutil.Error:
                continue
            total += rss
            parts[part] = parts.get(part, 0.0) + rss / 1e6
        with self.lock:
            if total > self.peak:
                self.peak = total
                self.peak_parts = {k: round(v, 1) for k, v in sorted(parts.items())}
                self.peak_processes = len(processes)
        return total

    def _run(self, interval: float) -> None:
        while not self.stopping.wait(interval):
            self.sample()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)


def covered(settings: Settings, spec: PipelineSpec, ends: dict[int, int]) -> int:
    """How many of the records below `ends` the pipeline's committed offsets cover."""
    committed = offsets.committed_offsets(settings, spec.consumer_group, spec.source.topic)
    return sum(min(committed.get(p, (0, None))[0], end) for p, end in ends.items())


def wait_for(
    stream: StreamProcess,
    heartbeats: Heartbeats | None,
    condition: Callable[[], bool],
    timeout: float,
    what: str,
) -> None:
    """Poll `condition` until it holds; the stream exiting or the timeout is an error."""
    deadline = time.monotonic() + timeout
    while True:
        stream.check()
        if heartbeats is not None:
            heartbeats.check()
        if condition():
            return
        if time.monotonic() >= deadline:
            last = heartbeats.latest if heartbeats is not None else {}
            raise TimeoutError(
                f"{what}: not within {timeout:.0f}s; last heartbeat {json.dumps(last)[:400]}; "
                f"last lines of {stream.log}:\n{stream.tail()}"
            )
        time.sleep(POLL_S)


def backlog_timeout(records: int) -> float:
    """Generous: two minutes plus 2,000 records a second."""
    return 120.0 + records / 2_000


def consume_backlog(
    bench: Bench,
    spec: PipelineSpec,
    keys: int,
    megabytes: float,
    label: str,
    distinct_keys: int | None = None,
    warm_events: Iterable[tuple[bytes, bytes]] | None = None,
    join_rows: int = 0,
) -> Point:
    """Start the stream on a preloaded source and run it until the committed offsets cover
    the whole backlog, sampling its process tree's memory; then stop it gracefully.

    `keys` is the workload's key space; `distinct_keys` how many of them occur (all, when
    None): the state holds that many rows once the backlog is covered. `warm_events`, when
    given, are produced in one transaction once the backlog is covered, and the still-running
    stream is timed from its commit until they are covered too (`Point.warm_seconds`).
    `join_rows`: the heartbeat's `join_state_rows` is awaited too (a joined table's rows)."""
    distinct = keys if distinct_keys is None else distinct_keys
    settings = bench.settings
    ends = offsets.end_offsets(settings, spec.source.topic)
    total = sum(ends.values())
    task = bench.progress.add_task(f"{label}: {total:,} records", total=total)
    heartbeats = Heartbeats(settings, spec.name)
    memory: TreeMemory | None = None
    warm_count, warm_seconds = 0, 0.0
    try:
        with stream_process(bench, spec) as stream:
            stream.start()
            memory = TreeMemory(stream.pid)
            done = 0

            def caught_up() -> bool:
                nonlocal done
                done = covered(settings, spec, ends)
                bench.progress.update(task, completed=done)
                return done >= total

            # A joined table's rows are read and stored as well (in the first micro-batch).
            timeout = backlog_timeout(total + join_rows)
            wait_for(stream, heartbeats, caught_up, timeout, f"{label}: backlog covered")
            covered_at = time.perf_counter()
            covered_rss = memory.sample()
            memory.close()
            # The heartbeat of the batch that covered the backlog follows its commit closely.
            deadline = time.monotonic() + 15
            while (
                (heartbeats.state_rows() or 0) < distinct
                or (heartbeats.latest.get("join_state_rows") or 0) < join_rows
            ) and time.monotonic() < deadline:
                stream.check()
                time.sleep(POLL_S)
            state_rows = heartbeats.state_rows()
            last_heartbeat = dict(heartbeats.latest)
            if warm_events is not None:
                warm_count, warm_seconds = consume_at_once(
                    bench, stream, heartbeats, spec, warm_events, label
                )
            stream.stop()
    finally:
        if memory is not None:
            memory.close()
        heartbeats.close()
    query_start = heartbeats.running_at or stream.started
    return Point(
        keys=keys,
        distinct_keys=distinct,
        events=total,
        megabytes=megabytes,
        startup_seconds=query_start - stream.started,
        seconds=covered_at - query_start,
        peak_rss_mb=memory.peak / 1e6,
        covered_rss_mb=covered_rss / 1e6,
        state_rows=state_rows,
        peak_rss_parts=memory.peak_parts,
        peak_processes=memory.peak_processes,
        warm_events=warm_count,
        warm_seconds=warm_seconds,
        heartbeat=last_heartbeat,
    )


def consume_at_once(
    bench: Bench,
    stream: StreamProcess,
    heartbeats: Heartbeats,
    spec: PipelineSpec,
    events: Iterable[tuple[bytes, bytes]],
    label: str,
) -> tuple[int, float]:
    """Produce `events` to the running stream's source in one transaction, so that a
    read_committed stream sees them all at once, and time from the commit until its committed
    offsets cover them. Returns the events and the seconds."""
    settings = bench.settings
    count = produce(settings, spec.source.topic, events, at_once=True)
    visible = time.perf_counter()
    ends = offsets.end_offsets(settings, spec.source.topic)
    total = sum(ends.values())
    task = bench.progress.add_task(f"{label}, warm: {count:,} more records", total=total)

    def caught_up() -> bool:
        done = covered(settings, spec, ends)
        bench.progress.update(task, completed=done)
        return done >= total

    wait_for(stream, heartbeats, caught_up, backlog_timeout(count), f"{label}: warm backlog")
    return count, time.perf_counter() - visible


def produce(
    settings: Settings, topic: str, events: Iterable[tuple[bytes, bytes]], at_once: bool = False
) -> int:
    """Produce `events` to `topic`; returns how many. `at_once`: in one transaction, so that a
    read_committed consumer sees none of them until it sees them all."""
    if at_once:
        producer = client.transactional_producer(
            settings, f"bench-at-once-{uuid.uuid4().hex}", queue_buffering_max_messages=500_000
        )
        producer.begin_transaction()
    else:
        producer = client.producer(settings, linger_ms=5)
    count = 0
    for key, value in events:
        records.send(producer, topic, key=key, value=value)
        count += 1
    if at_once:
        producer.commit_transaction(settings.connect_timeout_s * 12)
    elif producer.flush(60) != 0:
        raise RuntimeError(f"producing to {topic}: records left undelivered after 60 s")
    return count


def restart(
    bench: Bench,
    point: Point,
    spec: PipelineSpec,
    events: Iterable[tuple[bytes, bytes]],
    label: str,
    with_failover: bool = True,
) -> None:
    """With the stream stopped and its checkpoint intact: produce `events`, start the stream and
    time from the process start until its committed offsets cover them. Its memory is sampled
    too: with the state loaded and small batches, it tells the state's share from the batches'.
    Then, unless `with_failover` is false, the failovers."""
    settings = bench.settings
    count = produce(settings, spec.source.topic, events)
    ends = offsets.end_offsets(settings, spec.source.topic)
    total = sum(ends.values())
    bench.progress.console.print(f"{label}: restarting with the checkpoint after {count:,} events")
    memory: TreeMemory | None = None
    try:
        with stream_process(bench, spec) as stream:
            stream.start()
            memory = TreeMemory(stream.pid)
            wait_for(
                stream,
                None,
                lambda: covered(settings, spec, ends) >= total,
                backlog_timeout(point.keys),
                f"{label}: restart covering {count:,} new events",
            )
            point.restart_seconds = time.perf_counter() - stream.started
            memory.sample()
            memory.close()
            if with_failover:
                failover(bench, point, spec, label, stream)
            stream.stop()
    finally:
        if memory is not None:
            memory.close()
    point.restart_events = count
    point.restart_peak_rss_mb = memory.peak / 1e6


def failover(
    bench: Bench, point: Point, spec: PipelineSpec, label: str, first: StreamProcess
) -> None:
    """With the stream `first` running and a trickle of events: its lone driver SIGKILLed,
    which its supervisor replaces with a new driver (`failover_cold_seconds`); then a warm
    standby (`--standby`) beside it, and the active driver SIGKILLed again
    (`failover_standby_seconds`). Each timed from the kill until a read_committed reader sees
    the next changelog transaction."""
    settings = bench.settings
    bench.progress.console.print(f"{label}: failover, without a standby and with one")
    second = StreamProcess(
        settings,
        spec,
        bench.pipelines,
        bench.logs / f"{spec.name}.standby.log",
        max_offsets_per_trigger=MAX_OFFSETS_PER_TRIGGER,
        stall_timeout=None,
    )
    second.args.append("--standby")
    stop = threading.Event()

    def trickle() -> None:  # about 200 events a second, new keys
        out = client.producer(settings)
        for n, (key, value) in enumerate(unique_events(10**9, f"f{spec.name}-")):
            records.send(out, spec.source.topic, key, value)
            if n % 10 == 9:
                out.flush(10)
                if stop.wait(0.05):
                    return

    def beats() -> tuple[dict[str, Any], dict[str, Any]]:
        latest = heartbeat.latest(settings)
        return latest.get(spec.name, {}), latest.get(f"{spec.name}@standby", {})

    def until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + backlog_timeout(point.keys)
        while not condition():
            first.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: {what} not within the time allowed")
            time.sleep(POLL_S)

    def kill_active() -> float:
        os.kill(beats()[0]["pid"], signal.SIGKILL)
        return first_commit_after(settings, spec.changelog_topic, time.monotonic())

    producer = threading.Thread(target=trickle, daemon=True)
    with second:
        until(lambda: beats()[0].get("state") == "running", "the stream running")
        producer.start()
        try:
            point.failover_cold_seconds = kill_active()
            second.start()
            until(lambda: beats()[1].get("state") == "standby", "the standby waiting")
            point.failover_standby_seconds = kill_active()
        finally:
            stop.set()
            producer.join(timeout=30)


# -- scenarios -------------------------------------------------------------------------------


def state_scale_point(
    bench: Bench,
    spec: PipelineSpec,
    keys: int,
    megabytes: float,
    new_events: Iterable[tuple[bytes, bytes]],
    distinct_keys: int | None = None,
    warm_events: Iterable[tuple[bytes, bytes]] | None = None,
    with_failover: bool = True,
) -> Point:
    label = f"stream over {keys:,} keys"
    point = consume_backlog(bench, spec, keys, megabytes, label, distinct_keys, warm_events)
    # And failover, from the restarted stream.
    restart(bench, point, spec, new_events, label, with_failover)
    parts = ", ".join(f"{name} {mb:,.0f}" for name, mb in point.peak_rss_parts.items())
    bench.progress.console.print(
        f"{label}: {point.events:,} records in {point.seconds:.1f}s, peak RSS "
        f"{point.peak_rss_mb:,.0f} MB ({parts}; {point.peak_processes} processes), "
        f"{point.covered_rss_mb:,.0f} MB when covered; restart {point.restart_seconds:.1f}s, "
        f"peak RSS {point.restart_peak_rss_mb:,.0f} MB"
    )
    return point


def state_scale_figure(small: Point, large: Point) -> StateScaleFigure:
    growth = large.peak_rss_mb - small.peak_rss_mb
    covered_growth = large.covered_rss_mb - small.covered_rss_mb
    ratio = large.restart_seconds / small.restart_seconds if small.restart_seconds else 0.0
    return StateScaleFigure(
        "state-scale",
        large.events,
        large.seconds,
        large.megabytes,
        details={
            "keys": [small.keys, large.keys],
            "rss_growth_mb": round(growth, 1),
            "covered_rss_growth_mb": round(covered_growth, 1),
            # The restarts carry the same small batch: their growth is the state's own.
            "restart_rss_growth_mb": round(
                large.restart_peak_rss_mb - small.restart_peak_rss_mb, 1
            ),
            "restart_ratio": round(ratio, 3),
            "max_offsets_per_trigger": MAX_OFFSETS_PER_TRIGGER,
        },
        targets=[
            *(
                target(
                    f"failover with a warm standby at {p.keys:,} keys <= {FAILOVER_TARGET_S:g} s",
                    p.failover_standby_seconds,
                    p.failover_standby_seconds <= FAILOVER_TARGET_S,
                )
                for p in (small, large)
                if p.failover_standby_seconds is not None
            ),
            target(
                f"peak rss growth <= {RSS_GROWTH_TARGET_MB:g} MB",
                growth,
                growth <= RSS_GROWTH_TARGET_MB,
            ),
            target(
                f"restart at {large.keys:,} keys <= {RESTART_RATIO_TARGET}x restart at "
                f"{small.keys:,} keys",
                ratio,
                ratio <= RESTART_RATIO_TARGET,
            ),
        ],
        points=[small, large],
    )


def restore_versus_recompute(bench: Bench, keys: int) -> list[Figure]:
    """A changelog of `keys` keys (one event each) built by the stream; then the stream
    restarted without its checkpoint, and the table recomputed from the source with Spark."""
    settings = bench.settings
    topic = f"bench-restore-{bench.stamp}"
    topics.create_topic(settings, topic, PARTITIONS)
    megabytes = preload(
        settings, topic, unique_events(keys, "r", seed=21), bench.progress, total=keys
    )
    spec = bench_spec(f"bench_restore_{bench.stamp}", topic, bench.pipelines)
    label = f"changelog of {keys:,} keys"
    consume_backlog(bench, spec, keys, megabytes, label)
    checkpoint = settings.checkpoint_root / spec.name
    if not checkpoint.is_dir():
        raise RuntimeError(f"{label}: the stream left no checkpoint folder {checkpoint}")
    storage.remove_tree(checkpoint)  # local, or on object storage

    ends = offsets.end_offsets(settings, topic)
    total = sum(ends.values())
    task = bench.progress.add_task(f"restoring {keys:,} keys from the changelog", total=keys)
    heartbeats = Heartbeats(settings, spec.name)
    try:
        with stream_process(bench, spec) as stream:
            stream.start()

            def restored() -> bool:
                rows = heartbeats.state_rows() or 0
                bench.progress.update(task, completed=min(rows, keys))
                return rows >= keys and covered(settings, spec, ends) >= total

            wait_for(
                stream,
                heartbeats,
                restored,
                backlog_timeout(keys),
                f"restore of {keys:,} keys (heartbeat state_rows >= {keys:,})",
            )
            seconds = time.perf_counter() - stream.started
            state_rows = heartbeats.state_rows()
            stream.stop()
    finally:
        heartbeats.close()

    bench.progress.console.print(f"recomputing the table of {keys:,} keys from the source")
    rows, recompute_seconds, session_seconds = recompute_from_source(bench, spec)
    if rows != keys:
        raise RuntimeError(f"recompute-from-source: {rows:,} keys, the source holds {keys:,}")
    restore = StreamFigure(
        "restore-from-changelog",
        keys,
        seconds,
        0.0,
        details={
            "keys": keys,
            "state_rows": state_rows,
            "timed_from": "process start",
            "vs_recompute": round(seconds / recompute_seconds, 3) if recompute_seconds else 0.0,
        },
        note=f"checkpoint deleted; recompute-from-source {recompute_seconds:.1f} s",
    )
    recompute = StreamFigure(
        "recompute-from-source",
        total,
        recompute_seconds,
        megabytes,
        details={
            "keys": rows,
            "timed_from": "process start",
            "session_seconds": round(session_seconds, 3),
        },
        note=f"Spark batch over the source in a new process, {rows:,} keys",
    )
    return [restore, recompute]


def recompute_from_source(bench: Bench, spec: PipelineSpec) -> tuple[int, float, float]:
    """The spec's table computed from the whole source by a Spark batch in a process of its own
    (a new JVM), as the restore runs in a new stream process: both are timed from the process
    start. (rows, seconds, seconds until the Spark session was ready)."""
    started = time.time()
    done = subprocess.run(
        [sys.executable, __file__, str(bench.pipelines / f"{spec.name}.yaml")],
        env={**os.environ, **bench.settings.as_env()},
        capture_output=True,
        text=True,
        timeout=backlog_timeout(spec_records(bench.settings, spec)),
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"recompute-from-source exited with {done.returncode}:\n{done.stderr[-3000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["rows"], result["computed_at"] - started, result["session_at"] - started


def spec_records(settings: Settings, spec: PipelineSpec) -> int:
    return sum(offsets.end_offsets(settings, spec.source.topic).values())


def _recompute(spec_file: str) -> None:
    """recompute-from-source's process: prints the rows and the wall-clock moments its Spark
    session was ready and its table computed."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    from duality.spark import session
    from duality.spec import load_spec

    settings = Settings.from_env()
    spec = load_spec(Path(spec_file))
    spark = session(settings, "duality-bench-recompute")
    session_at = time.time()
    raw = (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_source_options())
        .option("subscribe", spec.source.topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    table = spec_table(spec, raw)
    # Writing to `noop` computes every column (a count() alone would prune the aggregates).
    observation = Observation("recompute")
    table.observe(observation, F.count(F.lit(1)).alias("rows")).write.format("noop").mode(
        "overwrite"
    ).save()
    rows = int(observation.get["rows"])
    print(json.dumps({"rows": rows, "session_at": session_at, "computed_at": time.time()}))
    spark.stop()


class ChangelogFollower:
    """Reads a changelog read_committed as records arrive and ties them to produced events:
    event n of key k is visible when a record of k first carries a count of at least n."""

    def __init__(self, settings: Settings, spec: PipelineSpec, stamps: dict[bytes, list[float]]):
        self.count_column = next(
            (c for c, a in spec.aggregates.items() if a.function == "count"), None
        )
        if self.count_column is None:
            raise RuntimeError(f"{spec.name}: the latency scenario needs a count() aggregate")
        self.stamps = stamps  # per key, the Kafka timestamps (s) of its events, in order
        # Per key, the events produced before the measurement (warm-up); None: not measuring.
        self.warmup: dict[bytes, int] | None = None
        self.seen: dict[bytes, int] = {}
        self.visible = 0
        self.latencies: list[float] = []
        self.warmup_latencies: list[float] = []
        self.overcounted = 0
        self.error: BaseException | None = None
        starts = offsets.beginning_offsets(settings, spec.changelog_topic)
        self.consumer = client.consumer(
            settings,
            f"bench-latency-{uuid.uuid4().hex}",
            isolation_level="read_committed",
            enable_partition_eof=False,
            fetch_wait_max_ms=10,
        )
        self.consumer.assign(
            [offsets.TopicPartition(spec.changelog_topic, p, o) for p, o in starts.items()]
        )
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def start_measuring(self) -> None:
        """Every event produced from now on is measured."""
        self.warmup = {key: len(events) for key, events in self.stamps.items()}

    def _follow(self) -> None:
        try:
            while not self.stopping.is_set():
                messages = self.consumer.consume(num_messages=10_000, timeout=0.05)
                received = time.time()
                for message in messages:
                    key, value = message.key(), message.value()
                    if message.error() is not None or key is None or value is None:
                        continue
                    self._record(key, json.loads(value), received)
        except BaseException as error:
            self.error = error

    def _record(self, key: bytes, value: dict[str, Any], received: float) -> None:
        count = int(value.get(self.count_column) or 0)
        before = self.seen.get(key, 0)
        if count <= before:
            return
        stamps = self.stamps.get(key, [])
        if count > len(stamps):  # the stream counted more events than were produced
            self.overcounted += 1
            count = len(stamps)
        first = self.warmup.get(key, 0) if self.warmup is not None else count
        self.warmup_latencies.extend(received - stamps[n] for n in range(before, min(first, count)))
        self.latencies.extend(received - stamps[n] for n in range(max(before, first), count))
        self.seen[key] = count
        self.visible += count - before

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"following the changelog failed: {self.error}")

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.consumer.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted, non-empty `values` (q in 0..100)."""
    rank = max(1, math.ceil(q / 100 * len(values)))
    return values[rank - 1]


class PacedProducer:
    """Valid order events over `keys` keys at a fixed rate, each with its Kafka timestamp
    (CreateTime) set by the producer and recorded per key in production order."""

    def __init__(self, settings: Settings, topic: str, keys: int, rate: float):
        self.topic, self.keys, self.rate = topic, keys, rate
        self.producer = client.producer(settings, linger_ms=1)
        self.rng = random.Random(31)
        self.stamps: dict[bytes, list[float]] = {}
        self.produced = 0

    def run(self, count: int, progress: Progress, task: TaskID) -> tuple[float, int]:
        """Produce `count` events at the rate; returns (seconds, bytes)."""
        started = time.monotonic()
        sent = size = 0
        while sent < count:
            due = min(count, int((time.monotonic() - started) * self.rate) + 1)
            while sent < due:
                size += self._send_one()
                sent += 1
            self.producer.poll(0)
            progress.update(task, completed=self.produced)
            time.sleep(0.002)
        seconds = time.monotonic() - started
        if self.producer.flush(30) != 0:
            raise RuntimeError(f"producing to {self.topic}: records left undelivered after 30 s")
        return seconds, size

    def _send_one(self) -> int:
        rng, n = self.rng, self.produced
        product = f"p{rng.randrange(self.keys):06d}"
        key = product.encode()
        value = (
            f'{{"order_id":"l{n:09d}","product":"{product}",'
            f'"customer":"c{rng.randrange(100_000):05d}","quantity":{rng.randint(1, 9)},'
            f'"amount":{rng.randrange(100, 50_000) / 100}}}'
        ).encode()
        now_ms = int(time.time() * 1000)
        # Recorded before the record exists, so the follower always finds its stamp.
        self.stamps.setdefault(key, []).append(now_ms / 1000)
        while True:
            try:
                self.producer.produce(self.topic, key=key, value=value, timestamp=now_ms)
                break
            except BufferError:
                self.producer.poll(0.01)
        self.produced += 1
        return len(key) + len(value)


def latency_scenario(
    bench: Bench, keys: int, rate: float, seconds: float, trigger_seconds: float
) -> StreamFigure:
    settings, progress = bench.settings, bench.progress
    topic = f"bench-latency-{bench.stamp}"
    topics.create_topic(settings, topic, PARTITIONS)
    spec = bench_spec(f"bench_latency_{bench.stamp}", topic, bench.pipelines)
    source = PacedProducer(settings, topic, keys, rate)
    warmup_seconds = max(LATENCY_WARMUP_MIN_S, min(LATENCY_WARMUP_MAX_S, seconds / 3))
    warmup = max(1, int(rate * warmup_seconds))
    measured = max(1, int(rate * seconds))
    heartbeats = Heartbeats(settings, spec.name)
    follower: ChangelogFollower | None = None
    try:
        with stream_process(bench, spec, trigger_seconds) as stream:
            stream.start()
            wait_for(
                stream,
                heartbeats,
                lambda: (
                    heartbeats.running_at is not None
                    and topics.topic_exists(settings, spec.changelog_topic)
                ),
                300,
                f"latency: stream {spec.name} running",
            )
            follower = ChangelogFollower(settings, spec, source.stamps)
            reader = follower
            task = progress.add_task(
                f"latency: {rate:,.0f} events/s, {warmup_seconds:g}s warm-up, {seconds:g}s",
                total=warmup + measured,
            )
            source.run(warmup, progress, task)

            def warm() -> bool:
                reader.check()
                return reader.visible >= warmup

            wait_for(stream, None, warm, 120, f"latency: {warmup:,} warm-up events visible")
            reader.start_measuring()
            duration, size = source.run(measured, progress, task)
            deadline = time.monotonic() + max(60.0, 20 * trigger_seconds)
            while reader.visible < source.produced and time.monotonic() < deadline:
                stream.check()
                reader.check()
                time.sleep(POLL_S)
            stream.stop()
    finally:
        if follower is not None:
            follower.close()
        heartbeats.close()
    latencies = sorted(reader.latencies)
    unseen = measured - len(latencies)
    p50 = percentile(latencies, 50) if latencies else None
    p99 = percentile(latencies, 99) if latencies else None
    warmup_latencies = sorted(reader.warmup_latencies)
    warmup_p99 = percentile(warmup_latencies, 99) if warmup_latencies else None
    trigger = trigger_seconds

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    figure = StreamFigure(
        "latency",
        measured,
        duration,
        size / 1e6,
        details={
            "rate_target": rate,
            "rate_achieved": round(measured / duration, 1) if duration else 0.0,
            "trigger_seconds": trigger,
            "warmup_seconds": warmup_seconds,
            "warmup_events": warmup,
            # The query's first seconds, while the JVM compiles its code: reported, not a target.
            "warmup_p99_s": rounded(warmup_p99),
            "keys": keys,
            "p50_s": rounded(p50),
            "p99_s": rounded(p99),
            "max_s": rounded(latencies[-1] if latencies else None),
            "mean_s": rounded(sum(latencies) / len(latencies) if latencies else None),
            "measured_events": len(latencies),
            "unseen_events": unseen,
            "overcounted_records": reader.overcounted,
        },
        targets=[
            target(
                f"p99 <= {LATENCY_P99_TARGET_S:g} s",
                p99,
                p99 is not None and unseen == 0 and p99 <= LATENCY_P99_TARGET_S,
            )
        ],
        note=(
            (f"p50 {p50:.2f} s, p99 {p99:.2f} s, " if p50 is not None and p99 is not None else "")
            + f"trigger {trigger:g} s, after a {warmup_seconds:g} s warm-up"
            + (f" (its p99 {warmup_p99:.2f} s)" if warmup_p99 is not None else "")
            + (f"; {unseen:,} events never visible" if unseen else "")
        ),
    )
    return figure


def cold_throughput(
    bench: Bench, source: str, records: int, keys: int, megabytes: float, group: str
) -> StreamFigure:
    """`stream-throughput` measured by a group run without the `streams` group (`group`
    names it): on the baselines' topic as the streams group measures it (the same cold run,
    without the warm backlog, restart and failovers that follow it there), so that a group's
    ratio to it is of one run."""
    bench.progress.console.print(f"stream over the backlog: {records:,} records, {keys:,} keys")
    spec = bench_spec(f"bench_sales_{bench.stamp}", source, bench.pipelines)
    point = consume_backlog(bench, spec, keys, megabytes, "stream-throughput", 0)
    return StreamFigure(
        "stream-throughput",
        point.events,
        point.seconds,
        megabytes,
        details={
            "keys": keys,
            "startup_seconds": round(point.startup_seconds, 3),
            "peak_rss_mb": round(point.peak_rss_mb, 1),
            "max_offsets_per_trigger": MAX_OFFSETS_PER_TRIGGER,
            "measured_by": group,
        },
        note=f"process start to running {point.startup_seconds:.1f} s (the {group}'s run)",
    )


def same_backlog(
    bench: Bench,
    scenario: str,
    tag: str,
    records: int,
    keys: int,
    megabytes: float,
    rich: bool = False,
) -> StreamFigure:
    """`scenario`: stream-throughput's backlog (the same events) preloaded to a topic of its
    own and consumed by a pipeline of its own (`rich`: the rich spec)."""
    settings = bench.settings
    topic = f"bench-{tag}-{bench.stamp}"
    topics.create_topic(settings, topic, PARTITIONS)
    preload(settings, topic, order_events(records, keys), bench.progress)
    spec = bench_spec(f"bench_{tag}_{bench.stamp}", topic, bench.pipelines, rich=rich)
    point = consume_backlog(bench, spec, keys, megabytes, scenario, 0)
    return StreamFigure(
        scenario,
        point.events,
        point.seconds,
        megabytes,
        details={"keys": keys, "max_offsets_per_trigger": MAX_OFFSETS_PER_TRIGGER},
    )


def stream_scenarios(
    bench: Bench,
    source: str,
    records: int,
    keys: int,
    megabytes: float,
    *,
    distinct_keys: int,
    latency_rate: float,
    latency_seconds: float,
    trigger_seconds: float,
    state_scale_factor: int = STATE_SCALE_FACTOR,
    failover_at_both: bool = True,
) -> list[Figure]:
    """Every stream scenario, in order: throughput (which is also state-scale's smaller state),
    the larger state, restore versus recompute, latency. `distinct_keys`: of the backlog's
    `keys`, how many occur (random draws may miss a few). `failover_at_both`: failovers at both
    states, or at the larger one only."""
    settings, progress = bench.settings, bench.progress

    spec = bench_spec(f"bench_sales_{bench.stamp}", source, bench.pipelines)
    progress.console.print("Spark's own streaming aggregation of the backlog (baseline)")
    baseline = spark_aggregation(bench, spec, megabytes)
    progress.console.print(f"stream over the backlog: {records:,} records, {keys:,} keys")
    small = state_scale_point(
        bench,
        spec,
        keys,
        megabytes,
        order_events(RESTART_EVENTS, keys, seed=13),
        distinct_keys,
        warm_events=order_events(records, keys, seed=15),
        with_failover=failover_at_both,
    )
    throughput = StreamFigure(
        "stream-throughput",
        small.events,
        small.seconds,
        megabytes,
        details={
            "keys": keys,
            "startup_seconds": round(small.startup_seconds, 3),
            "wall_seconds": round(small.startup_seconds + small.seconds, 3),
            "peak_rss_mb": round(small.peak_rss_mb, 1),
            "max_offsets_per_trigger": MAX_OFFSETS_PER_TRIGGER,
        },
    )
    warm = StreamFigure(
        "stream-throughput-warm",
        small.warm_events,
        small.warm_seconds,
        megabytes * small.warm_events / small.events,
        details={"keys": keys, "max_offsets_per_trigger": MAX_OFFSETS_PER_TRIGGER},
    )

    # The same backlog as stream-throughput's (the same events, in a topic of its own: the
    # runs above grew the source), so that both are timed over the same records.
    progress.console.print(
        "the same backlog through a filter, a computed key, count_distinct, latest and stddev"
    )
    rich = same_backlog(bench, "stream-rich", "rich", records, keys, megabytes, rich=True)
    set_throughput_ratio(
        rich,
        throughput,
        RICH_TARGET,
        "a filter, a computed key, count_distinct, latest and stddev over the same backlog",
    )

    # The same backlog again, by the same stream with its metrics endpoint, then without it.
    progress.console.print("the same backlog by the same stream with metrics, then without")
    measured = same_backlog(bench, "stream-metrics-on", "metrics", records, keys, megabytes)
    without = replace(bench, settings=settings.replace(metrics_port=-1))
    plain = same_backlog(without, "stream-metrics-off", "nometrics", records, keys, megabytes)
    set_metrics_ratio(plain, measured)

    large_keys = keys * state_scale_factor
    large_topic = f"bench-state-{bench.stamp}"
    topics.create_topic(settings, large_topic, PARTITIONS)
    large_megabytes = preload(
        settings, large_topic, unique_events(large_keys, "u"), progress, total=large_keys
    )
    large_spec = bench_spec(f"bench_state_{bench.stamp}", large_topic, bench.pipelines)
    progress.console.print(f"stream over {large_keys:,} keys, one event each")
    large = state_scale_point(
        bench,
        large_spec,
        large_keys,
        large_megabytes,
        unique_events(RESTART_EVENTS, "u", seed=14),
    )
    figures: list[Figure] = [
        baseline,
        throughput,
        warm,
        rich,
        measured,
        plain,
        state_scale_figure(small, large),
    ]

    progress.console.print(f"restore from the changelog versus recompute: {records:,} keys")
    figures.extend(restore_versus_recompute(bench, records))

    progress.console.print(
        f"latency: {latency_rate:,.0f} events/s for {latency_seconds:g}s, "
        f"trigger {trigger_seconds:g}s"
    )
    figures.append(latency_scenario(bench, keys, latency_rate, latency_seconds, trigger_seconds))
    return figures


if __name__ == "__main__":
    _recompute(sys.argv[1])
