"""Settings inside Airflow: `DUALITY_*` from the environment, then the connections
`kafka_default` and `spark_default` take over the Kafka and Spark fields (DESIGN §4).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from duality.config import Settings

KAFKA_CONN_ID = "kafka_default"
SPARK_CONN_ID = "spark_default"

# librdkafka names in the Kafka connection's extra -> Settings fields.
_KAFKA_FIELDS = {
    "bootstrap.servers": "bootstrap_servers",
    "security.protocol": "security_protocol",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.username": "sasl_username",
    "sasl.password": "sasl_password",
}


def spark_master(host: str | None, port: int | None) -> str | None:
    """The Spark master URL a `spark` connection names (host `local[2]`, or `spark://h` + port)."""
    if not host:
        return None
    host = host.strip()
    if host.startswith("local") or port in (None, 0) or host.rsplit(":", 1)[-1].isdigit():
        return host
    return f"{host}:{port}"


def overrides(
    kafka_extra: dict[str, Any] | None, spark: tuple[str | None, int | None] | None
) -> dict[str, Any]:
    """The Settings fields that the two connections set (pure: unit tests and compose tests)."""
    changes: dict[str, Any] = {}
    for name, field in _KAFKA_FIELDS.items():
        value = (kafka_extra or {}).get(name)
        if value not in (None, ""):
            changes[field] = str(value)
    if spark is not None:
        master = spark_master(*spark)
        if master:
            changes["spark_master"] = master
    return changes


def settings(kafka_conn_id: str = KAFKA_CONN_ID, spark_conn_id: str = SPARK_CONN_ID) -> Settings:
    """`Settings.from_env()` with the Airflow connections applied (missing ones are skipped).

    Reading the Kafka connection's extra registers its `sasl.password` with Airflow's secrets
    masker, so a task log shows it as `***`.
    """
    from airflow.sdk import BaseHook

    def connection(conn_id: str) -> Any:
        try:
            return BaseHook.get_connection(conn_id)
        except Exception:  # not defined: the environment's settings stand
            return None

    kafka_conn, spark_conn = connection(kafka_conn_id), connection(spark_conn_id)
    return _with_connections(
        kafka_conn.extra_dejson if kafka_conn is not None else None, spark_conn
    )


async def asettings(
    kafka_conn_id: str = KAFKA_CONN_ID, spark_conn_id: str = SPARK_CONN_ID
) -> Settings:
    """`settings()` for the triggerer's event loop (the masker is told without blocking it)."""
    from airflow.sdk import BaseHook

    async def connection(conn_id: str) -> Any:
        try:
            return await BaseHook.aget_connection(conn_id)
        except Exception:  # not defined: the environment's settings stand
            return None

    kafka_conn, spark_conn = await connection(kafka_conn_id), await connection(spark_conn_id)
    return _with_connections(
        await kafka_conn.aextra_dejson() if kafka_conn is not None else None, spark_conn
    )


def _with_connections(kafka_extra: dict[str, Any] | None, spark_conn: Any) -> Settings:
    from duality.config import Settings

    changes = overrides(
        kafka_extra, (spark_conn.host, spark_conn.port) if spark_conn is not None else None
    )
    return Settings.from_env().replace(**changes)


def execution_timeout(kind: str) -> timedelta:
    """A task kind's execution timeout (`<kind>_timeout_s`), from the environment's settings:
    DAG files read it when they are parsed, so no connection is looked up then."""
    from duality.config import Settings

    return timedelta(seconds=getattr(Settings.from_env(), f"{kind}_timeout_s"))
