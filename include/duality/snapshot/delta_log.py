"""The table's Delta log as duality reads and writes it: commits and the records duality keeps
in their userMetadata, a version's state replayed without Spark, a version by time travel."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from duality import storage
from duality.errors import ConcurrentWrite, UsageError
from duality.snapshot.coverage import Coverage
from duality.spec import PipelineSpec
from duality.storage import Location

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

METADATA_KEY = "duality"
# Commits that do not change the table's rows; an incremental run may build on top of them.
_ROW_PRESERVING = {"OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES"}


@dataclasses.dataclass(frozen=True)
class Version:
    version: int
    timestamp_ms: int
    operation: str
    metadata: dict[str, Any] | None  # duality's userMetadata, None for a foreign commit
    metrics: dict[str, int] = dataclasses.field(default_factory=dict)  # operationMetrics


def history(path: Location) -> list[Version]:
    """The table's commits, newest first: the `commitInfo` of each JSON commit in its log (what
    Delta's own history reads), without a Spark job."""
    versions = []
    for file in (path / "_delta_log").glob("*.json"):
        if not file.stem.isdigit():
            continue
        info: dict[str, Any] = {}
        with file.open() as lines:
            for line in lines:
                if line.startswith('{"commitInfo"'):
                    info = json.loads(line)["commitInfo"]
                    break
        metadata = None
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            metadata = json.loads(info.get("userMetadata") or "{}").get(METADATA_KEY)
        metrics = {k: int(v) for k, v in (info.get("operationMetrics") or {}).items()}
        versions.append(
            Version(
                int(file.stem),
                int(info.get("timestamp", file.stat().st_mtime * 1000)),
                str(info.get("operation", "UNKNOWN")),
                metadata,
                metrics,
            )
        )
    return sorted(versions, key=lambda v: -v.version)


@dataclasses.dataclass(frozen=True)
class TableState:
    """A version of the table as its log defines it (Delta's PROTOCOL.md, action
    reconciliation): the protocol, the metadata and the live data files."""

    version: int
    protocol: dict[str, Any]
    metadata: dict[str, Any]
    files: dict[str, dict[str, Any]]  # the live `add` actions, by path

    @property
    def fields(self) -> list[dict[str, Any]]:
        return list(json.loads(self.metadata["schemaString"])["fields"])

    @property
    def columns(self) -> list[str]:
        return [field["name"] for field in self.fields]

    @property
    def properties(self) -> dict[str, str]:
        return dict(self.metadata.get("configuration") or {})

    @property
    def rows(self) -> int | None:
        """Live rows: each file's records less its deletion vector's; None when a file's
        statistics do not say."""
        try:
            return sum(
                json.loads(add["stats"])["numRecords"]
                - (add.get("deletionVector") or {}).get("cardinality", 0)
                for add in self.files.values()
            )
        except (ValueError, KeyError, TypeError):
            return None


# Delta's concurrent modification exceptions end with the winning commit's commitInfo as JSON.
_CONFLICTING = re.compile(r"Conflicting commit: (\{.*\})")
# What duality writes each kind of commit it records (its userMetadata's `kind`) with.
_COMMANDS = {
    "snapshot": "duality snapshot",
    "maintain": "duality snapshot --maintain",
    "validation": "duality validate",
    "publish": "duality publish",
}
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet$")


def table_state(path: Location, version: int) -> TableState | None:
    """`version` replayed from the newest classic checkpoint at or before it and the JSON
    commits after that, without Spark; None when the log cannot be read that way (a commit
    missing, a V2 checkpoint only): the callers then ask Spark."""
    log = path / "_delta_log"
    try:
        names = [entry.name for entry in log.iterdir()]
        start, protocol, metadata, files = _checkpoint_state(log, names, version)
        for commit in range(start, version + 1):
            actions = [json.loads(line) for line in (log / f"{commit:020d}.json").open()]
            protocol, metadata = _apply(actions, files, protocol, metadata)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if protocol is None or metadata is None:
        return None
    return TableState(version, protocol, metadata, files)


def advanced(state: TableState, actions: list[dict[str, Any]]) -> TableState:
    """The version after `state` whose commit holds `actions`."""
    files = dict(state.files)
    protocol, metadata = _apply(actions, files, state.protocol, state.metadata)
    assert protocol is not None and metadata is not None
    return TableState(state.version + 1, protocol, metadata, files)


def _apply(
    actions: list[dict[str, Any]],
    files: dict[str, dict[str, Any]],
    protocol: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A commit's actions applied: the live files (by path) updated in place; the protocol and
    metadata in force after it returned."""
    for action in actions:
        protocol = action.get("protocol", protocol)
        metadata = action.get("metaData", metadata)
    # One commit never adds and removes the same logical file: removes, then adds.
    for action in actions:
        removed: dict[str, Any] | None = action.get("remove")
        live = files.get(removed["path"]) if removed else None
        if removed and live is not None and deletion_vector_id(live) == deletion_vector_id(removed):
            del files[removed["path"]]
    for action in actions:
        if "add" in action:
            files[action["add"]["path"]] = action["add"]
    return protocol, metadata


def deletion_vector_id(action: dict[str, Any]) -> str | None:
    """The unique id of a file action's deletion vector (PROTOCOL.md), None without one."""
    vector = action.get("deletionVector")
    if not vector:
        return None
    offset = vector.get("offset")
    return (
        vector["storageType"] + vector["pathOrInlineDv"] + ("" if offset is None else f"@{offset}")
    )


def _checkpoint_state(
    log: Location, names: list[str], version: int
) -> tuple[int, dict[str, Any] | None, dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The newest complete classic (single or multi-part) checkpoint at or before `version`:
    the first commit after it, its protocol, metadata and live files; else from commit 0."""
    parts: dict[int, list[str]] = {}
    expected: dict[int, int] = {}  # how many parts each checkpoint has (a single file: 1)
    for name in names:
        match = _CHECKPOINT.match(name)
        if match and int(match[1]) <= version:
            parts.setdefault(int(match[1]), []).append(name)
            expected[int(match[1])] = int(match[3] or 1)
    complete = [at for at, found in parts.items() if len(found) == expected[at]]
    if not complete:
        return 0, None, None, {}
    at = max(complete)
    import pyarrow.parquet as pq

    filesystem, _ = storage.arrow(log)
    files = [storage.arrow(log / name)[1] for name in sorted(parts[at])]
    present = pq.read_schema(files[0], filesystem=filesystem).names
    wanted = [c for c in ("protocol", "metaData", "add") if c in present]
    table = pq.read_table(files, columns=wanted, filesystem=filesystem)
    rows = table.to_pylist(maps_as_pydicts="strict")
    protocol = next((row["protocol"] for row in rows if row.get("protocol")), None)
    metadata = next((row["metaData"] for row in rows if row.get("metaData")), None)
    live = {row["add"]["path"]: _present(row["add"]) for row in rows if row.get("add")}
    return at + 1, _present(protocol), _present(metadata), live


def checkpoint_if_due(
    spark: SparkSession, path: Location, version: int, properties: dict[str, str]
) -> bool:
    """Delta checkpoints a table's log, and removes the log files past their retention, when one
    of its own commits lands on a multiple of `delta.checkpointInterval` (the table's
    `properties`, 10 by default); duality's commits (decision 30) are not Delta's, so after one
    of them Delta is asked to checkpoint `version` once that many commits follow the newest
    checkpoint. True when it did."""
    interval = int(properties.get("delta.checkpointInterval", "10"))
    names = [entry.name for entry in (path / "_delta_log").iterdir()]
    newest = max((int(match[1]) for name in names if (match := _CHECKPOINT.match(name))), default=0)
    if version - newest < interval:
        return False
    jvm: Any = spark._jvm  # Delta has no API for it but its DeltaLog's
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, str(path))
    none = jvm.scala.Option.empty()
    log.checkpoint(log.update(False, none, none), none)
    return True


def _present(value: Any) -> Any:
    """A checkpoint's struct as its JSON commit would hold it: absent fields and the parsed
    copies of statistics and partition values left out."""
    if isinstance(value, dict):
        return {
            key: _present(item)
            for key, item in value.items()
            if item is not None and not key.endswith("_parsed")
        }
    return value


@contextmanager
def lost_race(path: Location, statement: str, again: str) -> Iterator[None]:
    """The Delta statement inside, said in one line when it loses the race for its version to
    another writer's conflicting commit (one of Delta's concurrent modification exceptions,
    whose message and Java stack trace run to dozens of lines): a ConcurrentWrite naming the
    commit that won and `again`, what to do."""
    from delta import exceptions  # its import converts Delta's Java exceptions to its own

    conflicts = tuple(getattr(exceptions, name) for name in exceptions.__all__)
    try:
        yield
    except conflicts as error:
        raise ConcurrentWrite(
            f"{statement} of {path} lost the race for its version to another writer: "
            f"{_winner(path, str(error))} took it first, and conflicts with it "
            f"({type(error).__name__}); nothing was written: {again}"
        ) from None


def _winner(path: Location, message: str) -> str:
    """The commit that won a race, from the commitInfo Delta's exception quotes (else the
    table's newest commit): its version, operation and writer."""
    found = _CONFLICTING.search(message)
    info: dict[str, Any] = {}
    with contextlib.suppress(json.JSONDecodeError):
        info = json.loads(found[1]) if found else {}
    if "version" not in info:
        newest = history(path)[0]
        info = {"version": newest.version, "operation": newest.operation}
        info["userMetadata"] = user_metadata(newest.metadata) if newest.metadata else None
    kind = None
    with contextlib.suppress(json.JSONDecodeError, AttributeError):
        kind = json.loads(info.get("userMetadata") or "{}").get(METADATA_KEY, {}).get("kind")
    writer = f"`{_COMMANDS[kind]}`" if kind in _COMMANDS else info.get("engineInfo") or "Delta"
    return f"version {info['version']} ({info.get('operation', 'a commit')} by {writer})"


def is_table(path: Location) -> bool:
    return (path / "_delta_log").is_dir()


def require_table(spec: PipelineSpec, path: Location) -> Location:
    if not is_table(path):
        raise UsageError(
            f"pipeline {spec.name} has no snapshot at {path}: build one with "
            f"`duality snapshot {spec.name}`"
        )
    return path


def version_coverage(versions: list[Version], version: int) -> tuple[Coverage | None, str | None]:
    """What `version` covers (from `history()`): its commit's record, or that of the version it
    was built on through row-preserving commits; else None and why."""
    for entry in versions:
        if entry.version > version:
            continue
        if entry.metadata is not None and "coverage" in entry.metadata:
            return Coverage.from_dict(entry.metadata["coverage"]), None
        if entry.operation not in _ROW_PRESERVING:
            return None, f"version {entry.version} ({entry.operation}) was written outside duality"
    return None, "no version records the changelog offsets it covers"


def latest_data_version(versions: list[Version]) -> int:
    """The newest version that is not one of duality's validation or publish commits."""
    for entry in versions:
        if (entry.metadata or {}).get("kind") not in ("validation", "publish"):
            return entry.version
    return versions[-1].version


@contextmanager
def session_conf(spark: SparkSession, values: dict[str, str]) -> Iterator[None]:
    """The Spark session's `values` inside, what they were before after."""
    before = {key: spark.conf.get(key, None) for key in values}
    for key, value in values.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def commit_metadata(spark: SparkSession, metadata: dict[str, Any]) -> AbstractContextManager[None]:
    """Every Delta commit made inside carries `metadata` as its userMetadata (`history()` reads
    it back)."""
    text = user_metadata(metadata)
    return session_conf(spark, {"spark.databricks.delta.commitInfo.userMetadata": text})


def user_metadata(metadata: dict[str, Any]) -> str:
    """`metadata` as a commit's userMetadata holds it (`history()` reads it back)."""
    return json.dumps({METADATA_KEY: metadata}, separators=(",", ":"))


def sql_name(path: Location) -> str:
    """The table at `path` as SQL names it (`delta.`/a/path``)."""
    return "delta.`" + str(path).replace("`", "``") + "`"


def load(spark: SparkSession, path: Location, version: int | None = None) -> DataFrame:
    """The table at `version` (time travel; default: the newest)."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(str(path))
