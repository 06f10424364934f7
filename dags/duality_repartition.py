"""`duality_repartition`: daily, checks the hot topics of DUALITY_REPARTITION_CONFIG for skew and
copies their new records, exactly once, into the repartitioned topics (DESIGN §9).

Trigger it by hand to do one topic now: `topic` (a configured one, or any topic with
`partitions`), `partitions`, `strategy` and `dry_run` (check and say what would be copied).
Parsing reads the YAML config and nothing else: no broker, no Spark.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Param, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from duality_airflow.hooks import execution_timeout
from duality_airflow.operators import RepartitionOperator

from duality.config import Settings
from duality.spec import load_repartition_config


def _configured() -> list[dict[str, Any]]:
    return [t.model_dump() for t in load_repartition_config(Settings.from_env()).topics]


def select_moves(configured: list[dict[str, Any]], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The copies this run makes: every configured topic, or the one the person asked for."""
    topic = (params.get("topic") or "").strip()
    strategy = params.get("strategy") or "configured"
    partitions = params.get("partitions")
    moves = [dict(t) for t in configured if not topic or t["source"] == topic]
    if topic and not moves:
        if not partitions:
            raise AirflowFailException(
                f"topic {topic!r} is not in the repartition config: give `partitions` (and a "
                "strategy), or add it to DUALITY_REPARTITION_CONFIG"
            )
        chosen = "key-hash" if strategy == "configured" else strategy
        moves = [
            {
                "source": topic,
                "target": f"{topic}-{partitions}p",
                "partitions": partitions,
                "strategy": chosen,
                "hot_keys": "auto" if chosen == "salted" else None,
                "salts": None,
            }
        ]
    for move in moves:
        if partitions:
            move["partitions"] = int(partitions)
        if strategy != "configured":
            move["strategy"] = strategy
            if strategy == "key-hash":
                move["hot_keys"] = move["salts"] = None
            elif not move.get("hot_keys"):
                move["hot_keys"] = "auto"
        move["dry_run"] = bool(params.get("dry_run"))
    if not moves:
        raise AirflowSkipException(
            "no topic to repartition: DUALITY_REPARTITION_CONFIG lists none; add one there or "
            "name a `topic` when triggering"
        )
    return moves


with DAG(
    dag_id="duality_repartition",
    description="skew check and exactly-once copy of hot topics into repartitioned topics",
    doc_md=__doc__,
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(hours=6),
    default_args={"owner": "duality", "retries": 1, "retry_delay": timedelta(minutes=2)},
    tags=["duality", "repartition"],
    params={
        "topic": Param(
            "",
            type="string",
            title="Topic",
            description="Only this source topic (empty: every configured topic). "
            f"Configured: {', '.join(t['source'] for t in _configured()) or 'none'}.",
        ),
        "partitions": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            title="Partitions",
            description="Partitions of the target (empty: as configured).",
        ),
        "strategy": Param(
            "configured",
            type="string",
            enum=["configured", "key-hash", "salted"],
            title="Strategy",
            description="key-hash keeps each key in one partition; salted spreads hot keys.",
        ),
        "dry_run": Param(
            False,
            type="boolean",
            title="Dry run",
            description="Check skew and the plan; copy nothing.",
        ),
    },
) as dag:

    @task(execution_timeout=execution_timeout("repartition"))
    def select() -> list[dict[str, Any]]:
        context = get_current_context()
        return select_moves(_configured(), dict(context["params"]))

    RepartitionOperator.partial(
        task_id="repartition", execution_timeout=execution_timeout("repartition")
    ).expand(move=select())
