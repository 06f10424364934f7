"""Pipeline specs: the YAML files of `DUALITY_PIPELINES`, loaded and validated with pydantic.

Computed `fields`, the `where` filter and aggregate arguments are expressions of the language of
`duality.expressions`, parsed into data and type-checked when the spec loads; nothing from a spec
is ever evaluated or pasted into SQL. The join's part (`tables`, `join`) is `duality.join.spec`'s.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from duality.avro.source import AvroSource
from duality.config import Settings
from duality.errors import UsageError
from duality.expressions import checking, parsing
from duality.expressions.tree import Call, Expression, ExpressionError
from duality.join.spec import Join, JoinedTable, Table, joined_table
from duality.schema import FIELD, KEY_TYPES, SQL_TYPES, FieldType, field_names
from duality.storage import Location

NAME = r"^[a-z][a-z0-9_]*$"
NUMERIC: tuple[str, ...] = ("long", "int", "double")
FUNCTIONS = checking.AGGREGATES
_ONE_ARGUMENT = "count(), sum(x), min(x), max(x), avg(x), count_distinct(x), latest(x), " + (
    "earliest(x), stddev(x) or count_if(condition)"
)
_DURATION = re.compile(
    r"^\s*(\d+)\s*(second|seconds|minute|minutes|hour|hours|day|days)\s*$", re.IGNORECASE
)
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


@dataclasses.dataclass(frozen=True)
class Aggregate:
    """One output column: an aggregate function of an expression (none for `count()`).

    `type` is the column's type and `argument` a typed expression once the spec has checked it.
    """

    function: str
    argument: Expression | None = None
    type: str = ""

    @classmethod
    def parse(cls, text: str, key: str | None = None) -> Aggregate:
        """`sum(quantity * price)` -> Aggregate; the argument is parsed, not yet typed."""
        parsed = parsing.parse(text, key)
        call = parsed.tree
        if not isinstance(call, Call):
            raise ExpressionError(
                f"an aggregate is one call of {_ONE_ARGUMENT}; this is an expression",
                key,
                call.pos,
            )
        if call.name not in FUNCTIONS:
            what = f"unknown function {call.name!r}"
            if call.name in checking.FUNCTIONS:
                what = f"{call.name}() is a function, not an aggregate"
            raise ExpressionError(f"{what}: write {_ONE_ARGUMENT}", key, call.pos)
        wanted = 0 if call.name == "count" else 1
        if len(call.args) != wanted:
            usage = (
                "count() counts records and takes no argument"
                if wanted == 0
                else (f"{call.name}() takes one argument, as in {call.name}(amount)")
            )
            raise ExpressionError(f"{usage}; got {len(call.args)}", key, call.pos)
        if wanted == 0:
            return cls(call.name)
        inner = text[text.index("(") + 1 : text.rindex(")")].strip()
        return cls(call.name, Expression(inner, key or "", call.args[0]))

    def check(self, scope: Mapping[str, str], key: str, unknown: Any = None) -> Aggregate:
        """This aggregate typed against `scope`; errors name `key` and the position."""
        if self.argument is None:
            return dataclasses.replace(self, type="long")
        argument = checking.check(dataclasses.replace(self.argument, key=key), scope, unknown)
        kind, name, pos = argument.type, self.function, argument.tree.pos
        needs = {
            "sum": (NUMERIC, "a number"),
            "avg": (NUMERIC, "a number"),
            "stddev": (NUMERIC, "a number"),
            "min": ((*NUMERIC, "timestamp"), "a number or a timestamp"),
            "max": ((*NUMERIC, "timestamp"), "a number or a timestamp"),
            "count_if": (("boolean",), "a boolean condition"),
        }
        allowed, what = needs.get(name, (tuple(SQL_TYPES), "a value"))
        if kind not in allowed:
            shown = f"{argument.field} is a {kind}" if argument.field else f"got a {kind}"
            if kind == "null":
                shown = "the argument is always null"
            raise ExpressionError(f"{name}() needs {what}; {shown}", key, pos)
        if name in ("count_if", "count_distinct"):
            result = "long"
        elif name in ("avg", "stddev"):
            result = "double"
        elif name == "sum":
            result = "long" if kind in ("int", "long") else "double"
        else:  # min, max, latest, earliest
            result = kind
        return dataclasses.replace(self, argument=argument, type=result)

    @property
    def field(self) -> str | None:
        """The field name when the argument is a plain field, else None."""
        return self.argument.field if self.argument is not None else None

    def __str__(self) -> str:
        return f"{self.function}({self.argument or ''})"


def _to_aggregate(value: Any) -> Aggregate:
    if isinstance(value, Aggregate):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not an aggregate: write {_ONE_ARGUMENT}")
    return Aggregate.parse(value)


AggregateExpr = Annotated[
    Aggregate,
    PlainValidator(_to_aggregate),
    PlainSerializer(str),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^\s*[a-z_]+\s*\(.*\)\s*$",
            "description": f"An aggregate: {_ONE_ARGUMENT}, of an expression "
            "(docs/streams.md#expressions)",
            "examples": ["count()", "sum(quantity * price)", "count_if(quantity >= 10)"],
        }
    ),
]


def parse_duration(text: str) -> int:
    """'10 minutes' -> 600 seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(
            f"{text!r} is not a duration: write a number and a unit, as in '10 minutes' "
            "(seconds, minutes, hours, days)"
        )
    amount, unit = int(match.group(1)), match.group(2).lower().rstrip("s")
    if amount < 1:
        raise ValueError(f"{text!r}: a duration must be positive")
    return amount * _UNIT_SECONDS[unit]


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    topic: str = Field(min_length=1, max_length=249, pattern=r"^[a-zA-Z0-9._-]+$")
    # `avro`: the Confluent wire format, its schemas from the registry (docs/streams.md#formats).
    format: Literal["json", "avro"] = "json"
    # An Avro source's registry subject; unset, `<topic>-value` (TopicNameStrategy).
    subject: str | None = Field(default=None, min_length=1)
    # An Avro source may leave it out: the columns are then its subject's latest version's.
    fields: dict[str, FieldType] = Field(alias="schema", default_factory=dict)
    key: list[str]
    event_time: str | None = None
    # Larger records go to the dead-letter topic as oversized.
    max_record_bytes: int = Field(default=65_536, ge=1_024, le=10_000_000)

    @field_validator("fields")
    @classmethod
    def _field_names(cls, value: dict[str, FieldType]) -> dict[str, FieldType]:
        return field_names(value)

    @field_validator("key", mode="before")
    @classmethod
    def _key_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    _avro: AvroSource | None = PrivateAttr(default=None)
    _columns_known: bool = PrivateAttr(default=True)

    @model_validator(mode="after")
    def _avro_schema(self, info: ValidationInfo) -> Source:
        """An Avro source's columns and reader schema from its subject (decision 38); with
        `registry: False` in the context (the DAG file's parse), the registry is not asked."""
        if self.format != "avro":
            if self.subject is not None:
                raise ValueError("subject: only an Avro source (format: avro) has one")
            if not self.fields:
                raise ValueError("schema: a JSON source lists its fields")
            return self
        context = info.context or {}
        if context.get("registry") is False:
            self._columns_known = bool(self.fields)
            return self
        from duality.avro.source import resolve

        settings = context.get("settings") or Settings.from_env()
        self._avro = resolve(settings, self.topic, self.subject, self.fields)
        if not self.fields:
            self.fields = dict(self._avro.columns)
        return self

    @property
    def avro(self) -> AvroSource | None:
        """An Avro source's subject, reader schema and where its columns came from; None for a
        JSON source, and for an Avro one loaded without its registry (`load_spec(...,
        registry=False)`)."""
        return self._avro

    @property
    def columns_known(self) -> bool:
        """False for an Avro source without `schema:` loaded without its registry: its columns
        (`fields`) are then empty, and the spec's expressions were not typed."""
        return self._columns_known

    @model_validator(mode="after")
    def _key_and_time_in_schema(self) -> Source:
        if not self.key:
            raise ValueError("key: name at least one field")
        if len(set(self.key)) != len(self.key):
            raise ValueError("key: a field is named twice")
        if self.event_time is not None and self._columns_known:
            if self.event_time not in self.fields:
                raise ValueError(f"event_time field {self.event_time!r} is not in the schema")
            if self.fields[self.event_time] != "timestamp":
                raise ValueError(
                    f"event_time field {self.event_time!r} is a {self.fields[self.event_time]}, "
                    "not a timestamp"
                )
        return self


class Window(BaseModel):
    """Tumbling windows of `size`, or hopping ones when `slide` (dividing `size`) is shorter."""

    model_config = ConfigDict(extra="forbid")

    size: str
    slide: str | None = Field(
        default=None,
        description="How far each window starts after the previous one; divides size. "
        "Default: size (tumbling windows).",
    )
    watermark: str

    @field_validator("size", "watermark")
    @classmethod
    def _duration(cls, value: str) -> str:
        parse_duration(value)
        return value

    @field_validator("slide")
    @classmethod
    def _slide_divides_size(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or "size" not in info.data:
            return value
        slide, size = parse_duration(value), parse_duration(info.data["size"])
        if size % slide:
            raise ValueError(
                f"{value!r} does not divide the size {info.data['size']!r}: a record is in "
                "size / slide windows, so use a slide that divides the size (or leave slide out "
                "for tumbling windows)"
            )
        return value

    @model_serializer(mode="wrap")
    def _without_default_slide(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A tumbling window dumps as before slide existed: the state layout's fingerprint of
        # today's checkpoints stays the same.
        data = handler(self)
        if isinstance(data, dict) and data.get("slide") is None:
            data.pop("slide", None)
        return data

    @property
    def size_seconds(self) -> int:
        return parse_duration(self.size)

    @property
    def slide_seconds(self) -> int:
        return parse_duration(self.slide) if self.slide is not None else self.size_seconds

    @property
    def watermark_seconds(self) -> int:
        return parse_duration(self.watermark)


class Changelog(BaseModel):
    model_config = ConfigDict(extra="forbid")

    topic: str | None = Field(default=None, pattern=r"^[a-zA-Z0-9._-]+$")
    partitions: int | None = Field(default=None, ge=1, le=10_000)


class Snapshot(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    # When the Airflow snapshot DAG runs: a cron expression or preset (@hourly, @daily).
    schedule: str = "@hourly"


class Expectation(BaseModel):
    """A Great Expectations check of the snapshot: the expectation's name and its arguments.

    Written like a GE suite's JSON, e.g. `{type: expect_column_values_to_be_between,
    kwargs: {column: revenue, min_value: 0}}`; the names and arguments are checked against
    Great Expectations when the suite is built (`duality spec validate` does it too).
    """

    model_config = ConfigDict(extra="forbid")

    type: str = Field(pattern=r"^expect_[a-z0-9_]+$")
    kwargs: dict[str, Any] = {}

    def columns(self) -> list[str]:
        """The snapshot columns the arguments name."""
        named = []
        for argument in ("column", "column_A", "column_B"):
            if isinstance(self.kwargs.get(argument), str):
                named.append(self.kwargs[argument])
        for argument in ("column_list", "column_set"):
            value = self.kwargs.get(argument)
            if isinstance(value, list):
                named.extend(str(item) for item in value)
        return named


# The DAGs each pipeline gets (dags/duality_pipelines.py, DESIGN §9).
DAG_KINDS = ("stream", "snapshot", "reset")


class PipelineSpec(BaseModel):
    """A pipeline: a source topic, computed fields, a filter, a group key, aggregates, and
    where the table goes."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=100)
    source: Source
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="Computed fields, in order: name -> expression of source fields and the "
        "fields above it (docs/streams.md#expressions).",
        examples=[{"revenue": "quantity * price"}],
    )
    where: str | None = Field(
        default=None,
        description="A boolean expression; records for which it is not true are skipped.",
        examples=["status = 'paid' and quantity > 0"],
    )
    aggregates: dict[str, AggregateExpr] = Field(min_length=1)
    tables: dict[str, Table] = Field(
        default_factory=dict,
        description="Tables the pipeline may join, by name (docs/streams.md#joins).",
    )
    join: list[Join] = Field(
        default_factory=list,
        description="The table each event is joined with; its columns are then named as "
        "<table>.<column> in fields, where, the key and aggregate arguments.",
    )
    window: Window | None = None
    changelog: Changelog = Changelog()
    snapshot: Snapshot = Snapshot()
    expectations: list[Expectation] = []
    # State partitions of the stream: Spark fixes them in the checkpoint, so a change needs
    # `duality stream rescale` (docs/streams.md#state-partitions). None: from the settings.
    parallelism: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="state partitions of the stream's aggregation (default: "
        "DUALITY_STREAM_PARTITIONS); changing it needs `duality stream rescale`",
    )

    _computed: dict[str, Expression] = PrivateAttr(default_factory=dict)
    _where: Expression | None = PrivateAttr(default=None)
    _joined: JoinedTable | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.match(NAME, value):
            raise ValueError(
                f"{value!r} is not a pipeline name: use lowercase letters, digits and _, "
                "starting with a letter (like product_sales)"
            )
        return value

    @model_validator(mode="after")
    def _expressions_typed(self, info: ValidationInfo) -> PipelineSpec:
        """The joined table, computed fields in order, then the filter, the key and the
        aggregates, typed."""
        context = info.context or {}
        if not self.source.columns_known:
            return self  # loaded without the registry: nothing to type against (columns_known)
        source = self.source.fields
        scope: dict[str, str] = dict(source)
        try:
            self._joined = joined_table(self, context, _table_loader(context))
        except _ColumnsUnknown:
            self.source._columns_known = False  # its table's columns are not known either
            return self
        if self._joined is not None:
            scope |= self._joined.qualified()
            self._key_on_table_columns()
        for name, text in self.fields.items():
            key = f"fields.{name}"
            if name in source:
                raise ExpressionError(
                    f"{name!r} is a source field: a computed field may not shadow it; "
                    "choose another name",
                    key,
                )
            if not re.match(FIELD, name) or name.startswith("_"):
                raise ExpressionError(
                    "a field name is letters, digits and _, starting with a letter", key
                )
            if name.lower() in parsing.KEYWORDS:
                raise ExpressionError(f"{name!r} is a keyword of the expression language", key)
            later = list(self.fields)[list(self.fields).index(name) :]

            def unknown(field: str, later: list[str] = later, name: str = name) -> str:
                if field == name:
                    return f"field {field!r} is defined in terms of itself"
                if field in later:
                    return (
                        f"field {field!r} is used before it is defined: fields are computed "
                        f"in order, so define {field} above {name}"
                    )
                return ""

            expression = checking.typed(str(text), key, scope, unknown)
            if expression.type == "null":
                raise ExpressionError("the value is always null, so it has no type", key, 1)
            self._computed[name] = expression
            scope[name] = expression.type
        if self.where is not None:
            where = checking.typed(str(self.where), "where", scope)
            if where.type != "boolean":
                raise ExpressionError(
                    f"where must be a boolean condition, as in status = 'paid'; got a {where.type}",
                    "where",
                    1,
                )
            self._where = where
        for name in self.source.key:
            if name not in scope:
                raise ExpressionError(
                    f"key field {name!r} is neither in the schema nor a computed field: key on "
                    f"one of {', '.join(scope)}",
                    "source.key",
                )
            if scope[name] not in KEY_TYPES:
                raise ExpressionError(
                    f"key field {name!r} is a {scope[name]}: key on string, long, int or "
                    "boolean fields",
                    "source.key",
                )
        for column, aggregate in self.aggregates.items():
            key = f"aggregates.{column}"
            if not re.match(NAME, column):
                raise ExpressionError(f"the column name must match {NAME}", key)
            if column in self.source.key or column in ("window_start", "window_end"):
                raise ExpressionError(f"aggregate column {column!r} clashes with a key column", key)
            self.aggregates[column] = aggregate.check(scope, key)
        return self

    @model_validator(mode="after")
    def _window_and_expectations(self) -> PipelineSpec:
        if self.window is not None and self.source.event_time is None:
            raise ValueError("window: a windowed pipeline needs source.event_time")
        if not self.source.columns_known:
            return self  # a key on a table's column is not renamed yet (_key_on_table_columns)
        for index, expectation in enumerate(self.expectations):
            for column in expectation.columns():
                if column not in self.snapshot_columns:
                    raise ValueError(
                        f"expectations[{index}] ({expectation.type}) names column {column!r}, "
                        f"which the snapshot does not have; its columns are "
                        f"{', '.join(self.snapshot_columns)}"
                    )
        return self

    def _key_on_table_columns(self) -> None:
        """A key entry naming a table column (`customers.tier`) keys on a computed field of
        the column's name (`tier`), which the fields compute first."""
        assert self._joined is not None
        for index, name in enumerate(self.source.key):
            table, dot, column = name.partition(".")
            if not dot:
                continue
            if table != self._joined.name or column not in self._joined.columns:
                known = ", ".join(self._joined.qualified())
                raise ExpressionError(
                    f"{name!r} is no column of the joined table (its columns: {known})",
                    "source.key",
                )
            if column in self.source.fields or column in self.fields:
                raise ExpressionError(
                    f"{name!r} would be the key column {column!r}, which clashes with a field "
                    f"of that name: define a field of another name (fields: {{{table}_{column}: "
                    f"{name}}}) and key on it",
                    "source.key",
                )
            self.fields = {column: name, **self.fields}
            self.source.key[index] = column

    @property
    def joined(self) -> JoinedTable | None:
        """The table each event is joined with, resolved and typed; None without a join."""
        return self._joined

    # -- expressions and types ---------------------------------------------------------------

    @property
    def computed_fields(self) -> dict[str, Expression]:
        """Each computed field's typed expression, in order (`.type` is its type)."""
        return dict(self._computed)

    @property
    def where_expression(self) -> Expression | None:
        """The typed `where` condition (a boolean), or None."""
        return self._where

    @property
    def field_types(self) -> dict[str, str]:
        """The type of every source field, then of every computed field."""
        return {**self.source.fields, **{n: e.type for n, e in self._computed.items()}}

    def field_type(self, name: str) -> str:
        """The type of a source or computed field."""
        return self.field_types[name]

    # -- derived names -----------------------------------------------------------------------

    @property
    def changelog_topic(self) -> str:
        return self.changelog.topic or f"{self.name}-changelog"

    @property
    def dlq_topic(self) -> str:
        return f"{self.name}-dlq"

    @property
    def table_topic(self) -> str:
        """The joined table's rows as the stream's state holds them, written in each
        micro-batch's transaction: what a restore without checkpoint reads back (compacted)."""
        assert self._joined is not None, f"pipeline {self.name} joins no table"
        return f"{self.name}-table-{self._joined.name}"

    @property
    def consumer_group(self) -> str:
        """The group whose committed offsets say what the changelog covers."""
        return f"duality-{self.name}"

    def dag_id(self, kind: str) -> str:
        """The Airflow DAG of this pipeline that does `kind`: stream, snapshot or reset."""
        assert kind in DAG_KINDS, kind
        return f"duality_{self.name}_{kind}"

    @cached_property
    def key_columns(self) -> list[str]:
        return [*self.source.key, *(["window_start"] if self.window else [])]

    @cached_property
    def required_fields(self) -> list[str]:
        """The source fields the spec uses anywhere: key, a join's `on`, computed fields, where,
        aggregates, event time, in that order."""
        names = list(self.source.key)
        names += self._joined.on.fields if self._joined is not None else []
        for expression in [
            *self._computed.values(),
            *([self._where] if self._where else []),
            *(a.argument for a in self.aggregates.values() if a.argument is not None),
        ]:
            names += expression.fields
        names += [self.source.event_time] if self.source.event_time else []
        return [n for n in dict.fromkeys(names) if n in self.source.fields]

    @property
    def snapshot_columns(self) -> list[str]:
        """The Delta snapshot's columns: key columns, aggregate columns, `_updated_at`."""
        return [*self.key_columns, *self.aggregates, "_updated_at"]

    def snapshot_path(self, settings: Settings) -> Location:
        if self.snapshot.path:
            return settings.location(self.snapshot.path)
        return settings.warehouse / self.name


class _ColumnsUnknown(Exception):
    """A joined pipeline's columns are not known: it was loaded without the registry."""


def _table_loader(context: Mapping[str, Any]) -> Any:
    """How a joined pipeline's spec is read: as this one is (with or without the registry)."""
    if context.get("registry") is not False:
        return load_spec

    def load(path: Path, reading: tuple[str, ...]) -> PipelineSpec:
        other = load_spec(path, reading, context.get("settings"), registry=False)
        if not other.source.columns_known:
            raise _ColumnsUnknown(path)
        return other

    return load


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("function-after", "function-before")]
    if parts[:2] == ["source", "fields"]:
        parts[1] = "schema"
    return ".".join(parts) or "(top level)"


def parse_spec(
    data: Any,
    origin: str,
    folder: Path | None = None,
    reading: tuple[str, ...] = (),
    settings: Settings | None = None,
    registry: bool = True,
) -> PipelineSpec:
    """Validate already-parsed YAML; errors name the origin, the spec key (`fields.band`), the
    position in an expression and the reason. A pipeline's table is looked up in `folder`;
    `reading` are the pipelines whose tables led here. An Avro source's schemas come from the
    registry of `settings` (default: the environment's); with `registry` False it is not asked,
    and an Avro source without `schema:` has no columns yet (`Source.columns_known`)."""
    if not isinstance(data, dict):
        raise UsageError(f"{origin}: a pipeline spec is a YAML mapping, got {type(data).__name__}")
    try:
        context = {"folder": folder, "reading": reading, "settings": settings, "registry": registry}
        return PipelineSpec.model_validate(data, context=context)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            cause = item.get("ctx", {}).get("error")
            if isinstance(cause, ExpressionError) and cause.key:
                problems.append(f"  {cause}")
                continue
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"  {_location(item['loc'])}: {message}")
        raise UsageError(f"{origin}: invalid pipeline spec\n" + "\n".join(problems)) from None


def load_spec(
    path: Path,
    reading: tuple[str, ...] = (),
    settings: Settings | None = None,
    registry: bool = True,
) -> PipelineSpec:
    """The spec in `path`, validated. `registry=False` loads it without asking an Avro
    source's schema registry, for what needs no columns: the DAG file, which Airflow parses
    every few seconds, must not depend on the registry being up (the task that runs the stream
    loads the spec again with it, and stops with an error naming the setting when it is down)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise UsageError(f"{path}: cannot read the spec ({error.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise UsageError(f"{path}: not valid YAML: {error}") from None
    spec = parse_spec(data, str(path), path.parent, reading, settings, registry)
    if path.stem != spec.name:
        raise UsageError(
            f"{path}: the file is named {path.stem!r} but the pipeline {spec.name!r}: "
            f"rename the file to {spec.name}.yaml"
        )
    return spec


def spec_files(settings: Settings) -> list[Path]:
    folder = settings.pipelines
    if not folder.is_dir():
        raise UsageError(f"pipelines folder {folder} does not exist: set DUALITY_PIPELINES")
    return sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])


def find_spec(settings: Settings, name_or_path: str, registry: bool = True) -> PipelineSpec:
    """A spec by pipeline name (looked up in the pipelines folder) or by file path; `registry`
    as `load_spec`'s."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        return load_spec(candidate, settings=settings, registry=registry)
    for path in spec_files(settings):
        if path.stem == name_or_path:
            return load_spec(path, settings=settings, registry=registry)
    known = ", ".join(p.stem for p in spec_files(settings)) or "none"
    raise UsageError(
        f"no pipeline {name_or_path!r} in {settings.pipelines} (known: {known}); "
        "name a pipeline or a spec file"
    )


def json_schema() -> dict[str, Any]:
    return PipelineSpec.model_json_schema(by_alias=True)


# -- the topics the scheduled repartition DAG looks after ----------------------------------


class RepartitionTopic(BaseModel):
    """One hot topic and the repartitioned copy its consumers read."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(min_length=1)
    target: str = Field(min_length=1)
    partitions: int = Field(ge=1)
    strategy: Literal["key-hash", "salted"] = "key-hash"
    hot_keys: str | None = None
    salts: int | None = Field(default=None, ge=2)


class RepartitionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    topics: list[RepartitionTopic] = Field(default_factory=list)


def load_repartition_config(settings: Settings) -> RepartitionConfig:
    """`DUALITY_REPARTITION_CONFIG` (YAML); a missing file means no topic is looked after."""
    path = settings.repartition_config
    if not path.is_file():
        return RepartitionConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise UsageError(f"{path}: not valid YAML: {error}") from None
    try:
        return RepartitionConfig.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(
            f"{_location(tuple(e['loc']))}: {e['msg']}" for e in error.errors(include_url=False)
        )
        raise UsageError(f"{path}: {problems}") from None
