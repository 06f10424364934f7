"""State partitions without a stream: the number in force, the one a checkpoint fixed, and the
errors of a start or a rescale that would not agree with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from duality.config import SHIPPED_PIPELINES, Settings
from duality.errors import UsageError
from duality.spec import PipelineSpec, load_spec
from duality.stream import rescale, seeding


def _spec(tmp_path: Path, parallelism: int | None = None) -> PipelineSpec:
    data = yaml.safe_load((SHIPPED_PIPELINES / "product_sales.yaml").read_text())
    if parallelism is not None:
        data["parallelism"] = parallelism
    path = tmp_path / "pipelines" / "product_sales.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def test_the_number_in_force_comes_from_the_spec_then_the_settings_then_spark(tmp_path: Path):
    local = Settings(home=tmp_path, spark_master="local[3]")
    assert seeding.state_partitions(local, _spec(tmp_path)) == 3
    cluster = Settings(home=tmp_path, spark_master="spark://h:7077")
    assert seeding.state_partitions(cluster, _spec(tmp_path)) == 4
    assert seeding.state_partitions(cluster.replace(stream_partitions=6), _spec(tmp_path)) == 6
    chosen = _spec(tmp_path, parallelism=8)
    assert seeding.state_partitions(cluster.replace(stream_partitions=6), chosen) == 8
    with pytest.raises(UsageError, match="DUALITY_STREAM_PARTITIONS=0: set it to 1 or more"):
        Settings(home=tmp_path, stream_partitions=0)


def test_a_bad_parallelism_names_the_field(tmp_path: Path):
    with pytest.raises(UsageError, match="parallelism"):
        _spec(tmp_path, parallelism=0)


def test_the_checkpoint_says_its_number(tmp_path: Path):
    spec = _spec(tmp_path)
    checkpoint = tmp_path / "checkpoint"
    assert seeding.checkpoint_partitions(checkpoint) is None
    seeding.prepare_checkpoint(spec, checkpoint, 8)
    assert seeding.checkpoint_partitions(checkpoint) == 8
    # A checkpoint from before duality recorded it: Spark's offset log has the number.
    marker = checkpoint / "duality-engine.json"
    marker.write_text(
        json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "partitions"})
    )
    (checkpoint / "offsets").mkdir()
    conf = {"spark.sql.shuffle.partitions": "2"}
    (checkpoint / "offsets" / "0").write_text(
        "v1\n" + json.dumps({"batchWatermarkMs": 0, "conf": conf}) + '\n{"t":{"0":5}}\n'
    )
    assert seeding.checkpoint_partitions(checkpoint) == 2


def test_a_start_with_another_number_names_the_rescale(tmp_path: Path):
    spec = _spec(tmp_path)
    checkpoint = tmp_path / "checkpoint"
    seeding.prepare_checkpoint(spec, checkpoint, 4)
    (checkpoint / "offsets").mkdir()
    (checkpoint / "offsets" / "0").write_text('v1\n{"conf": {}}\n{"t":{"0":5}}\n')
    assert seeding.checkpoint_usable(spec, checkpoint, 4)
    with pytest.raises(UsageError) as raised:
        seeding.checkpoint_usable(spec, checkpoint, 8)
    message = str(raised.value)
    assert "has 4 state partitions" in message
    assert f"duality stream rescale {spec.name} --partitions 8" in message


def test_a_rescale_the_next_start_would_refuse_stops_before_any_work(tmp_path: Path):
    settings = Settings(home=tmp_path, spark_master="local[2]", checkpoint_root=tmp_path / "cp")
    spec = _spec(tmp_path, parallelism=4)
    with pytest.raises(UsageError, match=r"set `parallelism: 8` in its spec first"):
        rescale.plan(settings, spec, 8)
    with pytest.raises(UsageError, match="has no checkpoint"):
        rescale.plan(settings, spec, None)
