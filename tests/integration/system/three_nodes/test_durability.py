"""Durable topics on a three-node KRaft cluster of our own: every topic duality creates gets the
replication factor and min.insync.replicas the settings call for, and `duality status` reports
one that has fewer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from duality.config import Settings
from duality.kafka import topics
from duality.local.kraft import LocalKafkaCluster
from duality.spec import PipelineSpec
from duality.stream import heartbeat
from duality.stream.topics import ensure_topics
from tests.harness import assert_eventually, make_pipeline, run_duality


def _duality(
    settings: Settings, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_duality(settings, *args, "--json", env=env, timeout=120)


def _pipeline(settings: Settings, folder: Path) -> PipelineSpec:
    spec = make_pipeline(settings, folder, "product_sales")
    topics.create_topic(settings, spec.source.topic, 3)
    ensure_topics(settings, spec)
    return spec


def _status(settings: Settings) -> tuple[int, dict[str, Any], str]:
    result = _duality(settings, "status")
    report = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.returncode, report, result.stderr


def _listed(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["topic"]: t for t in report.get("broker", {}).get("topics", [])}


def test_every_topic_is_replicated_as_configured(cluster: LocalKafkaCluster, tmp_path: Path):
    settings = cluster.settings
    spec = _pipeline(settings, tmp_path / "pipelines")
    created = [spec.source.topic, spec.changelog_topic, spec.dlq_topic, heartbeat.STATUS_TOPIC]
    # A new topic reaches each broker's metadata in its own time, and a request may go to any.
    assert_eventually(
        lambda: [
            (r.topic, r.replication_factor, r.min_insync_replicas)
            for r in topics.replication(settings, created)
        ],
        [(t, 3, 2) for t in created],
        timeout=30,
    )

    pipelines = tmp_path / "pipelines"
    scoped = settings.replace(
        pipelines=pipelines, repartition_config=pipelines / "no-repartition.yaml"
    )
    ours = {spec.changelog_topic, spec.dlq_topic, heartbeat.STATUS_TOPIC}
    code, report, stderr = assert_eventually(
        lambda: _status(scoped),
        lambda seen: seen[0] == 0 and set(_listed(seen[1])) == ours,
        timeout=60,
        message="status exits 0 and lists the pipeline's and the heartbeats' topics",
    )
    assert report["broker"]["durability"] == {
        "replication_factor": 3,
        "min_insync_replicas": 2,
        "brokers": 3,
        "chosen_by": "cluster size",
    }
    assert not any(t["below_configured"] for t in _listed(report).values())

    # A pipeline whose changelog was made with one replica, as duality did before it read the
    # replication factor from the settings.
    short = make_pipeline(settings, tmp_path / "pipelines", "product_sales")
    topics.create_topic(settings.replace(replication_factor=1), short.changelog_topic, 3)
    code, report, stderr = assert_eventually(
        lambda: _status(scoped),
        lambda seen: short.changelog_topic in _listed(seen[1]),
        timeout=60,
        message="status lists the changelog made with one replica",
    )
    assert code == 1, stderr[-2000:]
    assert short.changelog_topic in stderr and "kafka-reassign-partitions" in stderr
    listed = _listed(report)
    assert listed[short.changelog_topic]["replication_factor"] == 1
    assert listed[short.changelog_topic]["below_configured"] is True
    assert listed[spec.changelog_topic]["below_configured"] is False

    # More replicas than brokers is a bad setting, named before any topic is made.
    result = _duality(scoped, "status", env={"DUALITY_REPLICATION_FACTOR": "4"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "DUALITY_REPLICATION_FACTOR=4" in result.stderr and "3 brokers" in result.stderr, (
        result.stderr[-2000:]
    )
