from __future__ import annotations

from pathlib import Path

import pytest

from duality.config import Settings, describe
from duality.errors import UsageError


def test_defaults_are_relative_to_home(tmp_path: Path):
    settings = Settings.from_env({"DUALITY_HOME": str(tmp_path)})
    assert settings.bootstrap_servers == "localhost:9092"
    assert settings.warehouse == tmp_path / ".local" / "warehouse"
    assert settings.jar_cache == tmp_path / ".cache" / "jars"
    assert settings.local_dir == tmp_path / ".local"


def test_environment_overrides(tmp_path: Path):
    settings = Settings.from_env(
        {
            "DUALITY_HOME": str(tmp_path),
            "DUALITY_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
            "DUALITY_SECURITY_PROTOCOL": "SASL_SSL",
            "DUALITY_SASL_MECHANISM": "PLAIN",
            "DUALITY_SASL_USERNAME": "me",
            "DUALITY_SASL_PASSWORD": "secret",
            "DUALITY_WAREHOUSE": "/data/warehouse",
            "DUALITY_CONNECT_TIMEOUT_S": "3.5",
            "DUALITY_CONTROLLER_PORT": "19093",
        }
    )
    assert settings.first_bootstrap == ("k1", 9092)
    assert settings.warehouse == Path("/data/warehouse")
    assert settings.connect_timeout_s == 3.5
    assert settings.controller_port == 19093
    assert settings.kafka_client_config() == {
        "bootstrap.servers": "k1:9092,k2:9092",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "me",
        "sasl.password": "secret",
    }
    options = settings.spark_kafka_options()
    assert options["kafka.bootstrap.servers"] == "k1:9092,k2:9092"
    assert "PlainLoginModule" in options["kafka.sasl.jaas.config"]
    assert 'username="me"' in options["kafka.sasl.jaas.config"]
    # A dead leader's offsets call is given up after 5 s, and asked again (decision 33).
    assert options["kafka.default.api.timeout.ms"] == options["kafka.request.timeout.ms"] == "5000"
    # Spark's reads: the same connection, and a consumer at a partition's end is not held 500 ms.
    reading = settings.spark_kafka_source_options()
    assert reading == {
        **options,
        "fetchOffset.numRetries": "12",
        "fetchOffset.retryIntervalMs": "500",
        # An executor's fetch from a dead leader fails after 10 s, not 120 (decision 33).
        "kafkaConsumer.pollTimeoutMs": "10000",
        "kafka.fetch.max.wait.ms": "10",
    }


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("DUALITY_BOOTSTRAP_SERVERS", "localhost", "host:port"),
        ("DUALITY_BOOTSTRAP_SERVERS", "localhost:abc", "host:port"),
        ("DUALITY_SECURITY_PROTOCOL", "TLS", "PLAINTEXT"),
        ("DUALITY_CONTROLLER_PORT", "ninety", "number"),
        ("DUALITY_AIRFLOW_DB", "postgresql", "use sqlite"),
        ("DUALITY_AIRFLOW_DB", "mysql", "or postgres"),
        ("DUALITY_BATCH_SERVER", "sc://localhost:15002", "like 127.0.0.1:7078"),
        ("DUALITY_STREAM_NICE", "20", "from 0 (the default) to 19"),
        ("DUALITY_SERVE_WRITE_RECORDS", "0", "at least 1"),
    ],
)
def test_bad_settings_name_the_variable_and_the_fix(variable: str, value: str, named: str):
    with pytest.raises(UsageError) as error:
        Settings.from_env({variable: value})
    assert variable in str(error.value)
    assert named in str(error.value)


def test_airflow_runs_on_sqlite_unless_postgres_is_asked_for():
    assert Settings.from_env({}).airflow_db == "sqlite"
    assert Settings.from_env({"DUALITY_AIRFLOW_DB": "postgres"}).airflow_db == "postgres"


def test_every_setting_is_described():
    rows = describe()
    core = ["BOOTSTRAP_SERVERS", "SPARK_MASTER", "WAREHOUSE", "CHECKPOINT_ROOT", "JAR_CACHE"]
    described = {row[0] for row in rows}
    assert {f"DUALITY_{name}" for name in (*core, "PIPELINES", "AIRFLOW_URL")} <= described
    assert all(meaning for _, _, meaning in rows)


def test_cluster_ids_never_read_as_options():
    from duality.local.broker import new_cluster_id

    ids = {new_cluster_id() for _ in range(5000)}
    assert len(ids) == 5000
    assert not any(i.startswith("-") for i in ids)
    assert all(len(i) == 22 for i in ids)


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"DUALITY_REPLICATION_FACTOR": "0"}, "DUALITY_REPLICATION_FACTOR=0"),
        ({"DUALITY_REPLICATION_FACTOR": "three"}, "whole number"),
        (
            {"DUALITY_REPLICATION_FACTOR": "2", "DUALITY_MIN_INSYNC_REPLICAS": "3"},
            "DUALITY_MIN_INSYNC_REPLICAS=3 is more than DUALITY_REPLICATION_FACTOR=2",
        ),
    ],
)
def test_bad_durability_settings_are_named(environ: dict[str, str], named: str):
    with pytest.raises(UsageError) as error:
        Settings.from_env(environ)
    assert named in str(error.value)


class _Metadata:
    """What an admin client's list_topics answers, as far as `durability` reads it."""

    def __init__(self, brokers: int):
        self.brokers = {i: f"broker {i}" for i in range(brokers)}


@pytest.mark.parametrize(
    ("brokers", "environ", "expected"),
    [
        (1, {}, (1, 1, "cluster size")),
        (2, {}, (1, 1, "cluster size")),
        (3, {}, (3, 2, "cluster size")),
        (5, {}, (3, 2, "cluster size")),
        (3, {"DUALITY_REPLICATION_FACTOR": "2"}, (2, 1, "settings")),
        (3, {"DUALITY_MIN_INSYNC_REPLICAS": "3"}, (3, 3, "cluster size")),
    ],
)
def test_durability_follows_the_cluster_unless_set(
    monkeypatch: pytest.MonkeyPatch, brokers: int, environ: dict[str, str], expected: tuple
):
    from duality.kafka import client, topics

    monkeypatch.setattr(client, "metadata", lambda *_: _Metadata(brokers))
    durable = topics.durability(Settings.from_env(environ))
    assert (durable.replication_factor, durable.min_insync_replicas, durable.chosen_by) == expected
    assert durable.brokers == brokers


def test_more_replicas_than_brokers_is_a_usage_error(monkeypatch: pytest.MonkeyPatch):
    from duality.kafka import client, topics

    monkeypatch.setattr(client, "metadata", lambda *_: _Metadata(1))
    with pytest.raises(UsageError) as error:
        topics.durability(Settings.from_env({"DUALITY_REPLICATION_FACTOR": "3"}))
    assert "has 1 broker:" in str(error.value) and "lower it to 1" in str(error.value)


def test_a_secret_in_the_environment_takes_the_place_of_the_stack_s_secret_file(tmp_path):
    """An Airflow task's stream gets the batch server's secret from a connection, in its
    environment, while the stack's record names the secret's file: one setting, not two."""
    import json

    from duality.config import STACK_FILE

    local = tmp_path / ".local"
    local.mkdir()
    secret_file = local / "secret"
    record = {"settings": {"DUALITY_BATCH_SERVER_SECRET_FILE": str(secret_file)}}
    (local / STACK_FILE).write_text(json.dumps(record))
    base = {"DUALITY_HOME": str(tmp_path)}
    given = Settings.from_env({**base, "DUALITY_BATCH_SERVER_SECRET": "s" * 32})
    assert given.batch_server_secret == "s" * 32 and given.batch_server_secret_file is None
    recorded = Settings.from_env(base)
    assert recorded.batch_server_secret_file == secret_file and recorded.batch_server_secret is None
    with pytest.raises(UsageError, match="both"):  # both given by the user: ask for one
        Settings.from_env(
            {
                **base,
                "DUALITY_BATCH_SERVER_SECRET": "s" * 32,
                "DUALITY_BATCH_SERVER_SECRET_FILE": str(secret_file),
            }
        )


def test_a_process_duality_starts_inherits_no_setting_the_settings_unset(monkeypatch):
    """An Airflow task whose connection gives the batch server's secret starts the stream
    without the secret file its own environment names: one form of the setting, not two."""
    monkeypatch.setenv("DUALITY_BATCH_SERVER_SECRET_FILE", "/stack/secret")
    monkeypatch.setenv("PATH_FOR_THE_TEST", "kept")
    settings = Settings.from_env({"DUALITY_HOME": "/x"}).replace(batch_server_secret="s" * 32)
    env = settings.process_env()
    assert env["DUALITY_BATCH_SERVER_SECRET"] == "s" * 32
    assert "DUALITY_BATCH_SERVER_SECRET_FILE" not in env and env["PATH_FOR_THE_TEST"] == "kept"


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"DUALITY_S3_ENDPOINT": "127.0.0.1:8333"}, "DUALITY_S3_ENDPOINT='127.0.0.1:8333'"),
        ({"DUALITY_S3_ENDPOINT": "http://h:1/bucket"}, "no bucket or path"),
        ({"DUALITY_S3_BUCKET": "Bad_Bucket"}, "DUALITY_S3_BUCKET='Bad_Bucket'"),
        ({"DUALITY_S3_ACCESS_KEY": "k"}, "both DUALITY_S3_ACCESS_KEY and DUALITY_S3_SECRET_KEY"),
        ({"DUALITY_S3_SECRET_KEY": "s3-secret-0123"}, "both DUALITY_S3_ACCESS_KEY"),
        (
            {
                "DUALITY_S3_ACCESS_KEY": "k",
                "DUALITY_S3_SECRET_KEY": "s3-secret-0123",
                "DUALITY_S3_SECRET_KEY_FILE": "/run/secret",
            },
            "both DUALITY_S3_SECRET_KEY and DUALITY_S3_SECRET_KEY_FILE",
        ),
    ],
)
def test_bad_object_store_settings_are_named_without_the_secret(
    environ: dict[str, str], named: str
):
    with pytest.raises(UsageError) as error:
        Settings.from_env(environ)
    assert named in str(error.value) and "s3-secret-0123" not in str(error.value)


def test_the_object_store_secret_is_read_from_its_file_and_never_shown(tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_text("from-the-file-0123456789\n")
    settings = Settings.from_env(
        {
            "DUALITY_S3_ENDPOINT": "http://127.0.0.1:8333",
            "DUALITY_S3_ACCESS_KEY": "duality",
            "DUALITY_S3_SECRET_KEY_FILE": str(secret),
        }
    )
    assert settings.read_s3_secret_key() == "from-the-file-0123456789"
    given = settings.replace(s3_secret_key="given-0123456789", s3_secret_key_file=None)
    assert given.read_s3_secret_key() == "given-0123456789"
    assert "given-0123456789" not in repr(given)
    missing = settings.replace(s3_secret_key_file=tmp_path / "nothing")
    with pytest.raises(UsageError, match=r"DUALITY_S3_SECRET_KEY_FILE=.*cannot be read"):
        missing.read_s3_secret_key()
