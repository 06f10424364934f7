"""Three DAGs per pipeline spec in DUALITY_PIPELINES (DESIGN §9):

- `duality_<name>_stream`: the stream supervisor, every minute. It starts the stream when it
  should run and does not, restarts it when it is dead or stalled (with backoff), and never
  starts a second copy. Trigger it by hand with `action` start, stop, restart or rescale, and
  `replicas` 2 for a warm standby. Each run also checks the replicas of the tables
  (`DUALITY_REPLICAS`, docs/serving.md) and starts this host's again when it does not answer.
- `duality_<name>_snapshot`: incremental snapshot -> validate -> publish, on the spec's
  `snapshot.schedule` (hourly by default). Publishing updates the snapshot's Asset.
- `duality_<name>_reset`: the application reset tool, by hand only, after a confirmation.

Parsing reads the YAML specs and nothing else: no broker, no Spark, no schema registry.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Asset, Param
from duality_airflow.operators import (
    PublishOperator,
    ResetOperator,
    SnapshotOperator,
    SuperviseStreamOperator,
    ValidateOperator,
)
from duality_airflow.sensors import StreamRunningSensor

from duality.config import Settings
from duality.spec import PipelineSpec, load_spec, spec_files
from duality.storage import ObjectPath

START = datetime(2026, 1, 1)
DEFAULT_ARGS = {
    "owner": "duality",
    "retries": 1,
    "retry_delay": timedelta(minutes=1),
}


def stream_dag(spec: PipelineSpec) -> DAG:
    with DAG(
        dag_id=spec.dag_id("stream"),
        description=f"keeps the stream of {spec.name} running ({spec.source.topic} -> "
        f"{spec.changelog_topic})",
        doc_md=__doc__,
        schedule=timedelta(minutes=1),
        start_date=START,
        catchup=False,
        max_active_runs=1,
        dagrun_timeout=timedelta(minutes=10),
        default_args={**DEFAULT_ARGS, "retries": 0},  # the next minute's run is the retry
        tags=["duality", "stream", spec.name],
        params={
            "action": Param(
                "ensure",
                type="string",
                enum=["ensure", "start", "stop", "restart", "rescale"],
                title="Action",
                description="ensure: start it if it should run and does not, restart it when "
                "stalled (what the schedule does). start / stop / restart: do it now; a "
                "stopped stream stays stopped until started. rescale: rebuild its state in "
                "the partitions its spec asks for (`parallelism`) from the changelog; refused "
                "while a snapshot of the pipeline runs.",
            ),
            "replicas": Param(
                None,
                type=["null", "integer"],
                enum=[None, 1, 2],
                title="Drivers on this host",
                description="2: keep a warm standby beside the stream, which takes over within "
                "seconds when the active driver dies; 1: no standby. Kept for the runs that "
                "follow; empty: as before.",
            ),
            "partitions": Param(
                None,
                type=["null", "integer"],
                minimum=1,
                title="State partitions (rescale)",
                description="With rescale: the number of state partitions, which must be the "
                "spec's `parallelism` (else DUALITY_STREAM_PARTITIONS); empty: that number.",
            ),
        },
    ) as dag:
        supervise = SuperviseStreamOperator(
            task_id="supervise", pipeline=spec.name, action="{{ params.action }}"
        )
        running = StreamRunningSensor(task_id="wait_running", pipeline=spec.name)
        supervise >> running
    return dag


def snapshot_dag(spec: PipelineSpec, settings: Settings) -> DAG:
    table = spec.snapshot_path(settings)
    asset = Asset(
        name=f"duality_{spec.name}_snapshot",
        # s3://bucket/key for a table on object storage (Airflow's name for the scheme).
        uri=f"s3://{table.bucket}/{table.key}" if isinstance(table, ObjectPath) else table.as_uri(),
        group="duality",
    )
    version = "{{ ti.xcom_pull(task_ids='snapshot')['version'] }}"
    with DAG(
        dag_id=spec.dag_id("snapshot"),
        description=f"Delta snapshot of {spec.name}: build -> validate -> publish",
        doc_md=__doc__,
        schedule=spec.snapshot.schedule,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        dagrun_timeout=timedelta(hours=1),
        default_args=DEFAULT_ARGS,
        tags=["duality", "snapshot", spec.name],
    ) as dag:
        build = SnapshotOperator(task_id="snapshot", pipeline=spec.name)
        check = ValidateOperator(task_id="validate", pipeline=spec.name, version=version, retries=0)
        publish = PublishOperator(
            task_id="publish", pipeline=spec.name, version=version, outlets=[asset]
        )
        build >> check >> publish
    return dag


def reset_dag(spec: PipelineSpec) -> DAG:
    with DAG(
        dag_id=spec.dag_id("reset"),
        description=f"reset {spec.name} to reprocess {spec.source.topic} (manual only)",
        doc_md=__doc__,
        schedule=None,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        default_args={**DEFAULT_ARGS, "retries": 0},
        tags=["duality", "reset", spec.name],
        params={
            "confirm": Param(
                "",
                type="string",
                title="Confirm",
                description=f"Type the pipeline name, {spec.name}, to reset it: the stream "
                "stops, its changelog is emptied and it reprocesses the source.",
            ),
            "to_datetime": Param(
                None,
                type=["null", "string"],
                format="date-time",
                title="Reprocess from",
                description="Reprocess the source from this time; empty: from the beginning.",
            ),
            "dry_run": Param(
                False, type="boolean", title="Dry run", description="Only show the plan."
            ),
        },
    ) as dag:
        ResetOperator(task_id="reset", pipeline=spec.name)
    return dag


def _build() -> dict[str, DAG]:
    settings = Settings.from_env()
    dags: dict[str, DAG] = {}
    for path in spec_files(settings):
        # A bad spec is an import error naming the file and field. An Avro source's registry is
        # not asked: the DAGs need no columns, and a registry that is down must not fail the
        # import of every pipeline's DAGs (the stream's task asks it, and names the setting).
        spec = load_spec(path, registry=False)
        for dag in (stream_dag(spec), snapshot_dag(spec, settings), reset_dag(spec)):
            dags[dag.dag_id] = dag
    return dags


globals().update(_build())
