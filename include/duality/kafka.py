"""The only module that imports confluent_kafka: clients built from Settings, admin calls, and
what their failures mean for the user (docs/decisions/0011-one-kafka-module.md)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import tenacity
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewTopic,
)

from duality.config import Settings
from duality.errors import BrokerUnavailable, DualityError, TopicMissing, UsageError

T = TypeVar("T")

Isolation = Literal["read_committed", "read_uncommitted"]

# librdkafka reports every failed connection attempt through this logger; commands turn
# unreachable brokers into one BrokerUnavailable error instead of a screen of retries.
_client_log = logging.getLogger("duality.kafka.client")
log = logging.getLogger("duality.kafka")
_client_log.addHandler(logging.NullHandler())

# Configs for topics that should compact quickly on the dev broker; callers pass them explicitly.
FAST_COMPACTION = {
    "cleanup.policy": "compact",
    "segment.ms": "1000",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "60000",
}

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
_NO_ANSWER = (
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
)
_LOGIN_REFUSED = (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED)
_DENIED = (
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


@dataclasses.dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]
    # Kafka's id of this incarnation of the topic: a deleted and recreated topic gets a new one.
    topic_id: str = ""


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


def send(
    producer: Producer,
    topic: str,
    key: bytes | str | None = None,
    value: bytes | str | None = None,
    headers: list[tuple[str, str | bytes | None]] | None = None,
) -> None:
    """Produce one record, waiting for room in the producer's queue when it is full."""
    while True:
        try:
            producer.produce(topic, key=key, value=value, headers=headers)
            return
        except BufferError:
            producer.poll(0.05)


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


def end_of_partition(message: Message) -> bool:
    """Whether `message` is a consumer's end-of-partition event; one that carries any other
    error raises it."""
    error = message.error()
    if error is None:
        return False
    if error.code() == KafkaError._PARTITION_EOF:
        return True
    raise KafkaException(error)


# -- failures and retries -----------------------------------------------------------------------


def _error(exc: BaseException) -> KafkaError | None:
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error if isinstance(error, KafkaError) else None


def _code(exc: BaseException) -> int | None:
    error = _error(exc)
    return None if error is None else error.code()


def _as_exception(error: KafkaError | KafkaException) -> KafkaException:
    return error if isinstance(error, KafkaException) else KafkaException(error)


def _reason(exc: KafkaException) -> str:
    error = _error(exc)
    return str(exc) if error is None else str(error.str())


def failure(
    settings: Settings, doing: str, cause: KafkaException, timeout: float | None = None
) -> Exception:
    """What the failure of a call that was to `doing` means for the user: a refused login or a
    denied operation (UsageError), no answer in time (BrokerUnavailable); any other error is
    returned as it is."""
    code = _code(cause)
    reason = _reason(cause)
    if code in _NO_ANSWER:
        # A refused login looks like no answer to the call; librdkafka reports it apart.
        refused = _refused_login(settings, since=float("-inf"))
        if refused is None:
            waited = settings.connect_timeout_s if timeout is None else timeout
            return _timed_out(settings, doing, waited, reason)
        return refused
    user = repr(settings.sasl_username) if settings.sasl_username else None
    if code in _LOGIN_REFUSED:
        return _login_refused(settings, reason)
    if code in _DENIED:
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


def _timed_out(settings: Settings, doing: str, timeout: float, reason: str) -> DualityError:
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
        return _not_yet(exc) or _code(exc) in also

    retry = tenacity.Retrying(
        retry=tenacity.retry_if_exception(not_yet),
        stop=tenacity.stop_after_delay(seconds),
        wait=tenacity.wait_fixed(0.2),
        reraise=True,
    )
    try:
        return retry(call)
    except KafkaException as exc:
        if _not_yet(exc) and _code(exc) not in also:  # still "not yet" when the time was up
            raise _timed_out(settings, doing, seconds, _reason(exc)) from None
        raise failure(settings, doing, exc) from None


def _result(future: Any, settings: Settings, doing: str) -> Any:
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


# -- topics ------------------------------------------------------------------------------------


def ensure_reachable(settings: Settings, timeout: float | None = None) -> int:
    """Wait up to `timeout` seconds for the cluster to answer; returns the number of brokers."""
    return len(_metadata(settings, "list its brokers", timeout=timeout).brokers)


def _metadata(
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
            if _code(exc) not in _NO_ANSWER or time.monotonic() >= deadline:
                raise failure(settings, doing, exc, timeout) from None
            refused = _refused_login(settings, asked)
            if refused is not None:
                raise refused from None
            wait *= 2


@dataclasses.dataclass(frozen=True)
class Durability:
    """How the topics duality creates are replicated on the cluster the settings name."""

    replication_factor: int
    min_insync_replicas: int
    brokers: int
    # "settings" when DUALITY_REPLICATION_FACTOR names the factor, else "cluster size".
    chosen_by: str


def durability(settings: Settings, doing: str = "list its brokers") -> Durability:
    """The replication factor and `min.insync.replicas` for new topics: from the settings, else
    3 and 2 on a cluster of at least three brokers and 1 and 1 on a smaller one. `doing` names
    the work in the error when the cluster does not answer."""
    brokers = len(_metadata(settings, doing).brokers)
    factor = settings.replication_factor or (3 if brokers >= 3 else 1)
    if factor > brokers:
        raise UsageError(
            f"DUALITY_REPLICATION_FACTOR={factor}, but the cluster at {settings.bootstrap_servers} "
            f"has {brokers} broker{'s' if brokers != 1 else ''}: lower it to {brokers} or less, "
            "or unset it to follow the cluster's size"
        )
    in_sync = settings.min_insync_replicas or (2 if factor >= 3 else 1)
    if in_sync > factor:
        raise UsageError(
            f"DUALITY_MIN_INSYNC_REPLICAS={in_sync} is more than the replication factor {factor}: "
            "no write could succeed; lower it"
        )
    chosen_by = "settings" if settings.replication_factor else "cluster size"
    return Durability(factor, in_sync, brokers, chosen_by)


def create_topic(
    settings: Settings,
    name: str,
    partitions: int,
    *,
    config: Mapping[str, str] | None = None,
    exist_ok: bool = False,
) -> bool:
    """Create a topic replicated as `durability` says; returns False when it already existed
    and `exist_ok` allowed that."""
    if partitions < 1:
        raise UsageError(f"topic {name!r}: partitions must be at least 1, got {partitions}")
    if exist_ok and topic_exists(settings, name):
        # No request to the controller, which may be the broker that just died: a producer
        # that makes sure of its topic (`duality produce`) goes on through a broker's loss.
        _wait_for_leaders(settings, name)
        return False
    durable = durability(settings, f"create topic {name!r}")
    new = NewTopic(
        name,
        num_partitions=partitions,
        replication_factor=durable.replication_factor,
        config={"min.insync.replicas": str(durable.min_insync_replicas), **(config or {})},
    )
    futures = admin(settings).create_topics([new], request_timeout=settings.connect_timeout_s)
    try:
        _result(futures[name], settings, f"create topic {name!r}")
    except KafkaException as exc:
        if _code(exc) != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
        if not exist_ok:
            raise UsageError(
                f"topic {name!r} already exists: delete it or choose another name"
            ) from None
        _wait_for_leaders(settings, name)
        return False
    _wait_for_leaders(settings, name)
    return True


def _wait_for_leaders(settings: Settings, name: str) -> None:
    """Until the broker that answers knows the topic and every partition has a leader: a topic
    just created takes a moment to reach every broker's metadata."""

    def ready() -> None:
        entry = _metadata(settings, f"describe topic {name!r}", name).topics.get(name)
        if entry is None or entry.error is not None or not entry.partitions:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, retriable=True))
        if any(p.leader < 0 for p in entry.partitions.values()):
            raise KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE, retriable=True))

    retrying(settings, f"wait for the partitions of the new topic {name!r} to have leaders", ready)


def delete_topic(settings: Settings, name: str) -> None:
    futures = admin(settings).delete_topics([name], request_timeout=settings.connect_timeout_s)
    _result(futures[name], settings, f"delete topic {name!r}")


# A topic just created reaches each broker's metadata in its own time, and a request may go to
# any broker (the client cannot choose): a lookup that finds no topic asks again for this long
# before it says the topic does not exist.
_NEW_TOPIC_REACHES_BROKERS_S = 5.0


def _until_known(settings: Settings, name: str, call: Callable[[], T]) -> T:
    """`call()`, asked again while it raises UNKNOWN_TOPIC_OR_PART (or Kafka says "not yet");
    TopicMissing once the topic has been unknown for `_NEW_TOPIC_REACHES_BROKERS_S`."""
    try:
        return retrying(
            settings,
            f"look up topic {name!r}",
            call,
            seconds=_NEW_TOPIC_REACHES_BROKERS_S,
            also=(KafkaError.UNKNOWN_TOPIC_OR_PART,),
        )
    except KafkaException as exc:
        if _code(exc) == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise TopicMissing(
                f"topic {name!r} does not exist on {settings.bootstrap_servers}: "
                "check the name, or create it first"
            ) from None
        raise


def describe_topic(settings: Settings, name: str) -> TopicInfo:
    """Partitions, replication factor and non-default configs of one topic."""

    def describe() -> TopicInfo:
        futures = admin(settings).describe_topics(
            TopicCollection([name]), request_timeout=settings.connect_timeout_s
        )
        description = _result(futures[name], settings, f"describe topic {name!r}")
        partitions = description.partitions
        return TopicInfo(
            name=name,
            partitions=len(partitions),
            replication_factor=len(partitions[0].replicas) if partitions else 0,
            config={
                key: entry.value
                for key, entry in _configs(settings, name).items()
                if not entry.is_default and entry.value is not None
            },
            topic_id=str(description.topic_id),
        )

    return _until_known(settings, name, describe)


def _configs(settings: Settings, topic: str) -> dict[str, Any]:
    """The config entries of `topic`, broker defaults included."""
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    futures = admin(settings).describe_configs(
        [resource], request_timeout=settings.connect_timeout_s
    )
    return _result(futures[resource], settings, f"describe the configs of topic {topic!r}")


def broker_setting(settings: Settings, name: str) -> str | None:
    """A broker's value of `name` (the lowest-numbered broker's), or None where the cluster
    does not tell (no right to describe its configs)."""
    broker = min(_metadata(settings, "list its brokers").brokers)
    resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
    try:
        futures = admin(settings).describe_configs(
            [resource], request_timeout=settings.connect_timeout_s
        )
        entries = _result(futures[resource], settings, f"describe broker {broker}'s configs")
    except BrokerUnavailable:
        raise
    except (DualityError, KafkaException) as error:
        log.info("broker %s's %s unknown: %s", broker, name, error)
        return None
    entry = entries.get(name)
    return None if entry is None or entry.value is None else str(entry.value)


@dataclasses.dataclass(frozen=True)
class TopicReplication:
    topic: str
    replication_factor: int  # the fewest replicas any of its partitions has
    min_insync_replicas: int  # its own setting, or the broker's default
    below_min_isr: int  # partitions with fewer in-sync replicas than that right now


def replication(settings: Settings, topics: Iterable[str]) -> list[TopicReplication]:
    """How those of `topics` that exist are replicated: one metadata and one config request."""
    metadata = _metadata(settings, "list its topics")
    present = [t for t in dict.fromkeys(topics) if t in metadata.topics]
    if not present:
        return []
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in present]

    def describe() -> list[dict[str, Any]]:
        futures = admin(settings).describe_configs(
            resources, request_timeout=settings.connect_timeout_s
        )
        return [
            _result(futures[resource], settings, f"describe the configs of topic {topic!r}")
            for topic, resource in zip(present, resources, strict=True)
        ]

    # The metadata named the topics, but the broker answering for their configs may not know a
    # new one yet: asked again until it does.
    answers = retrying(
        settings,
        f"describe the configs of topics {present}",
        describe,
        also=(KafkaError.UNKNOWN_TOPIC_OR_PART,),
    )
    rows = []
    for topic, configs in zip(present, answers, strict=True):
        in_sync = int(configs["min.insync.replicas"].value)
        partitions = list(metadata.topics[topic].partitions.values())
        rows.append(
            TopicReplication(
                topic,
                min((len(p.replicas) for p in partitions), default=0),
                in_sync,
                sum(1 for p in partitions if len(p.isrs) < in_sync),
            )
        )
    return rows


def topic_overrides(settings: Settings, name: str) -> dict[str, str]:
    """The configs set on the topic itself (not broker defaults): what a copy of it should get."""
    return {
        key: entry.value
        for key, entry in _configs(settings, name).items()
        if _source(entry) == ConfigSource.DYNAMIC_TOPIC_CONFIG.value and entry.value is not None
    }


def set_topic_config(settings: Settings, name: str, config: Mapping[str, str]) -> None:
    """Set `config` on an existing topic (only those keys; the others stay as they are)."""
    entries = [
        ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)
        for key, value in config.items()
    ]
    resource = ConfigResource(ConfigResource.Type.TOPIC, name, incremental_configs=entries)
    futures = admin(settings).incremental_alter_configs(
        [resource], request_timeout=settings.connect_timeout_s
    )
    _result(futures[resource], settings, f"set the configs of topic {name!r}")


def max_message_bytes(settings: Settings, topic: str) -> int:
    """The largest record batch `topic` accepts: its max.message.bytes, broker default included."""
    return int(_configs(settings, topic)["max.message.bytes"].value)


def _source(entry: Any) -> int:
    return int(getattr(entry.source, "value", entry.source))


def topic_exists(settings: Settings, name: str, *, wait_if_missing: bool = False) -> bool:
    """Whether topic `name` exists. `wait_if_missing`, for a caller that fails when it does not:
    a topic not found is looked for again for `_NEW_TOPIC_REACHES_BROKERS_S`, since one just
    created may not have reached the broker that answers."""
    if not wait_if_missing:
        return name in _metadata(settings, "list its topics").topics

    def listed() -> None:
        if name not in _metadata(settings, "list its topics").topics:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))

    try:
        _until_known(settings, name, listed)
    except TopicMissing:
        return False
    return True


def partition_count(settings: Settings, topic: str) -> int:
    doing = f"describe topic {topic!r}"

    def count() -> int:
        entry = _metadata(settings, doing, topic).topics.get(topic)
        if entry is not None and entry.error is not None and entry.error.code() in _DENIED:
            raise failure(settings, doing, KafkaException(entry.error))
        if entry is None or entry.error is not None:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
        return len(entry.partitions)

    return _until_known(settings, topic, count)


# -- offsets -----------------------------------------------------------------------------------


# What a consumer's offset lookup answers for a partition whose leader died (decision 21).
_LEADER_GONE = (*_NO_ANSWER, KafkaError._UNKNOWN_PARTITION, KafkaError._DESTROY_BROKER)


def _list_offsets(
    settings: Settings, topic: str, at: Literal["earliest", "latest"] | int, isolation: Isolation
) -> dict[int, int]:
    """Per partition of `topic`, the first offset still stored, the next to be written, or the
    first at or after the timestamp `at` (ms; -1 where there is none), asked through a consumer
    that never subscribes, not the admin client (decision 21)."""
    timeout = settings.connect_timeout_s

    def ask() -> dict[int, int]:
        # A consumer per attempt: a kept one would ask a dead leader again and again.
        partitions = [TopicPartition(topic, p) for p in range(partition_count(settings, topic))]
        reader = consumer(settings, "duality-offsets", isolation_level=isolation)
        try:
            if isinstance(at, str):
                marks = {
                    tp.partition: reader.get_watermark_offsets(tp, timeout=timeout, cached=False)
                    for tp in partitions
                }
                return {p: low if at == "earliest" else high for p, (low, high) in marks.items()}
            for tp in partitions:
                tp.offset = at
            found = reader.offsets_for_times(partitions, timeout)
            for tp in found:
                if tp.error is not None:
                    raise KafkaException(tp.error)
            return {tp.partition: tp.offset for tp in found}
        except KafkaException as exc:
            if _code(exc) not in _LEADER_GONE:
                raise
            # No answer in time, or no leader known, for a partition whose leader died: asked
            # again (about 10 s later, Kafka's controller has elected another).
            raise KafkaException(
                KafkaError(KafkaError.LEADER_NOT_AVAILABLE, _reason(exc), retriable=True)
            ) from None
        finally:
            reader.close()

    return retrying(settings, f"list the offsets of topic {topic!r}", ask)


def end_offsets(
    settings: Settings, topic: str, isolation: Isolation = "read_committed"
) -> dict[int, int]:
    """Per partition, the offset the next record will get (read_committed: the stable end)."""
    return _list_offsets(settings, topic, "latest", isolation)


def offsets_for_time(settings: Settings, topic: str, timestamp_ms: int) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is at or after `timestamp_ms`;
    the end offset where no record is that recent."""
    found = _list_offsets(settings, topic, timestamp_ms, "read_uncommitted")
    ends = end_offsets(settings, topic, "read_uncommitted")
    return {p: offset if offset >= 0 else ends[p] for p, offset in found.items()}


def beginning_offsets(settings: Settings, topic: str) -> dict[int, int]:
    """Per partition, the first offset still stored (after retention and delete-records)."""
    return _list_offsets(settings, topic, "earliest", "read_uncommitted")


def delete_records(settings: Settings, topic: str, before: Mapping[int, int]) -> dict[int, int]:
    """Delete records below the given offset of each partition; returns the new low watermarks."""
    request = [TopicPartition(topic, partition, offset) for partition, offset in before.items()]
    futures = admin(settings).delete_records(
        request, request_timeout=settings.connect_timeout_s, operation_timeout=30
    )
    doing = f"delete records of topic {topic!r}"
    return {
        tp.partition: _result(future, settings, doing).low_watermark
        for tp, future in futures.items()
    }


# -- consumer groups ---------------------------------------------------------------------------


def consumer_groups(settings: Settings) -> list[str]:
    doing = "list the consumer groups"
    future = admin(settings).list_consumer_groups(request_timeout=settings.connect_timeout_s)
    result = _result(future, settings, doing)
    refused = [e for e in result.errors if _code(_as_exception(e)) not in _NO_ANSWER]
    if refused or (result.errors and not result.valid):
        raise failure(settings, doing, _as_exception((refused or result.errors)[0]))
    if result.errors:
        # Brokers that are down: their groups move to another coordinator within seconds, and
        # the groups of the brokers that answered are still worth showing.
        log.warning("%d broker(s) did not list their consumer groups", len(result.errors))
    return sorted(listing.group_id for listing in result.valid)


def _committed(
    settings: Settings, group: str, partitions: list[TopicPartition], isolation: Isolation
) -> list[TopicPartition]:
    """A group's committed offsets of `partitions`, asked through a consumer of the group that
    never subscribes. (The admin client's ListConsumerGroupOffsets is not used: librdkafka 2.16
    crashes the process when the group coordinator answers NOT_COORDINATOR to it.)"""
    reader = consumer(settings, group, isolation_level=isolation)

    def ask() -> list[TopicPartition]:
        try:
            found: list[TopicPartition] = reader.committed(
                partitions, timeout=settings.connect_timeout_s
            )
        except KafkaException:
            # A group the user may not read only times the call out; the consumer has the why.
            event = reader.poll(0)
            if event is not None and event.error() is not None:
                raise KafkaException(event.error()) from None
            raise
        return found

    try:
        return retrying(settings, f"read the committed offsets of group {group!r}", ask)
    finally:
        reader.close()


def group_offsets(settings: Settings, group: str) -> dict[tuple[str, int], int]:
    """The committed offsets of a consumer group: (topic, partition) -> offset."""
    partitions = [
        TopicPartition(topic, partition)
        for topic, entry in _metadata(settings, "list its topics").topics.items()
        for partition in entry.partitions
    ]
    return {
        (tp.topic, tp.partition): tp.offset
        for tp in _committed(settings, group, partitions, "read_uncommitted")
        if tp.offset >= 0
    }


def committed_offsets(
    settings: Settings, group: str, topic: str, isolation: Isolation = "read_committed"
) -> dict[int, tuple[int, bytes | None]]:
    """A group's committed (offset, metadata) per partition of `topic`; absent when none.

    The metadata is bytes, never decoded here: it is the committing client's (Kafka Streams
    commits binary metadata), and only the code that wrote it knows its format.
    read_committed asks for stable offsets (KIP-447): offsets an open transaction is committing
    are waited out, never half seen; read_uncommitted answers at once with the last stable ones.
    """
    partitions = [TopicPartition(topic, p) for p in range(partition_count(settings, topic))]
    found = _committed(settings, group, partitions, isolation)
    return {tp.partition: (tp.offset, _metadata_bytes(tp)) for tp in found if tp.offset >= 0}


def _metadata_bytes(partition: TopicPartition) -> bytes | None:
    """The committed metadata of `partition` as bytes. confluent-kafka 2.16 decodes it as UTF-8
    when the attribute is read, and reads librdkafka's unterminated copy up to the next NUL
    byte, so the bytes may end with a few that were never committed."""
    try:
        text: str | None = partition.metadata
    except UnicodeDecodeError as exc:
        return bytes(exc.object)
    return None if text is None else text.encode()


def commit_offsets(settings: Settings, group: str, topic: str, offsets: Mapping[int, int]) -> None:
    """Set the committed offsets of `group` on `topic` (a group with no member running)."""
    committer = consumer(settings, group)
    try:
        committer.commit(
            offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()], asynchronous=False
        )
    except KafkaException as exc:
        raise failure(settings, f"commit offsets of group {group!r}", exc) from None
    finally:
        committer.close()


@dataclasses.dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    committed: int
    end: int

    @property
    def lag(self) -> int:
        return max(0, self.end - self.committed)


def lag(settings: Settings, groups: Iterable[str] | None = None) -> list[PartitionLag]:
    """Consumer lag per group and partition: end offset minus committed offset."""
    selected = list(groups) if groups is not None else consumer_groups(settings)
    rows: list[PartitionLag] = []
    ends: dict[str, dict[int, int]] = {}
    for group in selected:
        for (topic, partition), committed in sorted(group_offsets(settings, group).items()):
            if topic not in ends:
                ends[topic] = end_offsets(settings, topic)
            rows.append(PartitionLag(group, topic, partition, committed, ends[topic][partition]))
    return rows


# -- reading -----------------------------------------------------------------------------------


def read_to_end(
    settings: Settings,
    topic: str,
    *,
    isolation: Isolation = "read_committed",
    last: int | None = None,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    timeout: float = 300.0,
) -> Iterator[Message]:
    """Every record of `topic` from its beginning (or only the `last` ones of each partition,
    or from the offsets `start`) up to the end offsets of the moment of the call (or `end`).

    Under read_committed, records of aborted transactions are skipped by the client.
    """
    ends = dict(end) if end is not None else end_offsets(settings, topic, isolation)
    starts = beginning_offsets(settings, topic)
    if start is not None:
        starts = {p: max(first, start.get(p, first)) for p, first in starts.items()}
    if last is not None:
        starts = {p: max(first, ends[p] - last) for p, first in starts.items()}
    pending = {p for p, stop in ends.items() if stop > starts.get(p, 0)}
    if not pending:
        return
    reader = consumer(settings, f"duality-reader-{uuid.uuid4().hex}", isolation_level=isolation)
    try:
        reader.assign([TopicPartition(topic, p, starts[p]) for p in pending])
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                doing = f"deliver topic {topic!r} up to its end offsets {ends}"
                raise _timed_out(settings, doing, timeout, f"partitions {sorted(pending)} behind")
            for message in reader.consume(num_messages=10_000, timeout=1.0):
                eof = end_of_partition(message)
                partition = message.partition()
                offset = message.offset()
                assert partition is not None and offset is not None
                if eof:
                    # At EOF the position may sit past the end after transaction markers.
                    if offset >= ends[partition]:
                        pending.discard(partition)
                    continue
                if offset < ends[partition]:
                    yield message
                if offset + 1 >= ends[partition]:
                    pending.discard(partition)
    except KafkaException as exc:
        raise failure(settings, f"read topic {topic!r}", exc) from None
    finally:
        reader.close()
