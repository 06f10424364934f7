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

Every request carries the server's shared secret, compared in constant time, over TLS when a
certificate is configured; a step whose settings would take it outside the server's warehouse,
checkpoints, reports or local folder is refused before any work
(docs/decisions/0034-an-authenticated-batch-server.md).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import hmac
import io
import json
import logging
import os
import select
import socket
import socketserver
import ssl
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import tenacity

from duality.config import PREFIX, Settings
from duality.errors import CheckFailed, DualityError, UsageError
from duality.spark import scratch_folder, session, set_step_session
from duality.storage import Location, ObjectPath

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("duality.batch_server")

# The commands that run on the server when one is configured.
BATCH_COMMANDS = frozenset({"snapshot", "validate", "publish", "repartition", "read"})
_STEP = threading.local()  # on a step's thread: `sink`, where its output goes
# Settings a client never sends with a step: the secret and the certificate are the server's own.
SECURITY_SETTINGS = frozenset(
    PREFIX + name
    for name in (
        "BATCH_SERVER_SECRET",
        "BATCH_SERVER_SECRET_FILE",
        "BATCH_SERVER_TLS_CERT",
        "BATCH_SERVER_TLS_KEY",
    )
)
# The folders a step's settings must keep within the server's own, and what they are called.
CONFINED = {
    "warehouse": "warehouse",
    "checkpoint_root": "checkpoint root",
    "reports": "reports folder",
    "local_dir": "local folder",
}
# How long a connection may take to send its request (a TLS handshake included).
REQUEST_TIMEOUT_S = 30.0
# The longest request line read (a step's arguments and settings take a few kB).
MAX_REQUEST_BYTES = 1 << 20
# What the server tells a client whose secret is missing or wrong (never the secret itself).
_SECRET_FIX = (
    f"set {PREFIX}BATCH_SERVER_SECRET_FILE (or {PREFIX}BATCH_SERVER_SECRET; in Airflow, the "
    "password of the spark_default connection) to the server's secret (`duality up` keeps the "
    "local stack's in <local_dir>/batch-server/secret)"
)
# The pool every job goes to, fair between jobs (Spark's default pool is first in, first out).
_FAIR_POOL = """<?xml version="1.0"?>
<allocations>
  <pool name="default">
    <schedulingMode>FAIR</schedulingMode><weight>1</weight><minShare>0</minShare>
  </pool>
</allocations>
"""


def _within(value: Location, root: Location) -> bool:
    """Whether `value` is `root` or below it: local folders with links and `..` resolved; an
    object storage location in the same bucket, under the same prefix."""
    if isinstance(root, ObjectPath) or isinstance(value, ObjectPath):
        return (
            isinstance(root, ObjectPath)
            and isinstance(value, ObjectPath)
            and value.bucket == root.bucket
            and (not root.key or value.key == root.key or value.key.startswith(root.key + "/"))
        )
    return value.resolve().is_relative_to(root.resolve())


class Refused(UsageError):
    """The server refused the request (no secret or a wrong one, a plain connection to a TLS
    server, a folder outside its own): said by the server, with the fix."""


class StepCancelled(BaseException):
    """Raised in a step's thread when its command went away (not an Exception: nothing in the
    step's code catches it by accident)."""


# --- the client: what a command does when a server is configured ------------------------------


def run_remote(settings: Settings, argv: Sequence[str], command: str) -> int:
    """Run `duality ARGV` on the server `settings.batch_server`, relaying its output; its exit
    code. No server: a UsageError naming the fix; the request refused (secret, TLS, folders): a
    Refused saying why; lost mid-step: a CheckFailed."""
    request = {
        "secret": settings.read_batch_server_secret(),
        "argv": list(argv),
        "env": step_env(settings),
    }
    connection = _connect(settings)
    connection.settimeout(None)  # a step takes as long as it takes
    with connection, connection.makefile("rb") as replies:
        connection.sendall(json.dumps(request).encode() + b"\n")
        for line in replies:
            reply = json.loads(line)
            if "refused" in reply:
                raise Refused(
                    f"the batch server {settings.batch_server} refused `duality {command}`: "
                    f"{reply['refused']}"
                )
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


def step_env(settings: Settings) -> dict[str, str]:
    """The settings a step runs with, as sent to the server: all but the secret's and TLS's."""
    return {k: v for k, v in settings.as_env().items() if k not in SECURITY_SETTINGS}


def _connect(settings: Settings, *, wait: bool = True) -> socket.socket:
    """A connection to the server (over TLS when a certificate is configured); one that is
    being started or restarted (its Spark starts before it listens) is waited for up to
    `batch_server_wait_s`, saying so."""
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
        stop=tenacity.stop_after_delay(settings.batch_server_wait_s if wait else 0),
        wait=tenacity.wait_fixed(1.0),
        before_sleep=said,
        reraise=True,
    )
    try:
        connection = retrying(socket.create_connection, (host, int(port)), timeout=10.0)
    except OSError as error:
        raise UsageError(
            f"the batch server DUALITY_BATCH_SERVER={settings.batch_server} does not answer "
            f"({error.strerror or error}) after {settings.batch_server_wait_s:g} s: start it "
            "with `duality up`, or unset DUALITY_BATCH_SERVER to run the step in a Spark of "
            "its own"
        ) from None
    return _client_tls(settings, connection, host)


def _client_tls(settings: Settings, connection: socket.socket, host: str) -> socket.socket:
    """`connection` over TLS, the server's certificate checked against the configured one (its
    name too); as it is without a certificate."""
    cert = settings.batch_server_tls_cert
    if cert is None:
        return connection
    setting = f"{PREFIX}BATCH_SERVER_TLS_CERT={cert}"
    try:
        context = ssl.create_default_context(cafile=str(cert))
    except (OSError, ssl.SSLError) as error:
        connection.close()
        raise UsageError(
            f"{setting} cannot be read as a certificate ({_reason(error)}): point it at the "
            "batch server's certificate (PEM)"
        ) from None
    try:
        return context.wrap_socket(connection, server_hostname=host)
    except ssl.SSLCertVerificationError as error:
        connection.close()
        raise UsageError(
            f"the batch server {settings.batch_server} did not present the certificate of "
            f"{setting} ({error.verify_message}): point it at the certificate the server runs "
            "with, whose names include the host of DUALITY_BATCH_SERVER"
        ) from None
    except OSError as error:
        connection.close()
        raise UsageError(
            f"no TLS connection to the batch server {settings.batch_server} "
            f"({_reason(error)}): it takes plain connections only, or is not a batch server; "
            f"unset {PREFIX}BATCH_SERVER_TLS_CERT, or start the server with a certificate"
        ) from None


def _reason(error: BaseException) -> str:
    return str(getattr(error, "reason", None) or getattr(error, "strerror", None) or error)


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
        self.started = time.time()  # when its command starts running (the report's start)
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
        """Wait for the client to hang up; gone before the step ended, cancel the step. Read
        nothing: a TLS connection's reads and writes must not run on two threads at once, so
        the kernel says when the client's side closed (POLLRDHUP), whatever it has sent."""
        poller = select.poll()
        poller.register(self.connection.fileno(), select.POLLRDHUP | select.POLLHUP)
        while not self.done.is_set():
            with contextlib.suppress(InterruptedError):
                if poller.poll(1000):
                    break
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


class _Refusal(Exception):
    """A request the server does not run; the message is for the client and the server's log
    (it never holds the secret)."""


class _Handler(socketserver.StreamRequestHandler):
    server: BatchServer

    def handle(self) -> None:
        peer = self.client_address[0] if self.client_address else "?"
        try:
            request = self._request()
            self.server.authenticate(request)
            if request.get("status") is True:
                self.wfile.write(json.dumps(self.server.report()).encode() + b"\n")
                return
            argv, env = request.get("argv"), request.get("env")
            if not isinstance(argv, list) or not isinstance(env, dict):
                raise _Refusal("the request names no command: it is not from a duality client")
            argv, env = [str(a) for a in argv], {str(k): str(v) for k, v in env.items()}
            self.server.confine(env)
        except _Refusal as refusal:
            log.warning("refused a request from %s: %s", peer, refusal)
            with contextlib.suppress(OSError):
                self.wfile.write(json.dumps({"refused": str(refusal)}).encode() + b"\n")
            return
        self.connection.settimeout(None)  # a step takes as long as it takes
        self._run(argv, {k: v for k, v in env.items() if k not in SECURITY_SETTINGS})

    def _request(self) -> dict[str, Any]:
        try:
            line = self.rfile.readline(MAX_REQUEST_BYTES)
        except OSError as error:  # the timeout, among others
            raise _Refusal(f"no request came ({_reason(error)})") from None
        if not line.endswith(b"\n"):
            raise _Refusal("no request line (one JSON object and a line end) came in time")
        try:
            request = json.loads(line)
        except ValueError:
            raise _Refusal("the request is not JSON: it is not from a duality client") from None
        if not isinstance(request, dict):
            raise _Refusal("the request is not a JSON object: it is not from a duality client")
        return request

    def _run(self, argv: list[str], env: dict[str, str]) -> None:
        step = _Step(self.server, self.connection, argv)
        with self.server.lock:
            self.server.steps[step.id] = step
        watcher = threading.Thread(target=step.watch, name=f"watch-{step.id}", daemon=True)
        watcher.start()
        started = time.monotonic()
        log.info("step %s: duality %s", step.id, " ".join(argv))
        code: int | None = None
        try:
            try:
                code = step.run(env)
            finally:
                self.server.finished(step, code)
        except StepCancelled:
            log.warning("step %s: cancelled after %.1fs", step.id, time.monotonic() - started)
            return
        except BaseException as error:  # a bug in a step must not take the server down
            log.exception("step %s failed", step.id)
            step.output("err", f"duality {' '.join(argv[:2])}: error: {error}\n")
            code = 1
        step.send({"exit": code})
        log.info(
            "step %s: exit %d in %.1fs (started at %.3f, ended at %.3f)",
            step.id,
            code,
            time.monotonic() - started,
            step.started,
            time.time(),
        )
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # ends the watcher


class Command(Protocol):
    """`duality.cli.main`: a command's exit code, with the settings of `environ`."""

    def __call__(
        self, argv: Sequence[str], environ: Mapping[str, str], *, forward: bool
    ) -> int: ...


class BatchServer(socketserver.ThreadingTCPServer):
    """Steps (`command` runs) on `spark`, one thread each, for clients of (host, port) that send
    `secret`, over TLS with `tls`; a step's folders stay within those of `settings`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        spark: SparkSession,
        command: Command,
        *,
        settings: Settings,
        secret: str,
        tls: ssl.SSLContext | None = None,
    ):
        self.spark, self.command, self.settings, self.tls = spark, command, settings, tls
        # Compared as digests: the time a comparison takes says nothing of the secret's length.
        self._digest = hashlib.sha256(secret.encode()).digest()
        self.lock = threading.Lock()
        self.steps: dict[str, _Step] = {}  # running, by id
        # The last steps that ended, with when they started and ended (the status report).
        self.ended: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
        # What a step prints goes to its client: sys.stdout and sys.stderr route by thread.
        self._own = (sys.stdout, sys.stderr)
        sys.stdout = _Routed(sys.stdout, "out")
        sys.stderr = _Routed(sys.stderr, "err")
        super().__init__(address, _Handler)

    def server_close(self) -> None:
        super().server_close()
        sys.stdout, sys.stderr = self._own

    def finish_request(self, request: Any, client_address: Any) -> None:
        """On the request's own thread: TLS's handshake (a slow client holds up no other), then
        the request."""
        request.settimeout(REQUEST_TIMEOUT_S)
        try:
            secured = self._secured(request, client_address[0])
        except _Refusal as refusal:
            if str(refusal):  # else said already
                log.info("a connection from %s ended: %s", client_address[0], refusal)
            return
        except OSError as error:
            log.info("a connection from %s ended: %s", client_address[0], _reason(error))
            return
        try:
            _Handler(secured, client_address, self)
        finally:
            if secured is not request:
                with contextlib.suppress(OSError):
                    secured.close()

    def _secured(self, request: socket.socket, peer: str) -> socket.socket:
        """The connection, over TLS when the server has a certificate. A plain client of a TLS
        server is told so in plain text; a TLS client of a plain server is hung up on."""
        first = request.recv(1, socket.MSG_PEEK)
        if not first:
            raise _Refusal("")  # a port probe (compose's health check): nothing to say
        handshake = first == b"\x16"  # a TLS record of the handshake
        if self.tls is None:
            if handshake:
                raise _Refusal("a TLS client, and this server has no certificate")
            return request
        if not handshake:
            message = (
                f"this batch server takes TLS connections only: set {PREFIX}BATCH_SERVER_TLS_CERT "
                "to its certificate (`duality up` keeps the local stack's in "
                "<local_dir>/batch-server/tls/)"
            )
            log.warning("refused a request from %s: %s", peer, message)
            with contextlib.suppress(OSError):
                request.sendall(json.dumps({"refused": message}).encode() + b"\n")
            raise _Refusal("")
        return self.tls.wrap_socket(request, server_side=True)

    def authenticate(self, request: Mapping[str, Any]) -> None:
        """Raise _Refusal unless the request carries the server's secret (compared in constant
        time)."""
        sent = request.get("secret")
        if not isinstance(sent, str) or not sent:
            raise _Refusal(f"the request carries no secret: {_SECRET_FIX}")
        if not hmac.compare_digest(hashlib.sha256(sent.encode()).digest(), self._digest):
            raise _Refusal(f"the request's secret is not the server's: {_SECRET_FIX}")

    def confine(self, env: Mapping[str, str]) -> None:
        """Raise _Refusal when the settings `env` would take a step outside the server's
        warehouse, checkpoint root, reports or local folder (links and `..` resolved first)."""
        try:
            step = Settings.from_env(env)
        except DualityError as error:
            raise _Refusal(f"the step's settings are wrong: {error}") from None
        if step.s3_endpoint != self.settings.s3_endpoint:
            raise _Refusal(
                f"{PREFIX}S3_ENDPOINT={step.s3_endpoint} is not the batch server's object store "
                f"{self.settings.s3_endpoint}: set it to the server's, or unset "
                f"{PREFIX}BATCH_SERVER to run the step in a Spark of its own"
            )
        for name, what in CONFINED.items():
            root, value = getattr(self.settings, name), getattr(step, name)
            if not _within(value, root):
                root = root.resolve()
                raise _Refusal(
                    f"{PREFIX}{name.upper()}={value} is outside the batch server's {what} "
                    f"{root}: set it to {root} (or a folder in it), or unset "
                    f"{PREFIX}BATCH_SERVER to run the step in a Spark of its own"
                )

    def finished(self, step: _Step, code: int | None) -> None:
        """`step` ended (code None: it was cancelled or failed on a bug)."""
        with self.lock:
            self.steps.pop(step.id, None)
            self.ended.append(
                {
                    "id": step.id,
                    "command": " ".join(step.argv),
                    "started": step.started,
                    "ended": time.time(),
                    "exit": code,
                }
            )

    def report(self) -> dict[str, Any]:
        """The steps running, the last ones that ended (with their start and end times), and
        Spark's jobs running (of any step)."""
        with self.lock:
            steps = [
                {"id": s.id, "command": " ".join(s.argv), "started": s.started}
                for s in self.steps.values()
            ]
            ended = list(self.ended)
        jobs = list(self.spark.sparkContext.statusTracker().getActiveJobsIds())
        return {"steps": steps, "ended": ended, "active_jobs": jobs}


def server_report(settings: Settings, timeout: float = 10.0) -> dict[str, Any]:
    """What the server `settings.batch_server` runs (`BatchServer.report`), asked with the
    settings' secret; not waited for. Refused: a Refused saying why."""
    request = {"status": True, "secret": settings.read_batch_server_secret()}
    with _connect(settings, wait=False) as connection:
        connection.settimeout(timeout)
        connection.sendall(json.dumps(request).encode() + b"\n")
        with connection.makefile("rb") as replies:
            reply = dict(json.loads(replies.readline()))
    if "refused" in reply:
        raise Refused(f"the batch server {settings.batch_server} refused: {reply['refused']}")
    return reply


def server_tls(settings: Settings) -> ssl.SSLContext | None:
    """The server's TLS context from its certificate and key; None without a certificate."""
    cert, key = settings.batch_server_tls_cert, settings.batch_server_tls_key
    if cert is None:
        return None
    if key is None:
        raise UsageError(
            f"{PREFIX}BATCH_SERVER_TLS_CERT={cert} is set without {PREFIX}BATCH_SERVER_TLS_KEY: "
            "the batch server needs the certificate's private key too"
        )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as error:
        raise UsageError(
            f"{PREFIX}BATCH_SERVER_TLS_CERT={cert} and {PREFIX}BATCH_SERVER_TLS_KEY={key} "
            f"cannot be loaded ({_reason(error)}): point them at a PEM certificate and its "
            "private key"
        ) from None
    return context


def serve(settings: Settings, host: str, port: int, command: Command) -> int:
    """Start Spark, warm it, then run `command` for clients of (host, port) that send the
    settings' secret, until SIGTERM or SIGINT. No secret: a UsageError, before Spark starts."""
    import signal

    started = time.monotonic()
    secret = settings.read_batch_server_secret()
    if secret is None:
        raise UsageError(
            f"the batch server needs a shared secret, which every request must carry: set "
            f"{PREFIX}BATCH_SERVER_SECRET_FILE (a file holding it) or {PREFIX}BATCH_SERVER_SECRET "
            "(`duality up` makes one for the local stack)"
        )
    tls = server_tls(settings)
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
    server = BatchServer((host, port), spark, command, settings=settings, secret=secret, tls=tls)
    # After the routing: a step's log records go to its client, the server's to its log.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info(
        "batch server ready on %s:%d in %.1fs (Spark %s; %s; a secret required)",
        host,
        server.server_address[1],
        time.monotonic() - started,
        settings.spark_master,
        "TLS" if tls is not None else "no TLS",
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
