"""Repartitioning against the real broker and Spark, the target compared with the source read
independently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from duality import cli, process, repartition, skew, workload
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import client, offsets, records, topics
from tests import truth
from tests.harness import (
    ROOT,
    StreamProcess,
    assert_eventually,
    make_pipeline,
    read_latest,
    read_messages,
    read_topic,
)

EVENTS, KEYS = 30_000, 1_000
RECORD = ("partition", "offset", "key", "value", "timestamp", "headers")


def _records(settings: Settings, topic: str) -> list[dict]:
    rows = []
    for m in read_messages(settings, topic):
        values = (m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
        rows.append(dict(zip(RECORD, (*values, list(m.headers() or [])), strict=True)))
    return rows


def _lineage(record: dict) -> tuple[int, int]:
    headers = dict(record["headers"])
    return int(headers["duality.source.partition"]), int(headers["duality.source.offset"])


def _assert_exact_copy(settings: Settings, source: str, target: str) -> list[dict]:
    """Target = source as multisets of (source partition, offset), contents and order kept."""
    originals = {(r["partition"], r["offset"]): r for r in _records(settings, source)}
    copies = _records(settings, target)
    lineage = Counter(_lineage(r) for r in copies)
    assert max(lineage.values(), default=1) == 1, "a source record was copied twice"
    assert set(lineage) == set(originals), (
        f"missing {len(set(originals) - set(lineage))}, extra {len(set(lineage) - set(originals))}"
    )
    for copy in copies:
        original = originals[_lineage(copy)]
        assert copy["key"] == original["key"] and copy["value"] == original["value"]
        assert copy["timestamp"] == original["timestamp"]
        assert copy["headers"][:-2] == original["headers"]
    # Per (target partition, source partition), the copies come in source offset order.
    seen: dict[tuple[int, int], int] = {}
    for copy in copies:
        source_partition, offset = _lineage(copy)
        where = (copy["partition"], source_partition)
        assert offset > seen.get(where, -1), f"order broken in {where}"
        seen[where] = offset
    return copies


def _produce(
    settings: Settings, folder: Path, topic: str, events: int, zipf: float, seed: int
) -> None:
    spec = make_pipeline(settings, folder, "product_sales", topic=topic)
    workload.produce(settings, spec, events=events, keys=KEYS, zipf=zipf, bad_fraction=0, seed=seed)


def test_key_hash_copy_is_exact_and_agrees_with_java(
    settings: Settings, spark, topic: str, tmp_path: Path
):
    source, target, reference = topic, f"{topic}-6p", f"{topic}-java"
    topics.create_topic(settings, source, 4, config={"retention.ms": "86400000"})
    _produce(settings, tmp_path, source, EVENTS, 1.1, seed=31)
    # Records with headers and null keys too.
    producer = client.producer(settings)
    for i in range(200):
        records.send(producer, source, None, f"null-key-{i}", [("trace", str(i).encode())])
        records.send(producer, source, f"h-{i % 7}", f"v{i}", [("trace", str(i).encode())])
    assert producer.flush(30) == 0

    plan = repartition.plan(settings, source, target, 6)
    report = repartition.run(settings, plan)
    assert report.copied == EVENTS + 400
    assert topics.partition_count(settings, target) == 6
    assert topics.topic_overrides(settings, target)["retention.ms"] == "86400000"
    copies = _assert_exact_copy(settings, source, target)
    assert sum(report.target_partitions.values()) == len(copies)

    # Where Spark's Kafka sink (the Java producer's default partitioner) puts each key.
    keys = sorted({c["key"] for c in copies if c["key"] is not None})
    frame = spark.createDataFrame([(k, b"x") for k in keys], "key binary, value binary")
    topics.create_topic(settings, reference, 6)
    options = settings.spark_kafka_options()
    frame.write.format("kafka").options(**options).option("topic", reference).save()
    java = {key: partition for partition, _, key, _ in read_topic(settings, reference)}
    assert len(java) == len(keys)
    for copy in copies:
        if copy["key"] is None:
            assert copy["partition"] == _lineage(copy)[0] % 6
        else:
            assert copy["partition"] == java[copy["key"]], copy["key"]

    # A later run copies only what arrived since.
    assert repartition.run(settings, plan).copied == 0
    _produce(settings, tmp_path, source, 1_000, 1.1, seed=32)
    again = repartition.run(settings, plan)
    assert again.copied == 1_000
    _assert_exact_copy(settings, source, target)


def _job(settings: Settings, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DUALITY_BOOTSTRAP_SERVERS": settings.bootstrap_servers}
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "jobs" / "repartition.py"), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )


def test_sigkill_mid_copy_then_resume(settings: Settings, topic: str, tmp_path: Path):
    source, target = topic, f"{topic}-5p"
    topics.create_topic(settings, source, 4)
    _produce(settings, tmp_path, source, 40_000, 1.1, seed=41)
    plan = repartition.plan(settings, source, target, 5)
    log = tmp_path / "repartition.log"
    args = [source, "--to", target, "--partitions", "5"]

    def copied() -> int:
        return sum(o for o, _ in offsets.committed_offsets(settings, plan.group, source).values())

    first = _job(settings, log, *args, "--throttle", "2500", "--transaction-records", "500")
    try:
        assert_eventually(
            lambda: first.poll() is None and copied() >= 4_000,
            timeout=120,
            message=f"the copy never got going; see {log}",
        )
        seen = copied()
    finally:
        process.kill_group(first.pid, reap=first)
    # The killed copiers may have left transactions open (with offset commits in them): the
    # progress is final only after the next run fenced them, so it is read from that run.
    second = _job(settings, log, *args)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, log.read_text()[-3000:]
    report = json.loads(out)
    assert 0 < report["copied"] <= 40_000 - seen, "not killed mid-copy, or not resumed"
    assert copied() == 40_000
    _assert_exact_copy(settings, source, target)


def test_salted_evens_a_hot_key_and_aggregates_stay_exact(
    settings: Settings, topic: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    source, target = topic, f"{topic}-salted"
    topics.create_topic(settings, source, 4)
    _produce(settings, tmp_path, source, EVENTS, 1.35, seed=51)
    original = read_topic(settings, source)
    keys = Counter(key for _, _, key, _ in original)
    top_share = keys.most_common(1)[0][1] / len(original)
    assert 0.27 <= top_share <= 0.35, top_share

    monkeypatch.setenv("DUALITY_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    plot = tmp_path / "skew.png"
    assert cli.main(["skew", source, "--json", "--window", "10m", "--plot", str(plot)]) == 0
    before = json.loads(capsys.readouterr().out)
    # Every record is younger than the window: the rate over it covers them all.
    assert all(round(p["rate"] * 600) == p["records"] for p in before["partitions"])
    assert sum(p["records"] for p in before["partitions"]) == EVENTS
    assert before["skew_size"] > 1.3 and before["hot_partitions"]
    assert before["heaviest_keys"][0]["share"] > 0.2
    assert before["recommendation"]["strategy"] == "salted"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    command = ["repartition", source, "--to", target, "--partitions", "6"]
    assert cli.main([*command, "--strategy", "salted", "--hot-keys", "auto", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["copied"] == EVENTS
    hot_keys = report["plan"]["hot_keys"]
    assert hot_keys[0] == keys.most_common(1)[0][0].decode()

    copies = _assert_exact_copy(settings, source, target)
    per_partition = Counter(c["partition"] for c in copies)
    after = skew.ratio([per_partition[p] for p in range(6)])
    assert after <= 1.3, (after, per_partition)
    assert report["skew_after"] == pytest.approx(after, abs=0.001)
    hottest = keys.most_common(1)[0][0]
    assert len({c["partition"] for c in copies if c["key"] == hottest}) == 6
    assert cli.main(["skew", target, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skew_size"] <= 1.3

    # A keyed pipeline reading the salted topic computes exactly the source's aggregates.
    pipelines = tmp_path / "pipelines"
    spec = make_pipeline(settings, pipelines, "product_sales", topic=target)
    # A transactional topic ends with a commit marker. The stream commits the offsets Spark
    # planned its micro-batches to, which pass the markers: it covers the topic to its end.
    ends = offsets.end_offsets(settings, target, "read_uncommitted")
    assert all(ends[p] > 1 + max(c["offset"] for c in copies if c["partition"] == p) for p in ends)
    stream = StreamProcess(settings, spec, pipelines, tmp_path / "stream.log")
    stream.start()
    try:
        assert_eventually(
            lambda: (
                {
                    p: o
                    for p, (o, _) in offsets.committed_offsets(
                        settings, spec.consumer_group, target
                    ).items()
                }
                == ends
            ),
            timeout=240,
            interval=1.0,
            message=f"the stream did not cover the salted topic; see {stream.log}",
        )
    finally:
        assert stream.stop() == 0, stream.tail()
    expected, bad = truth.expected(spec, original)
    assert not bad
    latest = read_latest(settings, spec)
    truth.assert_tables_equal(truth.changelog_table(spec, latest), expected)
    stream_group = spec.consumer_group
    skew_lag = cli.main(["skew", target, "--group", stream_group, "--json"])
    assert skew_lag == 0
    lags = {p["partition"]: p["lag"] for p in json.loads(capsys.readouterr().out)["partitions"]}
    assert lags == {p: 0 for p in range(6)}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--partitions", "3", "--missing-source"], "does not exist"),
        (["--partitions", "3", "--existing-target"], "exists with 2 partitions, not 3"),
        (["--partitions", "0"], "--partitions must be at least 1"),
        (["--partitions", "3", "--strategy", "salted", "--salts", "2"], "--salts needs hot keys"),
        (["--partitions", "3", "--salts", "2"], "apply to --strategy salted only"),
        (["--partitions", "3", "--strategy", "salted"], "needs --hot-keys"),
        (
            ["--partitions", "3", "--strategy", "salted", "--hot-keys", "a", "--salts", "4"],
            "--salts must be between 2 and --partitions",
        ),
    ],
)
def test_bad_arguments_exit_2_and_create_nothing(
    settings: Settings,
    topic: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
    arguments: list[str],
    message: str,
):
    monkeypatch.setenv("DUALITY_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    arguments = list(arguments)
    source, target = topic, f"{topic}-target"
    if "--missing-source" in arguments:
        arguments.remove("--missing-source")
    else:
        topics.create_topic(settings, source, 2)
    if "--existing-target" in arguments:
        arguments.remove("--existing-target")
        topics.create_topic(settings, target, 2)
    existed = topics.topic_exists(settings, target)
    code = cli.main(["repartition", source, "--to", target, *arguments])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert message in captured.err.replace("\n", " "), captured.err
    assert topics.topic_exists(settings, target) == existed
    assert topics.topic_exists(settings, source) == ("does not exist" not in message)
    group = f"duality-repartition-{target}"
    assert group not in offsets.consumer_groups(settings)


def test_skew_of_a_missing_topic_exits_2(
    settings: Settings, topic: str, monkeypatch: pytest.MonkeyPatch, capsys
):
    monkeypatch.setenv("DUALITY_BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    assert cli.main(["skew", topic]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_continuous_mirrors_new_records_until_stopped(
    settings: Settings, topic: str, tmp_path: Path
):
    source, target = topic, f"{topic}-3p"
    topics.create_topic(settings, source, 2)
    _produce(settings, tmp_path, source, 5_000, 1.1, seed=61)
    log = tmp_path / "continuous.log"
    job = _job(settings, log, source, "--to", target, "--partitions", "3", "--continuous")
    plan = repartition.plan(settings, source, target, 3)

    def copied() -> int:
        return sum(o for o, _ in offsets.committed_offsets(settings, plan.group, source).values())

    try:
        assert_eventually(lambda: copied() >= 5_000, timeout=120, message=f"see {log}")
        _produce(settings, tmp_path, source, 2_000, 1.1, seed=62)
        assert_eventually(lambda: copied() >= 7_000, timeout=60, message=f"see {log}")
    finally:
        job.terminate()
        out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, log.read_text()[-3000:]
    report = json.loads(out)
    assert report["copied"] == 7_000 and report["rounds"] >= 2
    _assert_exact_copy(settings, source, target)

    # Resuming into the same target with another plan is refused before anything is done.
    with pytest.raises(UsageError, match="is being filled by another plan"):
        repartition.plan(settings, source, target, 3, "salted", "product-000000")


def test_resume_after_a_copier_died_between_offset_commit_and_commit(
    settings: Settings, spark, topic: str, tmp_path: Path
):
    source, target = topic, f"{topic}-3p"
    topics.create_topic(settings, source, 2)
    _produce(settings, tmp_path, source, 5_000, 1.1, seed=71)
    plan = repartition.plan(settings, source, target, 3)
    repartition.ensure_target(settings, plan)
    # A copier of partition 0 that wrote records and its offset commit, then died.
    zombie = client.producer(settings, transactional_id=plan.transactional_id(0))
    zombie.init_transactions(60)
    zombie.begin_transaction()
    for _ in range(100):
        records.send(zombie, target, b"zombie", b"never committed")
    group = client.consumer(settings, plan.group)
    zombie.send_offsets_to_transaction(
        [TopicPartition(source, 0, 100, plan.metadata())], group.consumer_group_metadata(), 60
    )
    group.close()
    assert zombie.flush(30) == 0

    # Checking the arguments does not wait for the dead transaction; the run fences it.
    assert repartition.plan(settings, source, target, 3) == plan
    report = repartition.run(settings, plan)
    assert report.copied == 5_000
    _assert_exact_copy(settings, source, target)

    # The target is transactional (commit markers after the records): a copy of it covers its
    # end offsets exactly, so a later run (or --continuous) finds nothing left to do.
    second = repartition.plan(settings, target, f"{target}-again", 2)
    assert repartition.run(settings, second).copied == 5_000
    _assert_exact_copy(settings, target, second.target)
    left = repartition.remaining(settings, second, offsets.end_offsets(settings, target))
    assert left == {0: 0, 1: 0, 2: 0}
