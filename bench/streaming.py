"""Stream scenarios of `make bench`, measured on topics preloaded in the same run.

- `stream-throughput`: the changelog-backed stream consuming a backlog (1M events over 100k keys
  by default), from the query's start until the committed offsets cover the whole backlog.
- `restore-from-changelog` versus `recompute-from-source`: rebuilding the state of a pipeline
  whose changelog holds 10k keys built from the same number of events, from the changelog
  (what a restart does) and by aggregating the whole source again with Spark.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from baselines import Figure
from duality import kafka, status
from duality.config import Settings
from duality.spec import PipelineSpec, parse_spec
from duality.stream import Aggregator, classify, pre_aggregate
from duality.stream_job import StreamDriver

SPEC = Path(__file__).resolve().parents[1] / "include" / "pipelines" / "product_sales.yaml"


def bench_spec(name: str, topic: str) -> PipelineSpec:
    data = yaml.safe_load(SPEC.read_text())
    data["name"] = name
    data["source"]["topic"] = topic
    data["changelog"] = {"partitions": 6}
    return parse_spec(data, f"bench spec {name}")


def run_to_end(settings: Settings, spec: PipelineSpec, records: int, megabytes: float) -> Figure:
    """Run the stream driver until it covers the topic; time from query start to the end."""
    driver = StreamDriver(settings, spec, max_offsets_per_trigger=500_000)
    failure: list[BaseException] = []

    def target() -> None:
        try:
            driver.run()
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    ends = kafka.end_offsets(settings, spec.source.topic)
    started = None
    try:
        while True:
            if failure:
                raise RuntimeError(f"stream of {spec.name} failed: {failure[0]}")
            if started is None and kafka.topic_exists(settings, status.STATUS_TOPIC):
                beat = status.latest(settings).get(spec.name, {})
                if beat.get("state") == "running":
                    started = time.perf_counter()
            if started is not None:
                committed = kafka.committed_offsets(
                    settings, spec.consumer_group, spec.source.topic
                )
                if all(committed.get(p, (0, None))[0] >= end for p, end in ends.items()):
                    break
            time.sleep(0.2)
        seconds = time.perf_counter() - started
    finally:
        driver.request_stop()
        thread.join(timeout=180)
    return Figure("stream-throughput", records, seconds, megabytes)


def restore_versus_recompute(
    settings: Settings, spec: PipelineSpec, records: int, megabytes: float
) -> list[Figure]:
    aggregator = Aggregator(settings, spec)
    start = time.perf_counter()
    aggregator.restore()
    restore = time.perf_counter() - start
    keys = len(aggregator.state)
    aggregator.close()

    from duality.spark import session

    spark = session(settings, "duality-bench")
    start = time.perf_counter()
    raw = (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_options())
        .option("subscribe", spec.source.topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .load()
    )
    frame = classify(spec, raw, {})
    rebuilt = pre_aggregate(spec, frame.where(frame["_error"].isNull())).count()
    recompute = time.perf_counter() - start
    assert rebuilt == keys, f"recomputed {rebuilt} keys, restored {keys}"
    return [
        Figure("restore-from-changelog", keys, restore, 0.0),
        Figure("recompute-from-source", records, recompute, megabytes),
    ]
