"""The `object-store` group: the snapshot DAG's steps as whole commands (the `cmd-*` scenarios of
bench/commands.py) and a stream's failover with a warm standby, with every location (tables,
checkpoints, reports) on the S3 server `duality up --object-store` runs, beside the same
scenarios on local disk in the same run (issue #49). Each S3 figure is named `<scenario>-s3`
and carries its local twin's seconds and the ratio between them; the targets are the issue's:
the incremental snapshot at most 0.25x the full rebuild on S3 (set by bench/commands.py on the
warm runs), failover with a standby at most 10 s."""

from __future__ import annotations

import dataclasses
from typing import Any

from commands import command_scenarios
from rich.progress import Progress

from baselines import Figure, order_events
from duality.config import Settings
from duality.local.object_store import LocalObjectStore
from streaming import RESTART_EVENTS, Bench, Point, bench_spec, state_scale_point, target

FAILOVER_STANDBY_SECONDS = 10.0


@dataclasses.dataclass
class BesideLocal(Figure):
    """A figure measured with every location on S3, and its local twin's seconds."""

    measured: Figure | None = None
    local_seconds: float | None = None
    notes: str = ""
    targets: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = dict(self.measured.as_dict()) if self.measured else {}
        document |= super().as_dict()
        ratio = self.seconds / self.local_seconds if self.local_seconds else None
        document |= {
            "local_seconds": self.local_seconds,
            "vs_local": None if ratio is None else round(ratio, 2),
            "notes": self.notes,
        }
        targets = [*(document.get("targets") or []), *self.targets]
        if targets:
            document["targets"] = targets
            document["met"] = all(t["met"] for t in targets)
        return document


def on_object_store(settings: Settings, store: LocalObjectStore, stamp: int) -> Settings:
    """`settings` with the S3 server's endpoint and credentials, and the warehouse, checkpoints
    and reports under `s3a://<bucket>/bench-<stamp>/`."""
    prefix = f"s3a://{settings.s3_bucket}/bench-{stamp}"
    return Settings.from_env(
        {
            **settings.as_env(),
            **store.client_settings(),
            "DUALITY_WAREHOUSE": f"{prefix}/warehouse",
            "DUALITY_CHECKPOINT_ROOT": f"{prefix}/checkpoints",
            "DUALITY_REPORTS": f"{prefix}/reports",
        }
    )


def object_store_scenarios(
    bench: Bench,
    source: str,
    snapshot_keys: int,
    keys: int,
    stamp: int,
    progress: Progress,
    local_commands: list[Figure] | None,
) -> list[Figure]:
    """The S3 server is started, used and stopped here. `local_commands`: the commands group's
    figures of this run, else they are measured here too (locally) for the comparison."""
    settings, say = bench.settings, progress.console.print
    store = LocalObjectStore(settings)
    say("starting the S3 server (SeaweedFS)")
    store.start()
    try:
        s3 = on_object_store(settings, store, stamp)
        figures: list[Figure] = []
        if local_commands is None:
            say(f"the snapshot DAG's steps on local disk, {snapshot_keys:,} keys")
            local_commands = command_scenarios(
                settings, source, snapshot_keys, bench.pipelines, stamp, say
            )
            figures.extend(local_commands)
        say(f"the snapshot DAG's steps with every location on S3, {snapshot_keys:,} keys")
        remote = command_scenarios(s3, source, snapshot_keys, bench.pipelines, stamp + 1, say)
        figures.extend(_beside(remote, local_commands))
        figures.append(_failover(bench, s3, source, keys, progress))
        return figures
    finally:
        store.stop()


def _beside(remote: list[Figure], local: list[Figure]) -> list[Figure]:
    """The S3 figures as `<scenario>-s3`, each beside its local twin's seconds."""
    by_name = {figure.scenario: figure for figure in local}
    beside: list[Figure] = []
    for figure in remote:
        twin = by_name.get(figure.scenario)
        local_seconds = twin.seconds if twin is not None else None
        note = "" if local_seconds is None else f"local {local_seconds:.2f} s"
        beside.append(
            BesideLocal(
                f"{figure.scenario}-s3",
                figure.records,
                figure.seconds,
                figure.megabytes,
                measured=figure,
                local_seconds=local_seconds,
                notes=note,
            )
        )
    return beside


def _failover(bench: Bench, s3: Settings, source: str, keys: int, progress: Progress) -> Figure:
    """Failover without and with a standby (bench/streaming.py `failover`), a stream over the
    same backlog with its checkpoint on local disk, then on S3."""
    points: dict[str, Point] = {}
    for where, settings in (("local", bench.settings), ("s3", s3)):
        scoped = dataclasses.replace(bench, settings=settings, stamp=bench.stamp + len(points))
        spec = bench_spec(f"bench_failover_{where}_{scoped.stamp}", source, scoped.pipelines)
        progress.console.print(f"failover, the checkpoint on {where}")
        points[where] = state_scale_point(
            scoped, spec, keys, 0.0, order_events(RESTART_EVENTS, keys, seed=17)
        )
    local, remote = points["local"], points["s3"]
    standby = remote.failover_standby_seconds
    met = standby is not None and standby <= FAILOVER_STANDBY_SECONDS
    return BesideLocal(
        "failover-standby-s3",
        remote.events,
        standby or 0.0,
        0.0,
        local_seconds=local.failover_standby_seconds,
        notes=(
            f"local {local.failover_standby_seconds or 0:.1f} s; without a standby "
            f"{remote.failover_cold_seconds or 0:.1f} s on S3, "
            f"{local.failover_cold_seconds or 0:.1f} s local"
        ),
        targets=[
            target(f"failover with a standby <= {FAILOVER_STANDBY_SECONDS:g} s", standby, met)
        ],
    )
