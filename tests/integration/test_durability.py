"""Durable topics on a three-node KRaft cluster of our own: every topic duality creates gets the
replication factor and min.insync.replicas the settings call for, and `duality status` reports
one that has fewer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from duality import kafka, status, stream_job
from duality.config import Settings
from duality.local import LocalKafkaCluster, ephemeral_cluster
from duality.spec import PipelineSpec
from tests.harness import make_pipeline


@pytest.fixture(scope="module")
def cluster(base_settings: Settings) -> Iterator[LocalKafkaCluster]:
    with ephemeral_cluster(base_settings, brokers=3) as started:
        yield started


def _env(settings: Settings, pipelines: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DUALITY_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "DUALITY_PIPELINES": str(pipelines),
        "DUALITY_REPARTITION_CONFIG": str(pipelines / "no-repartition.yaml"),
        "DUALITY_LOCAL_DIR": str(settings.local_dir),
        "DUALITY_CHECKPOINT_ROOT": str(settings.checkpoint_root),
    }


def _duality(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duality.cli", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _pipeline(settings: Settings, folder: Path) -> PipelineSpec:
    spec = make_pipeline(settings, folder, "product_sales")
    kafka.create_topic(settings, spec.source.topic, 3)
    stream_job.ensure_topics(settings, spec)
    return spec


def test_every_topic_is_replicated_as_configured(cluster: LocalKafkaCluster, tmp_path: Path):
    settings = cluster.settings
    spec = _pipeline(settings, tmp_path / "pipelines")
    topics = [spec.source.topic, spec.changelog_topic, spec.dlq_topic, status.STATUS_TOPIC]
    rows = kafka.replication(settings, topics)
    assert [(r.topic, r.replication_factor, r.min_insync_replicas) for r in rows] == [
        (t, 3, 2) for t in topics
    ]

    env = _env(settings, tmp_path / "pipelines")
    result = _duality(env, "status")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)["broker"]
    assert report["durability"] == {
        "replication_factor": 3,
        "min_insync_replicas": 2,
        "brokers": 3,
        "chosen_by": "cluster size",
    }
    listed = {t["topic"]: t for t in report["topics"]}
    assert set(listed) == {spec.changelog_topic, spec.dlq_topic, status.STATUS_TOPIC}
    assert not any(t["below_configured"] for t in listed.values())

    # A pipeline whose changelog was made with one replica, as duality did before it read the
    # replication factor from the settings.
    short = make_pipeline(settings, tmp_path / "pipelines", "product_sales")
    kafka.create_topic(settings.replace(replication_factor=1), short.changelog_topic, 3)
    result = _duality(env, "status")
    assert result.returncode == 1, result.stdout[-2000:]
    assert short.changelog_topic in result.stderr and "kafka-reassign-partitions" in result.stderr
    listed = {t["topic"]: t for t in json.loads(result.stdout)["broker"]["topics"]}
    assert listed[short.changelog_topic]["replication_factor"] == 1
    assert listed[short.changelog_topic]["below_configured"] is True
    assert listed[spec.changelog_topic]["below_configured"] is False

    # More replicas than brokers is a bad setting, named before any topic is made.
    result = _duality({**env, "DUALITY_REPLICATION_FACTOR": "4"}, "status")
    assert result.returncode == 2
    assert "DUALITY_REPLICATION_FACTOR=4" in result.stderr and "3 brokers" in result.stderr
