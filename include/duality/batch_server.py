"""The batch server: one long-running Python process with a warm Spark (and Delta and Great
Expectations imported and used once), which runs the batch steps that `duality` commands send it
(docs/decisions/0026-warm-spark-for-batch-steps.md).

A command (`BATCH_COMMANDS`) run with `DUALITY_BATCH_SERVER=host:port` connects, sends its
arguments and its settings as one JSON line, and relays what comes back: the step's stdout and
stderr, then its exit code. On the server each step runs in a thread of its own, in a Spark
session of its own (`SparkSession.newSession`: its temporary views and settings unseen by other
steps) and a fair-scheduler pool of its own. The connection is the step's lifeline: when the
command ends before its step (SIGTERM from Airflow, a timeout, SIGKILL), the server interrupts
the session's Spark jobs and stops the step's thread, so no work outlives the task.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import socket
import socketserver
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import tenacity

from duality.config import Settings
from duality.errors import CheckFailed, UsageError
from duality.spark import scratch_folder, session, set_step_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("duality.batch_server")

# The commands that run on the server when one is configured.
BATCH_COMMANDS = frozenset({"snapshot", "validate", "publish", "repartition", "read"})
_STEP = threading.local()  # on a step's thread: `sink`, where its output goes
# The pool every job goes to, fair between jobs (Spark's default pool is first in, first out).
_FAIR_POOL = """<?xml version="1.0"?>
<allocations>
  <pool name="default">
    <schedulingMode>FAIR</schedulingMode><weight>1</weight><minShare>0</minShare>
  </pool>
</allocations>
"""


class StepCancelled(BaseException):
    """Raised in a step's thread when its command went away (not an Exception: nothing in the
    step's code catches it by accident)."""


# --- the client: what a command does when a server is configured ------------------------------


def run_remote(settings: Settings, argv: Sequence[str], command: str) -> int:
    """Run `duality ARGV` on the server `settings.batch_server`, relaying its output; its exit
    code. Connection refused: a UsageError naming the fix; lost mid-step: a CheckFailed."""
    connection = _connect(settings)
    connection.settimeout(None)  # a step takes as long as it takes
    with connection, connection.makefile("rb") as replies:
        request = {"argv": list(argv), "env": settings.as_env()}
        connection.sendall(json.dumps(request).encode() + b"\n")
        for line in replies:
            reply = json.loads(line)
            if "exit" in reply:
                return int(reply["exit"])
            stream = sys.stdout if reply["stream"] == "out" else sys.stderr
            stream.write(reply["text"])
            stream.flush()
    raise CheckFailed(
        f"the batch server {settings.batch_server} closed the connection before `duality "
        f"{command}` ended (it was stopped or restarted): the step did not finish and committed "
        "nothing after what its output shows; run it again (Airflow retries it)"
    )


def _connect(settings: Settings) -> socket.socket:
    """A connection to the server; one that is being started or restarted (its Spark starts
    before it listens) is waited for up to `batch_server_wait_s`, saying so."""
    assert settings.batch_server is not None
    host, _, port = settings.batch_server.rpartition(":")

    def said(state: tenacity.RetryCallState) -> None:
        if state.attempt_number == 1:
            print(
                f"the batch server {settings.batch_server} does not answer yet; waiting up to "
                f"{settings.batch_server_wait_s:g} s (DUALITY_BATCH_SERVER_WAIT_S)",
                file=sys.stderr,
                flush=True,
            )

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(OSError),
        stop=tenacity.stop_after_delay(settings.batch_server_wait_s),
        wait=tenacity.wait_fixed(1.0),
        before_sleep=said,
        reraise=True,
    )
    try:
        return retrying(socket.create_connection, (host, int(port)), timeout=10.0)
    except OSError as error:
        raise UsageError(
            f"the batch server DUALITY_BATCH_SERVER={settings.batch_server} does not answer "
            f"({error.strerror or error}) after {settings.batch_server_wait_s:g} s: start it "
            "with `duality up`, or unset DUALITY_BATCH_SERVER to run the step in a Spark of "
            "its own"
        ) from None


# --- the server ------------------------------------------------------------------------------


class _Routed(io.TextIOBase):
    """sys.stdout or sys.stderr of the server: on a step's thread, that step's output; on any
    other thread, the server's own (its log)."""

    def __init__(self, own: TextIO, stream: str):
        self.own, self.stream = own, stream

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        sink: Callable[[str, str], None] | None = getattr(_STEP, "sink", None)
        if sink is None:
            return self.own.write(text)
        sink(self.stream, text)
        return len(text)

    def flush(self) -> None:
        self.own.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.own.fileno()


class _Step:
    """One command's run: its thread, its session, and the connection it answers on."""

    def __init__(self, server: BatchServer, connection: socket.socket, argv: list[str]):
        self.server, self.connection, self.argv = server, connection, argv
        self.id = uuid.uuid4().hex[:12]
        self.started = time.time()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread_id = threading.get_ident()
        self.session: SparkSession | None = None

    def send(self, message: Mapping[str, Any]) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.connection.sendall(json.dumps(message).encode() + b"\n")

    def output(self, stream: str, text: str) -> None:
        self.send({"stream": stream, "text": text})

    def run(self, env: dict[str, str]) -> int:
        self.session = self.server.spark.newSession()
        _STEP.sink = self.output
        set_step_session(self.session)
        try:
            return self.server.command(self.argv, env, forward=False)
        except SystemExit as exit_:  # argparse, and `sys.exit` in a command
            return exit_.code if isinstance(exit_.code, int) else 1
        finally:
            self.done.set()
            _STEP.sink = None
            set_step_session(None)

    def watch(self) -> None:
        """Wait for the connection to close; closed before the step ended, cancel the step."""
        with contextlib.suppress(OSError):
            while self.connection.recv(4096):
                pass
        if not self.done.is_set():
            self.cancel()

    def cancel(self) -> None:
        log.warning("step %s: its command went away; interrupting its Spark jobs", self.id)
        if self.session is not None:
            with contextlib.suppress(Exception):
                self.session.interruptAll()
        # Stop the step's Python code at its next instruction (after the call it is in returns,
        # which the interruption above ends for Spark calls).
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(self.thread_id), ctypes.py_object(StepCancelled)
        )


class _Handler(socketserver.StreamRequestHandler):
    server: BatchServer

    def handle(self) -> None:
        request = json.loads(self.rfile.readline() or b"{}")
        if request.get("status"):
            self.wfile.write(json.dumps(self.server.report()).encode() + b"\n")
            return
        argv, env = request.get("argv"), request.get("env")
        if not isinstance(argv, list) or not isinstance(env, dict):
            return  # not a duality client (a port probe): nothing to run
        step = _Step(self.server, self.connection, argv)
        with self.server.lock:
            self.server.steps[step.id] = step
        watcher = threading.Thread(target=step.watch, name=f"watch-{step.id}", daemon=True)
        watcher.start()
        started = time.monotonic()
        log.info("step %s: duality %s", step.id, " ".join(argv))
        try:
            try:
                code = step.run(env)
            finally:
                with self.server.lock:
                    self.server.steps.pop(step.id, None)
        except StepCancelled:
            log.warning("step %s: cancelled after %.1fs", step.id, time.monotonic() - started)
            return
        except BaseException as error:  # a bug in a step must not take the server down
            log.exception("step %s failed", step.id)
            step.output("err", f"duality {' '.join(argv[:2])}: error: {error}\n")
            code = 1
        step.send({"exit": code})
        log.info("step %s: exit %d in %.1fs", step.id, code, time.monotonic() - started)
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # ends the watcher


class Command(Protocol):
    """`duality.cli.main`: a command's exit code, with the settings of `environ`."""

    def __call__(
        self, argv: Sequence[str], environ: Mapping[str, str], *, forward: bool
    ) -> int: ...


class BatchServer(socketserver.ThreadingTCPServer):
    """Steps (`command` runs) on `spark`, one thread each, for clients of (host, port)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], spark: SparkSession, command: Command):
        self.spark, self.command = spark, command
        self.lock = threading.Lock()
        self.steps: dict[str, _Step] = {}  # running, by id
        # What a step prints goes to its client: sys.stdout and sys.stderr route by thread.
        self._own = (sys.stdout, sys.stderr)
        sys.stdout = _Routed(sys.stdout, "out")
        sys.stderr = _Routed(sys.stderr, "err")
        super().__init__(address, _Handler)

    def server_close(self) -> None:
        super().server_close()
        sys.stdout, sys.stderr = self._own

    def report(self) -> dict[str, Any]:
        """The steps running, and Spark's jobs running (of any step)."""
        with self.lock:
            steps = [
                {"id": s.id, "command": " ".join(s.argv), "started": s.started}
                for s in self.steps.values()
            ]
        jobs = list(self.spark.sparkContext.statusTracker().getActiveJobsIds())
        return {"steps": steps, "active_jobs": jobs}


def server_report(address: str, timeout: float = 10.0) -> dict[str, Any]:
    """What the server at `address` runs (`BatchServer.report`)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as connection:
        connection.sendall(b'{"status": true}\n')
        with connection.makefile("rb") as replies:
            return dict(json.loads(replies.readline()))


def serve(settings: Settings, host: str, port: int, command: Command) -> int:
    """Start Spark, warm it, then run `command` for clients of (host, port) until SIGTERM or
    SIGINT."""
    import signal

    started = time.monotonic()
    # Steps of different pipelines run side by side: their jobs share the executors fairly.
    pools = scratch_folder(settings) / "fairscheduler.xml"
    pools.write_text(_FAIR_POOL)
    # The driver's heap at its full size from the start: a JVM that shrinks its heap between
    # steps grows it again, collection after collection, while a large step caches its table
    # (the first validation of 1,000,000 rows took about 1 s longer, docs/benchmarks.md).
    heap = f"-Xms{settings.spark_driver_memory}"
    os.environ["SPARK_SUBMIT_OPTS"] = f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {heap}".strip()
    spark = session(
        settings,
        "duality-batch-server",
        extra={"spark.scheduler.mode": "FAIR", "spark.scheduler.allocation.file": str(pools)},
    )
    warm_up(spark)
    server = BatchServer((host, port), spark, command)
    # After the routing: a step's log records go to its client, the server's to its log.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info(
        "batch server ready on %s:%d in %.1fs (Spark %s)",
        host,
        server.server_address[1],
        time.monotonic() - started,
        settings.spark_master,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
        spark.stop()
    return 0


def warm_up(spark: SparkSession) -> None:
    """What every step's first use would otherwise pay: Great Expectations' import, a Delta
    table written, merged into and described, in a folder removed after."""
    import great_expectations  # noqa: F401  (its import alone takes seconds)

    from duality.snapshot.delta_log import sql_name

    with tempfile.TemporaryDirectory(prefix="duality-warm-up-") as folder:
        table = sql_name(Path(folder) / "t")
        spark.range(100).selectExpr("id AS k", "id AS v").write.format("delta").save(
            str(Path(folder) / "t")
        )
        spark.range(50, 150).selectExpr("id AS k", "id * 2 AS v").createOrReplaceTempView("s")
        spark.sql(
            f"MERGE INTO {table} AS t USING s ON t.k = s.k WHEN MATCHED THEN UPDATE SET v = s.v "
            "WHEN NOT MATCHED THEN INSERT (k, v) VALUES (s.k, s.v)"
        )
        spark.sql(f"DESCRIBE DETAIL {table}").collect()
        spark.catalog.dropTempView("s")
