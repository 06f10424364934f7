"""The local stack's commands: `up`, `down`, `status`, `lag` and `demo`."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from duality.arguments import at_least_one, not_negative
from duality.cli.output import table
from duality.cli.parsing import Commands
from duality.config import AIRFLOW_DBS, Settings
from duality.kafka import offsets
from duality.local import stack
from duality.local.broker import BrokerStatus


def add_commands(commands: Commands) -> None:
    up = commands.add("up", _cmd_up, "start the local stack (idempotent)")
    up.add_argument(
        "--brokers", type=at_least_one, help="Kafka brokers, a KRaft quorum from 3 (default 1)"
    )
    up.add_argument(
        "--spark-workers",
        type=not_negative,
        help="start a Spark standalone master and this many workers (default 0: local mode)",
    )
    up.add_argument(
        "--sasl",
        action="store_true",
        help="clients log in with SCRAM-SHA-512 as DUALITY_SASL_USERNAME with "
        "DUALITY_SASL_PASSWORD (DUALITY_SECURITY_PROTOCOL=SASL_PLAINTEXT, "
        "DUALITY_SASL_MECHANISM=SCRAM-SHA-512)",
    )
    up.add_argument(
        "--monitoring",
        action="store_true",
        help="also start Prometheus (scraping the streams, Spark and the Pushgateway, with the "
        "alert rules of monitoring/alerts.yml) and the Pushgateway the batch steps push to",
    )
    up.add_argument(
        "--schema-registry",
        action="store_true",
        help="also start a schema registry (Apicurio Registry 3.0.9, its Confluent API) that "
        "Avro sources read their schemas from; sets DUALITY_SCHEMA_REGISTRY_URL",
    )
    up.add_argument(
        "--object-store",
        action="store_true",
        help="also start an S3 server (SeaweedFS, built once into the jar cache) with its data "
        "under the local folder, an access key and its bucket (DUALITY_S3_BUCKET); sets "
        "DUALITY_S3_ENDPOINT, DUALITY_S3_ACCESS_KEY and DUALITY_S3_SECRET_KEY_FILE",
    )
    up.add_argument(
        "--airflow-db",
        choices=AIRFLOW_DBS,
        help="Airflow's metadata database: standalone on SQLite (default), or its components "
        "as separate processes on a local PostgreSQL",
    )
    commands.add("down", _cmd_down, "stop the local stack")
    commands.add("status", _cmd_status, "report the local stack")
    lag = commands.add("lag", _cmd_lag, "consumer lag per group, topic and partition")
    lag.add_argument("--group", action="append", help="only this consumer group (repeatable)")

    demo = commands.add("demo", _cmd_demo, "the whole story through Airflow on the local stack")
    demo.add_argument("--events", type=int, default=50_000, help="orders to produce")
    demo.add_argument("--seed", type=int, help="random seed, for a repeatable workload")


def _cmd_up(settings: Settings, args: Namespace, console: Console) -> stack.StackUp:
    with console.status("starting the local stack") as spinner:
        started = stack.up(
            settings,
            brokers=args.brokers,
            spark_workers=args.spark_workers,
            airflow_db=args.airflow_db,
            sasl=args.sasl,
            monitoring=args.monitoring,
            schema_registry=args.schema_registry,
            object_store=args.object_store,
            progress=spinner.update,
        )
    if args.json:
        return started
    broker = started.broker
    if isinstance(broker, BrokerStatus):
        verb = "already running" if broker.already_running else "started"
        console.print(
            f"Kafka broker {verb} at [bold]{broker.bootstrap_servers}[/] (pid {broker.pid}); "
            f"logs in {broker.log}"
        )
    else:
        console.print(
            f"Kafka cluster of {len(broker.nodes)} brokers running at "
            f"[bold]{broker.bootstrap_servers}[/]"
        )
    spark = started.spark
    if spark is not None:
        console.print(
            f"Spark master at [bold]{spark.master_url}[/] with {len(spark.workers)} workers "
            f"(UI {spark.master_ui}); logs in {spark.root}"
        )
    batch = started.batch
    verb = "already running" if batch.already_running else "started"
    console.print(
        f"batch server {verb} at [bold]{batch.address}[/] (pid {batch.pid}, Spark "
        f"{batch.master}): the batch steps run in its warm Spark; log {batch.log}"
    )
    serving = started.serving
    if serving is not None:
        verb = "already running" if serving.already_running else "started"
        console.print(
            f"replicas {verb} at [bold]{serving.url}[/] (pid {serving.pid}) for "
            f"{', '.join(serving.pipelines) or 'no pipeline'}: `duality query` asks them; "
            f"log {serving.log}"
        )
    watching = started.monitoring
    if watching is not None:
        verb = "already running" if watching.already_running else "started"
        console.print(
            f"Prometheus {verb} at [bold]http://{watching.prometheus.address}[/] (pid "
            f"{watching.prometheus.pid}; config {watching.config}, alert rules {watching.rules}), "
            f"its Pushgateway at [bold]{watching.pushgateway.address}[/] (pid "
            f"{watching.pushgateway.pid}); logs in {watching.prometheus.log.parent.parent}"
        )
    registry = started.schema_registry
    if registry is not None:
        verb = "already running" if registry.already_running else "started"
        console.print(
            f"schema registry {verb} at [bold]{registry.url}[/] (pid {registry.pid}; Apicurio "
            f"Registry, schemas kept in {registry.log.parent}); log {registry.log}"
        )
    store = started.object_store
    if store is not None:
        verb = "already running" if store.already_running else "started"
        console.print(
            f"S3 server {verb} at [bold]{store.endpoint}[/] (pid {store.pid}; SeaweedFS, bucket "
            f"[bold]{store.bucket}[/], data in {store.log.parent / 'data'}); log {store.log}"
        )
    web = started.airflow
    verb = "already running" if web.already_running else "started"
    console.print(
        f"Airflow {verb} at [bold]{web.url}[/] (pid {web.pid}); log in as [bold]{web.user}[/] "
        f"with password [bold]{web.password}[/] (kept in {web.password_file}); logs in {web.log}"
    )
    return started


def _cmd_down(settings: Settings, args: Namespace, console: Console) -> stack.StackDown:
    stopped = stack.down(settings)
    if args.json:
        return stopped
    for stream in stopped.streams:
        console.print(f"stream {stream.pipeline} stopped (pid {stream.pid})")
    airflow = stopped.airflow
    console.print(
        f"Airflow stopped (pid {airflow.pid})" if airflow.was_running else "Airflow was not running"
    )
    if stopped.serving is not None and stopped.serving.was_running:
        console.print(f"replicas stopped (pid {stopped.serving.pid})")
    if stopped.batch.was_running:
        console.print(f"batch server stopped (pid {stopped.batch.pid})")
    for name, pid in stopped.monitoring.pids.items():
        console.print(f"{name} stopped (pid {pid})")
    if stopped.schema_registry is not None:
        console.print(f"schema registry stopped (pid {stopped.schema_registry})")
    if stopped.object_store is not None:
        console.print(f"S3 server stopped (pid {stopped.object_store})")
    if stopped.spark.was_running:
        console.print(f"Spark master and workers stopped (pids {stopped.spark.pids})")
    for node in stopped.brokers:
        console.print(f"Kafka {node.node} stopped (pid {node.pid})")
    if not stopped.brokers:
        console.print("Kafka was not running")
    return stopped


def _cmd_status(settings: Settings, args: Namespace, console: Console) -> stack.StackStatus:
    report = stack.status(settings)
    if not args.json:
        _print_status(report, console)
    stack.require_sound(report)
    return report


def _print_status(report: stack.StackStatus, console: Console) -> None:
    broker, spark, airflow = report.broker, report.spark, report.airflow
    if report.topology.brokers == 1:
        nodes = [("kafka", broker.state, broker.bootstrap_servers, broker.pid, broker.reachable)]
    else:
        nodes = [
            (f"kafka-{n.node_id}", n.state, n.bootstrap_servers, n.pid, n.reachable)
            for n in broker.nodes
        ]
    rows = [
        (name, state, address, str(pid or "-"), "yes" if reachable else "no", str(node.log))
        for (name, state, address, pid, reachable), node in zip(nodes, broker.nodes, strict=True)
    ]
    if spark is not None:
        alive = f"{sum(w.registered for w in spark.workers)}/{len(spark.workers)} workers"
        pid = str(spark.master_pid or "-")
        rows.append(("spark", spark.state, spark.master_url or "-", pid, alive, str(spark.log)))
    batch = report.batch
    pid = str(batch.pid or "-")
    steps = "" if batch.steps is None else f"{len(batch.steps)} steps running"
    rows.append(("batch-server", batch.state, batch.address or "-", pid, steps, str(batch.log)))
    serving = report.serving
    if serving is not None:
        healthy = "yes" if serving.healthy else "no"
        pid = str(serving.pid or "-")
        rows.append(("serve", serving.state, serving.url or "-", pid, healthy, str(serving.log)))
    if report.monitoring is not None:
        for name, program in (
            ("prometheus", report.monitoring.prometheus),
            ("pushgateway", report.monitoring.pushgateway),
        ):
            ready = "yes" if program.ready else "no"
            pid = str(program.pid or "-")
            rows.append((name, program.state, program.address or "-", pid, ready, str(program.log)))
    store = report.object_store
    if store is not None:
        ready = "yes" if store.ready else "no"
        pid = str(store.pid or "-")
        rows.append(("s3", store.state, store.endpoint or "-", pid, ready, str(store.log)))
    for name, component in airflow.components.items():
        rows.append(
            (
                "airflow" if name == "standalone" else f"airflow {name}",
                "running" if component.pid else "stopped",
                airflow.url if name in ("standalone", "api-server") else "",
                str(component.pid or "-"),
                "yes" if airflow.healthy else "no",
                str(component.log),
            )
        )
    database = airflow.postgres
    if database is not None:
        address = f"127.0.0.1:{database.port}" if database.port else "-"
        pid = str(database.pid or "-")
        rows.append(("postgres", database.state, address, pid, "", str(database.log)))
    columns = ("service", "state", "address", "pid", "reachable", "log")
    console.print(table("duality local stack", columns, rows))
    durable = broker.durability
    if durable is None:
        return
    console.print(
        f"new topics: replication factor {durable.replication_factor}, "
        f"min.insync.replicas {durable.min_insync_replicas} "
        f"({durable.brokers} brokers; chosen by {durable.chosen_by})"
    )
    header = ("topic", "replicas", "min.insync.replicas", "below min ISR now")
    topics = [
        (
            t.topic + (" [red](fewer than configured)[/red]" if t.below_configured else ""),
            str(t.replication_factor),
            str(t.min_insync_replicas),
            str(t.below_min_isr),
        )
        for t in broker.topics
    ]
    console.print(table("duality's topics", header, topics))


def _cmd_lag(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    rows = offsets.lag(settings, args.group or None)
    result = [{**dataclasses.asdict(r), "lag": r.lag} for r in rows]
    if not args.json:
        columns = ("group", "topic", "partition", "committed", "end", "lag")
        cells = [list(map(str, row.values())) for row in result]
        shown = table(f"consumer lag on {settings.bootstrap_servers}", columns, cells, columns[1:])
        console.print(shown if rows else "no consumer group has committed offsets")
    return {"lag": result}


def _cmd_demo(settings: Settings, args: Namespace, console: Console) -> dict[str, Any]:
    from duality import demo

    result = demo.run(settings, args.events, console, seed=args.seed)
    if not args.json:
        console.print(demo_summary(result))
    return result


def demo_summary(result: Mapping[str, Any]) -> Table:
    """`duality demo`'s summary: every pipeline it ran, the repartition, where to look."""
    moved = result["repartition"]
    summary = Table(
        title=f"duality demo: {len(result['pipelines'])} pipelines in {result['seconds']:.0f}s"
    )
    summary.add_column("what")
    summary.add_column("result", overflow="fold")
    writes = {}  # topic -> what went to it (two pipelines may read one topic)
    for ran in result["pipelines"].values():
        made = ran["produced"]
        bad = sum(made["bad"].values())
        writes[made["topic"]] = f"{made['produced']:,} to {made['topic']} ({bad:,} bad)"
        if "table" in ran:
            joined = ran["table"]
            writes[joined["topic"]] = f"{joined['rows']:,} table rows to {joined['topic']}"
    summary.add_row("events produced", "; ".join(writes.values()))
    summary.add_row(
        "skew (max/mean)",
        f"{moved['skew_before']:.2f} in {moved['source']} -> {moved['skew_after']:.2f} in "
        f"{moved['target']} (partitions {moved['partitions']}; it holds "
        f"{moved['target_records']:,} records, {moved['copied_this_run']:,} copied by this "
        "run)",
    )
    for name, ran in result["pipelines"].items():
        stream, published = ran["stream"], ran["snapshot"]
        keys = stream.get("keys")
        text = (
            f"{stream['source_records']:,} records of {ran['source']}"
            + (f" into {keys:,} rows of state" if isinstance(keys, int) else "")
            + f", {ran['dead_letters']:,} dead-lettered"
        )
        joined = ran.get("table")
        if joined is not None:
            text += f"; {joined['join']} join with table {joined['name']} ({joined['topic']})"
            if isinstance(stream.get("unmatched"), int):
                text += f", {stream['unmatched']:,} events without a row"
        text += (
            f"\nsnapshot version {published['version']} published ({published['rows']:,} rows, "
            f"{published['mode']}); validation {published['validation']} "
            f"({published['checks']} checks); Data Docs {published['data_docs']}"
        )
        summary.add_row(name, text)
    summary.add_row("skew plot", moved["plot"])
    summary.add_row("Airflow", f"{result['airflow']} (DAGs tagged duality)")
    summary.add_row("pipelines page", result["pipelines_page"])
    return summary
