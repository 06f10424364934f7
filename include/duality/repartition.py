"""Repartitioning a topic: copy SOURCE into TARGET with N partitions, every record exactly once
(docs/decisions/0005-exactly-once-repartition.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from duality import skew
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, offsets, records, topics
from duality.partitioning import Partitioner

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("duality.repartition")

STRATEGIES = ("key-hash", "salted")
# Records per transaction: bounds what a crash throws away and how long readers wait.
TRANSACTION_RECORDS = 50_000
# Offset commit metadata is limited to 4096 bytes by default (offset.metadata.max.bytes).
_PLAN_METADATA_LIMIT = 4000


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one repartitioning does; stored with its progress so every run does the same."""

    source: str
    target: str
    partitions: int
    strategy: str = "key-hash"
    hot_keys: tuple[str, ...] = ()
    salts: int = 1

    @property
    def group(self) -> str:
        return f"duality-repartition-{self.target}"

    def transactional_id(self, source_partition: int) -> str:
        return f"duality-repartition-{self.target}-{source_partition}"

    def metadata(self) -> str:
        return json.dumps(
            {
                "source": self.source,
                "strategy": self.strategy,
                "partitions": self.partitions,
                "hot_keys": list(self.hot_keys),
                "salts": self.salts,
            },
            separators=(",", ":"),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "partitions": self.partitions,
            "strategy": self.strategy,
            "hot_keys": list(self.hot_keys),
            "salts": self.salts,
            "group": self.group,
        }

    def partitioner(self) -> Partitioner:
        """Where this plan puts each record."""
        hot = self.hot_keys if self.strategy == "salted" else ()
        return Partitioner(self.partitions, hot, self.salts)


# -- arguments -----------------------------------------------------------------------------


def check_arguments(
    source: str,
    target: str,
    partitions: int,
    strategy: str,
    hot_keys: str | None,
    salts: int | None,
) -> None:
    """The checks that need no broker; each error names the argument and the fix."""
    if not source or not target:
        raise UsageError("SOURCE and --to TARGET must both name topics")
    if source == target:
        raise UsageError(f"--to {target!r} is the source itself: copy into a new topic")
    if partitions < 1:
        raise UsageError(f"--partitions must be at least 1, got {partitions}")
    if strategy not in STRATEGIES:
        raise UsageError(f"--strategy {strategy!r} is unknown: use {' or '.join(STRATEGIES)}")
    if strategy == "key-hash" and (hot_keys is not None or salts is not None):
        raise UsageError(
            "--hot-keys and --salts apply to --strategy salted only: drop them, or use salted"
        )
    if salts is not None and not hot_keys:
        raise UsageError("--salts needs hot keys to salt: add --hot-keys auto or --hot-keys k1,k2")
    if strategy == "salted" and not hot_keys:
        raise UsageError("--strategy salted needs --hot-keys auto or --hot-keys k1,k2")
    if salts is not None and not 2 <= salts <= partitions:
        raise UsageError(
            f"--salts must be between 2 and --partitions ({partitions}), got {salts}: "
            "a hot key is spread over that many distinct partitions"
        )


def plan(
    settings: Settings,
    source: str,
    target: str,
    partitions: int,
    strategy: str = "key-hash",
    hot_keys: str | None = None,
    salts: int | None = None,
) -> Plan:
    """Check every argument against the cluster and decide the plan; creates nothing."""
    check_arguments(source, target, partitions, strategy, hot_keys, salts)
    topics.partition_count(settings, source)  # UsageError when the source is missing
    chosen: tuple[str, ...] = ()
    resumed = _resumable_auto_plan(settings, source, target, partitions, hot_keys, salts)
    if resumed is not None:
        # `auto` keeps the keys it chose on the first run: the plan is part of the progress.
        return resumed
    if strategy == "salted":
        assert hot_keys
        if hot_keys.strip() == "auto":
            ends = offsets.end_offsets(settings, source, "read_uncommitted")
            starts = offsets.beginning_offsets(settings, source)
            estimates = skew.key_estimates(
                skew.sample(settings, source), {p: ends[p] - starts[p] for p in ends}
            )
            chosen = tuple(skew.hot_keys(estimates, partitions, salts))
            if not chosen:
                raise UsageError(
                    f"--hot-keys auto found no hot key in {source!r} (none holds more than "
                    f"{skew.HOT_KEY_SHARE_OF_PARTITION:g} of a partition's fair share): "
                    "use --strategy key-hash, or name the keys"
                )
        else:
            chosen = tuple(k for k in (k.strip() for k in hot_keys.split(",")) if k)
            if not chosen:
                raise UsageError(f"--hot-keys {hot_keys!r} names no key: write k1,k2 or auto")
    spread = (salts or partitions) if strategy == "salted" else 1
    result = Plan(source, target, partitions, strategy, chosen, spread)
    if len(result.metadata()) > _PLAN_METADATA_LIMIT:
        raise UsageError("--hot-keys names too many or too long keys: name fewer keys")
    if topics.topic_exists(settings, target):
        existing = topics.partition_count(settings, target)
        if existing != partitions:
            raise UsageError(
                f"--to {target!r} exists with {existing} partitions, not {partitions}: "
                "choose another target, or delete it"
            )
        stored = stored_plan(settings, result)
        if stored is not None and stored != result:
            raise UsageError(
                f"--to {target!r} is being filled by another plan ({stored.metadata()}): "
                "repeat that plan to resume it, or choose another target"
            )
    return result


def _resumable_auto_plan(
    settings: Settings,
    source: str,
    target: str,
    partitions: int,
    hot_keys: str | None,
    salts: int | None,
) -> Plan | None:
    """The stored salted plan of TARGET when `--hot-keys auto` asks to go on with it."""
    if (hot_keys or "").strip() != "auto" or not topics.topic_exists(settings, target):
        return None
    probe = Plan(source, target, partitions, "salted", (), salts or partitions)
    stored = stored_plan(settings, probe)
    if stored is None or stored.strategy != "salted" or stored.partitions != partitions:
        return None
    if stored.source != source or (salts is not None and stored.salts != salts):
        return None
    if topics.partition_count(settings, target) != partitions:
        return None
    return stored


def dry_run(settings: Settings, plan: Plan) -> dict[str, Any]:
    """What a run of `plan` would copy now, and the skew it would leave; changes nothing."""
    ends = offsets.end_offsets(settings, plan.source, "read_committed")
    todo = remaining(settings, plan, ends)
    starts = offsets.beginning_offsets(settings, plan.source)
    estimates = skew.key_estimates(
        skew.sample(settings, plan.source), {p: ends[p] - starts.get(p, 0) for p in ends}
    )
    hot = list(plan.hot_keys) if plan.strategy == "salted" else None
    loads = skew.predicted_loads(estimates, plan.partitions, hot, plan.salts)
    return {
        "dry_run": True,
        "plan": plan.as_dict(),
        "target_exists": topics.topic_exists(settings, plan.target),
        "to_copy": sum(todo.values()),
        "per_source_partition": {str(p): n for p, n in sorted(todo.items())},
        "predicted_skew_after": round(skew.ratio(loads), 3),
    }


def stored_plan(settings: Settings, requested: Plan) -> Plan | None:
    """The plan recorded with the committed progress of an earlier run, if any."""
    # read_uncommitted: a killed run's open transaction must not hold up the argument checks.
    committed = offsets.committed_offsets(
        settings, requested.group, requested.source, "read_uncommitted"
    )
    for _, metadata in committed.values():
        try:
            # The plan is a JSON object; bytes after it are not ours (see kafka._metadata_bytes).
            data, _ = json.JSONDecoder().raw_decode((metadata or b"").decode(errors="replace"))
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "strategy" in data:
            return Plan(
                data.get("source", requested.source),
                requested.target,
                int(data["partitions"]),
                data["strategy"],
                tuple(data.get("hot_keys", ())),
                int(data.get("salts", 1)),
            )
    return None


# -- the copy of one source partition (runs in a Spark task) --------------------------------


@dataclasses.dataclass
class SliceResult:
    source_partition: int
    start: int
    end: int
    copied: int
    transactions: int
    per_target: dict[int, int]
    seconds: float

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> SliceResult:
        """From `dataclasses.asdict` through JSON (whose keys are strings)."""
        per_target = {int(p): int(n) for p, n in document["per_target"].items()}
        return cls(**{**document, "per_target": per_target})


def copy_slice(
    settings: Settings,
    plan: Plan,
    source_partition: int,
    end: int,
    *,
    transaction_records: int = TRANSACTION_RECORDS,
    throttle: float | None = None,
) -> SliceResult:
    """Copy source_partition from its committed offset up to `end`, exactly once."""
    started = time.monotonic()
    timeout = settings.connect_timeout_s
    # Fences (and aborts the open transaction of) a task of an earlier, killed run.
    producer = client.transactional_producer(
        settings,
        plan.transactional_id(source_partition),
        transaction_timeout_ms=120_000,
        queue_buffering_max_messages=500_000,
        batch_num_messages=10_000,
        linger_ms=50,
    )
    reader = client.consumer(
        settings, plan.group, isolation_level="read_committed", fetch_max_bytes=52_428_800
    )
    group_metadata = reader.consumer_group_metadata()
    committed = offsets.committed_offsets(settings, plan.group, plan.source)
    start = committed[source_partition][0] if source_partition in committed else 0
    result = SliceResult(source_partition, start, end, 0, 0, {}, 0.0)
    metadata = plan.metadata()
    partitioner = plan.partitioner()
    source_header = str(source_partition).encode()
    in_transaction = 0
    next_offset = start
    per_target = [0] * plan.partitions
    produce = producer.produce
    target_topic = plan.target

    def commit() -> None:
        nonlocal in_transaction
        consumed = [offsets.TopicPartition(plan.source, source_partition, next_offset, metadata)]
        client.send_offsets(producer, consumed, group_metadata, timeout * 3)
        producer.commit_transaction(timeout * 6)
        result.transactions += 1
        in_transaction = 0

    try:
        if start >= end:
            return result
        reader.assign([offsets.TopicPartition(plan.source, source_partition, start)])
        done = False
        while not done:
            for message in reader.consume(num_messages=200 if throttle else 10_000, timeout=1.0):
                eof = records.end_of_partition(message)
                offset = message.offset()
                assert offset is not None
                if eof:
                    # Past the last record there may be only transaction markers.
                    done = done or offset >= end
                    continue
                if offset >= end:
                    done = True
                    break
                if in_transaction == 0:
                    producer.begin_transaction()
                key, value = message.key(), message.value()
                target = partitioner(key, value, source_partition)
                headers: list[Any] = list(message.headers() or [])
                headers.append(("duality.source.partition", source_header))
                headers.append(("duality.source.offset", str(offset).encode()))
                timestamp = message.timestamp()[1]
                while True:  # kafka.send, inlined: this loop is the copy's hot path
                    try:
                        if timestamp >= 0:
                            produce(
                                target_topic,
                                value,
                                key,
                                partition=target,
                                timestamp=timestamp,
                                headers=headers,
                            )
                        else:
                            produce(target_topic, value, key, partition=target, headers=headers)
                        break
                    except BufferError:
                        producer.poll(0.05)
                per_target[target] += 1
                in_transaction += 1
                next_offset = offset + 1
                if in_transaction >= transaction_records:
                    commit()
                if offset + 1 >= end:
                    done = True
                    break
            if throttle:
                # Pace the copy: wait until the moment `copied` records are due.
                due = started + sum(per_target) / throttle
                time.sleep(max(0.0, due - time.monotonic()))
        if next_offset < end:
            # What is left below the end are transaction markers or aborted records (a source
            # that is itself transactional): move the progress past them, so the next run and
            # `--continuous` do not find them again.
            if in_transaction == 0:
                producer.begin_transaction()
                in_transaction = -1  # an open transaction without records
            next_offset = end
        if in_transaction:
            commit()
        result.per_target = {p: n for p, n in enumerate(per_target) if n}
        result.copied = sum(per_target)
    except BaseException:
        if in_transaction:
            try:
                producer.abort_transaction(timeout)
            except Exception:
                log.warning("aborting the transaction of partition %d failed", source_partition)
        raise
    finally:
        reader.close()
        producer.flush(timeout)
        result.seconds = time.monotonic() - started
    return result


# -- the run (Spark driver) ------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    plan: Plan
    source_partitions: dict[int, int]
    target_partitions: dict[int, int]
    seconds: float  # the whole run: checks, fencing, Spark start and the copy
    transactions: int
    rounds: int = 1
    copy_seconds: float = 0.0  # the Spark job that copies

    @property
    def copied(self) -> int:
        return sum(self.source_partitions.values())

    @property
    def skew_before(self) -> float:
        return skew.ratio(list(self.source_partitions.values()))

    @property
    def skew_after(self) -> float:
        counts = [self.target_partitions.get(p, 0) for p in range(self.plan.partitions)]
        return skew.ratio(counts)

    @property
    def records_per_s(self) -> float:
        return self.copied / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.as_dict(),
            "copied": self.copied,
            "source_partitions": {str(p): n for p, n in sorted(self.source_partitions.items())},
            "target_partitions": {
                str(p): self.target_partitions.get(p, 0) for p in range(self.plan.partitions)
            },
            "skew_before": round(self.skew_before, 3),
            "skew_after": round(self.skew_after, 3),
            "seconds": round(self.seconds, 3),
            "copy_seconds": round(self.copy_seconds, 3),
            "records_per_s": round(self.records_per_s, 1),
            "transactions": self.transactions,
            "rounds": self.rounds,
        }


def ensure_target(settings: Settings, plan: Plan) -> bool:
    """Create TARGET with N partitions and SOURCE's own configs, replicated as the settings say
    (`kafka.durability`); False when it existed."""
    configs = topics.topic_overrides(settings, plan.source)
    configs.pop("min.insync.replicas", None)
    return topics.create_topic(
        settings, plan.target, plan.partitions, config=configs, exist_ok=True
    )


def fence(settings: Settings, plan: Plan) -> None:
    """Abort the transactions that killed copiers of this plan left open.

    Until then, their uncommitted offset commits keep read_committed offset fetches waiting
    (UNSTABLE_OFFSET_COMMIT), so the driver fences before it reads the progress.
    """
    for partition in range(topics.partition_count(settings, plan.source)):
        client.transactional_producer(settings, plan.transactional_id(partition))


def remaining(settings: Settings, plan: Plan, ends: dict[int, int]) -> dict[int, int]:
    """Per source partition, the records between the committed progress and `ends`."""
    committed = offsets.committed_offsets(settings, plan.group, plan.source)
    starts = offsets.beginning_offsets(settings, plan.source)
    return {
        p: max(0, end - max(committed.get(p, (0, None))[0], starts.get(p, 0)))
        for p, end in ends.items()
    }


def run_once(
    settings: Settings,
    plan: Plan,
    *,
    transaction_records: int = TRANSACTION_RECORDS,
    throttle: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Copy what the source holds now (end offsets fixed at the start), one task per partition."""
    from duality.spark import session

    started = time.monotonic()
    ensure_target(settings, plan)
    ends = offsets.end_offsets(settings, plan.source, "read_committed")
    todo = remaining(settings, plan, ends)
    total = sum(todo.values())
    work = sorted(p for p, n in todo.items() if n > 0)
    log.info(
        "%s -> %s: %d records to copy from partitions %s", plan.source, plan.target, total, work
    )
    if not work:
        return Report(plan, {}, {}, time.monotonic() - started, 0)

    stop_watch = threading.Event()
    watcher = None
    if progress is not None:
        progress(0, total)

        def watch() -> None:
            while not stop_watch.wait(1.0):
                try:
                    left = sum(remaining(settings, plan, ends).values())
                except Exception:  # progress is informative only; the copy decides
                    continue
                progress(total - left, total)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

    spark = session(settings, f"duality-repartition-{plan.target}")
    ends_of_work = {p: ends[p] for p in work}

    def task(batches: Iterable[pa.RecordBatch]) -> Iterable[pa.RecordBatch]:
        import pyarrow

        for batch in batches:
            for index in batch.column("id").to_pylist():
                p = work[index]
                result = copy_slice(
                    settings,
                    plan,
                    p,
                    ends_of_work[p],
                    transaction_records=transaction_records,
                    throttle=throttle,
                )
                document = json.dumps(dataclasses.asdict(result))
                yield pyarrow.RecordBatch.from_pydict({"result": [document]})

    copy_started = time.monotonic()
    try:
        # One Spark task per source partition, through Arrow (no RDD, which a Spark Connect
        # client lacks: docs/decisions/0026-warm-spark-for-batch-steps.md).
        tasks = spark.range(len(work), numPartitions=len(work))
        rows = tasks.mapInArrow(task, "result string").collect()
        results = [SliceResult.from_dict(json.loads(row["result"])) for row in rows]
    finally:
        stop_watch.set()
        if watcher is not None:
            watcher.join(5)
    if progress is not None:
        progress(total, total)
    per_source = {r.source_partition: r.copied for r in results}
    per_target: dict[int, int] = {}
    for r in results:
        for p, n in r.per_target.items():
            per_target[p] = per_target.get(p, 0) + n
    return Report(
        plan,
        per_source,
        per_target,
        time.monotonic() - started,
        sum(r.transactions for r in results),
        copy_seconds=time.monotonic() - copy_started,
    )


def run(
    settings: Settings,
    plan: Plan,
    *,
    continuous: bool = False,
    stop: threading.Event | None = None,
    poll_s: float = 1.0,
    transaction_records: int = TRANSACTION_RECORDS,
    throttle: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """One run; with `continuous`, keep mirroring new records until `stop` is set."""
    ensure_target(settings, plan)
    fence(settings, plan)
    report = run_once(
        settings,
        plan,
        transaction_records=transaction_records,
        throttle=throttle,
        progress=progress,
    )
    if not continuous:
        return report
    stop = stop or threading.Event()
    rounds = 1
    while not stop.wait(poll_s):
        ends = offsets.end_offsets(settings, plan.source, "read_committed")
        if not sum(remaining(settings, plan, ends).values()):
            continue
        more = run_once(settings, plan, transaction_records=transaction_records, throttle=throttle)
        rounds += 1
        log.info("%s -> %s: mirrored %d more records", plan.source, plan.target, more.copied)
        for p, n in more.source_partitions.items():
            report.source_partitions[p] = report.source_partitions.get(p, 0) + n
        for p, n in more.target_partitions.items():
            report.target_partitions[p] = report.target_partitions.get(p, 0) + n
        report.transactions += more.transactions
        report.seconds += more.seconds
        report.copy_seconds += more.copy_seconds
    report.rounds = rounds
    return report
