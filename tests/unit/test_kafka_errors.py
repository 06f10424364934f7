"""What a failed Kafka call tells the user, and the one retry helper: no broker needed (a closed
port, and errors as librdkafka reports them). tests/integration/kafka/test_kafka_errors.py checks
the same against a broker that refuses logins and operations."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from duality import skew
from duality.config import Settings
from duality.errors import BrokerUnavailable, UsageError
from duality.kafka import client, offsets, topics
from duality.local.ports import free_port

PASSWORD = "s3cret-never-printed"


@pytest.fixture
def closed(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path, bootstrap_servers=f"localhost:{free_port()}", connect_timeout_s=1
    )


@pytest.fixture
def sasl(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path,
        bootstrap_servers="kafka-1:9092,kafka-2:9092",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="bob",
        sasl_password=PASSWORD,
    )


@pytest.mark.parametrize(
    ("call", "doing"),
    [
        (lambda s: skew.analyse(s, "orders"), "describe topic 'orders'"),
        (lambda s: topics.create_topic(s, "orders", 1), "create topic 'orders'"),
        (lambda s: offsets.consumer_groups(s), "list the consumer groups"),
        (lambda s: offsets.lag(s, ["g"]), "list its topics"),
    ],
    ids=["skew", "create_topic", "consumer_groups", "lag"],
)
def test_no_answer_is_a_timeout_naming_the_call_and_the_servers(
    closed: Settings, call: Callable[[Settings], Any], doing: str
):
    with pytest.raises(BrokerUnavailable) as error:
        call(closed)
    message = str(error.value)
    assert f"timed out after 1s waiting for Kafka at {closed.bootstrap_servers}" in message
    assert f"to {doing} (" in message
    assert "duality up" in message and "DUALITY_BOOTSTRAP_SERVERS" in message


def _exception(code: int, text: str) -> KafkaException:
    return KafkaException(KafkaError(code, text))


def test_a_refused_login_names_mechanism_and_user_never_the_password(sasl: Settings):
    cause = _exception(KafkaError.SASL_AUTHENTICATION_FAILED, "Authentication failed")
    error = client.failure(sasl, "list its topics", cause)
    assert isinstance(error, UsageError)
    message = str(error)
    assert "kafka-1:9092,kafka-2:9092 refused the SASL SCRAM-SHA-512 login of user 'bob'" in message
    assert "Authentication failed" in message and "DUALITY_SASL_PASSWORD" in message
    assert PASSWORD not in message


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    ],
)
def test_a_denied_operation_names_the_user_and_the_operation(sasl: Settings, code: int):
    error = client.failure(sasl, "describe topic 'orders'", _exception(code, "denied"))
    assert isinstance(error, UsageError)
    assert "does not allow user 'bob' to describe topic 'orders' (denied)" in str(error)
    assert PASSWORD not in str(error)
    tls = sasl.replace(
        security_protocol="SSL", sasl_mechanism=None, sasl_username=None, sasl_password=None
    )
    anonymous = client.failure(tls, "x", _exception(code, "denied"))
    assert "no DUALITY_SASL_USERNAME" in str(anonymous)


def test_other_errors_are_passed_on_as_they_are(sasl: Settings):
    cause = _exception(KafkaError.INVALID_REPLICATION_FACTOR, "3 > 1 broker")
    assert client.failure(sasl, "create topic 't'", cause) is cause


def _answering(answers: list[Any]) -> Callable[[], str]:
    """A call that raises or returns `answers` in turn."""

    def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return str(answer)

    return call


def test_retrying_asks_again_while_kafka_says_not_yet(sasl: Settings):
    answers: list[Any] = [
        _exception(KafkaError.COORDINATOR_LOAD_IN_PROGRESS, "loading"),
        _exception(KafkaError.UNSTABLE_OFFSET_COMMIT, "a transaction commits offsets"),
        "the offsets",
    ]
    assert client.retrying(sasl, "read offsets", _answering(answers)) == "the offsets"
    assert answers == []


LEADER_MOVES = {
    "not-leader": KafkaError.NOT_LEADER_FOR_PARTITION,
    "no-leader": KafkaError.LEADER_NOT_AVAILABLE,
    "fenced-epoch": KafkaError.FENCED_LEADER_EPOCH,
    "new-leader-catching-up": KafkaError.OFFSET_NOT_AVAILABLE,
    "dead-leader": KafkaError._TIMED_OUT,
    "leader-unknown": KafkaError._UNKNOWN_PARTITION,
    "dead-broker-forgotten": KafkaError._DESTROY_BROKER,
}


@pytest.mark.parametrize("code", LEADER_MOVES.values(), ids=LEADER_MOVES)
def test_offsets_are_asked_again_while_a_partition_leader_moves(
    sasl: Settings, monkeypatch: pytest.MonkeyPatch, code: int
):
    """While a dead leader's partitions move, a partition's offsets come back as an error that
    librdkafka does not flag retriable, or as no answer in time: they are asked for again, not
    raised to the user (`duality stream status` printed a traceback on the CI run of 2026-11-24),
    and each time through a new consumer, which learns the partition's leader afresh (a kept one
    asked the dead leader until the wait ran out, in the next CI run)."""
    answers: list[Any] = [code, code, (3, 42)]
    readers: list[Reader] = []

    class Reader:
        def __init__(self) -> None:
            self.asked = 0
            self.closed = False

        def get_watermark_offsets(self, tp: Any, **options: Any) -> tuple[int, int]:
            assert not self.closed
            self.asked += 1
            answer = answers.pop(0)
            if answer == code:
                error = KafkaError(code, "the leader is moving")
                assert not error.retriable()
                raise KafkaException(error)
            return answer  # type: ignore[no-any-return]

        def close(self) -> None:
            self.closed = True

    def new_reader(settings: Settings, group: str, **options: Any) -> Reader:
        readers.append(Reader())
        return readers[-1]

    monkeypatch.setattr(topics, "partition_count", lambda settings, topic: 1)
    monkeypatch.setattr(client, "consumer", new_reader)
    assert offsets.end_offsets(sasl, "orders") == {0: 42}
    assert answers == []
    assert [(r.asked, r.closed) for r in readers] == [(1, True)] * 3


def test_retrying_waits_out_the_codes_a_caller_names(sasl: Settings):
    """A topic the metadata named but another broker does not know yet: "not yet" for the
    caller that says so, a real error for every other."""
    unknown = _exception(KafkaError.UNKNOWN_TOPIC_OR_PART, "unknown topic")
    answers: list[Any] = [unknown, unknown, "the configs"]
    call = _answering(answers)
    also = (KafkaError.UNKNOWN_TOPIC_OR_PART,)
    assert client.retrying(sasl, "describe configs", call, also=also) == "the configs"
    assert answers == []
    answers.extend([unknown, "the configs"])
    with pytest.raises(KafkaException):
        client.retrying(sasl, "describe configs", call)
    assert answers == ["the configs"]
    # Still unknown when the time is up: raised as it is, for the caller to explain.
    answers[:] = [unknown] * 100
    with pytest.raises(KafkaException) as raised:
        client.retrying(sasl, "describe configs", call, seconds=0.3, also=also)
    assert raised.value.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART


def test_a_topic_one_broker_does_not_know_yet_is_asked_for_again(
    sasl: Settings, monkeypatch: pytest.MonkeyPatch
):
    """Right after a topic is created, the broker that answers may not know it yet: a lookup
    asks again, and says the topic does not exist only once no broker has named it for a while."""
    known = SimpleNamespace(error=None, partitions={0: None, 1: None, 2: None})
    unknown = SimpleNamespace(error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART), partitions={})
    answers: list[Any] = [unknown, unknown, known]

    def metadata(settings: Settings, doing: str, topic: str | None = None) -> SimpleNamespace:
        entry = answers.pop(0)
        if topic is None:  # every topic: one the broker does not know is not listed
            return SimpleNamespace(topics={} if entry is unknown else {"orders": entry})
        return SimpleNamespace(topics={topic: entry})

    monkeypatch.setattr(client, "metadata", metadata)
    assert topics.partition_count(sasl, "orders") == 3
    assert answers == []

    monkeypatch.setattr(topics, "_NEW_TOPIC_REACHES_BROKERS_S", 0.5)
    answers.extend([unknown] * 100)
    with pytest.raises(UsageError, match="topic 'orders' does not exist on kafka-1:9092"):
        topics.partition_count(sasl, "orders")
    assert 2 <= 100 - len(answers) < 10

    # A caller that fails on a missing topic asks the same way; any other asks once.
    answers[:] = [unknown, known, unknown]
    assert topics.topic_exists(sasl, "orders", wait_if_missing=True)
    assert answers == [unknown]
    assert not topics.topic_exists(sasl, "orders")
    answers.extend([unknown] * 100)
    assert not topics.topic_exists(sasl, "orders", wait_if_missing=True)
    assert 2 <= 100 - len(answers) < 10


def test_retrying_gives_up_with_a_timeout_and_stops_at_a_real_error(sasl: Settings):
    calls = 0

    def busy() -> None:
        nonlocal calls
        calls += 1
        raise _exception(KafkaError.NOT_COORDINATOR, "moving")

    with pytest.raises(BrokerUnavailable, match=r"timed out after 0.5s .* to read offsets"):
        client.retrying(sasl, "read offsets", busy, seconds=0.5)
    assert calls >= 2

    calls = 0

    def denied() -> None:
        nonlocal calls
        calls += 1
        raise _exception(KafkaError.GROUP_AUTHORIZATION_FAILED, "no ACL")

    with pytest.raises(UsageError, match="does not allow user 'bob' to read offsets"):
        client.retrying(sasl, "read offsets", denied)
    assert calls == 1


def test_committed_metadata_is_bytes_never_decoded(monkeypatch: pytest.MonkeyPatch):
    """Another client's metadata (Kafka Streams commits binary metadata) comes back as bytes:
    confluent-kafka 2.16 decodes it as UTF-8 when the attribute is read, past its end, and
    raised UnicodeDecodeError on `duality skew --group` (tests/integration/kafka/)."""

    class Committed:
        topic, partition, offset = "t", 0, 5

        @property
        def metadata(self) -> str:
            raise UnicodeDecodeError("utf-8", b"MTIz\xa5", 4, 5, "invalid start byte")

    monkeypatch.setattr(topics, "partition_count", lambda *_: 1)
    monkeypatch.setattr(offsets, "_committed", lambda *_: [Committed()])
    assert offsets.committed_offsets(None, "g", "t") == {0: (5, b"MTIz\xa5")}  # type: ignore[arg-type]


class _OffsetsCall:
    """A producer whose send_offsets_to_transaction blocks until released, or fails."""

    def __init__(self, error: BaseException | None = None, block: bool = False):
        self.error, self.block = error, block
        self.released = threading.Event()
        self.asked: list[float] = []

    def send_offsets_to_transaction(self, consumed: Any, metadata: Any, timeout: float) -> None:
        self.asked.append(timeout)
        if self.block:
            self.released.wait(30)
        if self.error is not None:
            raise self.error


def test_send_offsets_holds_the_timeout_librdkafka_does_not(monkeypatch: pytest.MonkeyPatch):
    """librdkafka may keep send_offsets_to_transaction waiting past its timeout on a group
    coordinator that went away (decision 33): duality's call ends with TransactionStuck."""
    monkeypatch.setattr(client, "_STUCK_GRACE_S", 0.2)
    stuck = _OffsetsCall(block=True)
    started = time.monotonic()
    with pytest.raises(client.TransactionStuck, match=r"did not return within 0\.3s"):
        client.send_offsets(stuck, [], None, 0.3)  # type: ignore[arg-type]
    assert 0.45 <= time.monotonic() - started < 5
    assert stuck.asked == [0.3]  # librdkafka was given the same timeout
    stuck.released.set()

    client.send_offsets(_OffsetsCall(), [], None, 0.3)  # type: ignore[arg-type]
    error = KafkaError(KafkaError._TIMED_OUT, "timed out", txn_requires_abort=True)
    abortable = KafkaException(error)
    with pytest.raises(KafkaException) as raised:
        client.send_offsets(_OffsetsCall(abortable), [], None, 0.3)  # type: ignore[arg-type]
    assert raised.value is abortable
