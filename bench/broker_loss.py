"""`broker-loss`: a stream on a three-broker cluster under a steady load, the leader of its
source's first partition SIGKILLed. The stall is the largest gap between two of the stream's
commits from the kill on; the baseline is the largest gap in the same run's steady load before
the kill; Kafka's own failure detection is the time until no partition of the stream's topics
is led by the dead broker (docs/operations.md#losing-a-broker)."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path

from rich.progress import Progress

from duality.config import Settings
from duality.kafka import client, offsets, topics
from duality.local.kraft import ephemeral_cluster
from duality.spec import PipelineSpec
from duality.stream import control
from streaming import MAX_OFFSETS_PER_TRIGGER, StreamFigure, bench_spec, target
from tests.harness import SteadyLoad, StreamProcess, assert_eventually

RATE = 5_000  # events a second
KEYS = 10_000
STEADY_S = 30.0  # the steady load measured before the kill
AFTER_KILL_S = 45.0  # how long the load and the watch go on after it
STALL_TARGET_S = 15.0
PARTITIONS = 6


class _Commits(threading.Thread):
    """When the stream's committed offsets moved, watched every 0.2 s (read_uncommitted: a
    look never waits for an open transaction)."""

    def __init__(self, settings: Settings, spec: PipelineSpec):
        super().__init__(daemon=True)
        # A look at a dead coordinator gives up soon; the next one asks again.
        self.settings = settings.replace(connect_timeout_s=2.0)
        self.spec = spec
        self.stopping = threading.Event()
        self.times: list[float] = []

    def run(self) -> None:
        last = None
        while not self.stopping.wait(0.2):
            try:
                committed = offsets.committed_offsets(
                    self.settings,
                    self.spec.consumer_group,
                    self.spec.source.topic,
                    "read_uncommitted",
                )
            except Exception:  # the coordinator moving: the next look tells
                continue
            total = sum(offset for offset, _ in committed.values())
            if total != last:
                self.times.append(time.monotonic())
                last = total


def _largest_gap(times: list[float], start: float, end: float) -> float:
    """The largest gap between commits within [start, end], its ends included as commits."""
    inside = [start, *(t for t in times if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(inside))


def _leaders_moved(settings: Settings, topics: list[str], victim: int, since: float) -> float:
    """Seconds from `since` until no partition of `topics` is led by `victim`."""

    def moved() -> bool:
        metadata = client.admin(settings).list_topics(timeout=5)
        return all(
            entry.leader != victim
            for topic in topics
            for entry in metadata.topics[topic].partitions.values()
        )

    assert_eventually(moved, timeout=120, interval=0.2, message="no new leaders")
    return time.monotonic() - since


def broker_loss_scenario(
    base: Settings, scratch: Path, progress: Progress, stamp: int
) -> StreamFigure:
    progress.console.print(
        f"broker-loss: a stream at {RATE:,} events/s on three brokers, its source's leader killed"
    )
    with ephemeral_cluster(base, brokers=3) as cluster:
        settings = cluster.settings.replace(
            checkpoint_root=scratch / "broker-loss" / "checkpoints",
            local_dir=scratch / "broker-loss" / "local",
        )
        pipelines = scratch / "broker-loss" / "pipelines"
        spec = bench_spec(f"bench_broker_loss_{stamp}", f"bench-broker-loss-{stamp}", pipelines)
        topics.create_topic(settings, spec.source.topic, PARTITIONS)
        stream = StreamProcess(
            settings,
            spec,
            pipelines,
            scratch / "broker-loss" / "stream.log",
            max_offsets_per_trigger=MAX_OFFSETS_PER_TRIGGER,
            stall_timeout=None,
        )
        load = SteadyLoad(
            settings, spec, rate=RATE, keys=KEYS, bad_fraction=0.0, partitions=PARTITIONS
        )
        commits = _Commits(settings, spec)
        stream.start()
        try:
            load.start()
            # Steady: the stream keeps up with the load (less than a second's worth behind)
            # before the watch begins.
            assert_eventually(
                lambda: stream.covered() >= RATE and (control.lag(settings, spec) or 0) < RATE,
                timeout=300,
                interval=1.0,
                message=f"the stream never kept up with {RATE:,} events/s; {stream.log}",
            )
            commits.start()
            steady_from = time.monotonic()
            time.sleep(STEADY_S)  # a benchmark's measuring window, not a synchronisation
            metadata = client.admin(settings).list_topics(spec.source.topic, timeout=10)
            victim = metadata.topics[spec.source.topic].partitions[0].leader
            node = cluster.node(victim)
            os.kill(node.pid() or 0, signal.SIGKILL)
            killed = time.monotonic()
            watched = [spec.source.topic, spec.changelog_topic]
            detection = _leaders_moved(settings, watched, victim, killed)
            time.sleep(max(0.0, killed + AFTER_KILL_S - time.monotonic()))
            watched_to = time.monotonic()
            stream.check()
        finally:
            load.stop()
            commits.stopping.set()
            stream.stop()
        steady = _largest_gap(commits.times, steady_from, killed)
        stall = _largest_gap(commits.times, killed, watched_to)
    figure = StreamFigure(
        "broker-loss",
        load.produced,
        stall,
        0.0,
        details={
            "rate": RATE,
            "stall_seconds": round(stall, 2),
            "steady_largest_gap_seconds": round(steady, 2),
            "leaders_moved_seconds": round(detection, 2),
            "commits_after_kill": sum(1 for t in commits.times if t > killed),
        },
        note=(
            f"stall {stall:.1f} s (steady load's largest gap {steady:.1f} s; Kafka moved the "
            f"dead broker's leaderships in {detection:.1f} s)"
        ),
    )
    figure.targets = [target(f"stall at most {STALL_TARGET_S:g} s", stall, stall <= STALL_TARGET_S)]
    return figure
