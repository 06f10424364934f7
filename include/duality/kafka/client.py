"""Connections to Kafka: the clients built from Settings (one admin client per connection), the
cluster's metadata, what a call's failure means for the user, and the one retry helper
(docs/decisions/0011-one-kafka-module.md, docs/decisions/0037-one-kafka-package.md)."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import tenacity
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from duality.config import Settings
from duality.errors import BrokerUnavailable, DualityError, UsageError

T = TypeVar("T")

Isolation = Literal["read_committed", "read_uncommitted"]

# librdkafka reports every failed connection attempt through this logger; commands turn
# unreachable brokers into one BrokerUnavailable error instead of a screen of retries.
_client_log = logging.getLogger("duality.kafka.client")
_client_log.addHandler(logging.NullHandler())

# Answers that mean "ask again in a moment": a coordinator or a partition leader that is moving,
# a new leader whose high watermark has not caught up yet. librdkafka flags most retriable errors
# itself, but confluent-kafka does not flag a partition's error in a result (an offset lookup's
# `TopicPartition.error`, an admin call's per-partition future), so they are named.
_NOT_YET = (
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.UNSTABLE_OFFSET_COMMIT,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.OFFSET_NOT_AVAILABLE,
    KafkaError.KAFKA_STORAGE_ERROR,
    KafkaError.NETWORK_EXCEPTION,
)
# No answer: librdkafka's own timeouts, the broker's, and connections that never came up.
NO_ANSWER = (
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
)
_LOGIN_REFUSED = (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED)
DENIED = (
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
)

# How often a call that waits for Kafka looks whether the login was refused meanwhile.
_REFUSAL_CHECK_S = 0.5

# What identifies a connection: the client properties of Settings.kafka_client_config().
_Connection = tuple[tuple[str, str], ...]
_admins: dict[_Connection, AdminClient] = {}
# The last refused login librdkafka reported per connection (through an admin client's poll).
# (when, librdkafka's reason)
_refused_logins: dict[_Connection, tuple[float, str]] = {}


def _connection(settings: Settings) -> _Connection:
    return tuple(sorted(settings.kafka_client_config().items()))


def _base_config(settings: Settings) -> dict[str, Any]:
    return {**dict(_connection(settings)), "logger": _client_log}


# -- clients ---------------------------------------------------------------------------------


def admin(settings: Settings) -> AdminClient:
    """The process's admin client for the connection `settings` name, built on first use."""
    connection = _connection(settings)
    client = _admins.get(connection)
    if client is None:
        config = _base_config(settings)
        # A long-lived client must notice a broker that came (back) up within a second.
        config["reconnect.backoff.max.ms"] = 1000
        config["error_cb"] = functools.partial(_note_error, connection)
        client = _admins.setdefault(connection, AdminClient(config))
    return client


def forget(settings: Settings) -> None:
    """Drop the process's admin client for the connection `settings` name: a cluster that was
    stopped for good would otherwise keep it reconnecting (and logging) for the process's life."""
    connection = _connection(settings)
    _admins.pop(connection, None)
    _refused_logins.pop(connection, None)


def _note_error(connection: _Connection, error: KafkaError) -> None:
    if error.code() in _LOGIN_REFUSED:
        _refused_logins[connection] = (time.monotonic(), error.str())


def producer(settings: Settings, **overrides: Any) -> Producer:
    """An idempotent producer that partitions keys like Java's default partitioner."""
    config = _base_config(settings)
    config.update(
        {
            "partitioner": "murmur2_random",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 20,
            "compression.type": "lz4",
        }
    )
    config.update({k.replace("_", "."): v for k, v in overrides.items()})
    return Producer(config)


def transactional_producer(settings: Settings, transactional_id: str, **overrides: Any) -> Producer:
    """A producer with `transactional_id`, initialised: that fences a producer of an earlier
    run with the same id and aborts the transaction it left open."""
    made = producer(settings, transactional_id=transactional_id, **overrides)
    timeout = settings.connect_timeout_s * 6
    try:
        made.init_transactions(timeout)
    except KafkaException as exc:
        doing = f"initialise the transactions of {transactional_id!r}"
        raise failure(settings, doing, exc, timeout) from None
    return made


# How long past its timeout a transactional call's own thread is waited for (send_offsets).
_STUCK_GRACE_S = 2.0


class TransactionStuck(Exception):
    """A transactional producer's call did not return within its timeout: the producer cannot be
    used again (its call is still in progress). A new producer with the same transactional id
    fences it and aborts its open transaction."""


def send_offsets(
    producer: Producer, consumed: list[Any], group_metadata: Any, timeout: float
) -> None:
    """`producer.send_offsets_to_transaction`, held to `timeout` by duality. librdkafka (2.16)
    does not hold that call's timeout (its issue 5456), and after the group's coordinator dies
    it may wait on that broker until another one's connection changes state (5511): the call is
    left to a thread of its own, and a call still running `_STUCK_GRACE_S` after its timeout
    raises TransactionStuck (decision 33)."""
    finished = threading.Event()
    failed: list[BaseException] = []

    def call() -> None:
        try:
            producer.send_offsets_to_transaction(consumed, group_metadata, timeout)
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)
        finally:
            finished.set()

    # A daemon: the call may never return, and must not keep the process from exiting.
    threading.Thread(target=call, name="duality-send-offsets", daemon=True).start()
    if not finished.wait(timeout + _STUCK_GRACE_S):
        raise TransactionStuck(
            f"sending the consumed offsets to the transaction did not return within {timeout:g}s "
            "(librdkafka waits on a group coordinator that went away)"
        )
    if failed:
        raise failed[0]


def consumer(
    settings: Settings,
    group_id: str,
    *,
    isolation_level: Isolation = "read_committed",
    **overrides: Any,
) -> Consumer:
    """A consumer with an explicit isolation level and no automatic offset commits."""
    config = _base_config(settings)
    config.update(
        {
            "group.id": group_id,
            "isolation.level": isolation_level,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    config.update({k.replace("_", "."): v for k, v in overrides.items()})
    return Consumer(config)


# -- failures and retries -----------------------------------------------------------------------


def _error(exc: BaseException) -> KafkaError | None:
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error if isinstance(error, KafkaError) else None


def error_code(exc: BaseException) -> int | None:
    error = _error(exc)
    return None if error is None else error.code()


def error_reason(exc: KafkaException) -> str:
    error = _error(exc)
    return str(exc) if error is None else str(error.str())


def failure(
    settings: Settings, doing: str, cause: KafkaException, timeout: float | None = None
) -> Exception:
    """What the failure of a call that was to `doing` means for the user: a refused login or a
    denied operation (UsageError), no answer in time (BrokerUnavailable); any other error is
    returned as it is."""
    code = error_code(cause)
    reason = error_reason(cause)
    if code in NO_ANSWER:
        # A refused login looks like no answer to the call; librdkafka reports it apart.
        refused = _refused_login(settings, since=float("-inf"))
        if refused is None:
            waited = settings.connect_timeout_s if timeout is None else timeout
            return timed_out(settings, doing, waited, reason)
        return refused
    user = repr(settings.sasl_username) if settings.sasl_username else None
    if code in _LOGIN_REFUSED:
        return _login_refused(settings, reason)
    if code in DENIED:
        who = f"user {user}" if user else "this client (no DUALITY_SASL_USERNAME)"
        return UsageError(
            f"Kafka at {settings.bootstrap_servers} does not allow {who} to {doing} ({reason}): "
            "grant it the ACL, or set DUALITY_SASL_USERNAME to a user that has it"
        )
    return cause


def _login_refused(settings: Settings, reason: str) -> UsageError:
    user = repr(settings.sasl_username) if settings.sasl_username else "(none)"
    return UsageError(
        f"Kafka at {settings.bootstrap_servers} refused the SASL {settings.sasl_mechanism} login "
        f"of user {user} ({reason}): check DUALITY_SASL_USERNAME and DUALITY_SASL_PASSWORD, and "
        "that DUALITY_SASL_MECHANISM is one the cluster accepts"
    )


# How Kafka's Java client (in Spark's Kafka source and sink) reports a refused login.
_JAVA_LOGIN_REFUSED = re.compile(
    r"org\.apache\.kafka\.common\.errors\.(?:Sasl)?AuthenticationException: ?([^\n]*)"
)


def refused_login_in(settings: Settings, error: BaseException) -> UsageError | None:
    """The refused login that a failure of Spark's Kafka source or sink comes from, as the
    same error a refused login of the Python clients gives; None for any other failure."""
    found = _JAVA_LOGIN_REFUSED.search(str(error))
    if found is None:
        return None
    return _login_refused(settings, found.group(1).strip() or "authentication failed")


def timed_out(settings: Settings, doing: str, timeout: float, reason: str) -> DualityError:
    """The error for a Kafka call that was to `doing` and got no answer within `timeout`."""
    return BrokerUnavailable(
        f"timed out after {timeout:g}s waiting for Kafka at {settings.bootstrap_servers} "
        f"(DUALITY_BOOTSTRAP_SERVERS) to {doing} ({reason}). Start the local broker with "
        "`duality up`, or point DUALITY_BOOTSTRAP_SERVERS at a running cluster."
    )


def _not_yet(exc: BaseException) -> bool:
    error = _error(exc)
    return error is not None and (error.retriable() or error.code() in _NOT_YET)


def retrying(
    settings: Settings,
    doing: str,
    call: Callable[[], T],
    *,
    seconds: float | None = None,
    also: tuple[int, ...] = (),
) -> T:
    """`call()`, which is to `doing`, asked again every 0.2 s while Kafka answers "not yet" (or
    an error whose code is in `also`), for at most `seconds` (default three connect timeouts);
    its failure goes through `failure`, and an error in `also` still there at the end is raised
    as it is, for the caller to explain."""
    seconds = settings.connect_timeout_s * 3 if seconds is None else seconds

    def not_yet(exc: BaseException) -> bool:
        return _not_yet(exc) or error_code(exc) in also

    retry = tenacity.Retrying(
        retry=tenacity.retry_if_exception(not_yet),
        stop=tenacity.stop_after_delay(seconds),
        wait=tenacity.wait_fixed(0.2),
        reraise=True,
    )
    try:
        return retry(call)
    except KafkaException as exc:
        if _not_yet(exc) and error_code(exc) not in also:  # still "not yet" when the time was up
            raise timed_out(settings, doing, seconds, error_reason(exc)) from None
        raise failure(settings, doing, exc) from None


def admin_result(future: Any, settings: Settings, doing: str) -> Any:
    """The result of an admin call's future; an error `failure` does not explain is raised as
    the KafkaException it is. A refused login ends the wait as soon as librdkafka reports it."""
    asked = time.monotonic()
    try:
        while True:
            try:
                return future.result(timeout=_REFUSAL_CHECK_S)
            except concurrent.futures.TimeoutError:
                refused = _refused_login(settings, asked)
                if refused is not None:
                    raise refused from None
    except KafkaException as exc:
        raise failure(settings, doing, exc) from None


def _refused_login(settings: Settings, since: float) -> UsageError | None:
    """A login refusal librdkafka reported for this connection after `since` (monotonic)."""
    connection = _connection(settings)
    if connection in _admins:
        _admins[connection].poll(0)
    refused = _refused_logins.pop(connection, None)
    if refused is None or refused[0] < since:
        return None
    return _login_refused(settings, refused[1])


# -- the cluster -------------------------------------------------------------------------------


def ensure_reachable(settings: Settings, timeout: float | None = None) -> int:
    """Wait up to `timeout` seconds for the cluster to answer; returns the number of brokers."""
    return len(metadata(settings, "list its brokers", timeout=timeout).brokers)


def metadata(
    settings: Settings, doing: str, topic: str | None = None, timeout: float | None = None
) -> Any:
    """The cluster's metadata: brokers, and `topic` or every topic."""
    timeout = settings.connect_timeout_s if timeout is None else timeout
    asked = time.monotonic()
    deadline = asked + timeout
    # Asked in growing slices, so that a refused login ends the wait once it is reported.
    wait = _REFUSAL_CHECK_S
    while True:
        try:
            return admin(settings).list_topics(
                topic, timeout=max(0.05, min(wait, deadline - time.monotonic()))
            )
        except KafkaException as exc:
            if error_code(exc) not in NO_ANSWER or time.monotonic() >= deadline:
                raise failure(settings, doing, exc, timeout) from None
            refused = _refused_login(settings, asked)
            if refused is not None:
                raise refused from None
            wait *= 2
