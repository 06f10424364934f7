"""The hook of duality's tasks: their settings (`DUALITY_*` from the environment, the connections
`kafka_default` and `spark_default` taking over the Kafka and Spark fields, DESIGN §4) and the
`duality ... --json` child process a task runs (docs/decisions/0009-airflow-task-processes.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowNotFoundException,
)

from duality.process import die_with_parent, group_alive, stop_group

if TYPE_CHECKING:
    from duality.config import Settings

KAFKA_CONN_ID = "kafka_default"
SPARK_CONN_ID = "spark_default"
# Its password is the bearer token of the replicas' API (DUALITY_SERVE_TOKEN).
SERVE_CONN_ID = "duality_serve"
# An Avro source's schema registry: its URL, basic-auth login and password
# (DUALITY_SCHEMA_REGISTRY_URL, _USER, _PASSWORD; docs/streams.md#formats).
REGISTRY_CONN_ID = "duality_schema_registry"
# The object store, as Airflow's Amazon provider names its connection: the login is the access
# key, the password its secret, the extra's `endpoint_url` (or the host) the S3 API's URL and
# its `region_name` the region (DUALITY_S3_*; docs/operations.md "Object storage").
AWS_CONN_ID = "aws_default"

# librdkafka names in the Kafka connection's extra -> Settings fields.
_KAFKA_FIELDS = {
    "bootstrap.servers": "bootstrap_servers",
    "security.protocol": "security_protocol",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.username": "sasl_username",
    "sasl.password": "sasl_password",
}


class DualityHook(BaseHook):
    """Resolves a task's settings once, from the environment with the two connections applied (a
    connection that is not defined leaves the environment's fields; one that cannot be read
    fails), and runs `duality` commands with them: each in a process group of its own that dies
    with the task, ended as a whole by `kill` (the operators' `on_kill`) or when the run is
    interrupted (an execution timeout), SIGTERM first and SIGKILL after `kill_grace_s`.

    Example::

        hook = DualityHook()
        result = hook.run(["snapshot", "product_sales"])
    """

    def __init__(self, kafka_conn_id: str = KAFKA_CONN_ID, spark_conn_id: str = SPARK_CONN_ID):
        super().__init__()
        self.kafka_conn_id = kafka_conn_id
        self.spark_conn_id = spark_conn_id
        self._settings: Settings | None = None
        self._process: subprocess.Popen[str] | None = None
        self._shown = ""

    def settings(self) -> Settings:
        """The settings; reading the Kafka connection's extra registers its `sasl.password` with
        Airflow's secrets masker, so a task log shows it as `***`, as reading the Spark
        connection does its password (the batch server's secret), `duality_serve` its
        password (the replicas' bearer token), `duality_schema_registry` its password (and
        the basic-auth header made of it) and `aws_default` its password (the object store's
        secret key). A secret from the environment or its file is registered too."""
        if self._settings is None:
            kafka = self._connection(self.kafka_conn_id)
            spark = self._connection(self.spark_conn_id)
            serve = self._connection(SERVE_CONN_ID)
            registry = self._connection(REGISTRY_CONN_ID)
            aws = self._connection(AWS_CONN_ID)
            extra = kafka.extra_dejson if kafka is not None else None
            aws_extra = aws.extra_dejson if aws is not None else None
            self._settings = _with_connections(extra, spark, serve, registry, aws, aws_extra)
            from airflow.sdk.log import mask_secret

            for secret in _secrets(self._settings):
                mask_secret(secret)
        return self._settings

    async def asettings(self) -> Settings:
        """`settings()` for the triggerer's event loop (the masker is told without blocking it)."""
        if self._settings is None:
            kafka = await self._aconnection(self.kafka_conn_id)
            spark = await self._aconnection(self.spark_conn_id)
            serve = await self._aconnection(SERVE_CONN_ID)
            registry = await self._aconnection(REGISTRY_CONN_ID)
            aws = await self._aconnection(AWS_CONN_ID)
            extra = await kafka.aextra_dejson() if kafka is not None else None
            aws_extra = await aws.aextra_dejson() if aws is not None else None
            self._settings = _with_connections(extra, spark, serve, registry, aws, aws_extra)
            from airflow.sdk.log import amask_secret

            for secret in _secrets(self._settings):
                await amask_secret(secret)
        return self._settings

    @staticmethod
    def _connection(conn_id: str) -> Any:
        """The connection, or None when it is not defined (the environment's fields stand)."""
        try:
            connection = BaseHook.get_connection(conn_id)
        except AirflowNotFoundException:
            return None
        except Exception as error:  # a database or secrets backend down must not go unnoticed
            raise _unreadable(conn_id, error) from error
        return _extra_checked(conn_id, connection)

    @staticmethod
    async def _aconnection(conn_id: str) -> Any:
        try:
            connection = await BaseHook.aget_connection(conn_id)
        except AirflowNotFoundException:
            return None
        except Exception as error:
            raise _unreadable(conn_id, error) from error
        return _extra_checked(conn_id, connection)

    def run(self, arguments: Sequence[Any]) -> Any:
        """Run `duality ARGUMENTS --json` to its end, its stderr relayed line by line to the task
        log; its JSON result, or the Airflow exception its exit code means (`_result`)."""
        settings = self.settings()
        command = duality_command([a for a in arguments if a not in ("", None)])
        self._shown = " ".join(command[2:])
        self.log.info("running %s", self._shown)
        process = self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,  # not the task's own stdin (Airflow's channel to it)
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_environment(settings),
            start_new_session=True,  # its own process group (and session): one signal for all
            # Even a SIGKILLed task leaves no driver: its JVM then sees its stdin close and exits.
            preexec_fn=die_with_parent,
        )
        relay = threading.Thread(target=self._relay, args=(process,), daemon=True)
        relay.start()
        assert process.stdout is not None
        try:
            output = process.stdout.read()
            # Exited but not reaped: its pid still names the group that kill() ends.
            with contextlib.suppress(ChildProcessError):  # reaped already by an on_kill
                os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        finally:
            # Also when the execution timeout's exception interrupts the read: nothing the
            # command started outlives the task's attempt.
            self.kill()
        code = process.wait()
        relay.join(10)
        return _result(self._shown, code, output)

    def _relay(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            if line.strip():
                self.log.info("%s", line.rstrip())

    def kill(self) -> None:
        """End the running command's process group: SIGTERM, up to `kill_grace_s` for every
        process of it to exit, then SIGKILL to what is left."""
        process = self._process
        if process is None or not group_alive(process.pid):  # the leader's pid is the group's
            return
        self.log.info("stopping process group %s (%s)", process.pid, self._shown)
        grace = self.settings().kill_grace_s
        if stop_group(process.pid, grace, whole_group=True, reap=process):
            self.log.warning("process group %s killed after %.1fs", process.pid, grace)


def _unreadable(conn_id: str, error: Exception) -> AirflowException:
    return AirflowException(
        f"cannot read the Airflow connection {conn_id!r}: {type(error).__name__}: {error}"
    )


def _extra_checked(conn_id: str, connection: Any) -> Any:
    """The connection, once its extra is known to be JSON (Airflow reads a bad one as `{}`)."""
    try:
        json.loads(connection.extra or "{}")
    except json.JSONDecodeError as error:
        raise AirflowFailException(
            f"the extra of the Airflow connection {conn_id!r} is not JSON ({error}): correct "
            "it, or delete the connection to use the environment's DUALITY_* settings"
        ) from None
    return connection


def _with_connections(
    kafka_extra: dict[str, Any] | None,
    spark_conn: Any,
    serve_conn: Any = None,
    registry_conn: Any = None,
    aws_conn: Any = None,
    aws_extra: dict[str, Any] | None = None,
) -> Settings:
    from duality.config import Settings

    changes = overrides(
        kafka_extra, (spark_conn.host, spark_conn.port) if spark_conn is not None else None
    )
    if spark_conn is not None and spark_conn.password:
        # The batch server's secret: the connection's takes over the environment's, and its file.
        changes |= {"batch_server_secret": spark_conn.password, "batch_server_secret_file": None}
    if serve_conn is not None and serve_conn.password:
        changes["serve_token"] = serve_conn.password
    if registry_conn is not None:
        changes |= registry_overrides(
            registry_conn.conn_type,
            registry_conn.host,
            registry_conn.port,
            registry_conn.schema,
            registry_conn.login,
            registry_conn.password,
        )
    if aws_conn is not None:
        changes |= aws_overrides(aws_conn.host, aws_conn.login, aws_conn.password, aws_extra)
    return Settings.from_env().replace(**changes)


def aws_overrides(
    host: str | None,
    login: str | None,
    password: str | None,
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Settings fields the `aws_default` connection sets: the endpoint from its extra's
    `endpoint_url` (the Amazon provider's name; else its host), the region from `region_name`,
    the access key and secret from its login and password (both or neither; the connection's
    secret takes over the environment's and its file)."""
    extra = extra or {}
    changes: dict[str, Any] = {}
    endpoint = extra.get("endpoint_url") or host
    if endpoint:
        changes["s3_endpoint"] = str(endpoint).strip().rstrip("/")
    if extra.get("region_name"):
        changes["s3_region"] = str(extra["region_name"])
    if bool(login) != bool(password):
        raise AirflowFailException(
            f"the Airflow connection {AWS_CONN_ID!r} has a "
            f"{'login' if login else 'password'} but no {'password' if login else 'login'}: "
            "the object store's access key (login) needs its secret (password), or neither"
        )
    if login:
        changes |= {"s3_access_key": login, "s3_secret_key": password, "s3_secret_key_file": None}
    return changes


def registry_overrides(
    conn_type: str | None,
    host: str | None,
    port: int | None,
    path: str | None,
    login: str | None,
    password: str | None,
) -> dict[str, Any]:
    """The Settings fields the `duality_schema_registry` connection sets: the URL from its host
    (a whole URL, `http://registry:8080/apis/ccompat/v7`, or a host name with the port and the
    schema field as the path, as the URI form `http://registry:8080/apis%2Fccompat%2Fv7` gives
    them), the basic-auth user and password from its login and password (both or neither)."""
    changes: dict[str, Any] = {}
    if host:
        host = host.strip().rstrip("/")
        if "://" in host:
            url = host
        else:
            scheme = "https" if conn_type == "https" else "http"
            url = f"{scheme}://{host}" + (f":{port}" if port else "")
        if path:
            url += "/" + path.strip("/")
        changes["schema_registry_url"] = url
    if bool(login) != bool(password):
        raise AirflowFailException(
            f"the Airflow connection {REGISTRY_CONN_ID!r} has a "
            f"{'login' if login else 'password'} but no {'password' if login else 'login'}: "
            "the schema registry's basic auth needs both (or neither)"
        )
    if login:
        changes |= {"schema_registry_user": login, "schema_registry_password": password}
    return changes


def _secrets(settings: Settings) -> list[str]:
    """The batch server's secret (whichever setting gives it), the replicas' token, the
    schema registry's password and basic-auth header and the object store's secret key, for
    Airflow's masker (an unreadable secret file is left for the command to name)."""
    from duality.avro.registry import authorization
    from duality.errors import DualityError

    found = [settings.serve_token] if settings.serve_token else []
    header = authorization(settings)
    if header is not None:  # the header's base64 shows the password too
        found += [str(settings.schema_registry_password), header.removeprefix("Basic ")]
    for read in (settings.read_s3_secret_key, settings.read_batch_server_secret):
        try:
            secret = read()
        except DualityError:
            continue
        found += [secret] if secret else []
    return found


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


def child_environment(settings: Settings) -> dict[str, str]:
    """The task's environment with its `DUALITY_*` variables replaced by the settings': a setting
    that a connection unset (the secret file, when `spark_default` gives the secret) is not
    inherited."""
    return settings.process_env()


def duality_command(arguments: Sequence[Any]) -> list[str]:
    return [sys.executable, "-m", "duality", *map(str, arguments), "--json"]


def _result(shown: str, code: int, output: str) -> Any:
    """The JSON result of a command that exited with `code`, or the exception failing the task:
    1 (a check failed) may be retried, 2 (bad input) is not, 0 without a result fails too."""
    try:
        result = json.loads(output) if output.strip() else None
    except json.JSONDecodeError:
        result = None
    what = f"`{shown}`"
    if code == 0:
        if result is None:
            raise AirflowException(f"{what} exited with code 0 but printed no JSON result")
        return result
    message = result.get("error") if isinstance(result, dict) else None
    if code < 0:
        with contextlib.suppress(ValueError):
            message = f"{what} was ended by {signal.Signals(-code).name}"
    message = message or f"{what} exited with code {code}"
    if code == 2:
        raise AirflowFailException(message)  # bad input: retrying cannot help
    raise AirflowException(message)


def execution_timeout(kind: str) -> timedelta:
    """A task kind's execution timeout (`<kind>_timeout_s`), from the environment's settings:
    DAG files read it when they are parsed, so no connection is looked up then."""
    from duality.config import Settings

    return timedelta(seconds=getattr(Settings.from_env(), f"{kind}_timeout_s"))
