"""The join's part of a pipeline spec (docs/streams.md#joins): the tables a pipeline may join
(`tables:`), its join (`join:`), and the joined table they resolve to, its `on` typed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from duality.errors import UsageError
from duality.expressions import checking
from duality.expressions.tree import Expression, ExpressionError
from duality.schema import KEY_TYPES, FieldType, field_names

if TYPE_CHECKING:
    from duality.avro.source import AvroSource
    from duality.spec import PipelineSpec

# How a pipeline's table is read: duality.spec.load_spec, passed in by the spec that joins it.
LoadSpec = Callable[[Path, tuple[str, ...]], "PipelineSpec"]


class Table(BaseModel):
    """A table a pipeline joins (docs/streams.md#joins): a compacted topic whose latest record
    per key is the row (a tombstone deletes it), or `pipeline: <name>`, another pipeline's table
    as its changelog publishes it. A topic's records are JSON, or Avro (`format: avro`, the
    Confluent wire format, decision 38): then `schema:` is the reader schema, checked against
    the versions of its subject (`subject`, else `<topic>-value`) when the spec loads."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    topic: str | None = Field(
        default=None, min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$"
    )
    format: Literal["json", "avro"] = "json"
    # An Avro table's registry subject; unset, `<topic>-value` (TopicNameStrategy).
    subject: str | None = Field(default=None, min_length=1)
    fields: dict[str, FieldType] | None = Field(default=None, alias="schema", min_length=1)
    key: str | None = None
    pipeline: str | None = None

    _avro: AvroSource | None = PrivateAttr(default=None)

    @field_validator("fields")
    @classmethod
    def _field_names(cls, value: dict[str, FieldType] | None) -> dict[str, FieldType] | None:
        return None if value is None else field_names(value)

    @model_validator(mode="after")
    def _topic_or_pipeline(self) -> Table:
        given = [
            n for n, v in (("topic", self.topic), ("schema", self.fields), ("key", self.key)) if v
        ]
        if self.pipeline is not None:
            if given:
                raise ValueError(
                    f"a pipeline's table takes `pipeline:` alone ({', '.join(given)} given): its "
                    "topic, schema and key are that pipeline's changelog's"
                )
            return self
        missing = [n for n in ("topic", "schema", "key") if n not in given]
        if missing:
            raise ValueError(
                f"a table needs {', '.join(missing)} (or `pipeline: <name>` for another "
                "pipeline's table)"
            )
        assert self.fields is not None and self.key is not None
        if self.key not in self.fields:
            raise ValueError(f"key {self.key!r} is not in the table's schema")
        if self.fields[self.key] not in KEY_TYPES:
            raise ValueError(
                f"key {self.key!r} is a {self.fields[self.key]}: key on a string, long, int or "
                "boolean field"
            )
        return self

    @model_validator(mode="after")
    def _avro_table(self, info: ValidationInfo) -> Table:
        """An Avro table's reader schema from its `schema:` and its subject's versions; with
        `registry: False` in the context (the DAG file's parse), the registry is not asked."""
        if self.format != "avro":
            if self.subject is not None:
                raise ValueError("subject: only an Avro table (format: avro) has one")
            return self
        if self.pipeline is not None:
            raise ValueError(
                "format: a pipeline's table is its changelog, which is JSON; leave format out"
            )
        context = info.context or {}
        if context.get("registry") is False:
            return self
        from duality.avro.source import resolve
        from duality.config import Settings

        assert self.topic is not None and self.fields is not None
        settings = context.get("settings") or Settings.from_env()
        self._avro = resolve(settings, self.topic, self.subject, self.fields)
        return self

    @property
    def avro(self) -> AvroSource | None:
        """An Avro table's subject and reader schema; None for a JSON one, and for an Avro one
        loaded without its registry."""
        return self._avro


class Join(BaseModel):
    """`join: [{table: customers, on: customer, type: left}]`: each event with the table's row
    whose key equals `on` (an expression over the event's source fields) as it stands then."""

    model_config = ConfigDict(extra="forbid")

    table: str
    on: str
    type: Literal["left", "inner"] = "left"

    @model_validator(mode="before")
    @classmethod
    def _on_read_as_true(cls, data: Any) -> Any:
        # YAML 1.1, which PyYAML reads, takes a bare `on` key for the boolean true.
        if isinstance(data, dict) and True in data and "on" not in data:
            data = {("on" if k is True else k): v for k, v in data.items()}
        return data


@dataclasses.dataclass(frozen=True)
class JoinedTable:
    """A joined table, resolved: its name in the spec, the topic it is read from, its columns
    (name -> type), its key column, how it is joined and the typed `on` expression. `pipeline`
    names the pipeline whose changelog it is, if any; `avro` is an Avro table's reader schema
    and registry."""

    name: str
    topic: str
    columns: dict[str, str]
    key: str
    type: str
    on: Expression
    pipeline: str | None = None
    avro: AvroSource | None = None

    @property
    def key_type(self) -> str:
        return self.columns[self.key]

    def qualified(self) -> dict[str, str]:
        """Its columns as the spec's expressions name them (`customers.tier`) and their types."""
        return {f"{self.name}.{c}": t for c, t in self.columns.items()}


def joined_table(
    spec: PipelineSpec, context: Mapping[str, Any], load: LoadSpec
) -> JoinedTable | None:
    """The spec's join resolved: its table (a pipeline's own, read with `load` from the
    pipelines folder that `context` names) and its `on` typed against the source fields."""
    for name in spec.tables:
        if name in spec.source.fields or name in spec.fields:
            raise ExpressionError(
                f"the table name clashes with the field {name!r}: rename the table",
                f"tables.{name}",
            )
    if not spec.join:
        return None
    if len(spec.join) > 1:
        raise ExpressionError(
            "a pipeline joins one table (Spark runs one such operator before the aggregation): "
            "join the other table in a pipeline of its own, and join that pipeline's table",
            "join",
        )
    join = spec.join[0]
    table = spec.tables.get(join.table)
    if table is None:
        known = ", ".join(spec.tables) or "none: declare it under tables"
        raise ExpressionError(f"no table {join.table!r} (tables: {known})", "join[0].table")
    avro = None
    if table.pipeline is not None:
        topic, columns, key = _pipeline_table(spec, join.table, table.pipeline, context, load)
    else:
        avro = table.avro
        assert table.topic is not None and table.fields is not None and table.key is not None
        topic, columns, key = table.topic, dict(table.fields), table.key
    if topic == spec.source.topic:
        raise ExpressionError(
            f"topic {topic!r} is the pipeline's source: a stream joins a table of another topic",
            f"tables.{join.table}",
        )
    on = checking.typed(join.on, "join[0].on", spec.source.fields)
    if on.type != columns[key]:
        raise ExpressionError(
            f"a {on.type}, but table {join.table} is keyed by {key}, a {columns[key]}: join on "
            f"an expression of type {columns[key]}",
            "join[0].on",
            1,
        )
    return JoinedTable(join.table, topic, columns, key, join.type, on, table.pipeline, avro)


def _pipeline_table(
    spec: PipelineSpec, name: str, pipeline: str, context: Mapping[str, Any], load: LoadSpec
) -> tuple[str, dict[str, str], str]:
    """Another pipeline's table: its changelog topic, columns (key, then aggregates) and key."""
    where = f"tables.{name}"
    reading = (*context.get("reading", ()), spec.name)
    if pipeline in reading:
        chain = " -> ".join([*reading, pipeline])
        raise ExpressionError(
            f"pipeline {pipeline!r} would read itself through a table ({chain})", where
        )
    folder = context.get("folder")
    if folder is None:
        raise ExpressionError(
            f"pipeline {pipeline!r} is looked up in the pipelines folder: load this spec from "
            "its file there",
            where,
        )
    path = next(
        (p for p in (folder / f"{pipeline}.yaml", folder / f"{pipeline}.yml") if p.is_file()), None
    )
    if path is None:
        known = ", ".join(sorted(p.stem for p in folder.glob("*.y*ml"))) or "none"
        raise ExpressionError(f"no pipeline {pipeline!r} in {folder} (known: {known})", where)
    try:
        other = load(path, reading)
    except UsageError as error:
        raise ExpressionError(f"pipeline {pipeline!r} does not load: {error}", where) from None
    if other.window is not None:
        raise ExpressionError(
            f"pipeline {pipeline!r} is windowed: its table has a row per key and window, and a "
            "join needs one row per key; join a pipeline without a window",
            where,
        )
    if len(other.source.key) != 1:
        raise ExpressionError(
            f"pipeline {pipeline!r} is keyed by {len(other.source.key)} fields: a join looks up "
            "one key; join a pipeline keyed by one field",
            where,
        )
    key = other.source.key[0]
    columns = {key: other.field_type(key), **{c: a.type for c, a in other.aggregates.items()}}
    return other.changelog_topic, columns, key
