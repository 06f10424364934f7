"""The checkpoint, and the state seeded from the changelog without one: the latest `_state` per
key as Parquet files that a file source feeds into the aggregation (docs/streams.md). The
checkpoint is a local folder or a location on object storage (`s3a://…`, docs/streams.md)."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

from duality import storage
from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import offsets
from duality.schema import SQL_TYPES
from duality.spec import PipelineSpec
from duality.stream.query import partials_of, row_types, rows_schema

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger("duality.stream")

# Marks a checkpoint written by this engine, with the fingerprint of the state's layout.
_ENGINE_FILE = "duality-engine.json"
_ENGINE = "state-store-1"


def checkpoint_dir(settings: Settings, spec: PipelineSpec) -> storage.Location:
    return settings.checkpoint_root / spec.name


def make_folder(folder: storage.Location) -> None:
    """`folder` there for a file source, which refuses a path that does not exist: on object
    storage, which has no folders, an empty marker object (`key/`) that S3A takes for one."""
    if isinstance(folder, storage.ObjectPath):
        folder.filesystem.create_dir(folder.arrow_path)
    else:
        folder.mkdir(parents=True, exist_ok=True)


def seeds_stream(
    spark: SparkSession, spec: PipelineSpec, checkpoint: storage.Location
) -> DataFrame:
    folder = checkpoint / "seed"
    make_folder(folder)
    return spark.readStream.schema(rows_schema(spec)).parquet(str(folder))


def write_seed(
    spark: SparkSession, settings: Settings, spec: PipelineSpec, checkpoint: storage.Location
) -> int:
    """The changelog's latest `_state` per key, read_committed, as Parquet seed files; returns
    the number of keys. Tombstones remove their key."""
    from pyspark.sql import functions as F

    folder = checkpoint / "seed"
    storage.remove_tree(folder)
    # A first start: nothing to read, no Spark job.
    if offsets.is_empty(settings, spec.changelog_topic):
        make_folder(folder)
        return 0
    raw = (
        spark.read.format("kafka")
        .options(**settings.spark_kafka_source_options())
        .option("subscribe", spec.changelog_topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    latest = raw.groupBy("key").agg(F.max_by("value", "offset").alias("value"))
    seeds = seed_rows(spec, latest.where(F.col("value").isNotNull()))
    # Written in place, no rename (object storage has none): the seed is read only by a query
    # that starts after this returns, and a start interrupted before its first offsets are
    # logged empties the whole checkpoint again (`checkpoint_usable`, `prepare_checkpoint`).
    # Overwritten: a standby building its query ahead may have made the folder meanwhile.
    seeds.write.mode("overwrite").parquet(str(folder))
    return spark.read.parquet(str(folder)).count()


def seed_rows(spec: PipelineSpec, values: DataFrame) -> DataFrame:
    """Rows of the aggregation's input (`row_types`) from changelog values (`value`, JSON):
    each key's `_state`, for its own window."""
    from pyspark.sql import functions as F

    state_ddl = ", ".join(f"`{p.name}` {p.type}" for p in partials_of(spec))
    # A sketch is base64 in the JSON, which reads back as binary.
    parsed = _parsed(spec, values, f"`_state` struct<{state_ddl}>")
    state = {p.column: F.col(f"v._state.`{p.name}`") for p in partials_of(spec)}
    columns: list[Column] = []
    for column, kind in row_types(spec).items():
        if column in spec.source.key:
            value = F.col(f"v.`{column}`")
        elif column == "_ts":
            value = F.to_timestamp("v.window_start")
        elif column == "_fresh":
            value = F.lit(0)
        else:
            value = state.get(column, F.lit(None))  # none for a sketch's raw values
        columns.append(value.cast(kind).alias(column))
    return parsed.select(*columns)


def through_rows(spec: PipelineSpec, values: DataFrame) -> DataFrame:
    """Each hopping window's key columns (`_ts`: its start) and `_through`, the source end
    offsets of the micro-batch that last updated it (`ChangelogWriter`), from changelog values."""
    from pyspark.sql import functions as F

    parsed = _parsed(spec, values, "`_through` map<string, bigint>")
    keys = [F.col(f"v.`{f}`").alias(f) for f in spec.source.key]
    return parsed.select(*keys, F.to_timestamp("v.window_start").alias("_ts"), "v._through")


def _parsed(spec: PipelineSpec, values: DataFrame, more: str) -> DataFrame:
    """Changelog values (`value`, JSON) parsed into `v`: the key fields, the window start as
    text, and `more` (DDL)."""
    from pyspark.sql import functions as F

    fields = [f"`{f}` {SQL_TYPES[spec.field_type(f)]}" for f in spec.source.key]
    fields += ["`window_start` string"] if spec.window is not None else []
    schema = ", ".join([*fields, more])
    return values.select(F.from_json(F.col("value").cast("string"), schema).alias("v"))


def state_layout(spec: PipelineSpec) -> str:
    """What the state's schema depends on; a checkpoint of another layout cannot be resumed."""
    layout: dict[str, Any] = {
        "key": spec.source.key,
        "types": [spec.field_type(f) for f in spec.source.key],
        "window": spec.window.model_dump() if spec.window else None,
        "partials": rows_schema(spec),
    }
    # Only when used, so that the layout of a spec without them is as before they existed.
    if spec.fields:
        layout["fields"] = spec.fields
    if spec.where is not None:
        layout["where"] = spec.where
    if spec.joined is not None:  # the join's operator and seed source are in the query's plan
        layout["join"] = [
            spec.joined.topic,
            spec.joined.columns,
            spec.joined.key,
            spec.joined.on.text,
        ]
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def state_partitions(settings: Settings, spec: PipelineSpec) -> int:
    """The state partitions a stream of `spec` runs with: its `parallelism`, else
    DUALITY_STREAM_PARTITIONS, else Spark's default here (`spark.default_partitions`)."""
    from duality.spark import default_partitions

    if spec.parallelism is not None:
        return spec.parallelism
    if settings.stream_partitions is not None:
        return settings.stream_partitions
    return default_partitions(settings)


def checkpoint_partitions(checkpoint: storage.Location) -> int | None:
    """The state partitions `checkpoint` fixed: as duality recorded them, else as Spark's
    offset log records its `spark.sql.shuffle.partitions`; None without a checkpoint."""
    marker = checkpoint / _ENGINE_FILE
    if marker.is_file():
        recorded = json.loads(marker.read_text()).get("partitions")
        if recorded is not None:
            return int(recorded)
    offsets = checkpoint / "offsets"
    logged = sorted(
        (int(f.name) for f in offsets.iterdir() if f.name.isdigit()) if offsets.is_dir() else []
    )
    if not logged:
        return None
    metadata = json.loads((offsets / str(logged[-1])).read_text().splitlines()[1])
    value = metadata.get("conf", {}).get("spark.sql.shuffle.partitions")
    return int(value) if value is not None else None


def checkpoint_usable(spec: PipelineSpec, checkpoint: storage.Location, partitions: int) -> bool:
    """Whether the query can resume from `checkpoint` rather than seed from the changelog; a
    checkpoint of another state layout, or of another number of state partitions than
    `partitions`, is a usage error."""
    offsets = checkpoint / "offsets"
    if not offsets.is_dir() or not any(offsets.iterdir()):
        return False
    marker = checkpoint / _ENGINE_FILE
    if not marker.is_file():
        log.warning(
            "%s: checkpoint %s was written by an older engine; rebuilding the state from %s",
            spec.name,
            checkpoint,
            spec.changelog_topic,
        )
        return False
    recorded = json.loads(marker.read_text())
    if recorded.get("layout") != state_layout(spec):
        raise UsageError(
            f"pipeline {spec.name}: its key, window, fields, filter or aggregates changed since "
            f"the checkpoint {checkpoint} was written, so neither it nor the changelog can be "
            f"resumed: run `duality reset {spec.name}` to recompute the table from the source"
        )
    fixed = checkpoint_partitions(checkpoint)
    if fixed is not None and fixed != partitions:
        raise UsageError(
            f"pipeline {spec.name}: its checkpoint {checkpoint} has {fixed} state partitions, "
            f"and it is asked to run with {partitions} (its spec's `parallelism`, else "
            f"DUALITY_STREAM_PARTITIONS): run `duality stream rescale {spec.name} --partitions "
            f"{partitions}` to rebuild its state in {partitions} from the changelog, or ask for "
            f"{fixed} again"
        )
    return True


def prepare_checkpoint(spec: PipelineSpec, checkpoint: storage.Location, partitions: int) -> None:
    """Empty the checkpoint folder and mark it as this engine's, with its state partitions."""
    storage.remove_tree(checkpoint)
    checkpoint.mkdir(parents=True)
    marker = {"engine": _ENGINE, "layout": state_layout(spec), "partitions": partitions}
    (checkpoint / _ENGINE_FILE).write_text(json.dumps(marker))
