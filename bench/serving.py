"""Pull-query scenarios of `make bench` (the `serve` group; issue #48, decision 36).

A pipeline's stream runs as users run it (tests.harness.StreamProcess) over a source of its own,
first given one event for each of `keys` keys (100,000 by default, `product-000000` onwards),
then a steady 5,000 events/s over the same keys (tests.harness.SteadyLoad) for the whole of the
pull scenarios (all but the bootstraps). One replica, `duality serve` run as users run it
(tests.serving.ServeProcess, a process of its own), keeps its table.

- `pull-query`: once the stream keeps up with the load (less than a second's events behind;
  after 120 s regardless, its lag in the figures), a client process of its own
  (bench/pullclient, in Go: four keep-alive HTTP connections) asks for random keys
  of the table at a fixed 1,000 requests/s for 30 s (scaled down with `--records`, at least
  10 s); each request's latency counts from when it was due (an open loop: a slow answer does
  not hold back the requests after it, and their wait counts). Targets: p99 at most 10 ms, and
  no errors (anything but a 200). The replica's resident memory (its process) before the load,
  at its peak and after.
- `pull-query-own-core`: the same paced run once more, right after, with the replica's
  processes and the client on the machine's last core and every other process of the run (the
  bench, its broker, the stream's driver and JVM, every thread) on the others: a replica with
  a core of its own, as a deployment gives it a host or a cpuset (decision 36). The same
  targets.
- `pull-query-priority`: the same paced run a third time, on every core again, with the
  replica and the client at a higher CPU priority than the rest of the run (nice -10 on their
  threads and on their sessions' autogroups, through which the kernel shares the CPU between
  sessions): a replica given priority on a shared host rather than a core of its own (run as
  root; otherwise the figure says the priority was refused). The same targets.
- `pull-query-realtime`: the same once more with the replica and the client under SCHED_RR
  (real-time round robin, priority 1): their threads run as soon as they wake, ahead of every
  other process, which still has the cores whenever they wait. The same targets.
- `pull-query-max`: the most requests/s the replica answers: four client processes asking
  without pause (one connection each) for 10 s, beside the same load (on the same cores as the
  replica, the stream and the load).
- `pull-freshness`: event to visible in a pull query. Five times a second an event is produced
  for one of 50 probe keys of their own (`probe-00`...; the load never writes them), each key's
  n-th event known from its `orders` count; the bench polls the replica (every 10 ms) for each
  key with an event not yet visible, and an event's figure is from just before it was produced
  until a pull query answers `orders` >= n. Beside it, the moment a read_committed consumer of
  the changelog first sees the same count: the stream's share of that time. Target: p99 at
  most 3 s.
- `replica-bootstrap`: a changelog of `snapshot_keys` keys (1,000,000 by default, written in
  the changelog's own record format), a full Delta snapshot built, validated and published by
  duality's own steps (`snapshot.build`, `validate.run`, in Spark in this process), then 10,000
  more changelog records after its coverage. A new `duality serve` (an empty folder) is timed
  from its process's start until it answers a position at the changelog's stable end with lag
  0; the records it applied (only those after the coverage) show that it started from the
  snapshot. Target: at most 15 s.
- `replica-bootstrap-changelog` (the baseline, same run): the same, with no published snapshot
  to find (a warehouse of its own, empty): the replica reads the whole changelog.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import random
import shutil
import subprocess
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from baselines import Figure, preload
from duality import validate
from duality.config import Settings
from duality.kafka import client, offsets, topics
from duality.snapshot import build, publish
from duality.spec import PipelineSpec
from duality.stream import control
from snapshots import _row, write_changelog
from streaming import (
    PARTITIONS,
    Bench,
    Heartbeats,
    StreamFigure,
    TreeMemory,
    bench_spec,
    covered,
    percentile,
    stream_process,
    target,
    wait_for,
)
from tests.harness import SteadyLoad
from tests.serving import ServeProcess, stable_ends

PULL_CLIENT = Path(__file__).resolve().parent / "pullclient"  # its Go source
# The scenario names whose records/s are no copy of the backlog (no ratio to the baselines).
SCENARIOS = (
    "pull-query",
    "pull-query-own-core",
    "pull-query-priority",
    "pull-query-realtime",
    "pull-query-max",
    "pull-freshness",
    "replica-bootstrap",
    "replica-bootstrap-changelog",
)

EVENT_RATE = 5_000  # events/s of the stream's steady load
PULL_RATE = 1_000.0  # requests/s of the paced client
PULL_CONNECTIONS = 4  # keep-alive connections of the paced client
PULL_SECONDS = 30.0  # the default of the paced client's run (scaled down with --records)
MAX_CLIENTS = 4
KEEP_UP_S = 120.0  # how long the stream is given to keep up with the load before measuring
MAX_SECONDS = 10.0
PROBE_KEYS = 50
PROBE_RATE = 5.0  # probe events a second
PROBE_POLL_S = 0.01
AFTER_SNAPSHOT = 10_000  # changelog records written after the snapshot's coverage

P99_TARGET_MS = 10.0
FRESHNESS_TARGET_S = 3.0
BOOTSTRAP_TARGET_S = 15.0


def every_key(keys: int) -> Iterator[tuple[bytes, bytes]]:
    """One order event for each key, `product-000000` onwards (SteadyLoad's keys)."""
    rng = random.Random(48)
    for i in range(keys):
        product = f"product-{i:06d}"
        yield product.encode(), _event(product, f"s{i:09d}", rng).encode()


def _event(product: str, order_id: str, rng: random.Random) -> str:
    return (
        f'{{"order_id":"{order_id}","product":"{product}",'
        f'"customer":"c{rng.randrange(100_000):05d}","quantity":{rng.randint(1, 9)},'
        f'"amount":{rng.randrange(100, 50_000) / 100}}}'
    )


def _mb(value: int) -> float:
    return round(value / 2**20, 1)


def _ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 3) if values else None


def _build_client(scratch: Path) -> Path:
    """The pull-query client (bench/pullclient, Go's standard library only), built into
    `scratch`."""
    if shutil.which("go") is None:
        raise RuntimeError("the serve group's pull-query client is written in Go: install Go")
    binary = scratch / "pullclient"
    subprocess.run(
        ["go", "build", "-o", str(binary), "."], cwd=PULL_CLIENT, check=True, capture_output=True
    )
    return binary


def _client(
    binary: Path,
    replica: ServeProcess,
    pipeline: str,
    keys: int,
    rate: float,
    seconds: float,
    out: Path,
    seed: int,
    connections: int,
) -> subprocess.Popen[bytes]:
    command = [
        str(binary),
        *("--url", replica.url, "--pipeline", pipeline, "--keys", str(keys)),
        *("--connections", str(connections)),
        *("--rate", f"{rate:g}", "--seconds", f"{seconds:g}", "--seed", str(seed)),
        *("--out", str(out)),
    ]
    placed = _CLIENT_PLACEMENT[0] if _CLIENT_PLACEMENT else None
    return subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # A session of its own, as the replica has: an autogroup the kernel schedules apart
        # from the bench's (whose thread produces the load).
        start_new_session=True,
        preexec_fn=placed,
    )


def _finished(client: subprocess.Popen[bytes], out: Path, seconds: float) -> dict[str, Any]:
    try:
        _, errors = client.communicate(timeout=seconds + 120)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    if client.returncode != 0:
        raise RuntimeError(f"the pull client failed ({client.returncode}): {errors[-2000:]!r}")
    return dict(json.loads(out.read_text()))


class _Probes:
    """The probe events of `pull-freshness` and when each was first visible: in a pull query
    of the replica, and to a read_committed consumer of the changelog (the stream's share)."""

    def __init__(self, settings: Settings, spec: PipelineSpec, replica: ServeProcess) -> None:
        self.settings, self.spec = settings, spec
        address = urllib.parse.urlsplit(replica.url)
        self.host, self.port = address.hostname or "127.0.0.1", address.port or 80
        self.keys = [f"probe-{n:02d}" for n in range(PROBE_KEYS)]
        self.produced: dict[str, list[float]] = {key: [] for key in self.keys}  # time.time()
        self.visible: dict[str, int] = dict.fromkeys(self.keys, 0)  # events seen in a pull query
        self.latencies: list[float] = []
        self.in_changelog: dict[str, int] = dict.fromkeys(self.keys, 0)
        self.stream_latencies: list[float] = []
        self.errors = 0
        self.rng = random.Random(49)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        ends = offsets.end_offsets(settings, spec.changelog_topic)
        self.reader = client.consumer(
            settings,
            f"bench-freshness-{uuid.uuid4().hex}",
            isolation_level="read_committed",
            enable_partition_eof=False,
            fetch_wait_max_ms=10,
        )
        self.reader.assign(
            [offsets.TopicPartition(spec.changelog_topic, p, o) for p, o in ends.items()]
        )
        self.follower = threading.Thread(target=self._follow, daemon=True)
        self.follower.start()

    def _follow(self) -> None:
        wanted = {key.encode() for key in self.keys}
        while not self.stopping.is_set():
            for message in self.reader.consume(num_messages=10_000, timeout=0.05):
                seen = time.time()
                if message.error() is not None or message.key() not in wanted:
                    continue
                key = message.key().decode()
                count = int(json.loads(message.value() or b"{}").get("orders") or 0)
                with self.lock:
                    stamps = self.produced[key]
                    for n in range(self.in_changelog[key], min(count, len(stamps))):
                        self.stream_latencies.append(seen - stamps[n])
                    self.in_changelog[key] = max(self.in_changelog[key], count)

    def run(self, seconds: float, drain: float = 60.0) -> float:
        """Probe events for `seconds`, then until every one is visible or `drain` more
        seconds passed; the seconds of probing."""
        producer = client.producer(self.settings, linger_ms=1)
        connection = http.client.HTTPConnection(self.host, self.port, timeout=5)
        prefix = f"/v1/pipelines/{self.spec.name}/rows/"
        started = time.monotonic()
        sent = 0
        deadline = started + seconds + drain
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now < started + seconds and sent <= (now - started) * PROBE_RATE:
                key = self.keys[sent % PROBE_KEYS]
                with self.lock:
                    self.produced[key].append(time.time())
                event = _event(key, f"probe{sent:07d}", self.rng)
                producer.produce(self.spec.source.topic, key=key.encode(), value=event.encode())
                producer.poll(0)
                sent += 1
            waiting = [k for k in self.keys if self.visible[k] < len(self.produced[k])]
            if not waiting and now >= started + seconds:
                break
            for key in waiting:
                try:
                    connection.request("GET", prefix + key)
                    answer = connection.getresponse()
                    body = answer.read()
                except (OSError, http.client.HTTPException):
                    self.errors += 1
                    connection.close()
                    connection = http.client.HTTPConnection(self.host, self.port, timeout=5)
                    continue
                if answer.status != 200:
                    continue  # 404 until the key's first event is visible
                seen = time.time()
                count = int(json.loads(body)["row"].get("orders") or 0)
                stamps = self.produced[key]
                for n in range(self.visible[key], min(count, len(stamps))):
                    self.latencies.append(seen - stamps[n])
                self.visible[key] = max(self.visible[key], count)
            time.sleep(PROBE_POLL_S)
        producer.flush(30)
        connection.close()
        return min(seconds, time.monotonic() - started)

    def unseen(self) -> int:
        return sum(max(0, len(self.produced[k]) - self.visible[k]) for k in self.keys)

    def close(self) -> None:
        self.stopping.set()
        self.follower.join(10)
        self.reader.close()


@dataclasses.dataclass
class _Paced:
    """One paced run of the client (PULL_RATE requests/s for a while) and its surroundings."""

    name: str  # the scenario's
    result: dict[str, Any]
    events: int  # the stream's load during it
    load_average: tuple[float, float]  # before and after
    lag: tuple[int | None, int | None]  # the stream's, before and after
    placement: str  # the cores

    @classmethod
    def run(
        cls,
        name: str,
        binary: Path,
        replica: ServeProcess,
        spec: PipelineSpec,
        keys: int,
        seconds: float,
        scratch: Path,
        load: SteadyLoad,
        placement: str,
    ) -> _Paced:
        settings = replica.settings
        produced, lag, average = load.produced, control.lag(settings, spec), os.getloadavg()[0]
        out = scratch / f"{name}.json"
        client = _client(
            binary, replica, spec.name, keys, PULL_RATE, seconds, out, 1, PULL_CONNECTIONS
        )
        result = _finished(client, out, seconds)
        return cls(
            name,
            result,
            load.produced - produced,
            (round(average, 2), round(os.getloadavg()[0], 2)),
            (lag, control.lag(settings, spec)),
            placement,
        )

    def figure(self, keys: int, rss: dict[str, float], max_rate: float) -> StreamFigure:
        paced = self.result
        latencies = sorted(paced["latencies_ms"])
        p50, p99, p999 = (_ms(latencies, q) for q in (50, 99, 99.9))
        services = sorted(paced["services_ms"])
        errors = int(paced["errors"])
        return StreamFigure(
            self.name,
            int(paced["requests"]),
            float(paced["seconds"]),
            0.0,
            details={
                "rate_target": PULL_RATE,
                "connections": PULL_CONNECTIONS,
                "keys": keys,
                "event_rate": EVENT_RATE,
                "events_during": self.events,
                "cores": self.placement,
                "p50_ms": p50,
                "p99_ms": p99,
                "p999_ms": p999,
                "max_ms": round(latencies[-1], 3) if latencies else None,
                # From when each request was sent rather than due: the difference is the
                # client's own wait (a connection or its process's turn on a core).
                "service_p50_ms": _ms(services, 50),
                "service_p99_ms": _ms(services, 99),
                "errors": errors,
                "first_error": paced["first_error"],
                "statuses": paced["statuses"],
                "max_requests_per_s": round(max_rate, 1),
                # The machine's 1-minute load average before and after the paced run: other
                # work on the same cores shows in the tail.
                "load_average": list(self.load_average),
                # The stream's lag on its source before and after the paced run (events).
                "stream_lag": list(self.lag),
                **rss,
            },
            targets=[
                target(
                    f"p99 <= {P99_TARGET_MS:g} ms", p99, p99 is not None and p99 <= P99_TARGET_MS
                ),
                target("no errors", errors, errors == 0 and bool(latencies)),
            ],
            note=(
                f"p50 {p50} ms, p99 {p99} ms, p999 {p999} ms, {errors} errors; cores: "
                f"{self.placement}; beside {EVENT_RATE:,} events/s; replica RSS "
                f"{rss['replica_rss_mb_before']} MiB before, peak {rss['replica_rss_mb_peak']} "
                f"MiB; load average {self.load_average[0]:.1f}; the stream's lag "
                f"{self.lag[0]} -> {self.lag[1]} events"
            ),
        )


@contextlib.contextmanager
def _own_core(replica: ServeProcess) -> Iterator[str]:
    """The replica's processes (its API and writer) and the clients started meanwhile on the
    last core, every other process of this run (this one, its broker, the stream's driver and
    its JVM, every thread of each) on the others; all back on every core after. A replica on
    a host or in a cpuset of its own, as a deployment gives it, on a machine this size."""
    cpus = sorted(os.sched_getaffinity(0))
    assert replica.process is not None
    if len(cpus) < 2:
        yield "shared (one core)"
        return
    own, rest = {cpus[-1]}, set(cpus[:-1])
    root = psutil.Process(replica.process.pid)
    replica_tree = {p.pid for p in [root, *root.children(recursive=True)]}
    me = psutil.Process()
    tree = [me, *me.children(recursive=True)]
    _pin(tree, lambda pid: own if pid in replica_tree else rest)
    _CLIENT_PLACEMENT[:] = [lambda: os.sched_setaffinity(0, own)]
    try:
        yield f"replica {cpus[-1]}, others {','.join(map(str, sorted(rest)))}"
    finally:
        _CLIENT_PLACEMENT.clear()
        _pin([me, *me.children(recursive=True)], lambda _: set(cpus))


PRIORITY_NICE = -10  # the replica's and the client's in `pull-query-priority`
REALTIME_PRIORITY = 1  # their SCHED_RR priority in `pull-query-realtime` (1-99)


@contextlib.contextmanager
def _ahead(replica: ServeProcess, realtime: bool) -> Iterator[str]:
    """The replica's processes and the clients started meanwhile ahead of the run's other
    processes, all back as they were after. Either at nice PRIORITY_NICE (every thread, and the
    session's autogroup: with autogroups on, the kernel shares the CPU between sessions first,
    so a thread's nice weighs only within its session), or `realtime`: under SCHED_RR, whose
    threads run as soon as they wake, before any of the others (the kernel still leaves those
    5 % of each second, sched_rt_runtime_us). Either needs root (CAP_SYS_NICE)."""
    assert replica.process is not None
    root = psutil.Process(replica.process.pid)
    replica_tree = [root, *root.children(recursive=True)]
    placed = _realtime if realtime else _renice
    try:
        placed(replica_tree, True)
    except PermissionError as refused:
        yield f"shared (the priority refused: {refused})"
        return
    _CLIENT_PLACEMENT[:] = [lambda: placed([psutil.Process()], True)]
    try:
        yield (
            f"replica and client under SCHED_RR {REALTIME_PRIORITY}"
            if realtime
            else f"replica and client at nice {PRIORITY_NICE}"
        ) + ", the others as they were"
    finally:
        _CLIENT_PLACEMENT.clear()
        placed(replica_tree, False)


def _renice(processes: list[psutil.Process], ahead: bool) -> None:
    """Every thread of each process, and its session's autogroup, at nice PRIORITY_NICE, or
    back at 0."""
    nice = PRIORITY_NICE if ahead else 0
    for process in processes:
        for thread in _threads(process):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, thread, nice)
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            Path(f"/proc/{process.pid}/autogroup").write_text(str(nice))


def _realtime(processes: list[psutil.Process], ahead: bool) -> None:
    """Every thread of each process under SCHED_RR at REALTIME_PRIORITY (threads started later
    inherit it), or back under SCHED_OTHER."""
    policy, priority = (os.SCHED_RR, REALTIME_PRIORITY) if ahead else (os.SCHED_OTHER, 0)
    for process in processes:
        for thread in _threads(process):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(thread, policy, os.sched_param(priority))


def _threads(process: psutil.Process) -> list[int]:
    try:
        return [thread.id for thread in process.threads()]
    except psutil.Error:
        return []  # ended meanwhile


def _pin(processes: list[psutil.Process], cpus_of: Callable[[int], set[int]]) -> None:
    """Every thread of each process onto `cpus_of(its pid)` (threads started later inherit)."""
    for process in processes:
        for thread in _threads(process):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.sched_setaffinity(thread, cpus_of(process.pid))


# What a client started now does first, in its process (nothing when empty): `_own_core` and
# `_ahead` set it.
_CLIENT_PLACEMENT: list[Callable[[], None]] = []


def pull_scenarios(
    bench: Bench, scratch: Path, keys: int, seconds: float, trigger_seconds: float
) -> list[Figure]:
    """`pull-query`, `pull-query-max` and `pull-freshness`, on one stream and one replica."""
    settings, progress = bench.settings, bench.progress
    binary = _build_client(scratch)
    topic = f"bench-serve-{bench.stamp}"
    topics.create_topic(settings, topic, PARTITIONS)
    spec = bench_spec(f"bench_serve_{bench.stamp}", topic, bench.pipelines)
    preload(settings, topic, every_key(keys), progress, total=keys)
    heartbeats = Heartbeats(settings, spec.name)
    stream = stream_process(bench, spec, trigger_seconds)
    replica = ServeProcess(
        settings.replace(pipelines=bench.pipelines), scratch / "serve-pull", spec.name
    )
    load = SteadyLoad(settings, spec, rate=EVENT_RATE, keys=keys, bad_fraction=0.0, seed=48)
    memory: TreeMemory | None = None
    probes: _Probes | None = None
    try:
        stream.start()
        ends = offsets.end_offsets(settings, topic)
        wait_for(
            stream,
            heartbeats,
            lambda: covered(settings, spec, ends) >= sum(ends.values()),
            300,
            f"serve: the stream over one event for each of {keys:,} keys",
        )
        replica.start()
        assert replica.process is not None
        memory = TreeMemory(replica.process.pid)
        changelog_ends = stable_ends(settings, spec.changelog_topic)
        wait_for(
            stream,
            heartbeats,
            lambda: replica.caught_up(spec.name, changelog_ends),
            120,
            "serve: the replica at the changelog's end",
        )
        rss_before = memory.sample()
        progress.console.print(
            f"serve: a replica of {keys:,} keys; the stream at {EVENT_RATE:,} events/s"
        )
        load.start()
        # Measured once the stream keeps up (less than a second's events behind), or after
        # KEEP_UP_S regardless, on a machine too busy for it: the lag then is in the figures.
        try:
            wait_for(
                stream,
                heartbeats,
                lambda: (control.lag(settings, spec) or 0) < EVENT_RATE and load.produced > 0,
                KEEP_UP_S,
                f"serve: the stream keeping up with {EVENT_RATE:,} events/s",
            )
        except TimeoutError:
            progress.console.print(
                f"serve: the stream did not keep up with {EVENT_RATE:,} events/s within "
                f"{KEEP_UP_S:g} s; measuring beside it as it is"
            )
        progress.console.print(
            f"pull-query: {PULL_RATE:,.0f} requests/s for {seconds:g} s from a process of its own"
        )

        def paced_run(name: str, placement: str) -> _Paced:
            return _Paced.run(name, binary, replica, spec, keys, seconds, scratch, load, placement)

        paced = paced_run("pull-query", "shared")
        rss_after = memory.sample()
        progress.console.print(
            "pull-query-own-core: the same with the replica and the client on a core of their "
            "own, every other process of the run on the others"
        )
        with _own_core(replica) as placement:
            own = paced_run("pull-query-own-core", placement)
        progress.console.print(
            "pull-query-priority: the same on every core, the replica and the client at a "
            "higher CPU priority than the rest of the run"
        )
        with _ahead(replica, realtime=False) as placement:
            niced = paced_run("pull-query-priority", placement)
        progress.console.print(
            "pull-query-realtime: the same with the replica and the client under SCHED_RR"
        )
        with _ahead(replica, realtime=True) as placement:
            realtime = paced_run("pull-query-realtime", placement)

        progress.console.print(f"pull-query-max: {MAX_CLIENTS} clients without pause")
        outs = [scratch / f"pull-query-max-{n}.json" for n in range(MAX_CLIENTS)]
        clients = [
            _client(binary, replica, spec.name, keys, 0, MAX_SECONDS, o, 10 + n, 1)
            for n, o in enumerate(outs)
        ]
        closed = [_finished(c, o, MAX_SECONDS) for c, o in zip(clients, outs, strict=True)]

        progress.console.print(f"pull-freshness: {PROBE_RATE:g} probe events/s for {seconds:g} s")
        probes = _Probes(settings, spec, replica)
        probed = probes.run(seconds)
        stream.check()
        load.stop()
        replica.stop()
        stream.stop()
    finally:
        if load.is_alive():
            load.stopping.set()
        if probes is not None:
            probes.close()
        if memory is not None:
            memory.close()
        replica.kill()
        stream.kill()
        heartbeats.close()

    requests_max = sum(int(c["requests"]) for c in closed)
    seconds_max = max(float(c["seconds"]) for c in closed)
    errors_max = sum(int(c["errors"]) for c in closed)
    max_rate = requests_max / seconds_max if seconds_max else 0.0
    rss = {
        "replica_rss_mb_before": _mb(rss_before),
        "replica_rss_mb_after": _mb(rss_after),
        "replica_rss_mb_peak": _mb(memory.peak),
    }
    paced_figures = [run.figure(keys, rss, max_rate) for run in (paced, own, niced, realtime)]
    most = StreamFigure(
        "pull-query-max",
        requests_max,
        seconds_max,
        0.0,
        details={
            "clients": MAX_CLIENTS,
            "errors": errors_max,
            "p99_ms": _ms(sorted(x for c in closed for x in c["latencies_ms"]), 99),
            "event_rate": EVENT_RATE,
        },
        note=(
            f"{MAX_CLIENTS} client processes without pause, beside {EVENT_RATE:,} events/s, "
            f"on the same cores; {errors_max} errors"
        ),
    )
    assert probes is not None
    fresh = sorted(probes.latencies)
    streamed = sorted(probes.stream_latencies)
    unseen = probes.unseen()
    f50, f99 = (_ms(fresh, q) for q in (50, 99))
    s50, s99 = (_ms(streamed, q) for q in (50, 99))
    freshness = StreamFigure(
        "pull-freshness",
        len(fresh),
        probed,
        0.0,
        details={
            "probe_rate": PROBE_RATE,
            "probe_keys": PROBE_KEYS,
            "poll_interval_s": PROBE_POLL_S,
            "trigger_seconds": trigger_seconds,
            "p50_s": f50,
            "p99_s": f99,
            "max_s": round(fresh[-1], 3) if fresh else None,
            "changelog_p50_s": s50,
            "changelog_p99_s": s99,
            "unseen_events": unseen,
            "poll_errors": probes.errors,
        },
        targets=[
            target(
                f"p99 <= {FRESHNESS_TARGET_S:g} s",
                f99,
                f99 is not None and unseen == 0 and f99 <= FRESHNESS_TARGET_S,
            )
        ],
        note=(
            f"event to pull query p50 {f50} s, p99 {f99} s (to the changelog p50 {s50} s, "
            f"p99 {s99} s); trigger {trigger_seconds:g} s, beside {EVENT_RATE:,} events/s"
            + (f"; {unseen} events never visible" if unseen else "")
        ),
    )
    return [*paced_figures, most, freshness]


def _new_replica(
    settings: Settings, folder: Path, spec: PipelineSpec, ends: dict[int, int]
) -> tuple[float, float, float, float]:
    """A new `duality serve` in `folder`: (seconds from its start to the changelog's end with
    lag 0, records it applied, its peak and final RSS in MiB)."""
    replica = ServeProcess(settings, folder, spec.name)
    memory: TreeMemory | None = None
    started = time.perf_counter()
    try:
        replica.start()
        assert replica.process is not None
        memory = TreeMemory(replica.process.pid, interval=0.1)
        deadline = time.monotonic() + 300
        while not replica.caught_up(spec.name, ends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a new replica not at {ends} within 300 s: {replica.tail()}")
            time.sleep(0.05)
        seconds = time.perf_counter() - started
        applied = replica.applied(spec.name)
        final = memory.sample()
        replica.stop()
    finally:
        if memory is not None:
            memory.close()
        replica.kill()
    return seconds, applied, _mb(memory.peak), _mb(final)


def bootstrap_scenarios(bench: Bench, scratch: Path, keys: int) -> list[Figure]:
    """`replica-bootstrap` from the published snapshot, and `replica-bootstrap-changelog`."""
    from duality.spark import session

    settings, progress = bench.settings, bench.progress
    spec = bench_spec(
        f"bench_bootstrap_{bench.stamp}", f"bench-bootstrap-{bench.stamp}", bench.pipelines
    )
    scoped = settings.replace(pipelines=bench.pipelines)
    topics.create_topic(settings, spec.source.topic, PARTITIONS)
    topics.create_topic(
        settings, spec.changelog_topic, PARTITIONS, config={"cleanup.policy": "compact"}
    )
    rng = random.Random(36)
    products = [f"p{i:07d}" for i in range(keys)]
    progress.console.print(f"replica-bootstrap: a changelog of {keys:,} keys, its snapshot")
    write_changelog(settings, spec, {p: _row(rng) for p in products})
    spark = session(settings, "duality-bench-serve")
    build.build(settings, spec, "full", spark=spark)
    report = validate.run(settings, spec, spark=spark)
    if not report.published:
        raise RuntimeError(f"replica-bootstrap: the snapshot was not published: {report.failed}")
    found = publish.published_in_log(spec.snapshot_path(settings))
    assert found is not None
    covered_offsets = dict(found.coverage.changelog)
    after = min(AFTER_SNAPSHOT, keys)
    write_changelog(settings, spec, {p: _row(rng) for p in rng.sample(products, after)})
    ends = stable_ends(settings, spec.changelog_topic)
    records = sum(ends.values())
    beyond = records - sum(covered_offsets.values())

    progress.console.print(f"replica-bootstrap: a new replica from the snapshot of {keys:,} keys")
    seconds, applied, peak, final = _new_replica(scoped, scratch / "serve-snapshot", spec, ends)
    progress.console.print("replica-bootstrap-changelog: a new replica from the changelog alone")
    alone = scoped.replace(warehouse=scratch / "no-snapshot")  # no published snapshot there
    base_seconds, base_applied, base_peak, base_final = _new_replica(
        alone, scratch / "serve-changelog", spec, ends
    )
    ratio = seconds / base_seconds if base_seconds else 0.0
    snapshot = StreamFigure(
        "replica-bootstrap",
        keys,
        seconds,
        0.0,
        details={
            "keys": keys,
            "changelog_records": records,
            "records_after_snapshot": beyond,
            "records_applied": int(applied),
            "from_snapshot": int(applied) == beyond,
            "replica_rss_mb_peak": peak,
            "replica_rss_mb_final": final,
            "vs_changelog_alone": round(ratio, 3),
        },
        targets=[
            target(
                f"at the changelog's end within {BOOTSTRAP_TARGET_S:g} s",
                seconds,
                int(applied) == beyond and seconds <= BOOTSTRAP_TARGET_S,
            )
        ],
        note=(
            f"from the published snapshot of {keys:,} keys, then {int(applied):,} changelog "
            f"records; {ratio:.2f}x replica-bootstrap-changelog; process start included; RSS "
            f"peak {peak} MiB"
        ),
    )
    baseline = StreamFigure(
        "replica-bootstrap-changelog",
        int(base_applied),
        base_seconds,
        0.0,
        details={
            "keys": keys,
            "changelog_records": records,
            "records_applied": int(base_applied),
            "replica_rss_mb_peak": base_peak,
            "replica_rss_mb_final": base_final,
        },
        note=f"baseline: the whole changelog, no snapshot; RSS peak {base_peak} MiB",
    )
    return [snapshot, baseline]


def serve_scenarios(
    bench: Bench,
    scratch: Path,
    keys: int,
    snapshot_keys: int,
    seconds: float,
    trigger_seconds: float,
) -> list[Figure]:
    """The group's scenarios, in order."""
    figures = pull_scenarios(bench, scratch, keys, seconds, trigger_seconds)
    figures.extend(bootstrap_scenarios(bench, scratch, snapshot_keys))
    return figures
