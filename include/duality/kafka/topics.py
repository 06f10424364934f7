"""Topics and their configs: creating (replicated as the cluster allows), deleting, describing
and looking them up, their partitions, and the configs of topics and brokers."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import (
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewTopic,
)

from duality.config import Settings
from duality.errors import BrokerUnavailable, DualityError, TopicMissing, UsageError
from duality.kafka import client

T = TypeVar("T")

log = logging.getLogger("duality.kafka")

# Configs for topics that should compact quickly on the dev broker; callers pass them explicitly.
FAST_COMPACTION = {
    "cleanup.policy": "compact",
    "segment.ms": "1000",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "60000",
}


@dataclasses.dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]
    # Kafka's id of this incarnation of the topic: a deleted and recreated topic gets a new one.
    topic_id: str = ""


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
    brokers = len(client.metadata(settings, doing).brokers)
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
    futures = client.admin(settings).create_topics(
        [new], request_timeout=settings.connect_timeout_s
    )
    try:
        client.admin_result(futures[name], settings, f"create topic {name!r}")
    except KafkaException as exc:
        if client.error_code(exc) != KafkaError.TOPIC_ALREADY_EXISTS:
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
        entry = client.metadata(settings, f"describe topic {name!r}", name).topics.get(name)
        if entry is None or entry.error is not None or not entry.partitions:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, retriable=True))
        if any(p.leader < 0 for p in entry.partitions.values()):
            raise KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE, retriable=True))

    client.retrying(
        settings, f"wait for the partitions of the new topic {name!r} to have leaders", ready
    )


def delete_topic(settings: Settings, name: str) -> None:
    futures = client.admin(settings).delete_topics(
        [name], request_timeout=settings.connect_timeout_s
    )
    client.admin_result(futures[name], settings, f"delete topic {name!r}")


# A topic just created reaches each broker's metadata in its own time, and a request may go to
# any broker (the client cannot choose): a lookup that finds no topic asks again for this long
# before it says the topic does not exist.
_NEW_TOPIC_REACHES_BROKERS_S = 5.0


def _until_known(settings: Settings, name: str, call: Callable[[], T]) -> T:
    """`call()`, asked again while it raises UNKNOWN_TOPIC_OR_PART (or Kafka says "not yet");
    TopicMissing once the topic has been unknown for `_NEW_TOPIC_REACHES_BROKERS_S`."""
    try:
        return client.retrying(
            settings,
            f"look up topic {name!r}",
            call,
            seconds=_NEW_TOPIC_REACHES_BROKERS_S,
            also=(KafkaError.UNKNOWN_TOPIC_OR_PART,),
        )
    except KafkaException as exc:
        if client.error_code(exc) == KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise TopicMissing(
                f"topic {name!r} does not exist on {settings.bootstrap_servers}: "
                "check the name, or create it first"
            ) from None
        raise


def describe_topic(settings: Settings, name: str) -> TopicInfo:
    """Partitions, replication factor and non-default configs of one topic."""

    def describe() -> TopicInfo:
        futures = client.admin(settings).describe_topics(
            TopicCollection([name]), request_timeout=settings.connect_timeout_s
        )
        description = client.admin_result(futures[name], settings, f"describe topic {name!r}")
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
    futures = client.admin(settings).describe_configs(
        [resource], request_timeout=settings.connect_timeout_s
    )
    return client.admin_result(
        futures[resource], settings, f"describe the configs of topic {topic!r}"
    )


def broker_setting(settings: Settings, name: str) -> str | None:
    """A broker's value of `name` (the lowest-numbered broker's), or None where the cluster
    does not tell (no right to describe its configs)."""
    broker = min(client.metadata(settings, "list its brokers").brokers)
    resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
    try:
        futures = client.admin(settings).describe_configs(
            [resource], request_timeout=settings.connect_timeout_s
        )
        entries = client.admin_result(
            futures[resource], settings, f"describe broker {broker}'s configs"
        )
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
    metadata = client.metadata(settings, "list its topics")
    present = [t for t in dict.fromkeys(topics) if t in metadata.topics]
    if not present:
        return []
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t) for t in present]

    def describe() -> list[dict[str, Any]]:
        futures = client.admin(settings).describe_configs(
            resources, request_timeout=settings.connect_timeout_s
        )
        return [
            client.admin_result(
                futures[resource], settings, f"describe the configs of topic {topic!r}"
            )
            for topic, resource in zip(present, resources, strict=True)
        ]

    # The metadata named the topics, but the broker answering for their configs may not know a
    # new one yet: asked again until it does.
    answers = client.retrying(
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
    futures = client.admin(settings).incremental_alter_configs(
        [resource], request_timeout=settings.connect_timeout_s
    )
    client.admin_result(futures[resource], settings, f"set the configs of topic {name!r}")


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
        return name in client.metadata(settings, "list its topics").topics

    def listed() -> None:
        if name not in client.metadata(settings, "list its topics").topics:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))

    try:
        _until_known(settings, name, listed)
    except TopicMissing:
        return False
    return True


def partition_count(settings: Settings, topic: str) -> int:
    doing = f"describe topic {topic!r}"

    def count() -> int:
        entry = client.metadata(settings, doing, topic).topics.get(topic)
        if entry is not None and entry.error is not None and entry.error.code() in client.DENIED:
            raise client.failure(settings, doing, KafkaException(entry.error))
        if entry is None or entry.error is not None:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
        return len(entry.partitions)

    return _until_known(settings, topic, count)
