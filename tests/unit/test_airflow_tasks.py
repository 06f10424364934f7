"""What duality's Airflow tasks guarantee about their settings, their child processes and their
trigger's arguments, without an Airflow: the hook, the operators and the trigger used directly."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import psutil
import pytest

from duality.config import Settings
from tests.harness import ROOT, assert_eventually, own_airflow_home


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """duality_airflow importable, with an Airflow home of its own and no connections."""
    own_airflow_home()
    for name in list(os.environ):
        if name.startswith("AIRFLOW_CONN_"):
            monkeypatch.delenv(name)
    monkeypatch.syspath_prepend(str(ROOT / "plugins"))
    from duality_airflow import hooks, operators, triggers

    return hooks, operators, triggers


def test_connections_not_defined_leave_the_environments_settings(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    hooks, _, _ = plugins
    monkeypatch.setenv("DUALITY_BOOTSTRAP_SERVERS", "from-the-environment:9092")
    for seen in (hooks.DualityHook().settings(), asyncio.run(hooks.DualityHook().asettings())):
        assert seen == Settings.from_env()


def test_a_connection_that_cannot_be_read_fails_naming_it(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    hooks, _, _ = plugins
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    def database_down(conn_id: str) -> None:
        raise RuntimeError("the metadata database does not answer")

    async def adatabase_down(conn_id: str) -> None:
        database_down(conn_id)

    down = "Airflow connection 'kafka_default': RuntimeError: the metadata database does not"
    with monkeypatch.context() as patched:
        patched.setattr(BaseHook, "get_connection", database_down)
        patched.setattr(BaseHook, "aget_connection", adatabase_down)
        with pytest.raises(AirflowException, match=down):
            hooks.DualityHook().settings()
        with pytest.raises(AirflowException, match=down):
            asyncio.run(hooks.DualityHook().asettings())
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", '{"conn_type": "spark", "extra": "{oops"}')
    with pytest.raises(AirflowFailException, match="connection 'spark_default' is not JSON"):
        hooks.DualityHook().settings()


def test_a_task_whose_child_exits_0_without_a_json_result_fails(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    hooks, operators, _ = plugins
    from airflow.sdk.exceptions import AirflowException

    monkeypatch.setattr(hooks, "duality_command", lambda _: [sys.executable, "-c", "pass"])
    task = operators.SnapshotOperator(task_id="snapshot", pipeline="product_sales")
    with pytest.raises(AirflowException, match="exited with code 0 but printed no JSON result"):
        task.execute({})


@pytest.mark.parametrize(
    ("unvalidated", "passed_on"), [(None, None), (4, 4)], ids=["skips", "passes-on"]
)
def test_a_snapshot_with_nothing_new_skips_unless_its_version_was_never_validated(  # type: ignore[no-untyped-def]
    plugins, monkeypatch, unvalidated, passed_on
):
    """Nothing new since version 5: the task skips what follows, unless the newest version
    built (4) has no verdict yet, an earlier try having ended before validation: then it is
    passed on for validation and publication."""
    hooks, operators, _ = plugins
    from airflow.sdk.exceptions import AirflowSkipException

    result = {"version": None, "previous_version": 5, "unvalidated_version": unvalidated}
    script = f"import json; print(json.dumps({result!r}))"
    monkeypatch.setattr(hooks, "duality_command", lambda _: [sys.executable, "-c", script])
    task = operators.SnapshotOperator(task_id="snapshot", pipeline="product_sales")
    if passed_on is None:
        with pytest.raises(AirflowSkipException, match="has not moved since version 5"):
            task.execute({})
    else:
        assert task.execute({})["version"] == passed_on


def test_killing_a_task_ends_its_childs_whole_group_sigkill_after_the_grace(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    hooks, operators, _ = plugins
    monkeypatch.setenv("DUALITY_KILL_GRACE_S", "1")
    # The child starts a grandchild that ignores SIGTERM, then waits.
    script = (
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(hooks, "duality_command", lambda _: [sys.executable, "-c", script])
    task = operators.SnapshotOperator(task_id="snapshot", pipeline="product_sales")
    ended: list[BaseException] = []

    def run() -> None:
        try:
            task.execute({})
        except BaseException as error:
            ended.append(error)

    running = threading.Thread(target=run, daemon=True)
    running.start()
    group = assert_eventually(lambda: task.hook._process and task.hook._process.pid, timeout=10)
    tree = assert_eventually(lambda: psutil.Process(group).children(), timeout=10)
    task.on_kill()
    running.join(10)
    assert not running.is_alive() and "ended by SIGTERM" in str(ended[0])
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_the_trigger_carries_connection_ids_not_settings(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    _, _, triggers = plugins
    monkeypatch.setenv("DUALITY_SASL_PASSWORD", "s3cret")
    classpath, arguments = triggers.StreamRunningTrigger("product_sales").serialize()
    assert classpath == "duality_airflow.triggers.StreamRunningTrigger"
    assert arguments == {
        "pipeline": "product_sales",
        "kafka_conn_id": "kafka_default",
        "spark_conn_id": "spark_default",
        "poll_s": 3.0,
    }
    assert "s3cret" not in json.dumps(arguments)


def test_the_batch_servers_secret_comes_from_spark_default_and_is_masked(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    """The Spark connection's password is the batch server's secret: it takes over the
    environment's secret file, and Airflow's masker hides it in task logs, as it does a secret
    from the environment."""
    hooks, _, _ = plugins
    from airflow.sdk.log import redact

    secret = "from-the-connection-0123456789"
    monkeypatch.setenv("DUALITY_BATCH_SERVER_SECRET_FILE", "/run/secrets/batch_server_secret")
    connection = {"conn_type": "spark", "host": "local[2]", "password": secret}
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(connection))
    for seen in (hooks.DualityHook().settings(), asyncio.run(hooks.DualityHook().asettings())):
        assert seen.batch_server_secret == secret and seen.batch_server_secret_file is None
        assert secret not in repr(seen)
    # The task's child gets the secret, not the file as well (both would be refused).
    child = hooks.child_environment(hooks.DualityHook().settings())
    assert child["DUALITY_BATCH_SERVER_SECRET"] == secret
    assert "DUALITY_BATCH_SERVER_SECRET_FILE" not in child and "PATH" in child
    assert Settings.from_env(child).read_batch_server_secret() == secret
    assert redact(f"a line with {secret} in it") == "a line with *** in it"
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_DEFAULT")
    monkeypatch.delenv("DUALITY_BATCH_SERVER_SECRET_FILE")
    from_env = "from-the-environment-0123456789"
    monkeypatch.setenv("DUALITY_BATCH_SERVER_SECRET", from_env)
    assert hooks.DualityHook().settings().batch_server_secret == from_env
    assert redact(f"{from_env}!") == "***!"


def test_the_replicas_token_comes_from_duality_serve_and_is_masked(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    """The `duality_serve` connection's password is the replicas' bearer token
    (docs/serving.md): the task's child gets it, and Airflow's masker hides it."""
    hooks, _, _ = plugins
    from airflow.sdk.log import redact

    token = "replica-token-from-airflow-0123"
    monkeypatch.setenv(
        "AIRFLOW_CONN_DUALITY_SERVE", json.dumps({"conn_type": "http", "password": token})
    )
    for seen in (hooks.DualityHook().settings(), asyncio.run(hooks.DualityHook().asettings())):
        assert seen.serve_token == token and token not in repr(seen)
    child = hooks.child_environment(hooks.DualityHook().settings())
    assert Settings.from_env(child).serve_token == token
    assert redact(f"Bearer {token}") == "Bearer ***"


def test_the_schema_registry_comes_from_duality_schema_registry_and_is_masked(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    """The `duality_schema_registry` connection gives an Avro source's registry: its URL (a
    whole URL as host, or the URI form's host, port and path), its basic-auth login and
    password; the task's child gets them, and Airflow's masker hides the password and the
    header made of it."""
    hooks, _, _ = plugins
    from airflow.sdk.log import redact

    from duality.avro.registry import authorization

    password = "registry-password-from-airflow-0123"
    monkeypatch.setenv("DUALITY_SCHEMA_REGISTRY_URL", "http://127.0.0.1:1/from-the-environment")
    uri = f"http://reader:{password}@registry.internal:8080/apis%2Fccompat%2Fv7"
    monkeypatch.setenv("AIRFLOW_CONN_DUALITY_SCHEMA_REGISTRY", uri)
    for seen in (hooks.DualityHook().settings(), asyncio.run(hooks.DualityHook().asettings())):
        assert seen.schema_registry_url == "http://registry.internal:8080/apis/ccompat/v7"
        assert seen.schema_registry_user == "reader"
        assert seen.schema_registry_password == password and password not in repr(seen)
    settings = hooks.DualityHook().settings()
    child = Settings.from_env(hooks.child_environment(settings))
    assert (child.schema_registry_url, child.schema_registry_password) == (
        "http://registry.internal:8080/apis/ccompat/v7",
        password,
    )
    header = authorization(settings)
    assert header is not None
    assert redact(f"password {password}") == "password ***"
    assert header.removeprefix("Basic ") not in str(redact(f"Authorization: {header}"))
    # The JSON form with a whole URL as host; no login: the environment's user stays unset.
    whole = {"conn_type": "http", "host": "https://registry.example.com/apis/ccompat/v7/"}
    monkeypatch.setenv("AIRFLOW_CONN_DUALITY_SCHEMA_REGISTRY", json.dumps(whole))
    seen = hooks.DualityHook().settings()
    assert seen.schema_registry_url == "https://registry.example.com/apis/ccompat/v7"
    assert seen.schema_registry_user is None and seen.schema_registry_password is None
    # A login without a password is refused naming the connection.
    half = {"conn_type": "http", "host": "registry", "login": "reader"}
    monkeypatch.setenv("AIRFLOW_CONN_DUALITY_SCHEMA_REGISTRY", json.dumps(half))
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="'duality_schema_registry' has a login but"):
        hooks.DualityHook().settings()


def test_the_object_store_comes_from_aws_default_and_is_masked(plugins, monkeypatch):  # type: ignore[no-untyped-def]
    """The `aws_default` connection (the Amazon provider's name) gives the object store: its
    extra's endpoint_url and region_name, its login (the access key) and password (the secret,
    taking over the environment's secret file); the task's child gets them, and Airflow's masker
    hides the secret."""
    hooks, _, _ = plugins
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.sdk.log import redact

    secret = "aws-secret-from-airflow-0123456789"
    monkeypatch.setenv("DUALITY_S3_ACCESS_KEY", "from-the-environment")
    monkeypatch.setenv("DUALITY_S3_SECRET_KEY_FILE", "/run/secrets/s3_secret")
    connection = {
        "conn_type": "aws",
        "login": "AKIAFROMAIRFLOW",
        "password": secret,
        "extra": json.dumps({"endpoint_url": "http://seaweedfs:8333/", "region_name": "eu-x-1"}),
    }
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(connection))
    for seen in (hooks.DualityHook().settings(), asyncio.run(hooks.DualityHook().asettings())):
        assert (seen.s3_endpoint, seen.s3_region) == ("http://seaweedfs:8333", "eu-x-1")
        assert (seen.s3_access_key, seen.s3_secret_key) == ("AKIAFROMAIRFLOW", secret)
        assert seen.s3_secret_key_file is None and secret not in repr(seen)
    child = hooks.child_environment(hooks.DualityHook().settings())
    assert "DUALITY_S3_SECRET_KEY_FILE" not in child
    assert Settings.from_env(child).read_s3_secret_key() == secret
    assert redact(f"secret {secret}") == "secret ***"
    half = {"conn_type": "aws", "login": "AKIAFROMAIRFLOW"}
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(half))
    with pytest.raises(AirflowFailException, match="'aws_default' has a login but no password"):
        hooks.DualityHook().settings()
