"""Writing a micro-batch exactly once: its changelog records and dead letters in one Kafka
transaction with the source offsets the batch covers, committed to the pipeline's group."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any, cast

from duality import changelog
from duality.config import Settings
from duality.kafka import client, offsets, records, topics
from duality.metrics import reason_kind
from duality.spec import PipelineSpec
from duality.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("duality.stream")

# A dead letter's headers and key get this much room when its value has to be cut to fit.
_DEAD_LETTER_MARGIN = 16_384


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """What Spark's offset log says of one micro-batch: source end offsets, watermark, and the
    end offsets of the joined table's topic (empty without a join)."""

    end_offsets: dict[int, int]
    watermark_ms: int
    table_offsets: dict[int, int] = dataclasses.field(default_factory=dict)


def planned_batch(
    checkpoint: Location, topic: str, batch_id: int, table_topic: str | None = None
) -> PlannedBatch:
    """Read `offsets/<batch_id>`, which Spark writes before it runs the batch: a version, the
    batch's metadata (with `batchWatermarkMs`), then one offset per source (one Kafka source
    reads the source topic and the joined table's topic)."""
    path = checkpoint / "offsets" / str(batch_id)
    lines = path.read_text().splitlines()
    metadata = json.loads(lines[1])
    for line in lines[2:]:
        if line.startswith("{"):
            document = json.loads(line)
            if topic in document:
                ends = {int(p): int(o) for p, o in document[topic].items()}
                table = document.get(table_topic, {}) if table_topic else {}
                return PlannedBatch(
                    ends,
                    int(metadata.get("batchWatermarkMs", 0)),
                    {int(p): int(o) for p, o in table.items()},
                )
    raise AssertionError(f"{path} holds no offsets of {topic}: {lines}")


@dataclasses.dataclass
class BatchResult:
    batch_id: int
    records: int = 0  # source offsets the batch covers
    dead_lettered: int = 0
    late: int = 0
    filtered: int = 0  # records the spec's `where` skipped
    unmatched: int = 0  # events an inner join found no row for
    table_rows: int = 0  # rows of the joined table that changed, written to its topic
    table_dead: int = 0  # of dead_lettered, table records that do not parse
    late_windows: int = 0  # (record, window) pairs dropped as late, the record counted in others
    updated_keys: int = 0
    replayed: bool = False  # its offsets were committed already: a replay, or no new records
    seconds: float = 0.0  # the whole batch in the driver
    commit_seconds: float = 0.0  # its transaction's offsets sent and commit
    # Dead letters by the kind of their reason (duality.metrics.reason_kind).
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)


# Seconds a micro-batch's transaction waits to add its source offsets: two requests, which took
# at most 5.2 s while a coordinator moved in the broker-loss test; one that waits longer is
# restarted with a new producer (about 4 s) rather than left to librdkafka (decision 33).
OFFSETS_TIMEOUT_S = 5.0


class ChangelogWriter:
    """Writes each micro-batch's output in one Kafka transaction with the source offsets."""

    def __init__(self, settings: Settings, spec: PipelineSpec, checkpoint: Location):
        self.settings = settings
        self.spec = spec
        self.checkpoint = checkpoint
        self.dead_letter_limit = topics.max_message_bytes(settings, spec.dlq_topic)
        # The transactional id is the pipeline's: a new driver fences any older one still alive,
        # and its open transaction is aborted before anything is read.
        self.producer = client.transactional_producer(
            settings,
            f"duality-{spec.name}",
            transaction_timeout_ms=300_000,
            queue_buffering_max_messages=1_000_000,
            # A micro-batch's records wait for room rather than all sit in the producer's queue
            # (1 GB by default): the driver's memory does not follow the keys a batch changes.
            queue_buffering_max_kbytes=32_768,
            linger_ms=20,
            message_max_bytes=self.dead_letter_limit + _DEAD_LETTER_MARGIN,
        )
        committed = offsets.committed_offsets(settings, spec.consumer_group, spec.source.topic)
        self.committed = {p: offset for p, (offset, _) in committed.items()}
        # The joined table's topic: how far the table's rows, in the state, have read it.
        self.table_topic = spec.joined.topic if spec.joined is not None else None
        self.table_committed: dict[int, int] = {}
        if self.table_topic is not None:
            table = offsets.committed_offsets(settings, spec.consumer_group, self.table_topic)
            self.table_committed = {p: offset for p, (offset, _) in table.items()}
        # A transactional call of the producer never returned (client.send_offsets): unusable.
        self.stuck = False
        # Since this driver started, for the heartbeat.
        self.filtered = self.late_windows = self.dead_lettered = self.unmatched = 0
        # The group the offsets are committed to; it never subscribes, so it never rebalances.
        group = client.consumer(settings, spec.consumer_group)
        self._group_metadata = group.consumer_group_metadata()
        group.close()

    def starting_offsets(self, table_starts: dict[int, int] | None = None) -> str:
        """Spark's startingOffsets for a query without checkpoint: the committed offsets; the
        joined table's topic from `table_starts` (where its seed ends)."""
        partitions = topics.partition_count(self.settings, self.spec.source.topic)
        # -2 is Spark's "earliest" for a partition the changelog does not cover yet.
        offsets = {str(p): self.committed.get(p, -2) for p in range(partitions)}
        starts = {self.spec.source.topic: offsets}
        if self.table_topic is not None:
            ends = table_starts or {}
            count = topics.partition_count(self.settings, self.table_topic)
            starts[self.table_topic] = {str(p): ends.get(p, -2) for p in range(count)}
        return json.dumps(starts)

    def write(self, batch: DataFrame, batch_id: int) -> BatchResult:
        from pyspark.sql import functions as F

        started = time.perf_counter()
        planned = planned_batch(self.checkpoint, self.spec.source.topic, batch_id, self.table_topic)
        source_records = sum(
            max(0, end - self.committed.get(p, 0)) for p, end in planned.end_offsets.items()
        )
        if all(self.committed.get(p, 0) >= end for p, end in planned.end_offsets.items()) and all(
            self.table_committed.get(p, 0) >= end for p, end in planned.table_offsets.items()
        ):
            # Spark replays a batch whose transaction had committed (the driver died between
            # the commit and Spark's own commit log). Run it for its state, write nothing.
            batch.write.format("noop").mode("overwrite").save()
            return BatchResult(batch_id, replayed=True)
        wanted = F.col("_kind") != "candidate"
        if self.spec.window is not None:
            # Spark drops a windowed row whose window ended at or before the batch's watermark:
            # a record late for its last window is late for all, and dead-lettered.
            wanted = wanted | (F.col("_first_window_end") <= F.lit(planned.watermark_ms))
        rows = output_rows(batch.where(wanted))
        spec, producer = self.spec, self.producer
        result = BatchResult(batch_id, source_records)
        source = spec.source.topic.encode()
        watermark = changelog.window_iso(planned.watermark_ms)
        delay = spec.window.watermark if spec.window is not None else ""
        # A hopping window's value ends with the source end offsets of the batch that updated
        # it last: what `validate --reconcile` needs to tell the pairs counted from the dropped.
        through = b""
        if spec.window is not None and spec.window.slide_seconds < spec.window.size_seconds:
            ends = {str(p): end for p, end in sorted(planned.end_offsets.items())}
            through = b',"_through":' + json.dumps(ends, separators=(",", ":")).encode() + b"}"
        rows_of_table: dict[bytes, tuple[tuple[int, int, int], bytes | None]] = {}
        producer.begin_transaction()
        try:
            for row in rows:
                kind = row["_kind"]
                if kind == "update":
                    value = bytes(row["_value"])[:-1] + through if through else row["_value"]
                    records.send(producer, spec.changelog_topic, row["_key"], value)
                    result.updated_keys += 1
                    continue
                if kind == "filtered":
                    result.filtered += 1
                    continue
                if kind == "unmatched":
                    result.unmatched += 1
                    continue
                if kind == "table":
                    # A key's last record in the join's order is the row the state holds.
                    place = (row["_order"], row["_partition"], row["_offset"])
                    held = rows_of_table.get(row["_key"])
                    if held is None or held[0] < place:
                        rows_of_table[row["_key"]] = (place, row["_value"])
                    continue
                if kind == "candidate" and row["_window_end"] > planned.watermark_ms:
                    result.late_windows += self._late_windows(row, planned.watermark_ms)
                    continue
                if kind == "candidate":
                    ended = changelog.window_iso(row["_window_end"])
                    reason = (
                        f"late event: its window ended at {ended}, not after the watermark "
                        f"{watermark} (the latest event time of earlier micro-batches minus "
                        f"{delay})"
                    )
                    result.late += 1
                else:
                    reason = row["_error"]
                result.dead_lettered += 1
                topic = source
                if kind == "table_dead":
                    assert self.table_topic is not None
                    topic = self.table_topic.encode()
                    result.table_dead += 1
                kind = reason_kind(reason)
                result.reasons[kind] = result.reasons.get(kind, 0) + 1
                self._dead_letter(row, reason, topic)
            for key, (_, value) in rows_of_table.items():
                records.send(producer, spec.table_topic, key, value)
            result.table_rows = len(rows_of_table)
            committing = time.perf_counter()
            consumed = [
                offsets.TopicPartition(spec.source.topic, p, end)
                for p, end in sorted(planned.end_offsets.items())
            ]
            if self.table_topic is not None:
                consumed += [
                    offsets.TopicPartition(self.table_topic, p, end)
                    for p, end in sorted(planned.table_offsets.items())
                ]
            # A call that librdkafka keeps waiting (decision 33) fails the batch, and the query's
            # restart fences this producer with a new one, far sooner than the driver's stall.
            client.send_offsets(producer, consumed, self._group_metadata, OFFSETS_TIMEOUT_S)
            producer.commit_transaction(self.settings.connect_timeout_s * 6)
            result.commit_seconds = round(time.perf_counter() - committing, 3)
        except client.TransactionStuck:
            # Its call still runs: no abort or flush can be asked of it. The next writer's
            # producer fences it and aborts its transaction.
            self.stuck = True
            raise
        except BaseException:
            try:
                producer.abort_transaction(self.settings.connect_timeout_s)
            except Exception:
                log.warning("%s: aborting the transaction failed too", spec.name)
            raise
        self.committed.update(planned.end_offsets)
        self.table_committed.update(planned.table_offsets)
        self.filtered += result.filtered
        self.unmatched += result.unmatched
        self.late_windows += result.late_windows
        self.dead_lettered += result.dead_lettered
        result.seconds = round(time.perf_counter() - started, 2)
        return result

    def _late_windows(self, row: Any, watermark_ms: int) -> int:
        """How many of a record's windows (ending a slide apart) ended by the watermark."""
        assert self.spec.window is not None
        slide = self.spec.window.slide_seconds * 1000
        return (watermark_ms - row["_first_window_end"]) // slide + 1

    def _dead_letter(self, row: Any, reason: str, source: bytes) -> None:
        key, value = (None if v is None else bytes(v) for v in (row["_key"], row["_value"]))
        room = self.dead_letter_limit - _DEAD_LETTER_MARGIN - len(key or b"")
        if value is not None and len(value) > room:
            kept = max(0, room)
            reason += (
                f"; the value was cut to its first {kept} of {len(value)} bytes, the most the "
                f"dead-letter topic {self.spec.dlq_topic} accepts (max.message.bytes "
                f"{self.dead_letter_limit})"
            )
            value = value[:kept]
        headers: list[tuple[str, str | bytes | None]] = [
            ("duality.error", reason.encode()),
            ("duality.source.topic", source),
            ("duality.source.partition", str(row["_partition"]).encode()),
            ("duality.source.offset", str(row["_offset"]).encode()),
        ]
        records.send(self.producer, self.spec.dlq_topic, key, value, headers)

    def close(self) -> None:
        if not self.stuck:
            self.producer.flush(10)


def output_rows(output: DataFrame) -> Iterator[dict[str, Any]]:
    """The output's rows one Arrow batch at a time, as Spark sends them: the calls `toArrow()`
    makes (pinned PySpark), without keeping every batch and their order, which a micro-batch's
    output, each key once, does not need. The driver's memory does not grow with the keys."""
    import pyarrow as pa
    from pyspark.errors.exceptions.captured import unwrap_spark_exception
    from pyspark.sql.pandas.serializers import ArrowCollectSerializer
    from pyspark.util import _load_from_socket

    port, secret, server = output._jdf.collectAsArrowToPython()
    stream = cast(Generator[Any], _load_from_socket((port, secret), ArrowCollectSerializer()))
    finished = False
    try:
        for item in stream:
            # The last item is the batches' order: not needed.
            if isinstance(item, pa.RecordBatch):
                yield from item.to_pylist()
        finished = True
    finally:
        stream.close()
        if finished:
            # The JVM's error, if the job failed after sending what it had.
            with unwrap_spark_exception():
                server.getResult()
