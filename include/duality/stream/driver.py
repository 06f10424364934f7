"""The stream's driver process (`python -m duality.stream.driver PIPELINE`, the supervisor's
child): creates the topics and runs the query, restarting it from its checkpoint on failure."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from duality.config import Settings
from duality.errors import DualityError
from duality.join import seeding as join_seeding
from duality.kafka import client, offsets
from duality.metrics import MetricsEndpoint, StreamMetrics, spark_ui_config
from duality.spec import PipelineSpec
from duality.stream import control, seeding
from duality.stream.changelog_writer import ChangelogWriter, output_rows
from duality.stream.election import Election
from duality.stream.heartbeat import Heartbeat
from duality.stream.options import StreamOptions
from duality.stream.query import build_query_frame
from duality.stream.supervisor import JVM_EXITED, STALLED_EXIT, entry_point
from duality.stream.topics import ensure_topics

log = logging.getLogger("duality.stream")

# A standby warms up on this many of each source partition's last records.
WARM_UP_RECORDS = 20
# A query asked to stop that has not stopped this long after is left behind: the process exits.
QUERY_STOP_S = 60.0
# The name progress.stateOperators gives the join's operator (TableJoin.java).
JOIN_OPERATOR = "flatMapGroupsWithState"


class ElectionLost(Exception):
    """This driver is no longer the active one (another took over, or its membership lapsed
    while Kafka was away): it stops its query and waits as a standby."""


def _heartbeat_listener(
    heartbeat: Heartbeat, fenced: Future[ChangelogWriter], metrics: StreamMetrics | None
) -> Any:
    """A StreamingQueryListener that turns query progress into heartbeats on `_duality-status`
    and the state store's gauges; the figures of the changelog's writer once it has fenced."""
    from pyspark.sql.streaming import StreamingQueryListener

    class Listener(StreamingQueryListener):
        def __init__(self) -> None:
            self.state: dict[str, Any] = {}
            # The last micro-batch, repeated while idle: the pipelines page shows its age.
            self.last_batch: dict[str, Any] = {}

        def onQueryStarted(self, event: Any) -> None:
            heartbeat.publish("running", query_id=str(event.id))

        def onQueryProgress(self, event: Any) -> None:
            progress = event.progress
            writer = fenced.result()
            kafka_source = next(
                (s for s in progress.sources if "kafka" in s.description.lower()), None
            )
            # A join's operator (TableJoin.java, `flatMapGroupsWithState`) keeps the joined
            # table's rows; the aggregation's is the other one. Which comes first in the list
            # is the plan's business, so they are told apart by name.
            join = [o for o in progress.stateOperators if o.operatorName == JOIN_OPERATOR]
            operators = [o for o in progress.stateOperators if o.operatorName != JOIN_OPERATOR]
            if operators:
                # Rows in Spark's state store: the table's keys (or windows) on the executors.
                self.state = {
                    "state_rows": operators[0].numRowsTotal,
                    "state_memory_bytes": operators[0].memoryUsedBytes,
                    # What the stateful stage ran with in this batch (the checkpoint's number).
                    "state_tasks": operators[0].numShufflePartitions,
                }
                if metrics is not None:
                    metrics.state(operators[0].numRowsTotal, operators[0].memoryUsedBytes)
            if join:
                # The joined table's rows in the join's state store, and what that store
                # reports using (RocksDB: its memory, and its SST files on disk).
                self.state |= {
                    "join_state_rows": join[0].numRowsTotal,
                    "join_state_memory_bytes": join[0].memoryUsedBytes,
                    "join_state_sst_bytes": (join[0].customMetrics or {}).get("rocksdbSstFileSize"),
                }
            self.last_batch = {
                "batch_id": progress.batchId,
                "last_batch_ms": int(time.time() * 1000),
            }
            heartbeat.publish(
                "running",
                input_rows_per_second=progress.inputRowsPerSecond,
                processed_rows_per_second=progress.processedRowsPerSecond,
                num_input_rows=progress.numInputRows,
                source_offsets=json_or_none(kafka_source.endOffset) if kafka_source else None,
                # The source's end offsets when the batch was planned: with the batch's own
                # records, the lag then, which the pipelines page charts without asking Kafka.
                source_latest_offsets=(
                    json_or_none(kafka_source.latestOffset) if kafka_source else None
                ),
                committed_offsets=writer.committed,
                table_offsets=writer.table_committed or None,
                filtered=writer.filtered,
                unmatched=writer.unmatched,
                late_windows=writer.late_windows,
                dead_lettered=writer.dead_lettered,
                watermark=progress.eventTime.get("watermark") if progress.eventTime else None,
                **self.last_batch,
                **self.state,
            )

        def onQueryIdle(self, event: Any) -> None:
            writer = fenced.result()
            heartbeat.publish(
                "running",
                idle=True,
                committed_offsets=writer.committed,
                table_offsets=writer.table_committed or None,
                filtered=writer.filtered,
                unmatched=writer.unmatched,
                late_windows=writer.late_windows,
                dead_lettered=writer.dead_lettered,
                **self.last_batch,
                **self.state,
            )

        def onQueryTerminated(self, event: Any) -> None:
            heartbeat.publish("failed" if event.exception else "stopped", error=event.exception)

    return Listener()


def subscribed(spec: PipelineSpec) -> list[str]:
    """The topics the stream's Kafka source reads: its source, and the joined table's."""
    return [spec.source.topic, *([spec.joined.topic] if spec.joined is not None else [])]


def json_or_none(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


class StreamDriver:
    def __init__(self, settings: Settings, spec: PipelineSpec, options: StreamOptions):
        self.settings = settings
        self.spec = spec
        self.options = options
        self.stopping = threading.Event()
        self.metrics: StreamMetrics | None = None
        self.partitions = 0  # the state partitions in force, set by `run`
        self.election: Election  # set by `run`, once Spark runs
        self._prepared: Any = None  # the query's frame, built by a standby while it waits
        # When it last made progress (became active, or committed a micro-batch): a driver
        # that makes none for its stall timeout exits for a new one.
        self.progressed = time.monotonic()

    def request_stop(self, *_: Any) -> None:
        self.stopping.set()

    def run(self) -> int:
        from duality.spark import session

        spec, settings = self.spec, self.settings
        client.ensure_reachable(settings)
        ensure_topics(settings, spec)
        # glibc gives each thread that allocates its own malloc arena; RocksDB's and the JVM's
        # native allocations from many threads then keep growing the JVM's resident memory.
        os.environ.setdefault("MALLOC_ARENA_MAX", "2")
        self.partitions = seeding.state_partitions(settings, spec)
        # Before any Spark: a checkpoint of another number stops the start (it names the fix).
        seeding.checkpoint_usable(spec, seeding.checkpoint_dir(settings, spec), self.partitions)
        extra = {
            "spark.driver.memory": settings.stream_driver_memory,
            "spark.sql.shuffle.partitions": str(self.partitions),
            # One global watermark for late rows and eviction: the one Spark records per batch.
            "spark.sql.streaming.statefulOperator.allowMultiple": "false",
        }
        if spec.joined is not None:
            # The join's operator is in both branches of the plan, the aggregation's and the
            # dead letters' (decision 35), which Spark's check refuses for a second
            # flatMapGroupsWithState. Each branch runs its own copy on the same records.
            extra["spark.sql.streaming.unsupportedOperationCheck"] = "false"
        if settings.metrics_port >= 0 and settings.prometheus_url is not None:
            # Spark's own metrics need the driver's UI, which costs a stream CPU: only where a
            # Prometheus runs to scrape them (`duality up --monitoring` records its address).
            extra |= spark_ui_config()
        spark = session(settings, f"duality-stream-{spec.name}", extra)
        # Warm (its JVM and Spark session up), it waits for its turn: one active driver per
        # pipeline across hosts (duality.stream.election).
        self.election = Election(settings, spec.name)
        if not self._wait_active(spark):
            self.election.close()
            return 0
        metrics, endpoint = self._metrics(spark)
        heartbeat = Heartbeat(
            settings,
            spec.name,
            metrics_port=endpoint.port if endpoint is not None else None,
            state_partitions=self.partitions,
        )
        self.metrics = metrics
        backoff = 1.0
        try:
            while not self.stopping.is_set():
                try:
                    # A query is (re)started only by the active driver (after a failure, the
                    # election may have moved on while this one was out of touch).
                    if not self.election.active.is_set():
                        if not self._wait_active(spark):
                            break
                        self.progressed = time.monotonic()
                    self._run_query(spark, heartbeat)
                    backoff = 1.0
                except ElectionLost as lost:
                    # The pipeline's heartbeat key is the new active driver's now: this one
                    # says it waits on the standby key (`_wait_active`).
                    log.warning("%s: %s; waiting as the standby", spec.name, lost)
                    self.election.lost.clear()  # the loop waits for the partition again
                except DualityError:
                    raise
                except Exception as error:
                    # A refused login does not heal by itself: end with it, no restart loop.
                    refused = client.refused_login_in(settings, error)
                    if refused is not None:
                        heartbeat.end("failed", error=str(refused))
                        raise refused from None
                    jvm = getattr(spark.sparkContext._gateway, "proc", None)
                    jvm_code = jvm.poll() if jvm is not None else None
                    if jvm_code is not None:
                        message = f"the driver's JVM exited with {jvm_code}"
                        self._exit_for_new_driver(heartbeat, "restarting", message, JVM_EXITED)
                    lines = str(error).strip().splitlines()
                    short = lines[0][:300] if lines else type(error).__name__
                    stall_timeout_s = self.options.stall_timeout_s
                    if time.monotonic() - self.progressed > stall_timeout_s:
                        # Restarted queries that keep failing: a new driver, with new clients
                        # and a new JVM, is the next thing to try.
                        message = (
                            f"no micro-batch committed for more than {stall_timeout_s:g}s, "
                            f"the query failing meanwhile ({short}): stalled"
                        )
                        self._exit_for_new_driver(heartbeat, "stalled", message, STALLED_EXIT)
                    log.warning(
                        "%s: stream failed (%s); restarting in %.0fs", spec.name, short, backoff
                    )
                    heartbeat.publish("restarting", error=short, backoff_s=backoff)
                    if metrics is not None:
                        metrics.restarts.labels(spec.name).inc()
                    self.stopping.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
            heartbeat.end("stopped")
        finally:
            heartbeat.close()
            if endpoint is not None:
                endpoint.close()
            # Last: a standby is assigned at once, its query starting after this one stopped.
            self.election.close()
        return 0

    def _wait_active(self, spark: Any) -> bool:
        """Wait, as a standby, until the election makes this driver active (True), or until
        it is asked to stop (False). A standby says so on its own heartbeat key."""
        # The first driver of a pipeline is made active at once; one restarted after a kill,
        # once the dead driver's session ends. Only a driver still waiting is a standby, and
        # warms up (on two cores a warm-up would slow a restart's restore).
        if self.election.active.wait(2 * self.election.session_timeout_ms / 1000):
            return True
        spec = self.spec
        self._warm_up(spark)
        try:
            # Built now, it is not built in the takeover (about 0.8 s); used if the checkpoint
            # is still there then.
            self._prepared = self._query_frame(spark, None)
        except Exception as error:  # the takeover builds it then
            log.warning("%s: building the query ahead failed: %s", spec.name, str(error)[:300])
        log.info("%s: standby, waiting for the active driver to end", spec.name)
        waiting = Heartbeat(self.settings, control.standby_key(spec.name))
        try:
            waiting.publish("standby")
            taken = self.election.wait_active(self.stopping, lambda: waiting.publish("standby"))
            waiting.publish("active" if taken else "stopped")
        finally:
            waiting.close()
        if taken:
            log.info("%s: taking over as the active driver", spec.name)
        return taken

    def _warm_up(self, spark: Any) -> None:
        """Run the query itself once over the source's last few records, with a checkpoint of
        its own and a batch function that only reads the output: a takeover's first
        micro-batch then finds the Kafka source's and the state store's classes loaded,
        RocksDB's library open and the plan's generated code in Spark's cache (decision 29)."""
        spec, settings = self.spec, self.settings
        started = time.monotonic()
        topic = spec.source.topic
        root = seeding.checkpoint_dir(settings, spec).parent
        if not isinstance(root, Path):
            # Never on object storage (its files are thrown away): under the local folder.
            root = settings.local_dir / "warm-up"
        root.mkdir(parents=True, exist_ok=True)
        # Beside the pipeline's checkpoint, on the storage its executors share.
        scratch = Path(tempfile.mkdtemp(prefix=f".{spec.name}-warm-up-", dir=root))
        try:
            ends = offsets.end_offsets(settings, topic)
            begins = offsets.beginning_offsets(settings, topic)
            starts = {
                topic: {
                    str(p): max(begins.get(p, 0), end - WARM_UP_RECORDS) for p, end in ends.items()
                }
            }
            if spec.joined is not None:  # the table's last records too
                table = spec.joined.topic
                ends = offsets.end_offsets(settings, table)
                begins = offsets.beginning_offsets(settings, table)
                starts[table] = {
                    str(p): max(begins.get(p, 0), end - WARM_UP_RECORDS) for p, end in ends.items()
                }
            source = (
                spark.readStream.format("kafka")
                .options(**settings.spark_kafka_source_options())
                .option("subscribe", ",".join(subscribed(spec)))
                .option("startingOffsets", json.dumps(starts))
                .option("kafka.isolation.level", "read_committed")
                .load()
            )
            frame = build_query_frame(
                spec,
                source,
                seeding.seeds_stream(spark, spec, scratch),
                join_seeding.seeds_stream(spark, scratch) if spec.joined is not None else None,
            )
            query = (
                frame.writeStream.outputMode("update")
                .foreachBatch(_read_output)
                .option("checkpointLocation", str(scratch / "checkpoint"))
                .trigger(availableNow=True)
                .start()
            )
            # Made active meanwhile (a driver restarted after a kill waits out the dead one's
            # session here), it stops warming up at once.
            while query.isActive and not self.stopping.is_set():
                if self.election.active.wait(0.2):
                    break
            if query.isActive:
                query.stop()
                log.info("%s: warming up cut short", spec.name)
                return
        except Exception as error:  # only time is lost: the takeover compiles what it needs
            log.warning("%s: warming up failed: %s", spec.name, str(error)[:300])
            return
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.info("%s: warmed up in %.1fs", spec.name, time.monotonic() - started)

    def _metrics(self, spark: Any) -> tuple[StreamMetrics | None, MetricsEndpoint | None]:
        """The stream's metrics and their endpoint, unless `DUALITY_METRICS_PORT=-1`."""
        settings, spec = self.settings, self.spec
        if settings.metrics_port < 0:
            return None, None
        metrics = StreamMetrics(spec.name)
        # The lag refresher asks Kafka in the background; it gives up sooner than a command.
        asking = settings.replace(connect_timeout_s=min(settings.connect_timeout_s, 2.0))
        endpoint = MetricsEndpoint(
            settings,
            metrics,
            lambda: offsets.end_offsets(asking, spec.source.topic),
            spark.sparkContext.uiWebUrl if settings.prometheus_url is not None else None,
        )
        log.info("%s: metrics on port %d (/metrics)", spec.name, endpoint.port)
        return metrics, endpoint

    def _query_frame(self, spark: Any, starting_offsets: str | None) -> Any:
        """The pipeline's query over its source (from `starting_offsets`, which a checkpoint's
        own offsets override) and the seed folder of its checkpoint."""
        spec, settings = self.spec, self.settings
        checkpoint = seeding.checkpoint_dir(settings, spec)
        source = (
            spark.readStream.format("kafka")
            .options(**settings.spark_kafka_source_options())
            .option("subscribe", ",".join(subscribed(spec)))
            .option("maxOffsetsPerTrigger", str(self.options.max_offsets_per_trigger))
            .option("kafka.isolation.level", "read_committed")
        )
        if starting_offsets is not None:
            source = source.option("startingOffsets", starting_offsets)
        return build_query_frame(
            spec,
            source.load(),
            seeding.seeds_stream(spark, spec, checkpoint),
            join_seeding.seeds_stream(spark, checkpoint) if spec.joined is not None else None,
        )

    def _run_query(self, spark: Any, heartbeat: Heartbeat) -> None:
        spec, settings = self.spec, self.settings
        checkpoint = seeding.checkpoint_dir(settings, spec)
        heartbeat.publish("restoring")
        prepared, self._prepared = self._prepared, None
        metrics = self.metrics
        usable = seeding.checkpoint_usable(spec, checkpoint, self.partitions)

        def fence() -> ChangelogWriter:
            # Fences any older driver and aborts its open transaction, then reads the offsets
            # the changelog covers.
            writer = ChangelogWriter(settings, spec, checkpoint)
            if metrics is not None:
                metrics.committed(writer.committed)
            return writer

        fencing = ThreadPoolExecutor(1, thread_name_prefix="duality-fencing")
        fenced = fencing.submit(fence)
        fencing.shutdown(wait=False)
        if usable:
            log.info(
                "%s: resuming from the checkpoint %s (the state is in Spark's state store; the "
                "changelog is not read)",
                spec.name,
                checkpoint,
            )
            # Spark resumes from the checkpoint's offsets and needs nothing of the changelog:
            # the fencing runs while the query starts, and the first micro-batch's write waits
            # for it. A standby built the query's frame while it waited (decision 29).
            frame = prepared if prepared is not None else self._query_frame(spark, None)
        else:
            # Fenced first: the seed and the starting offsets below are a consistent pair.
            writer = fenced.result()
            started = time.monotonic()
            seeding.prepare_checkpoint(spec, checkpoint, self.partitions)
            keys = seeding.write_seed(spark, settings, spec, checkpoint)
            log.info(
                "%s: restored %d keys from %s in %.1fs (seeding the state store); source resumes "
                "at %s",
                spec.name,
                keys,
                spec.changelog_topic,
                time.monotonic() - started,
                writer.committed or "the beginning",
            )
            table_starts = None
            if spec.joined is not None:
                rows, table_starts = join_seeding.write_seed(
                    spark, settings, spec, checkpoint, writer.table_committed
                )
                log.info(
                    "%s: %d rows of table %s from %s; its topic %s is read from %s",
                    spec.name,
                    rows,
                    spec.joined.name,
                    spec.table_topic if writer.table_committed else spec.joined.topic,
                    spec.joined.topic,
                    table_starts,
                )
            frame = self._query_frame(spark, writer.starting_offsets(table_starts))
        listener = _heartbeat_listener(heartbeat, fenced, metrics)
        spark.streams.addListener(listener)

        def apply(batch: Any, batch_id: int) -> None:
            writer = fenced.result()
            result = writer.write(batch, batch_id)
            self.progressed = time.monotonic()
            log.info("%s: batch %d: %s", spec.name, batch_id, result)
            if metrics is not None and not result.replayed:
                metrics.batch(result)
                metrics.committed(writer.committed)

        query = (
            frame.writeStream.queryName(f"duality-{spec.name}")
            .outputMode("update")
            .foreachBatch(apply)
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime=f"{self.options.trigger_seconds} seconds")
            .start()
        )
        try:
            # Stalled means one micro-batch running too long, not many busy ones in a row.
            busy_since: float | None = None
            stall_timeout_s = self.options.stall_timeout_s
            last_batch = None
            while query.isActive and not self.stopping.is_set():
                query.awaitTermination(1)
                if fenced.done() and fenced.exception() is not None:
                    raise cast(BaseException, fenced.exception())  # a refused login, say
                if self.election.lost.is_set():
                    # Another driver may be active: stop now (the transactional producer's
                    # fencing makes this one's commits fail meanwhile) and wait again.
                    raise ElectionLost("the election made another driver active")
                progress = query.lastProgress
                batch = progress["batchId"] if progress else None
                if query.status.get("isTriggerActive") and batch == last_batch:
                    busy_since = busy_since or time.monotonic()
                    if time.monotonic() - busy_since > stall_timeout_s:
                        # It hangs in a call that cannot be interrupted (a Kafka client waiting
                        # on a broker that went away): a new driver aborts its transaction.
                        message = f"a micro-batch ran for more than {stall_timeout_s:g}s: stalled"
                        # Where it waits, for the log (decision 33, "Not solved yet").
                        log.warning(
                            "%s: the driver's threads as it stalled:%s",
                            self.spec.name,
                            thread_stacks(),
                        )
                        self._exit_for_new_driver(heartbeat, "stalled", message, STALLED_EXIT)
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
                self._stop_or_exit(query, heartbeat)
            else:
                error = query.exception()
                if error is not None:
                    raise RuntimeError(str(error))
        finally:
            if query.isActive:
                query.stop()
            spark.streams.removeListener(listener)
            with contextlib.suppress(Exception):  # a fencing that failed has nothing to close
                fenced.result().close()

    def _stop_or_exit(self, query: Any, heartbeat: Heartbeat) -> None:
        """Stop the query; one that does not stop within `QUERY_STOP_S` (its thread stuck in a
        call that cannot be interrupted) ends the process instead: a stop always stops, and the
        next driver's fencing aborts whatever transaction was open."""
        stopping = threading.Thread(target=query.stop, name="duality-query-stop", daemon=True)
        stopping.start()
        stopping.join(QUERY_STOP_S)
        if stopping.is_alive():
            message = f"the query did not stop within {QUERY_STOP_S:g}s; exiting without it"
            log.error("%s: %s", self.spec.name, message)
            heartbeat.end("stopped", error=message)
            heartbeat.close()
            logging.shutdown()
            os._exit(0)

    def _exit_for_new_driver(
        self, heartbeat: Heartbeat, state: str, message: str, code: int
    ) -> None:
        """Say why on the status topic and end the process at once: PySpark's exit handlers
        would wait on a JVM that hangs or is gone. The supervisor starts a new driver."""
        log.error("%s: %s; exiting for a new driver", self.spec.name, message)
        heartbeat.end(state, error=message)
        heartbeat.close()
        logging.shutdown()
        os._exit(code)


def thread_stacks() -> str:
    """Every thread of this process with its Python stack, one after the other."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "".join(
        f"\n--- thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def _read_output(batch: Any, batch_id: int) -> None:
    """A warm-up's micro-batch: its output read as the changelog writer reads it, then dropped."""
    for _ in output_rows(batch):
        pass


def run(settings: Settings, spec: PipelineSpec, pipeline: str, options: StreamOptions) -> int:
    driver = StreamDriver(settings, spec, options)
    signal.signal(signal.SIGTERM, driver.request_stop)
    signal.signal(signal.SIGINT, driver.request_stop)
    return driver.run()


if __name__ == "__main__":
    sys.exit(entry_point("python -m duality.stream.driver", run))
