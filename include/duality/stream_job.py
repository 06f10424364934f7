"""The stream's driver: creates the pipeline's topics, runs the query, and keeps it running.

A failed query (the broker went away, a transaction could not commit) is restarted with
backoff from its checkpoint, so the stream recovers by itself; only a lost checkpoint makes it
seed its state from the changelog. SIGTERM stops it gracefully. A lock file makes sure one
checkpoint never has two drivers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from duality import kafka, status, stream
from duality.config import Settings
from duality.errors import DualityError, LocalStackError, UsageError
from duality.spec import PipelineSpec

log = logging.getLogger("duality.stream")

# Larger micro-batches read a backlog faster, but one that changed 1,000,000 keys ran the
# driver's 1 GB heap out of memory (README, benchmark).
MAX_OFFSETS_PER_TRIGGER = 500_000
# A micro-batch running longer than this is taken as stalled (a lost broker connection that
# never recovers): the query is stopped and restarted from the changelog.
STALL_TIMEOUT_S = 300.0
STALLED_EXIT = 75
# The driver's JVM is gone (killed, or ended by an OutOfMemoryError): no query can run in this
# process again, so it exits and the supervisor starts a driver with a new JVM.
JVM_EXITED = 76


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How a stream runs; the same arguments for `jobs/stream_aggregate.py` and its driver."""

    max_offsets_per_trigger: int = MAX_OFFSETS_PER_TRIGGER
    stall_timeout_s: float = STALL_TIMEOUT_S
    trigger_seconds: float = 1.0

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--max-offsets-per-trigger",
            type=int,
            default=MAX_OFFSETS_PER_TRIGGER,
            help="the most source records one micro-batch reads (default %(default)s)",
        )
        parser.add_argument(
            "--stall-timeout",
            type=float,
            default=STALL_TIMEOUT_S,
            help="seconds after which a running micro-batch is stalled (default %(default)s)",
        )
        parser.add_argument(
            "--trigger-seconds",
            type=float,
            default=1.0,
            help="the micro-batch trigger interval in seconds (default %(default)s)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StreamOptions:
        if args.max_offsets_per_trigger < 1:
            raise UsageError("--max-offsets-per-trigger must be at least 1")
        if args.trigger_seconds < 0 or args.stall_timeout <= 0:
            raise UsageError("--trigger-seconds must be 0 or more and --stall-timeout positive")
        return cls(args.max_offsets_per_trigger, args.stall_timeout, args.trigger_seconds)

    def to_args(self) -> list[str]:
        return [
            "--max-offsets-per-trigger",
            str(self.max_offsets_per_trigger),
            "--stall-timeout",
            str(self.stall_timeout_s),
            "--trigger-seconds",
            str(self.trigger_seconds),
        ]


def changelog_config(spec: PipelineSpec) -> dict[str, str]:
    config = dict(kafka.FAST_COMPACTION)
    if spec.window is not None:
        config["cleanup.policy"] = "compact,delete"
        # Windows are kept for a week after their last update, then deleted with their segment.
        config["retention.ms"] = str(7 * 24 * 3600 * 1000)
    return config


def ensure_topics(settings: Settings, spec: PipelineSpec) -> None:
    """Create the changelog, dead-letter and status topics when missing (never the source)."""
    source_partitions = kafka.partition_count(settings, spec.source.topic)
    kafka.create_topic(
        settings,
        spec.changelog_topic,
        spec.changelog.partitions or source_partitions,
        config=changelog_config(spec),
        exist_ok=True,
    )
    kafka.create_topic(settings, spec.dlq_topic, source_partitions, exist_ok=True)
    status.ensure_topic(settings)


def checkpoint_dir(settings: Settings, spec: PipelineSpec) -> Path:
    return settings.checkpoint_root / spec.name


def lock_file(settings: Settings, spec: PipelineSpec) -> Path:
    return settings.local_dir / "streams" / f"{spec.name}.lock"


@contextlib.contextmanager
def exclusive(settings: Settings, spec: PipelineSpec) -> Iterator[None]:
    """Hold the pipeline's lock for the life of the driver, or fail if another driver holds it."""
    path = lock_file(settings, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LocalStackError(
                f"pipeline {spec.name} already runs (lock {path} is held): stop it first with "
                f"`duality stream stop {spec.name}`"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _heartbeat_listener(heartbeat: status.Heartbeat, writer: stream.ChangelogWriter) -> Any:
    """A StreamingQueryListener that turns query progress into heartbeats on `_duality-status`."""
    from pyspark.sql.streaming import StreamingQueryListener

    class Listener(StreamingQueryListener):
        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

        def onQueryStarted(self, event: Any) -> None:
            heartbeat.publish("running", query_id=str(event.id))

        def onQueryProgress(self, event: Any) -> None:
            progress = event.progress
            kafka_source = next(
                (s for s in progress.sources if "kafka" in s.description.lower()), None
            )
            operators = progress.stateOperators
            if operators:
                # Rows in Spark's state store: the table's keys (or windows) on the executors.
                self.state = {
                    "state_rows": operators[0].numRowsTotal,
                    "state_memory_bytes": operators[0].memoryUsedBytes,
                }
            heartbeat.publish(
                "running",
                batch_id=progress.batchId,
                input_rows_per_second=progress.inputRowsPerSecond,
                processed_rows_per_second=progress.processedRowsPerSecond,
                num_input_rows=progress.numInputRows,
                source_offsets=json_or_none(kafka_source.endOffset) if kafka_source else None,
                committed_offsets=writer.committed,
                watermark=progress.eventTime.get("watermark") if progress.eventTime else None,
                **self.state,
            )

        def onQueryIdle(self, event: Any) -> None:
            heartbeat.publish(
                "running", idle=True, committed_offsets=writer.committed, **self.state
            )

        def onQueryTerminated(self, event: Any) -> None:
            heartbeat.publish("failed" if event.exception else "stopped", error=event.exception)

    return Listener()


def json_or_none(text: Any) -> Any:
    import json

    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


class StreamDriver:
    def __init__(self, settings: Settings, spec: PipelineSpec, options: StreamOptions):
        self.settings = settings
        self.spec = spec
        self.trigger_seconds = options.trigger_seconds
        self.max_offsets_per_trigger = options.max_offsets_per_trigger
        self.stall_timeout_s = options.stall_timeout_s
        self.stopping = threading.Event()

    def request_stop(self, *_: Any) -> None:
        self.stopping.set()

    def run(self) -> int:
        from duality.spark import session

        spec, settings = self.spec, self.settings
        # The lock is the supervisor's (supervise()); this process runs one driver.
        kafka.ensure_reachable(settings)
        ensure_topics(settings, spec)
        # glibc gives each thread that allocates its own malloc arena; RocksDB's and the JVM's
        # native allocations from many threads then keep growing the JVM's resident memory.
        os.environ.setdefault("MALLOC_ARENA_MAX", "2")
        spark = session(
            settings,
            f"duality-stream-{spec.name}",
            {"spark.driver.memory": settings.stream_driver_memory},
        )
        heartbeat = status.Heartbeat(settings, spec.name)
        backoff = 1.0
        try:
            while not self.stopping.is_set():
                try:
                    self._run_query(spark, heartbeat)
                    backoff = 1.0
                except DualityError:
                    raise
                except Exception as error:
                    # A refused login does not heal by itself: end with it, no restart loop.
                    refused = kafka.refused_login_in(settings, error)
                    if refused is not None:
                        heartbeat.publish("failed", error=str(refused))
                        raise refused from None
                    jvm_code = _jvm_exit_code(spark)
                    if jvm_code is not None:
                        message = f"the driver's JVM exited with {jvm_code}"
                        self._exit_for_new_driver(heartbeat, "restarting", message, JVM_EXITED)
                    log.warning(
                        "%s: stream failed (%s); restarting in %.0fs",
                        spec.name,
                        _short(error),
                        backoff,
                    )
                    heartbeat.publish("restarting", error=_short(error), backoff_s=backoff)
                    self.stopping.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
            heartbeat.publish("stopped")
        finally:
            heartbeat.close()
        return 0

    def _run_query(self, spark: Any, heartbeat: status.Heartbeat) -> None:
        spec, settings = self.spec, self.settings
        checkpoint = checkpoint_dir(settings, spec)
        heartbeat.publish("restoring")
        # First fence any older driver and abort its open transaction, then read what the
        # changelog covers: the seed and the starting offsets below are a consistent pair.
        writer = stream.ChangelogWriter(settings, spec, checkpoint)
        if stream.checkpoint_usable(spec, checkpoint):
            log.info(
                "%s: resuming from the checkpoint %s (the state is in Spark's state store; the "
                "changelog is not read)",
                spec.name,
                checkpoint,
            )
        else:
            started = time.monotonic()
            stream.prepare_checkpoint(spec, checkpoint)
            keys = stream.write_seed(spark, settings, spec, checkpoint)
            log.info(
                "%s: restored %d keys from %s in %.1fs (seeding the state store); source resumes "
                "at %s",
                spec.name,
                keys,
                spec.changelog_topic,
                time.monotonic() - started,
                writer.committed or "the beginning",
            )
        # One global watermark for late rows and eviction: the one Spark records per batch.
        spark.conf.set("spark.sql.streaming.statefulOperator.allowMultiple", "false")
        listener = _heartbeat_listener(heartbeat, writer)
        spark.streams.addListener(listener)
        source = (
            spark.readStream.format("kafka")
            .options(**settings.spark_kafka_source_options())
            .option("subscribe", spec.source.topic)
            .option("startingOffsets", writer.starting_offsets())
            .option("maxOffsetsPerTrigger", str(self.max_offsets_per_trigger))
            .option("kafka.isolation.level", "read_committed")
            .load()
        )
        frame = stream.build_query_frame(spec, source, stream.seeds_stream(spark, spec, checkpoint))

        def apply(batch: Any, batch_id: int) -> None:
            result = writer.write(batch, batch_id)
            log.info("%s: batch %d: %s", spec.name, batch_id, result)

        query = (
            frame.writeStream.queryName(f"duality-{spec.name}")
            .outputMode("update")
            .foreachBatch(apply)
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime=f"{self.trigger_seconds} seconds")
            .start()
        )
        try:
            # Stalled means one micro-batch running too long, not many busy ones in a row.
            busy_since: float | None = None
            last_batch = None
            while query.isActive and not self.stopping.is_set():
                query.awaitTermination(1)
                progress = query.lastProgress
                batch = progress["batchId"] if progress else None
                if query.status.get("isTriggerActive") and batch == last_batch:
                    busy_since = busy_since or time.monotonic()
                    if time.monotonic() - busy_since > self.stall_timeout_s:
                        self._give_up_stalled(heartbeat)
                else:
                    busy_since = None
                last_batch = batch
            if self.stopping.is_set():
                # Graceful: let the running batch commit its transaction before stopping.
                deadline = time.monotonic() + 60
                while (
                    query.isActive
                    and query.status.get("isTriggerActive")
                    and (time.monotonic() < deadline)
                ):
                    time.sleep(0.2)
                query.stop()
            else:
                error = query.exception()
                if error is not None:
                    raise RuntimeError(str(error))
        finally:
            if query.isActive:
                query.stop()
            spark.streams.removeListener(listener)
            writer.close()

    def _give_up_stalled(self, heartbeat: status.Heartbeat) -> None:
        """A batch hangs in a call that cannot be interrupted (a Kafka client waiting on a
        broker that went away): end the process at once; the supervisor starts a new one, which
        aborts the open transaction and restores from the changelog."""
        message = f"a micro-batch ran for more than {self.stall_timeout_s:g}s: stalled"
        self._exit_for_new_driver(heartbeat, "stalled", message, STALLED_EXIT)

    def _exit_for_new_driver(
        self, heartbeat: status.Heartbeat, state: str, message: str, code: int
    ) -> None:
        """Say why on the status topic and end this process with `code` at once (not a return:
        PySpark's exit handlers would wait on a JVM that hangs or is gone); the supervisor
        starts a new driver."""
        log.error("%s: %s; exiting for a new driver", self.spec.name, message)
        heartbeat.publish(state, error=message)
        heartbeat.close()
        logging.shutdown()
        os._exit(code)


def _jvm_exit_code(spark: Any) -> int | None:
    """The exit code of the JVM this process launched for `spark`, None while it runs."""
    process = getattr(spark.sparkContext._gateway, "proc", None)
    return process.poll() if process is not None else None


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def run_child(settings: Settings, spec: PipelineSpec, options: StreamOptions) -> int:
    """Run the driver in this process (the supervisor holds the pipeline's lock)."""
    driver = StreamDriver(settings, spec, options)
    signal.signal(signal.SIGTERM, driver.request_stop)
    signal.signal(signal.SIGINT, driver.request_stop)
    return driver.run()


def supervise(settings: Settings, spec: PipelineSpec, pipeline: str, options: StreamOptions) -> int:
    """Hold the lock and keep a driver process running until SIGTERM.

    A driver that exits on its own (stalled, crashed) is replaced after a backoff; one that
    exits with a usage error (a bad spec, say) ends the supervision with that code.
    """
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def request_stop(*_: Any) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    command = [sys.executable, "-m", "duality.stream_job", pipeline, *options.to_args()]
    backoff = 1.0
    with exclusive(settings, spec):
        while not stopping.is_set():
            child = subprocess.Popen(command, preexec_fn=_die_with_parent)
            code = child.wait()
            if stopping.is_set():
                break
            if code == UsageError.exit_code:
                return code
            log.warning(
                "%s: driver exited with %d; starting a new one in %.0fs", spec.name, code, backoff
            )
            stopping.wait(backoff)
            backoff = min(backoff * 2, 30.0)
    return 0


def _die_with_parent() -> None:
    """In the driver child: the kernel kills it when the supervisor dies (even by SIGKILL), so
    a killed stream never leaves a driver running without the lock."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _child_main(argv: list[str] | None = None) -> int:
    from duality.spec import find_spec

    parser = argparse.ArgumentParser(prog="python -m duality.stream_job")
    parser.add_argument("pipeline")
    StreamOptions.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = Settings.from_env()
        spec = find_spec(settings, args.pipeline)
        return run_child(settings, spec, StreamOptions.from_args(args))
    except DualityError as error:
        log.error("%s", error)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(_child_main())
