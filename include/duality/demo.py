"""`duality demo`: through Airflow on the stack `duality up` started, a skewed workload with bad
records is streamed, snapshotted, validated, published and repartitioned, then summed up; two
more pipelines are streamed and snapshotted side by side with it: `regional_sales` (a filter,
computed fields, hopping windows) and `tier_sales` (the same orders joined with a `customers`
table the demo fills); and, when the stack runs a schema registry (`duality up --schema-registry`,
as `make demo` starts it), `avro_sales` from orders written as Avro."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console

from duality import overview, skew, spec, workload
from duality.airflow_api import AirflowClient
from duality.config import Settings
from duality.errors import CheckFailed, LocalStackError, UsageError
from duality.kafka import client, offsets, records, topics
from duality.local.airflow import AIRFLOW_USER, LocalAirflow
from duality.stream import control

PIPELINE = "product_sales"
# The pipeline of issue #29 (a filter, computed fields, hopping windows), run beside the first;
# its workload's statuses are mostly the ones its filter keeps.
RICH_PIPELINE = "regional_sales"
RICH_VALUES = {"status": ["paid", "paid", "paid", "refunded"]}
# The pipeline of issue #47: the first pipeline's orders joined with a table of customers, by
# tier. The demo writes the rows of the first CUSTOMER_ROWS of the orders' 1,000 customers; the
# others have none, and the inner join counts their orders as unmatched.
JOIN_PIPELINE = "tier_sales"
CUSTOMER_ROWS = 950
CUSTOMER_VALUES = {
    "tier": ["gold"] + ["silver"] * 3 + ["bronze"] * 6,
    "region": ["north", "south", "east", "west"],
}
PIPELINES = (PIPELINE, RICH_PIPELINE, JOIN_PIPELINE)
# The pipeline of issue #50: orders in the Confluent wire format, their schema registered by the
# workload; run when the settings name a schema registry.
AVRO_PIPELINE = "avro_sales"
_CATCH_UP_TIMEOUT_S = 600.0
# After the committed offsets cover the topics, how long to wait for a heartbeat that says so
# (its counts are then the last batch's).
_HEARTBEAT_WAIT_S = 30.0


def run(
    settings: Settings, events: int, console: Console, *, seed: int | None = None
) -> dict[str, Any]:
    if events < 1:
        raise UsageError(f"--events must be at least 1, got {events}")
    client.ensure_reachable(settings)
    specs = {name: spec.find_spec(settings, name) for name in PIPELINES}
    pipeline, rich, joined = specs[PIPELINE], specs[RICH_PIPELINE], specs[JOIN_PIPELINE]
    # Its subject may not exist yet: the workload registers it, then the spec loads its columns.
    avro = None
    if settings.schema_registry_url:
        avro = spec.find_spec(settings, AVRO_PIPELINE, registry=False)
        if not avro.source.columns_known:  # its columns are its subject's: it must exist
            avro = spec.find_spec(settings, AVRO_PIPELINE)
    else:
        console.print(
            f"[yellow]{AVRO_PIPELINE} (an Avro source) is left out: no schema registry; "
            "`duality up --schema-registry` starts one (`make demo` does)[/]"
        )
    airflow = LocalAirflow(settings)
    if airflow.health() is None:
        raise LocalStackError(
            f"Airflow does not answer at {settings.airflow_url}: start the stack with `duality up`"
        )
    api = AirflowClient(settings.airflow_url, AIRFLOW_USER, airflow.password())
    moves = spec.load_repartition_config(settings).topics
    move = next((m for m in moves if m.source == pipeline.source.topic), None)
    if move is None:
        raise UsageError(
            f"{settings.repartition_config} has no entry for {pipeline.source.topic}: the demo "
            "repartitions the demo pipeline's source; add it there"
        )
    started = time.monotonic()
    result: dict[str, Any] = {
        "pipeline": PIPELINE,
        "airflow": settings.airflow_url,
        "pipelines_page": overview.page_url(settings.airflow_url),
    }

    def step(text: str) -> Callable[[str], None]:
        console.print(f"[bold]>[/] {text}")
        return lambda detail: status_line.update(f"{text}: {detail}")

    watched = [*specs.values(), *([avro] if avro is not None else [])]
    dead_before = {p.name: _records(settings, p.dlq_topic) for p in watched}
    with console.status("") as status_line:
        say = step(f"producing {events:,} orders with skewed products and bad records")
        report = workload.produce(
            settings,
            pipeline,
            events=events,
            keys=500,
            zipf=1.3,
            bad_fraction=0.02,
            seed=seed,
            progress=lambda done: say(f"{done:,} of {events:,}"),
        )
        result["produced"] = report.as_dict()
        say = step(f"producing {events:,} orders by region for {RICH_PIPELINE}")
        rich_report = workload.produce(
            settings,
            rich,
            events=events,
            keys=8,
            bad_fraction=0.02,
            seed=seed,
            values=RICH_VALUES,
            progress=lambda done: say(f"{done:,} of {events:,}"),
        )
        reports = {PIPELINE: report, RICH_PIPELINE: rich_report, JOIN_PIPELINE: report}
        if avro is not None:
            say = step(f"producing {events:,} orders as Avro for {AVRO_PIPELINE}")
            reports[AVRO_PIPELINE] = workload.produce(
                settings,
                avro,
                events=events,
                keys=200,
                bad_fraction=0.02,
                seed=seed,
                partitions=3,
                progress=lambda done: say(f"{done:,} of {events:,}"),
            )
            specs[AVRO_PIPELINE] = spec.find_spec(settings, AVRO_PIPELINE)
        assert joined.joined is not None
        say = step(
            f"writing {CUSTOMER_ROWS:,} customers to the compacted topic {joined.joined.topic} "
            f"that {JOIN_PIPELINE} joins {joined.source.topic} with"
        )
        table = workload.produce_table(
            settings, joined, rows=CUSTOMER_ROWS, values=CUSTOMER_VALUES, seed=seed
        )

        names = " and ".join([", ".join(list(specs)[:-1]), list(specs)[-1]])
        say = step(f"the supervisor DAGs start the streams of {names}")
        every = tuple(specs.values())
        _run_dags(api, {p.dag_id("stream"): {"action": "start"} for p in every}, say)
        stopped = [p for p in every if control.desired(settings, p) == "stopped"]  # by hand
        _run_dags(api, {p.dag_id("stream"): {"action": "start"} for p in stopped}, say)
        say = step("waiting for the streams to count every event")
        counted = {p.name: _wait_caught_up(settings, p, say) for p in every}

        say = step("the snapshot DAGs build, validate and publish Delta snapshots")
        dags = {p.name: p.dag_id("snapshot") for p in every}
        runs = _run_dags(api, {dag_id: {} for dag_id in dags.values()}, say)
        result["pipelines"] = {
            p.name: {
                "source": p.source.topic,
                "produced": reports[p.name].as_dict(),
                "stream": counted[p.name],
                "snapshot": _published(api, dags[p.name], runs[dags[p.name]]),
                "dead_letters": _records(settings, p.dlq_topic) - dead_before[p.name],
            }
            for p in every
        }
        result["pipelines"][JOIN_PIPELINE]["table"] = {
            "name": joined.joined.name,
            "topic": table.topic,
            "join": joined.joined.type,
            "rows": table.produced,
        }

        say = step(f"the repartition DAG checks {move.source} and copies it into {move.target}")
        runs = _run_dags(api, {"duality_repartition": {"topic": move.source}}, say)
        moved = _moved(api, runs["duality_repartition"], move.source)
        after = skew.analyse(settings, move.target)
        result["repartition"] = {
            "source": move.source,
            "target": move.target,
            "partitions": f"{topics.partition_count(settings, move.source)} -> {move.partitions}",
            "copied_this_run": moved["result"].get("copied", 0),
            "target_records": _records(settings, move.target),
            "skew_before": moved["skew"]["skew_size"],
            "skew_after": round(after.skew_size, 3),
            "plot": str(settings.reports / "skew" / f"{move.source}.png"),
        }
    result["dead_letters"] = result["pipelines"][PIPELINE]["dead_letters"]
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def _run_dags(
    client: AirflowClient, confs: dict[str, dict[str, Any]], say: Callable[[str], None]
) -> dict[str, str]:
    """Run DAGs side by side and wait for them all; returns each DAG's run id. A paused DAG is
    unpaused, and the run its schedule then makes at once is the one waited for (a manual run
    beside it would do the work twice); an unpaused one gets a manual run with its conf."""
    runs = {dag_id: _start_run(client, dag_id, conf, say) for dag_id, conf in confs.items()}
    for dag_id, run_id in runs.items():
        finished = client.wait_run(dag_id, run_id, progress=say)
        if finished["state"] != "success":
            failed = [
                t["task_id"]
                for t in client.task_instances(dag_id, run_id)
                if t.get("state") not in ("success", "skipped")
            ]
            raise CheckFailed(
                f"the run {run_id} of {dag_id} ended {finished['state']} (tasks {failed}); see "
                f"{client.url}/dags/{dag_id}"
            )
    return runs


def _start_run(
    client: AirflowClient, dag_id: str, conf: dict[str, Any], say: Callable[[str], None]
) -> str:
    dag = client.wait_for_dag(dag_id)
    if not dag.get("is_paused"):
        return client.trigger(dag_id, conf)
    known = {r["dag_run_id"] for r in client.runs(dag_id)}
    client.set_paused(dag_id, False)
    deadline = time.monotonic() + 120
    while True:
        fresh = [r["dag_run_id"] for r in client.runs(dag_id) if r["dag_run_id"] not in known]
        if fresh:
            return str(fresh[0])
        if time.monotonic() > deadline:
            raise LocalStackError(
                f"unpausing {dag_id} started no run within 120s; see {client.url}/dags/{dag_id}"
            )
        say(f"waiting for the scheduler to start {dag_id}")
        time.sleep(1)


def _wait_caught_up(
    settings: Settings, pipeline: spec.PipelineSpec, say: Callable[[str], None]
) -> dict[str, Any]:
    """Wait until the stream's committed offsets cover its source (and the table it joins),
    then, briefly, for a heartbeat that says so; what it counted."""
    deadline = time.monotonic() + _CATCH_UP_TIMEOUT_S
    while True:
        info = control.describe(settings, pipeline)
        behind = (info.lag or 0) + sum(t.lag or 0 for t in info.tables)
        if behind == 0:
            break
        if time.monotonic() > deadline:
            raise CheckFailed(
                f"the stream of {pipeline.name} is still {behind:,} records behind after "
                f"{_CATCH_UP_TIMEOUT_S:g}s; see {control.log_file(settings, pipeline)}"
            )
        say(f"{pipeline.name}: {behind:,} records to go")
        time.sleep(1)
    ends = offsets.end_offsets(settings, pipeline.source.topic)
    patience = time.monotonic() + _HEARTBEAT_WAIT_S
    while not _beat_covers(info.heartbeat, ends) and time.monotonic() < patience:
        say(f"{pipeline.name}: waiting for its heartbeat")
        time.sleep(1)
        info = control.describe(settings, pipeline)
    beat = info.heartbeat or {}
    counted: dict[str, Any] = {
        "source_records": sum(ends.values()),
        "keys": beat.get("state_rows"),
        "pid": info.pid,
    }
    if pipeline.joined is not None:
        counted["unmatched"] = beat.get("unmatched")
    return counted


def _beat_covers(beat: dict[str, Any] | None, ends: dict[int, int]) -> bool:
    """Whether a heartbeat's committed offsets (JSON: partitions as text) reach `ends`."""
    committed = (beat or {}).get("committed_offsets") or {}
    return all(int(committed.get(str(p), committed.get(p, 0))) >= end for p, end in ends.items())


def _published(client: AirflowClient, dag_id: str, run_id: str) -> dict[str, Any]:
    """What the snapshot DAG published: from this run, or the scheduled run that did the work
    first (this one then had nothing new and skipped)."""
    for candidate in [run_id, *(r["dag_run_id"] for r in client.runs(dag_id))]:
        states = {t["task_id"]: t.get("state") for t in client.task_instances(dag_id, candidate)}
        if states.get("publish") == "success":
            built = client.xcom(dag_id, candidate, "snapshot")
            report = client.xcom(dag_id, candidate, "validate")
            published = client.xcom(dag_id, candidate, "publish")
            return {
                "run_id": candidate,
                "version": published["published_version"],
                "rows": built["rows"],
                "mode": built["mode"],
                "validation": "passed" if report["success"] else "failed",
                "checks": report["checks"],
                "report": report["json_report"],
                "data_docs": report["data_docs"],
            }
    raise CheckFailed(f"no run of {dag_id} has published a snapshot; see {client.url}")


def _records(settings: Settings, topic: str) -> int:
    """Records in a topic, read_committed (offsets would count transaction markers too)."""
    if not topics.topic_exists(settings, topic):
        return 0
    return sum(1 for _ in records.read_to_end(settings, topic))


def _moved(client: AirflowClient, run_id: str, source: str) -> dict[str, Any]:
    """The repartition DAG's result for `source` (one mapped task per configured topic)."""
    for task in client.task_instances("duality_repartition", run_id):
        if task["task_id"] == "repartition":
            found = client.xcom("duality_repartition", run_id, "repartition", task["map_index"])
            if found and found.get("source") == source:
                return dict(found)
    raise CheckFailed(f"the run {run_id} of duality_repartition did not copy {source}")
