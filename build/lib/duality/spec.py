"""Pipeline specs: the YAML files of `DUALITY_PIPELINES`, loaded and validated with pydantic.

Aggregates are parsed by a strict grammar (`count()`, `sum(f)`, `min(f)`, `max(f)`, `avg(f)`)
into data; nothing from a spec is ever evaluated or pasted into SQL.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from duality.config import Settings
from duality.errors import UsageError

NAME = r"^[a-z][a-z0-9_]*$"
FIELD = r"^[A-Za-z_][A-Za-z0-9_]*$"
FieldType = Literal["string", "long", "int", "double", "boolean", "timestamp"]
NUMERIC: tuple[str, ...] = ("long", "int", "double")
# Each field type as a Spark SQL type.
SQL_TYPES = {
    "string": "string",
    "long": "bigint",
    "int": "int",
    "double": "double",
    "boolean": "boolean",
    "timestamp": "timestamp",
}
FUNCTIONS = ("count", "sum", "min", "max", "avg")
_CALL = re.compile(r"^\s*([a-z_]+)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)?\s*\)\s*$")
_DURATION = re.compile(
    r"^\s*(\d+)\s*(second|seconds|minute|minutes|hour|hours|day|days)\s*$", re.IGNORECASE
)
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


class Aggregate(BaseModel):
    """One output column: a function applied to a source field (none for count)."""

    model_config = ConfigDict(frozen=True)

    function: Literal["count", "sum", "min", "max", "avg"]
    field: str | None = None

    @classmethod
    def parse(cls, text: str) -> Aggregate:
        match = _CALL.match(text)
        if not match:
            raise ValueError(
                f"{text!r} is not an aggregate: write count(), sum(field), min(field), "
                "max(field) or avg(field)"
            )
        function, field = match.groups()
        if function not in FUNCTIONS:
            raise ValueError(
                f"unknown function {function!r} in {text!r}: use one of "
                + ", ".join(f"{f}()" for f in FUNCTIONS)
            )
        if function == "count" and field is not None:
            raise ValueError(f"{text!r}: count() takes no field")
        if function != "count" and field is None:
            raise ValueError(f"{text!r}: {function}() needs a field, as in {function}(amount)")
        return cls(function=function, field=field)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.function}({self.field or ''})"


def _to_aggregate(value: Any) -> Any:
    if isinstance(value, str):
        return Aggregate.parse(value)
    if isinstance(value, Aggregate):
        return value
    raise ValueError(f"{value!r} is not an aggregate: write count(), sum(field), ...")


AggregateExpr = Annotated[
    Aggregate,
    BeforeValidator(_to_aggregate),
    PlainSerializer(str),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^(count\(\)|(sum|min|max|avg)\([A-Za-z_][A-Za-z0-9_]*\))$",
            "examples": ["count()", "sum(amount)", "avg(temperature)"],
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
    format: Literal["json"] = "json"
    fields: dict[str, FieldType] = Field(alias="schema", min_length=1)
    key: list[str]
    event_time: str | None = None
    # Larger records go to the dead-letter topic as oversized.
    max_record_bytes: int = Field(default=65_536, ge=1_024, le=10_000_000)

    @field_validator("fields")
    @classmethod
    def _field_names(cls, value: dict[str, FieldType]) -> dict[str, FieldType]:
        for name in value:
            if not re.match(FIELD, name):
                raise ValueError(f"field name {name!r} must match {FIELD}")
            if name.startswith("_"):
                raise ValueError(f"field name {name!r}: names starting with _ are duality's own")
        return value

    @field_validator("key", mode="before")
    @classmethod
    def _key_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _key_and_time_in_schema(self) -> Source:
        if not self.key:
            raise ValueError("key: name at least one field")
        for name in self.key:
            if name not in self.fields:
                raise ValueError(
                    f"key field {name!r} is not in the schema: add it to source.schema or "
                    f"key on one of {', '.join(self.fields)}"
                )
            if self.fields[name] not in ("string", "long", "int", "boolean"):
                raise ValueError(
                    f"key field {name!r} is a {self.fields[name]}: key on string, long, int or "
                    "boolean fields"
                )
        if len(set(self.key)) != len(self.key):
            raise ValueError("key: a field is named twice")
        if self.event_time is not None:
            if self.event_time not in self.fields:
                raise ValueError(f"event_time field {self.event_time!r} is not in the schema")
            if self.fields[self.event_time] != "timestamp":
                raise ValueError(
                    f"event_time field {self.event_time!r} is a {self.fields[self.event_time]}, "
                    "not a timestamp"
                )
        return self


class Window(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: str
    watermark: str

    @field_validator("size", "watermark")
    @classmethod
    def _duration(cls, value: str) -> str:
        parse_duration(value)
        return value

    @property
    def size_seconds(self) -> int:
        return parse_duration(self.size)

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


class PipelineSpec(BaseModel):
    """A pipeline: a source topic, a group key, aggregates, and where the table goes."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=100)
    source: Source
    aggregates: dict[str, AggregateExpr] = Field(min_length=1)
    window: Window | None = None
    changelog: Changelog = Changelog()
    snapshot: Snapshot = Snapshot()
    expectations: list[Expectation] = []

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
    def _aggregates_match_schema(self) -> PipelineSpec:
        fields = self.source.fields
        for column, aggregate in self.aggregates.items():
            if not re.match(NAME, column):
                raise ValueError(f"aggregate column {column!r} must match {NAME}")
            if column in self.source.key or column in ("window_start", "window_end"):
                raise ValueError(f"aggregate column {column!r} clashes with a key column")
            if aggregate.field is None:
                continue
            if aggregate.field not in fields:
                raise ValueError(
                    f"{column}: {aggregate} uses unknown field {aggregate.field!r}; the schema "
                    f"has {', '.join(fields)}"
                )
            kind = fields[aggregate.field]
            if aggregate.function in ("sum", "avg") and kind not in NUMERIC:
                raise ValueError(f"{column}: {aggregate} needs a numeric field, not a {kind}")
            if aggregate.function in ("min", "max") and kind not in (*NUMERIC, "timestamp"):
                raise ValueError(f"{column}: {aggregate} needs a numeric or timestamp field")
        if self.window is not None and self.source.event_time is None:
            raise ValueError("window: a windowed pipeline needs source.event_time")
        for index, expectation in enumerate(self.expectations):
            for column in expectation.columns():
                if column not in self.snapshot_columns:
                    raise ValueError(
                        f"expectations[{index}] ({expectation.type}) names column {column!r}, "
                        f"which the snapshot does not have; its columns are "
                        f"{', '.join(self.snapshot_columns)}"
                    )
        return self

    # -- derived names -----------------------------------------------------------------------

    @property
    def changelog_topic(self) -> str:
        return self.changelog.topic or f"{self.name}-changelog"

    @property
    def dlq_topic(self) -> str:
        return f"{self.name}-dlq"

    @property
    def consumer_group(self) -> str:
        """The group whose committed offsets say what the changelog covers."""
        return f"duality-{self.name}"

    @cached_property
    def key_columns(self) -> list[str]:
        return [*self.source.key, *(["window_start"] if self.window else [])]

    @cached_property
    def required_fields(self) -> list[str]:
        """The source fields a good record must have: key, aggregated fields, event time."""
        fields = list(self.source.key)
        for aggregate in self.aggregates.values():
            if aggregate.field and aggregate.field not in fields:
                fields.append(aggregate.field)
        if self.source.event_time and self.source.event_time not in fields:
            fields.append(self.source.event_time)
        return fields

    @property
    def snapshot_columns(self) -> list[str]:
        """The Delta snapshot's columns: key columns, aggregate columns, `_updated_at`."""
        return [*self.key_columns, *self.aggregates, "_updated_at"]

    def snapshot_path(self, settings: Settings) -> Path:
        if self.snapshot.path:
            return Path(self.snapshot.path)
        return settings.warehouse / self.name


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("function-after", "function-before")]
    return ".".join(part.replace("fields", "schema") for part in parts) or "(top level)"


def parse_spec(data: Any, origin: str) -> PipelineSpec:
    """Validate already-parsed YAML; errors name the origin, the field and the reason."""
    if not isinstance(data, dict):
        raise UsageError(f"{origin}: a pipeline spec is a YAML mapping, got {type(data).__name__}")
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"  {_location(item['loc'])}: {message}")
        raise UsageError(f"{origin}: invalid pipeline spec\n" + "\n".join(problems)) from None


def load_spec(path: Path) -> PipelineSpec:
    try:
        text = path.read_text()
    except OSError as error:
        raise UsageError(f"{path}: cannot read the spec ({error.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise UsageError(f"{path}: not valid YAML: {error}") from None
    spec = parse_spec(data, str(path))
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


def find_spec(settings: Settings, name_or_path: str) -> PipelineSpec:
    """A spec by pipeline name (looked up in the pipelines folder) or by file path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        return load_spec(candidate)
    for path in spec_files(settings):
        if path.stem == name_or_path:
            return load_spec(path)
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
