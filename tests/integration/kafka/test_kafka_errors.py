"""The Kafka module against real brokers: one admin client per command, and what a command says
when a broker with SCRAM-SHA-512 logins and ACLs refuses a login or denies an operation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)

from duality import cli, workload
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, topics
from duality.local.broker import ephemeral_broker
from duality.local.scram import Scram
from tests.harness import make_pipeline

ADMIN_PASSWORD = "admin-secret"
ALICE_PASSWORD = "alice-secret"
WRONG_PASSWORD = "not-alices-password"


@pytest.fixture(scope="module")
def secured(base_settings: Settings) -> Iterator[Settings]:
    """Settings of the super user `admin` on a broker of its own with SCRAM-SHA-512 logins and
    ACLs (StandardAuthorizer); `alice` logs in but has no ACL."""
    scram = Scram(
        {"admin": ADMIN_PASSWORD, "alice": ALICE_PASSWORD}, acls=True, super_users=("admin",)
    )
    with ephemeral_broker(base_settings.replace(connect_timeout_s=5.0), scram=scram) as admin:
        yield admin


def _as(monkeypatch: pytest.MonkeyPatch, settings: Settings, user: str, password: str) -> None:
    """The command line's environment: the secured broker, as `user`."""
    for name, value in {
        "DUALITY_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "DUALITY_SECURITY_PROTOCOL": settings.security_protocol,
        "DUALITY_SASL_MECHANISM": settings.sasl_mechanism or "",
        "DUALITY_SASL_USERNAME": user,
        "DUALITY_SASL_PASSWORD": password,
        "DUALITY_CONNECT_TIMEOUT_S": "3",
    }.items():
        monkeypatch.setenv(name, value)


def test_a_refused_login_says_so_naming_mechanism_and_user_never_the_password(
    secured: Settings, topic: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    topics.create_topic(secured, topic, 2)
    _as(monkeypatch, secured, "alice", WRONG_PASSWORD)
    assert cli.main(["skew", topic]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert (
        f"Kafka at {secured.bootstrap_servers} refused the SASL SCRAM-SHA-512 login of user "
        "'alice'" in err
    )
    assert "invalid credentials" in err
    assert WRONG_PASSWORD not in err and "timed out" not in err


def test_an_operation_without_acl_names_the_user_and_the_operation(
    secured: Settings, topic: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    topics.create_topic(secured, topic, 2)
    group = f"{topic}-group"
    _as(monkeypatch, secured, "alice", ALICE_PASSWORD)
    assert cli.main(["skew", topic, "--group", group]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert f"does not allow user 'alice' to describe topic '{topic}'" in err
    assert ALICE_PASSWORD not in err

    # Allowed to read the topic, not the group: the group is named now.
    the_topic = (ResourceType.TOPIC, topic, ResourcePatternType.LITERAL)
    read = AclBinding(*the_topic, "User:alice", "*", AclOperation.READ, AclPermissionType.ALLOW)
    for future in client.admin(secured).create_acls([read]).values():
        future.result()
    for command in (["skew", topic, "--group", group], ["lag", "--group", group]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err.replace("\n", " ")
        assert f"does not allow user 'alice' to read the committed offsets of group '{group}'" in (
            err
        ), command

    alice = secured.replace(sasl_username="alice", sasl_password=ALICE_PASSWORD)
    with pytest.raises(
        UsageError, match=f"does not allow user 'alice' to create topic '{topic}-2'"
    ):
        topics.create_topic(alice, f"{topic}-2", 1)
    with pytest.raises(UsageError, match="does not allow user 'alice' to initialise the trans"):
        client.transactional_producer(alice, f"{topic}-tx")


class _CountingAdminClient(client.AdminClient):
    built = 0

    def __init__(self, config: dict) -> None:
        type(self).built += 1
        super().__init__(config)


def test_a_command_builds_one_admin_client(
    settings: Settings,
    topic: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
):
    topics.create_topic(settings, topic, 4)
    spec = make_pipeline(settings, tmp_path, "product_sales", topic=topic)
    workload.produce(settings, spec, events=2_000, keys=50, zipf=1.3, bad_fraction=0, seed=5)
    monkeypatch.setenv("DUALITY_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setattr(client, "AdminClient", _CountingAdminClient)
    commands = [
        ["skew", topic, "--group", spec.consumer_group, "--window", "1h"],
        ["repartition", topic, "--to", f"{topic}-8p", "--partitions", "8", "--dry-run"],
        ["lag"],
    ]
    for command in commands:
        monkeypatch.setattr(client, "_admins", {})  # a new process, as far as clients go
        _CountingAdminClient.built = 0
        assert cli.main(command) == 0, capsys.readouterr().err
        assert _CountingAdminClient.built == 1, command
