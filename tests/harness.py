"""What the tests share: waiting for conditions, reading topics whole, unique names."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
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

from duality import kafka
from duality.config import Settings
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
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(ended.stdout)


def assert_eventually(
    probe: Callable[[], T],
    expected: Any = None,
    *,
    timeout: float = 60.0,
    interval: float = 0.25,
    message: str = "",
) -> T:
    """Call `probe` until it returns `expected` (anything truthy when expected is None; a value
    for which `expected(value)` is true when it is callable)."""
    deadline = time.monotonic() + timeout
    last: Any = None
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
        time.sleep(interval)


def run_duality(
    config: Settings | Mapping[str, str],
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess[str]:
    """The `duality` command line run as users run it, in a process of its own, configured by
    `config`: settings (as their DUALITY_* variables), or the variables themselves where a test
    leaves some unset on purpose (a stack's later commands find its addresses in its record);
    `env` on top."""
    variables = config.as_env() if isinstance(config, Settings) else config
    return subprocess.run(
        [sys.executable, "-m", "duality.cli", *args],
        env={**os.environ, **variables, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


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
    isolation: kafka.Isolation = "read_committed",
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
    isolation: kafka.Isolation = "read_committed",
    timeout: float = 60.0,
) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of `topic` up to its current end (read_messages): (partition, offset, key,
    value)."""
    return [
        (m.partition(), m.offset(), m.key(), m.value())  # type: ignore[misc]
        for m in read_messages(settings, topic, isolation=isolation, timeout=timeout)
    ]


def make_pipeline(settings: Settings, folder: Path, template: str, **source: Any) -> PipelineSpec:
    """A copy of a demo spec with unique names, written to `folder` (DUALITY_PIPELINES)."""
    data = yaml.safe_load((ROOT / "include" / "pipelines" / f"{template}.yaml").read_text())
    name = f"t{uuid.uuid4().hex[:10]}"
    data["name"] = name
    data["source"]["topic"] = f"{name}-source"
    data["source"].update(source)
    data["changelog"] = {"partitions": 3}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


class StreamProcess:
    """A pipeline's stream driver run as a user runs it: `jobs/stream_aggregate.py` in a process."""

    def __init__(
        self,
        settings: Settings,
        spec: PipelineSpec,
        pipelines: Path,
        log: Path,
        max_offsets_per_trigger: int = 5000,
        stall_timeout: float = 300,
    ):
        self.settings, self.spec, self.log = settings, spec, log
        self.env = {
            **os.environ,
            "DUALITY_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "DUALITY_PIPELINES": str(pipelines),
            "DUALITY_CHECKPOINT_ROOT": str(settings.checkpoint_root),
            "DUALITY_WAREHOUSE": str(settings.warehouse),
            "DUALITY_LOCAL_DIR": str(settings.local_dir),
        }
        self.args = [
            "--max-offsets-per-trigger",
            str(max_offsets_per_trigger),
            "--stall-timeout",
            str(stall_timeout),
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "jobs" / "stream_aggregate.py"),
                    self.spec.name,
                    *self.args,
                ],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL the driver and everything it started (its JVM and Python workers)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the stream did not stop on SIGTERM; see {self.log}") from None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def covered(self) -> int:
        """How many source records the committed offsets cover (all partitions)."""
        committed = kafka.committed_offsets(
            self.settings, self.spec.consumer_group, self.spec.source.topic
        )
        return sum(offset for offset, _ in committed.values())

    def wait_caught_up(self, timeout: float = 240) -> None:
        def caught_up() -> bool:
            if not self.alive():
                raise AssertionError(f"the stream exited; see {self.log}:\n{self.tail()}")
            ends = kafka.end_offsets(self.settings, self.spec.source.topic)
            committed = kafka.committed_offsets(
                self.settings, self.spec.consumer_group, self.spec.source.topic
            )
            return all(committed.get(p, (0, None))[0] >= end for p, end in ends.items())

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
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
