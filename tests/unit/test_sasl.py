"""SASL logins without a broker: settings that need a login, the Java client's JAAS string,
Java properties files, the local broker's SCRAM users, and the `kafka_default` connection."""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import os
import sys
from pathlib import Path

import pytest

from duality.config import Settings, jaas_quote, java_properties
from duality.errors import UsageError
from duality.kafka import client, failover
from duality.local.airflow import LocalAirflow
from duality.local.scram import Scram
from duality.local.scram import scram_argument as _scram_argument
from tests.harness import ROOT

# Every character that needs escaping somewhere: quote, backslash, semicolon, equals, spaces,
# a line break, and characters outside ASCII.
PASSWORD = 'p"w\\d; a=b  c\nü'
SCRAM = {
    "home": Path("/tmp"),
    "bootstrap_servers": "localhost:9092",
    "security_protocol": "SASL_PLAINTEXT",
    "sasl_mechanism": "SCRAM-SHA-512",
    "sasl_username": "alice",
    "sasl_password": PASSWORD,
}


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ('a"b', '"a\\"b"'),
        ("a\\b", '"a\\\\b"'),
        ("a;b", '"a;b"'),
        ("a=b", '"a=b"'),
        (" a b ", '" a b "'),
        ("a\nb\rc", '"a\\nb\\rc"'),
        ('\\"', '"\\\\\\""'),
        ("", '""'),
    ],
)
def test_jaas_values_are_quoted_and_escaped(value: str, quoted: str):
    assert jaas_quote(value) == quoted


def test_the_java_client_gets_an_escaped_jaas_config():
    settings = Settings(**SCRAM)  # type: ignore[arg-type]
    assert settings.jaas_config() == (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="alice" password="p\\"w\\\\d; a=b  c\\nü";'
    )
    options = settings.spark_kafka_options()
    assert options == {
        "kafka.bootstrap.servers": "localhost:9092",
        "kafka.security.protocol": "SASL_PLAINTEXT",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": settings.jaas_config(),
        **{f"kafka.{key}": value for key, value in failover.JAVA_CLIENT.items()},
    }
    plain = settings.replace(sasl_mechanism="PLAIN", sasl_username='b"ob')
    assert plain.jaas_config() == (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        'username="b\\"ob" password="p\\"w\\\\d; a=b  c\\nü";'
    )
    no_login = Settings(home=Path("/tmp"))
    assert no_login.jaas_config() is None
    assert "kafka.sasl.jaas.config" not in no_login.spark_kafka_options()


def test_java_properties_escape_what_properties_load_would_read_otherwise():
    text = java_properties({"a key": " lead=x:y#!\\", "k": "tab\there\nü😀"})
    assert text == (
        "a\\ key=\\ lead\\=x\\:y\\#\\!\\\\\n"  # a key's spaces, a value's leading one
        "k=tab\\there\\n\\u00fc\\ud83d\\ude00\n"  # non-ASCII as UTF-16 \\u escapes
    )


def test_the_password_is_never_in_repr():
    settings = Settings(**SCRAM)  # type: ignore[arg-type]
    assert PASSWORD not in repr(settings) and "alice" in repr(settings)
    scram = Scram({"alice": PASSWORD})
    assert PASSWORD not in repr(scram) and scram.broker_password not in repr(scram)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"sasl_username": None}, "set DUALITY_SASL_USERNAME"),
        ({"sasl_password": None}, "set DUALITY_SASL_PASSWORD"),
        ({"sasl_username": "", "sasl_password": ""}, "DUALITY_SASL_USERNAME and DUALITY_SASL_PASS"),
        ({"sasl_mechanism": None}, "needs DUALITY_SASL_MECHANISM"),
        ({"sasl_mechanism": "scram-sha-512"}, "'scram-sha-512' is not supported"),
        ({"sasl_mechanism": "GSSAPI"}, "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
        ({"security_protocol": "PLAINTEXT"}, "needs a SASL security protocol"),
    ],
)
def test_a_sasl_login_needs_mechanism_user_and_password(changes: dict, named: str):
    with pytest.raises(UsageError) as error:
        Settings(**{**SCRAM, **changes})  # type: ignore[arg-type]
    assert named in str(error.value)
    assert PASSWORD not in str(error.value)


def test_settings_from_the_environment_name_the_missing_variable():
    with pytest.raises(UsageError, match="SASL_PLAINTEXT with DUALITY_SASL_MECHANISM=SCRAM-SHA"):
        Settings.from_env(
            {
                "DUALITY_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                "DUALITY_SASL_MECHANISM": "SCRAM-SHA-512",
                "DUALITY_SASL_USERNAME": "alice",
            }
        )


def test_local_scram_users_are_checked_and_formatted_without_their_password():
    with pytest.raises(UsageError, match="letters, digits"):
        Scram({"al,ice": "x"})
    with pytest.raises(UsageError, match="needs a password"):
        Scram({"alice": ""})
    argument = _scram_argument("alice", PASSWORD)
    assert argument.startswith("SCRAM-SHA-512=[name=alice,salt=")
    assert "saltedpassword=" in argument and argument.endswith(",iterations=4096]")
    assert PASSWORD not in argument
    # RFC 5802's Hi(password, salt, i), written out: what the broker checks a login against.
    fields = dict(part.split("=", 1) for part in argument[len("SCRAM-SHA-512=[") : -1].split(","))
    assert set(fields) == {"name", "salt", "saltedpassword", "iterations"}
    block = hmac.digest(PASSWORD.encode(), base64.b64decode(fields["salt"]) + b"\0\0\0\1", "sha512")
    salted = int.from_bytes(block, "big")
    for _ in range(4095):
        block = hmac.digest(PASSWORD.encode(), block, "sha512")
        salted ^= int.from_bytes(block, "big")
    assert base64.b64decode(fields["saltedpassword"]) == salted.to_bytes(64, "big")
    settings = Scram.from_settings(Settings(**SCRAM)).login(  # type: ignore[arg-type]
        Settings(home=Path("/tmp")), "alice"
    )
    assert settings.sasl_password == PASSWORD and settings.security_protocol == "SASL_PLAINTEXT"
    with pytest.raises(UsageError, match="DUALITY_SASL_MECHANISM=SCRAM-SHA-512"):
        Scram.from_settings(Settings(home=Path("/tmp")))


def test_a_refused_login_of_the_java_client_is_named_like_any_refused_login():
    settings = Settings(**SCRAM)  # type: ignore[arg-type]
    # As Spark reports it: a Py4J error around the Java exception and its stack.
    failure = RuntimeError(
        "An error occurred while calling o71.load.\n"
        ": org.apache.kafka.common.errors.SaslAuthenticationException: Authentication failed "
        "during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512\n"
        "\tat org.apache.kafka.clients.admin.KafkaAdminClient..."
    )
    error = client.refused_login_in(settings, failure)
    assert isinstance(error, UsageError)
    message = str(error)
    assert "refused the SASL SCRAM-SHA-512 login of user 'alice'" in message
    assert "invalid credentials with SASL mechanism SCRAM-SHA-512)" in message
    assert PASSWORD not in message
    assert client.refused_login_in(settings, RuntimeError("TimeoutException: no answer")) is None


def test_kafka_default_carries_the_login_through_airflow_and_masks_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The connection LocalAirflow defines, read by Airflow's own code as a task reads it,
    gives the same settings; reading it tells Airflow's secrets masker about the password."""
    settings = Settings(**{**SCRAM, "home": ROOT, "local_dir": tmp_path})  # type: ignore[arg-type]
    environment = LocalAirflow(settings).environment()
    extra = json.loads(environment["AIRFLOW_CONN_KAFKA_DEFAULT"])["extra"]
    assert extra["sasl.username"] == "alice" and extra["sasl.password"] == PASSWORD
    for name in list(os.environ):
        if name.startswith(("DUALITY_", "AIRFLOW_CONN_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_DEFAULT", environment["AIRFLOW_CONN_KAFKA_DEFAULT"])
    monkeypatch.syspath_prepend(str(ROOT / "plugins"))
    sys.modules.pop("duality_airflow.hooks", None)
    from duality_airflow import hooks

    # As a task reads it, and as the triggerer does (asynchronously).
    for seen in (hooks.DualityHook().settings(), asyncio.run(hooks.DualityHook().asettings())):
        for field in ("bootstrap_servers", "security_protocol", "sasl_mechanism", "sasl_username"):
            assert getattr(seen, field) == getattr(settings, field), field
        assert seen.sasl_password == PASSWORD
    from airflow.sdk._shared.secrets_masker import redact

    assert PASSWORD not in str(redact(f"task log line with {PASSWORD} in it"))


def test_only_a_refusal_reported_during_a_call_ends_it(monkeypatch: pytest.MonkeyPatch):
    settings = Settings(**SCRAM)  # type: ignore[arg-type]
    connection = client._connection(settings)
    monkeypatch.setattr(client, "_refused_logins", {connection: (100.0, "invalid credentials")})
    assert client._refused_login(settings, since=101.0) is None  # an old one: ask on
    monkeypatch.setattr(client, "_refused_logins", {connection: (102.0, "invalid credentials")})
    refused = client._refused_login(settings, since=101.0)
    assert refused is not None and "SCRAM-SHA-512 login of user 'alice'" in str(refused)
    assert client._refused_logins == {}
