"""What the tests (and the bench) share: the command line and a stream run as users run them,
ground-truth reads of topics with a consumer of their own, waiting for conditions, unique names."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psutil
import yaml
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaError,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec

from duality import process, workload
from duality.config import SHIPPED_PIPELINES, Settings
from duality.kafka import client, offsets
from duality.spec import PipelineSpec, load_spec

ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")

# Removed when the test process exits (conftest knows they are left until then).
AIRFLOW_HOMES: list[tempfile.TemporaryDirectory[str]] = []


def own_airflow_home() -> str:
    """AIRFLOW_HOME for Airflow imported in this test process: the one set, or else a temporary
    folder of its own, made once and removed when the process exits."""
    if "AIRFLOW_HOME" not in os.environ:
        home = tempfile.TemporaryDirectory(
            prefix="duality-airflow-home-", ignore_cleanup_errors=True
        )
        AIRFLOW_HOMES.append(home)
        os.environ["AIRFLOW_HOME"] = home.name
    return os.environ["AIRFLOW_HOME"]


def ended_pid() -> int:
    """The pid of a process that has ended: a short Python run, waited for."""
    code = "import os; print(os.getpid())"
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(ended.stdout)


MAX_INTERVAL = 1.0  # s between the probes of a long wait


def assert_eventually(
    probe: Callable[[], T],
    expected: Any = None,
    *,
    timeout: float = 60.0,
    interval: float = 0.25,
    message: str = "",
) -> T:
    """Call `probe` until it returns `expected` (anything truthy when expected is None; a value
    for which `expected(value)` is true when it is callable): every `interval` at first, then
    less often, up to every `MAX_INTERVAL` s (a long wait's probes are CPU the suite's other
    tests lack)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    pause = interval
    while True:
        last = probe()
        if callable(expected):
            if expected(last):
                return last
        elif (expected is None and last) or (expected is not None and last == expected):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"condition not met within {timeout:g}s{': ' + message if message else ''}; "
                f"last value: {last!r}"
                + (f", expected: {expected!r}" if expected is not None else "")
            )
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 1.5, max(interval, MAX_INTERVAL))


def run_python(
    config: Settings | Mapping[str, str],
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """Python run as users run it, in a process of its own, configured by `config`: settings (as
    their DUALITY_* variables), or the variables themselves where a test leaves some unset on
    purpose (a stack's later commands find its addresses in its record); `env` on top."""
    variables = config.as_env() if isinstance(config, Settings) else config
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, **variables, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


# How long a test lets `duality up` take: the batch server may warm for up to 600 s on a busy
# machine (`LocalBatchServer.start`), Airflow start for up to 300 s.
UP_TIMEOUT_S = 900.0


def run_duality(
    config: Settings | Mapping[str, str],
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """The `duality` command line, run by `run_python`."""
    return run_python(config, "-m", "duality", *args, env=env, timeout=timeout)


def duality_json(
    config: Settings | Mapping[str, str], *args: str, timeout: float = 240
) -> dict[str, Any]:
    """The JSON output of a `run_duality` with `--json` that must succeed."""
    done = run_duality(config, *args, "--json", timeout=timeout)
    assert done.returncode == 0, f"duality {' '.join(args)}: {done.stdout}{done.stderr[-3000:]}"
    return dict(json.loads(done.stdout))


def java_processes(pid: int) -> list[psutil.Process]:
    """The JVMs among a process's descendants (Python workers come and go meanwhile)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() == "java":
                found.append(child)
    return found


def unique_name(label: str) -> str:
    """A topic or group name no other test uses."""
    clean = re.sub(r"[^a-zA-Z0-9._-]+", "-", label)[:60].strip("-")
    return f"{clean}-{uuid.uuid4().hex[:8]}"


def read_messages(
    settings: Settings,
    topic: str,
    *,
    isolation: client.Isolation = "read_committed",
    timeout: float = 60.0,
) -> list[Message]:
    """Every record of `topic` up to its end offsets of the moment of the call (under
    read_committed, its last stable offsets). The ground truth of the tests: read with a plain
    consumer of their own, never through duality.kafka, whose reader the code under test uses."""
    config = settings.kafka_client_config()
    admin = AdminClient(config)
    partitions = admin.list_topics(topic, timeout=timeout).topics[topic].partitions
    level = IsolationLevel[isolation.upper()]
    asked = admin.list_offsets(
        {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions},
        isolation_level=level,
        request_timeout=timeout,
    )
    ends = {tp.partition: future.result().offset for tp, future in asked.items()}
    reader = Consumer(
        {
            **config,
            "group.id": unique_name("ground-truth"),
            "isolation.level": isolation,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    pending = {p for p, end in ends.items() if end > 0}
    reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
    records: list[Message] = []
    deadline = time.monotonic() + timeout
    try:
        while pending:
            assert time.monotonic() < deadline, f"{topic}: {sorted(pending)} not read to {ends}"
            for message in reader.consume(num_messages=10_000, timeout=1.0):
                partition, offset, error = message.partition(), message.offset(), message.error()
                assert partition is not None and offset is not None
                if error is not None:
                    assert error.code() == KafkaError._PARTITION_EOF, error
                    # At the end the position may sit past it, after transaction markers.
                    if offset >= ends[partition]:
                        pending.discard(partition)
                    continue
                if offset < ends[partition]:
                    records.append(message)
                if offset + 1 >= ends[partition]:
                    pending.discard(partition)
    finally:
        reader.close()
    return records


def read_topic(
    settings: Settings,
    topic: str,
    *,
    isolation: client.Isolation = "read_committed",
    timeout: float = 60.0,
) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of `topic` up to its current end (read_messages): (partition, offset, key,
    value)."""
    return [
        (m.partition(), m.offset(), m.key(), m.value())  # type: ignore[misc]
        for m in read_messages(settings, topic, isolation=isolation, timeout=timeout)
    ]


def read_latest(settings: Settings, spec: PipelineSpec) -> dict[bytes, dict[str, Any]]:
    """The latest live value per key of the pipeline's changelog (read_messages): what
    duality.changelog.read_latest gives, read independently of duality's reader."""
    latest: dict[bytes, dict[str, Any]] = {}
    for message in read_messages(settings, spec.changelog_topic, timeout=300):
        key, value = message.key(), message.value()
        if key is None:
            continue
        if value is None:
            latest.pop(key, None)
        else:
            latest[key] = json.loads(value)
    return latest


def make_pipeline(settings: Settings, folder: Path, template: str, **source: Any) -> PipelineSpec:
    """A copy of a demo spec with unique names, written to `folder` (DUALITY_PIPELINES)."""
    data = yaml.safe_load((SHIPPED_PIPELINES / f"{template}.yaml").read_text())
    name = f"t{uuid.uuid4().hex[:10]}"
    data["name"] = name
    data["source"]["topic"] = f"{name}-source"
    data["source"].update(source)
    data["changelog"] = {"partitions": 3}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def stream_command(pipeline: str, *args: str) -> list[str]:
    """How a pipeline's stream is started, as users start it: the one place that says so."""
    return [sys.executable, "-m", "duality.stream", pipeline, *args]


class StreamProcess:
    """A pipeline's stream run as users run it (`stream_command`) in a process group of its own
    (supervisor, driver, JVM and Python workers), configured by `settings` with `pipelines` as
    its folder of specs, its output appended to `log`. Shared by the tests and the bench."""

    def __init__(
        self,
        settings: Settings,
        spec: PipelineSpec,
        pipelines: Path,
        log: Path,
        max_offsets_per_trigger: int = 5000,
        stall_timeout: float | None = 300,
        trigger_seconds: float | None = None,
    ):
        self.settings = settings.replace(pipelines=pipelines)
        self.spec, self.log = spec, log
        self.args = ["--max-offsets-per-trigger", str(max_offsets_per_trigger)]
        if stall_timeout is not None:
            self.args += ["--stall-timeout", f"{stall_timeout:g}"]
        if trigger_seconds is not None:
            self.args += ["--trigger-seconds", f"{trigger_seconds:g}"]
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0  # perf_counter of the last start

    @property
    def pid(self) -> int:
        assert self.process is not None, "the stream was not started"
        return self.process.pid

    def start(self) -> None:
        command = stream_command(self.spec.name, *self.args)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(command)}\n".encode())
            out.flush()
            self.started = time.perf_counter()
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **self.settings.as_env()},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check(self) -> None:
        """Raise when the stream exited on its own."""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"the stream of {self.spec.name} exited with code {self.process.returncode}; "
                f"last lines of {self.log}:\n{self.tail()}"
            )

    def kill(self) -> None:
        """SIGKILL the stream's whole group (its JVM and Python workers too)."""
        if self.process is not None:
            process.kill_group(self.process.pid, reap=self.process)

    def stop(self, timeout: float = 180) -> int:
        """SIGTERM (the running micro-batch commits first) and wait for the whole group; its
        exit code, 0. A stream that must be killed, or that exits otherwise, is an error."""
        if self.process is None:
            return 0
        if process.stop_group(self.process.pid, timeout, reap=self.process):
            raise AssertionError(
                f"the stream of {self.spec.name} did not stop within {timeout:g}s of SIGTERM "
                f"and was killed; see {self.log}"
            )
        code = self.process.wait()
        assert code == 0, f"the stream of {self.spec.name} exited with {code}:\n{self.tail()}"
        return code

    def __enter__(self) -> StreamProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.kill()

    def covered(self) -> int:
        """How many source records the committed offsets cover (all partitions)."""
        committed = offsets.committed_offsets(
            self.settings, self.spec.consumer_group, self.spec.source.topic
        )
        return sum(offset for offset, _ in committed.values())

    def wait_caught_up(self, timeout: float = 240) -> None:
        def caught_up() -> bool:
            self.check()
            ends = offsets.end_offsets(self.settings, self.spec.source.topic)
            committed = offsets.committed_offsets(
                self.settings, self.spec.consumer_group, self.spec.source.topic
            )
            covered = all(committed.get(p, (0, None))[0] >= end for p, end in ends.items())
            return covered and settled(self.settings, self.spec.changelog_topic)

        assert_eventually(
            caught_up,
            timeout=timeout,
            interval=1.0,
            message=f"stream {self.spec.name} did not catch up; log {self.log}",
        )

    def run_until_caught_up(self) -> None:
        """Start the stream, wait until it covers the source, and stop it gracefully."""
        self.start()
        try:
            self.wait_caught_up()
        finally:
            assert self.stop() == 0, self.tail()

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def settled(settings: Settings, *topics: str) -> bool:
    """Whether no transaction is open on `topics`: their stable ends are their ends. A
    transaction's offsets can be visible before its markers reach every partition it wrote, so
    a reader that trusts the offsets alone can read its records as not yet committed."""
    return all(
        offsets.end_offsets(settings, topic)
        == offsets.end_offsets(settings, topic, "read_uncommitted")
        for topic in topics
    )


def joined_covered(settings: Settings, spec: PipelineSpec) -> bool:
    """Whether a joined pipeline's committed offsets cover both its source's and its table
    topic's ends, and the transaction that committed them has reached every topic it wrote."""
    assert spec.joined is not None
    for topic in (spec.source.topic, spec.joined.topic):
        ends = offsets.end_offsets(settings, topic)
        committed = offsets.committed_offsets(settings, spec.consumer_group, topic)
        if any(committed.get(p, (0, None))[0] < end for p, end in ends.items()):
            return False
    return settled(settings, spec.changelog_topic, spec.dlq_topic, spec.table_topic)


def first_commit_after(settings: Settings, topic: str, since: float) -> float:
    """Seconds from `since` (monotonic) until a read_committed consumer, placed at the topic's
    stable end now, reads a record: the next transaction committed."""
    ends = offsets.end_offsets(settings, topic)
    group = f"first-commit-{uuid.uuid4().hex}"
    reader = client.consumer(settings, group, enable_partition_eof=False)
    try:
        reader.assign([offsets.TopicPartition(topic, p, o) for p, o in ends.items()])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            message = reader.poll(0.05)
            if message is not None and message.error() is None:
                return time.monotonic() - since
        raise AssertionError(f"no transaction committed to {topic} within 120 s of the kill")
    finally:
        reader.close()


class SteadyLoad(threading.Thread):
    """`rate` events a second on the spec's source, a second's worth at a time, from start()
    until stop(); pause() holds it between two seconds' worth, resume() goes on."""

    def __init__(
        self,
        settings: Settings,
        spec: PipelineSpec,
        *,
        rate: int,
        keys: int,
        bad_fraction: float = 0.05,
        seed: int = 1,
        partitions: int = 6,
    ):
        super().__init__(daemon=True)
        self.settings, self.spec = settings, spec
        self.rate, self.keys, self.bad_fraction = rate, keys, bad_fraction
        self.seed, self.partitions = seed, partitions
        self.produced = 0
        self.error: BaseException | None = None
        self.running = threading.Event()
        self.running.set()
        self.idle = threading.Event()  # set between two seconds' worth
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.idle.set()
                if not self.running.wait(0.2):
                    continue
                self.idle.clear()
                self.produced += workload.produce(
                    self.settings,
                    self.spec,
                    events=self.rate,
                    keys=self.keys,
                    bad_fraction=self.bad_fraction,
                    rate=self.rate,
                    seed=self.seed,
                    partitions=self.partitions,
                ).produced
                self.seed += 1
        except BaseException as error:  # kept for the test to judge
            self.error = error
        finally:
            self.idle.set()

    def pause(self) -> None:
        """Stop producing once the second's worth in flight is written."""
        self.running.clear()
        assert self.idle.wait(60) and self.error is None, f"the load failed: {self.error}"

    def resume(self) -> None:
        self.running.set()

    def stop(self) -> int:
        """End the load; the events it produced."""
        self.stopping.set()
        self.running.set()
        if self.is_alive():
            self.join(timeout=120)
        assert not self.is_alive() and self.error is None, f"the load failed: {self.error}"
        return self.produced


# The files Delta keeps in a table's `_delta_log` (PROTOCOL.md: commits, checksums, classic,
# multi-part and V2 checkpoints, compacted commits, sidecars, the staged commits of coordinated
# commits; and Delta Lake's record of its last VACUUM).
_DELTA_LOG_NAME = re.compile(
    r"^(\d{20}\.(json|crc)"
    r"|\d{20}\.checkpoint(\.\d{10}\.\d{10}|\.[0-9a-f-]{36})?\.(parquet|json)"
    r"|\d{20}\.\d{20}\.compacted\.json"
    r"|_last_checkpoint|_last_vacuum_info|_sidecars|_staged_commits)$"
)


def not_delta_s(table: Path) -> list[str]:
    """The names in a table's `_delta_log` that are none of Delta's files (a writer's temporary
    file left behind, say); the `.<name>.crc` Hadoop's local filesystem writes beside a file
    counts as Delta's."""
    names = sorted(entry.name for entry in (table / "_delta_log").iterdir())
    hadoop = re.compile(r"^\.(.+)\.crc$")
    return [
        name
        for name in names
        if not _DELTA_LOG_NAME.match(found[1] if (found := hadoop.match(name)) else name)
    ]
