"""Changing a stream's state partitions (`duality stream rescale`): stop it, rebuild its state
in the new number from the changelog (the path a lost checkpoint takes), resume the source at
its committed offsets (docs/streams.md#state-partitions)."""

from __future__ import annotations

import dataclasses
from typing import Any

from duality import storage
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, offsets
from duality.spec import PipelineSpec
from duality.stream import control, seeding


@dataclasses.dataclass
class RescalePlan:
    pipeline: str
    partitions_before: int
    partitions: int
    checkpoint: str
    stop_pid: int | None  # the running stream's supervisor, restarted afterwards
    job_args: list[str]  # its options, which the restarted stream gets again
    standby_pid: int | None  # this host's standby, stopped first and restarted last
    standby_args: list[str]  # its options
    changelog_topic: str
    committed: dict[int, int]  # the source offsets the stream resumes at
    table_topic: str | None = None  # the pipeline's copy of its joined table

    def steps(self) -> list[str]:
        if self.partitions == self.partitions_before:
            return []
        steps = []
        if self.standby_pid is not None:
            steps.append(f"stop this host's standby (pid {self.standby_pid})")
        if self.stop_pid is not None:
            steps.append(f"stop the running stream (pid {self.stop_pid}); its last batch commits")
        steps.append(
            f"delete the checkpoint {self.checkpoint} ({self.partitions_before} state partitions)"
        )
        steps.append(
            f"rebuild the state in {self.partitions} partitions from {self.changelog_topic} "
            "when the stream starts (the changelog is read, not written)"
        )
        if self.table_topic is not None:
            steps.append(f"restore the joined table's rows from {self.table_topic}")
        offsets = ", ".join(f"{p}:{o}" for p, o in sorted(self.committed.items())) or "none yet"
        steps.append(f"resume the source at its committed offsets ({offsets})")
        if self.stop_pid is not None:
            steps.append("start the stream again")
        if self.standby_pid is not None:
            steps.append("start the standby again")
        return steps

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "steps": self.steps()}


def plan(settings: Settings, spec: PipelineSpec, partitions: int | None) -> RescalePlan:
    """What a rescale to `partitions` (default: what the spec and settings ask for) would do;
    a number the next start would refuse, or no checkpoint, is a usage error."""
    wanted = seeding.state_partitions(settings, spec)
    if partitions is not None and partitions != wanted:
        raise UsageError(
            f"pipeline {spec.name} asks for {wanted} state partitions (its spec's `parallelism`, "
            f"else DUALITY_STREAM_PARTITIONS), so a stream rescaled to {partitions} would not "
            f"start: set `parallelism: {partitions}` in its spec first"
        )
    checkpoint = seeding.checkpoint_dir(settings, spec)
    before = seeding.checkpoint_partitions(checkpoint)
    if before is None:
        raise UsageError(
            f"pipeline {spec.name} has no checkpoint at {checkpoint}: there is no state to "
            f"rescale; its next start runs with {wanted} state partitions"
        )
    client.ensure_reachable(settings)
    pid = control.running_pid(settings, spec)
    standby = control.running_pid(settings, spec, standby=True)
    committed = offsets.committed_offsets(settings, spec.consumer_group, spec.source.topic)
    return RescalePlan(
        pipeline=spec.name,
        partitions_before=before,
        partitions=wanted,
        checkpoint=str(checkpoint),
        stop_pid=pid,
        job_args=control.stream_options(pid) if pid is not None else [],
        standby_pid=standby,
        standby_args=control.stream_options(standby) if standby is not None else [],
        changelog_topic=spec.changelog_topic,
        committed={p: offset for p, (offset, _) in committed.items()},
        table_topic=spec.table_topic if spec.joined is not None else None,
    )


def execute(settings: Settings, spec: PipelineSpec, rescale: RescalePlan) -> None:
    """Carry out `rescale`. The supervisor (Airflow's too) does not start the stream meanwhile;
    a stream that ran is started again and waited for."""
    if not rescale.steps():
        return
    with control.held(settings, spec):
        if rescale.stop_pid is not None or control.running_pid(settings, spec) is not None:
            control.stop(settings, spec, hold=False)
        # The changelog and the committed offsets were written in one transaction per batch:
        # without the checkpoint the driver seeds the state from the one and resumes at the
        # other, in the new number of partitions.
        storage.remove_tree(settings.location(rescale.checkpoint))
    if rescale.stop_pid is not None:
        control.start(settings, spec, job_args=rescale.job_args)
    if rescale.standby_pid is not None:
        control.start(settings, spec, job_args=rescale.standby_args, wait=False)
