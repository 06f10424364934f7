"""The changelog-backed streaming aggregate: source topic -> keyed aggregates -> changelog topic.

A Structured Streaming query reads the source; for each micro-batch, Spark (in the JVM) parses
and classifies the records and pre-aggregates the good ones per group key. Python then sees only
the per-key partial aggregates and the bad records: it merges the partials into the table state,
and in one Kafka transaction writes the updated rows (absolute values) to the changelog, the bad
records to the dead-letter topic, and the source offsets the batch covers to the pipeline's
consumer group. The changelog and those offsets therefore always agree; on every start the state
is restored from the changelog and the source resumes from the committed offsets
(docs/decisions/0003-exactly-once-changelog.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaException, Producer, TopicPartition

from duality import changelog, kafka
from duality.config import Settings
from duality.spec import SQL_TYPES, PipelineSpec

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

log = logging.getLogger("duality.stream")


# -- the state of one pipeline ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Partial:
    """One partial aggregate kept in the state: `count`, or `sum|min|max` of a field."""

    function: str
    field: str | None

    @property
    def name(self) -> str:
        return "count" if self.field is None else f"{self.function}.{self.field}"


def partials_of(spec: PipelineSpec) -> list[Partial]:
    """The partial aggregates from which every aggregate column is computed exactly."""
    needed = [Partial("count", None)]
    for aggregate in spec.aggregates.values():
        if aggregate.field is None:
            continue
        function = "sum" if aggregate.function == "avg" else aggregate.function
        part = Partial(function, aggregate.field)
        if part not in needed:
            needed.append(part)
    return needed


def merge(spec: PipelineSpec, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if old is None:
        return dict(new)
    merged = dict(old)
    for part in partials_of(spec):
        name = part.name
        if part.function in ("count", "sum"):
            merged[name] = old[name] + new[name]
        elif part.function == "min":
            merged[name] = min(old[name], new[name])
        else:
            merged[name] = max(old[name], new[name])
    return merged


def aggregate_values(spec: PipelineSpec, state: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for column, aggregate in spec.aggregates.items():
        if aggregate.function == "count":
            values[column] = state["count"]
        elif aggregate.function == "avg":
            values[column] = state[f"sum.{aggregate.field}"] / state["count"]
        else:
            values[column] = state[f"{aggregate.function}.{aggregate.field}"]
    return values


# -- classification and pre-aggregation in the JVM ------------------------------------------


def required_fields(spec: PipelineSpec) -> list[str]:
    fields = list(spec.source.key)
    for aggregate in spec.aggregates.values():
        if aggregate.field and aggregate.field not in fields:
            fields.append(aggregate.field)
    if spec.source.event_time and spec.source.event_time not in fields:
        fields.append(spec.source.event_time)
    return fields


def classify(
    spec: PipelineSpec,
    raw: DataFrame,
    stream_time_ms: dict[int, int],
) -> DataFrame:
    """Parse the raw Kafka rows and name each bad record's reason in `_error` (null when good).

    Adds `_p` (the parsed struct) and, for windowed pipelines, `_ts_ms` (event time in ms).
    Lateness follows Kafka Streams' stream time: per source partition, the largest event time
    of the good records before this one (in offset order, continuing from the committed stream
    time); a record more than the watermark behind it is late.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ddl = ", ".join(f"`{f}` {SQL_TYPES[k]}" for f, k in spec.source.fields.items())
    text = F.col("value").cast("string")
    required = required_fields(spec)
    # Every JSON value reads as a string, so this struct tells present fields from missing ones
    # with one more parse of the record (not one per field).
    as_text = ", ".join(f"`{f}` string" for f in required)
    frame = raw.withColumn("_p", F.from_json(text, ddl, {"mode": "PERMISSIVE"})).withColumn(
        "_present", F.from_json(text, as_text, {"mode": "PERMISSIVE"})
    )
    limit = spec.source.max_record_bytes
    checks: list[tuple[Column, Column]] = [
        (F.col("value").isNull(), F.lit("null value")),
        (
            F.octet_length("value") > limit,
            F.concat(
                F.lit("oversized: "),
                F.octet_length("value").cast("string"),
                F.lit(f" bytes, the limit is {limit}"),
            ),
        ),
        (F.try_parse_json(text).isNull(), F.lit("malformed JSON")),
        (~F.ltrim(text).startswith("{"), F.lit("not a JSON object")),
    ]
    for field in required:
        kind = spec.source.fields[field]
        present = F.col(f"_present.{field}").isNotNull()
        checks.append((~present, F.lit(f"missing field {field}")))
        checks.append(
            (F.col(f"_p.{field}").isNull(), F.lit(f"wrong type for {field}: expected {kind}"))
        )
    error = F.lit(None).cast("string")
    for condition, reason in reversed(checks):
        error = F.when(condition, reason).otherwise(error)
    frame = frame.withColumn("_error", error)

    if spec.window is not None and spec.source.event_time is not None:
        ts_ms = F.unix_millis(F.col(f"_p.{spec.source.event_time}"))
        frame = frame.withColumn("_ts_ms", F.when(F.col("_error").isNull(), ts_ms))
        before = (
            Window.partitionBy("partition")
            .orderBy("offset")
            .rowsBetween(Window.unboundedPreceding, -1)
        )
        start = _map_literal(stream_time_ms)
        committed_time = F.coalesce(F.element_at(start, F.col("partition")), F.lit(-(2**62)))
        stream_time = F.greatest(
            committed_time, F.coalesce(F.max("_ts_ms").over(before), committed_time)
        )
        limit_ms = spec.window.watermark_seconds * 1000
        late = F.col("_ts_ms") < stream_time - F.lit(limit_ms)
        frame = frame.withColumn("_stream_time", stream_time).withColumn(
            "_error",
            F.when(
                F.col("_error").isNull() & late,
                F.concat(
                    F.lit("late event: event time "),
                    F.date_format(F.timestamp_millis("_ts_ms"), "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'"),
                    F.lit(f" is more than {spec.window.watermark} behind the stream time "),
                    F.date_format(
                        F.timestamp_millis("_stream_time"), "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'"
                    ),
                ),
            ).otherwise(F.col("_error")),
        )
    return frame


def _map_literal(values: dict[int, int]) -> Column:
    from pyspark.sql import functions as F

    if not values:
        return F.create_map().cast("map<int,bigint>")
    pairs: list[Column] = []
    for key, value in values.items():
        pairs.extend([F.lit(key), F.lit(value).cast("bigint")])
    return F.create_map(*pairs)


def pre_aggregate(spec: PipelineSpec, good: DataFrame) -> DataFrame:
    """Per group key (and window), the partial aggregates of this batch's good records."""
    from pyspark.sql import functions as F

    groups = [F.col(f"_p.{f}").alias(f) for f in spec.source.key]
    if spec.window is not None:
        window = F.window(
            F.col(f"_p.{spec.source.event_time}"), f"{spec.window.size_seconds} seconds"
        )
        groups.append(F.unix_millis(window.start).alias("window_start"))
    columns = []
    for part in partials_of(spec):
        if part.function == "count":
            columns.append(F.count(F.lit(1)).alias(part.name))
            continue
        value = F.col(f"_p.{part.field}")
        if spec.source.fields[part.field or ""] == "timestamp":
            value = F.unix_millis(value)
        function = {"sum": F.sum, "min": F.min, "max": F.max}[part.function]
        columns.append(function(value).alias(part.name))
    return good.groupBy(*groups).agg(*columns)


# -- one micro-batch -----------------------------------------------------------------------


@dataclasses.dataclass
class Committed:
    """What the changelog covers: per source partition, the next offset and the stream time."""

    offsets: dict[int, int]
    stream_time_ms: dict[int, int]

    def to_kafka(self, topic: str) -> list[TopicPartition]:
        return [
            TopicPartition(
                topic, p, offset, json.dumps({"stream_time": self.stream_time_ms.get(p)})
            )
            for p, offset in sorted(self.offsets.items())
        ]

    def _metadata(self, partition: int) -> str:
        return json.dumps({"stream_time": self.stream_time_ms.get(partition)})

    @classmethod
    def from_kafka(cls, committed: dict[int, tuple[int, str | None]]) -> Committed:
        offsets, times = {}, {}
        for partition, (offset, metadata) in committed.items():
            offsets[partition] = offset
            try:
                stream_time = json.loads(metadata or "{}").get("stream_time")
            except json.JSONDecodeError:
                stream_time = None
            if stream_time is not None:
                times[partition] = int(stream_time)
        return cls(offsets, times)


@dataclasses.dataclass
class BatchResult:
    batch_id: int
    records: int
    aggregated: int
    dead_lettered: int
    updated_keys: int
    skipped: int
    spark_s: float = 0.0  # parse, classify, pre-aggregate, collect
    merge_s: float = 0.0  # merge the partials into the state
    commit_s: float = 0.0  # the Kafka transaction


class Aggregator:
    """Holds one pipeline's table state and applies micro-batches to it exactly once."""

    def __init__(self, settings: Settings, spec: PipelineSpec):
        self.settings = settings
        self.spec = spec
        self.state: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.committed = Committed({}, {})
        self.producer: Producer | None = None

    # The transactional id is the pipeline's: a new driver fences any older one still alive.
    @property
    def transactional_id(self) -> str:
        return f"duality-{self.spec.name}"

    def restore(self) -> None:
        """Load the state from the changelog and what it covers from the committed offsets."""
        started = time.monotonic()
        committed = kafka.committed_offsets(
            self.settings, self.spec.consumer_group, self.spec.source.topic
        )
        self.committed = Committed.from_kafka(committed)
        latest = changelog.read_latest(self.settings, self.spec)
        self.state = {}
        for value in latest.values():
            key = tuple(value[column] for column in self.spec.key_columns)
            if self.spec.window is not None:
                key = (*key[:-1], _iso_to_ms(key[-1]))
            self.state[key] = value["_state"]
        log.info(
            "%s: restored %d keys from %s in %.1fs; source resumes at %s",
            self.spec.name,
            len(self.state),
            self.spec.changelog_topic,
            time.monotonic() - started,
            self.committed.offsets or "the beginning",
        )
        self.producer = kafka.producer(
            self.settings,
            transactional_id=self.transactional_id,
            transaction_timeout_ms=300_000,
            queue_buffering_max_messages=1_000_000,
            linger_ms=50,
        )
        self.producer.init_transactions(self.settings.connect_timeout_s * 6)
        # The group the offsets are committed to; it never subscribes, so it never rebalances.
        group = kafka.consumer(self.settings, self.spec.consumer_group)
        self._group_metadata = group.consumer_group_metadata()
        group.close()

    def starting_offsets(self) -> str:
        """Spark's startingOffsets for a query without checkpoint: the committed offsets."""
        partitions = kafka.partition_count(self.settings, self.spec.source.topic)
        # -2 is Spark's "earliest" for a partition the changelog does not cover yet.
        offsets = {str(p): self.committed.offsets.get(p, -2) for p in range(partitions)}
        return json.dumps({self.spec.source.topic: offsets})

    def process(self, raw: DataFrame, batch_id: int) -> BatchResult:
        from pyspark.sql import functions as F

        assert self.producer is not None, "restore() first"
        spec = self.spec
        started = time.perf_counter()
        # Records the changelog already covers (a replayed batch) are skipped, not re-applied.
        fresh = raw.where(
            F.col("offset")
            >= F.coalesce(
                F.element_at(_map_literal(self.committed.offsets), F.col("partition")), F.lit(0)
            )
        )
        classified = classify(spec, fresh, self.committed.stream_time_ms)
        # Cache only what the three actions below need; raw bytes only of the bad records.
        bad = F.col("_error").isNotNull()
        frame = classified.select(
            "partition",
            "offset",
            "_error",
            "_p",
            *(["_ts_ms"] if spec.window is not None else []),
            F.when(bad, F.col("key")).alias("key"),
            F.when(bad, F.col("value")).alias("value"),
        ).persist()
        try:
            summary = (
                frame.groupBy("partition")
                .agg(
                    F.max("offset").alias("last"),
                    F.count(F.lit(1)).alias("records"),
                    F.sum(F.when(F.col("_error").isNotNull(), 1).otherwise(0)).alias("bad"),
                    *([F.max("_ts_ms").alias("stream_time")] if spec.window is not None else []),
                )
                .collect()
            )
            if not summary:
                skipped = raw.count()
                result = BatchResult(batch_id, 0, 0, 0, 0, skipped)
                return result
            bad_rows = (
                frame.where(F.col("_error").isNotNull())
                .select("key", "value", "partition", "offset", "_error")
                .collect()
            )
            partial_rows = pre_aggregate(spec, frame.where(F.col("_error").isNull())).collect()
        finally:
            frame.unpersist()
        collected = time.perf_counter()

        offsets = dict(self.committed.offsets)
        stream_time = dict(self.committed.stream_time_ms)
        records = 0
        for row in summary:
            offsets[row["partition"]] = row["last"] + 1
            records += row["records"]
            if spec.window is not None and row["stream_time"] is not None:
                stream_time[row["partition"]] = max(
                    stream_time.get(row["partition"], row["stream_time"]), row["stream_time"]
                )
        updates: dict[tuple[Any, ...], dict[str, Any]] = {}
        for row in partial_rows:
            values = row.asDict()
            key = tuple(values.pop(column) for column in spec.key_columns)
            updates[key] = merge(spec, self.state.get(key), values)

        merged = time.perf_counter()
        now_ms = int(time.time() * 1000)
        self._write(bad_rows, updates, Committed(offsets, stream_time), now_ms)
        committed = time.perf_counter()
        # Only after the commit succeeded does the in-memory state move on.
        self.state.update(updates)
        self.committed = Committed(offsets, stream_time)
        result = BatchResult(
            batch_id,
            records,
            records - len(bad_rows),
            len(bad_rows),
            len(updates),
            0,
            spark_s=round(collected - started, 2),
            merge_s=round(merged - collected, 2),
            commit_s=round(committed - merged, 2),
        )
        return result

    def _write(
        self,
        bad_rows: Iterable[Any],
        updates: dict[tuple[Any, ...], dict[str, Any]],
        covered: Committed,
        now_ms: int,
    ) -> None:
        spec, producer = self.spec, self.producer
        assert producer is not None
        source = spec.source.topic
        producer.begin_transaction()
        try:
            for row in bad_rows:
                headers: list[tuple[str, str | bytes | None]] = [
                    ("duality.error", row["_error"].encode()),
                    ("duality.source.topic", source.encode()),
                    ("duality.source.partition", str(row["partition"]).encode()),
                    ("duality.source.offset", str(row["offset"]).encode()),
                ]
                kafka.send(
                    producer, spec.dlq_topic, _bytes(row["key"]), _bytes(row["value"]), headers
                )
            for key, state in updates.items():
                shown = key if spec.window is None else (*key[:-1], changelog.window_iso(key[-1]))
                value = changelog.encode_value(
                    spec, shown, aggregate_values(spec, state), state, now_ms
                )
                kafka.send(producer, spec.changelog_topic, changelog.encode_key(spec, shown), value)
            producer.send_offsets_to_transaction(
                covered.to_kafka(source), self._group_metadata, self.settings.connect_timeout_s * 3
            )
            producer.commit_transaction(self.settings.connect_timeout_s * 6)
        except KafkaException:
            try:
                producer.abort_transaction(self.settings.connect_timeout_s)
            except KafkaException:
                log.warning("%s: aborting the transaction failed too", spec.name)
            raise

    def close(self) -> None:
        if self.producer is not None:
            self.producer.flush(10)
            self.producer = None


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


def _iso_to_ms(text: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
