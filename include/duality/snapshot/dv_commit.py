"""A small change committed by duality itself, as Delta's PROTOCOL.md defines the commit: the
changed keys' rows marked deleted in deletion vectors, their new rows appended in one Parquet
file, one JSON commit created only if absent and then its checksum file (decision 30); and a
commit that only sets table properties (a validation's verdict, a publication).

Delta's own statements must scan every touched file two or three times to find the rows a few
keys hit; here the key columns are read once with Arrow, without Spark. A table whose protocol
asks for more than this writer does (row tracking, change data feed, constraints, column
mapping, ...) is left to Delta's MERGE: `blocker()` says why.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import struct
import time
import uuid
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from duality import storage
from duality.errors import DualityError
from duality.snapshot import delta_log
from duality.snapshot.delta_log import TableState, user_metadata
from duality.storage import Location, ObjectPath

if TYPE_CHECKING:
    import pyarrow as pa
    from pyroaring import BitMap64

# Delta's deletion vectors (PROTOCOL.md, "Deletion Vector Format"): a RoaringBitmapArray in the
# portable 64-bit layout behind a little-endian magic number; in a file, each behind its
# big-endian size and followed by its big-endian CRC-32, the file starting with a version byte.
_MAGIC = struct.pack("<I", 1681511377)
_DV_FILE_VERSION = b"\x01"
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {character: value for value, character in enumerate(_Z85)}
# The table features this writer honours, and the Delta types it writes (as Arrow types).
_READER_FEATURES = {"deletionVectors"}
_WRITER_FEATURES = {"deletionVectors", "appendOnly", "invariants", "checkConstraints"}
_WRITER_FEATURES |= {"changeDataFeed", "generatedColumns"}
_ARROW_TYPES = {
    "string": "string",
    "long": "int64",
    "integer": "int32",
    "double": "float64",
    "boolean": "bool_",
    "timestamp": "timestamp",
}
_COLUMN_METADATA = ("delta.invariants", "delta.generationExpression", "delta.identity")


@dataclasses.dataclass(frozen=True)
class Written:
    version: int
    inserted: int
    updated: int
    deleted: int


def blocker(state: TableState) -> str | None:
    """Why duality cannot write this table's next commit itself, or None when it can."""
    protocol, properties = state.protocol, state.properties
    if (protocol.get("minReaderVersion"), protocol.get("minWriterVersion")) != (3, 7):
        return "the table's protocol has no deletion vectors"
    unknown = set(protocol.get("readerFeatures") or []) - _READER_FEATURES
    unknown |= set(protocol.get("writerFeatures") or []) - _WRITER_FEATURES
    if unknown:
        return f"the table uses features duality does not write: {', '.join(sorted(unknown))}"
    if properties.get("delta.enableDeletionVectors") != "true":
        return "deletion vectors are not enabled on the table"
    settings = {
        "delta.appendOnly": "true",
        "delta.enableChangeDataFeed": "true",
        "delta.enableInCommitTimestamps": "true",
    }
    enabled = [key for key, value in settings.items() if properties.get(key) == value]
    enabled += [key for key in properties if key.startswith("delta.constraints.")]
    if properties.get("delta.columnMapping.mode", "none") != "none":
        enabled.append("delta.columnMapping.mode")
    if enabled:
        return f"the table sets {', '.join(enabled)}"
    if state.metadata.get("partitionColumns"):
        return "the table is partitioned"
    for field in state.fields:
        if field["type"] not in _ARROW_TYPES:
            return f"column {field['name']} has type {field['type']}"
        if any(key in (field.get("metadata") or {}) for key in _COLUMN_METADATA):
            return f"column {field['name']} has an invariant, generation or identity"
    return None


def write(
    root: Location,
    state: TableState,
    rows: pa.Table,
    key_columns: list[str],
    metadata: dict[str, Any],
) -> Written | None:
    """Version `state.version + 1`: the live rows of `rows`' keys deleted, `rows` without
    `_deleted` appended. `rows` holds one row per changed key, the table's columns and
    `_deleted`. None when another writer committed that version first (nothing is left)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pyroaring import BitMap64

    changed = rows.select([*key_columns, "_deleted"])
    written: list[Location] = []
    actions: list[dict[str, Any]] = []
    now = int(time.time() * 1000)
    vectors: dict[str, BitMap64] = {}
    records: dict[str, int] = {}  # each touched file's rows, as the file has them
    updated = deleted = 0
    for path, add in state.files.items():
        hits, records[path] = _rows_of(root / unquote(path), changed, key_columns)
        if hits.num_rows == 0:
            continue
        before = read_vector(root, add.get("deletionVector"))
        positions = hits.column("_row").to_pylist()
        live = hits.filter(pa.array([position not in before for position in positions]))
        dead = sum(live.column("_deleted").to_pylist())
        deleted, updated = deleted + dead, updated + live.num_rows - dead
        after = before | BitMap64(positions)
        if len(after) > len(before):
            vectors[path] = after
    files = _write_vectors(root, vectors, written)
    for path, descriptor in files.items():
        old = state.files[path]
        actions.append({"remove": _removal(old, now)})
        if descriptor["cardinality"] < records[path]:
            # Min and max may now be wider than the live rows': the bounds are no longer tight.
            # A file with a deletion vector must say how many rows it has.
            stats = json.loads(old.get("stats") or "{}")
            stats.update(numRecords=records[path], tightBounds=False)
            actions.append(
                {"add": {**old, "stats": json.dumps(stats), "deletionVector": descriptor}}
            )
    inserted_rows = rows.filter(pc.invert(rows.column("_deleted")))
    if inserted_rows.num_rows:
        actions.append({"add": _append(root, state, inserted_rows, now, written)})
    inserted = inserted_rows.num_rows - updated
    version = state.version + 1
    info = {
        "timestamp": now,
        "operation": "MERGE",
        "operationParameters": {"keys": json.dumps(key_columns)},
        "readVersion": state.version,
        "isolationLevel": "Serializable",
        "isBlindAppend": False,
        "operationMetrics": {
            "numTargetRowsInserted": str(inserted),
            "numTargetRowsUpdated": str(updated),
            "numTargetRowsDeleted": str(deleted),
            "numTargetDeletionVectorsAdded": str(len(files)),
        },
        "userMetadata": user_metadata(metadata),
        "engineInfo": "duality",
        "txnId": str(uuid.uuid4()),
    }
    if not _commit(root, state, info, actions):
        for file in written:
            file.unlink(missing_ok=True)
        return None
    return Written(version, inserted, updated, deleted)


def set_properties(
    root: Location, state: TableState, properties: dict[str, str], metadata: dict[str, Any]
) -> int | None:
    """Version `state.version + 1`: a commit that only sets table properties (what Delta's SET
    TBLPROPERTIES commits: the whole `metaData` again, its configuration updated), with
    `metadata` as its userMetadata. None when another writer committed that version first."""
    version = state.version + 1
    configuration = {**(state.metadata.get("configuration") or {}), **properties}
    info = {
        "timestamp": int(time.time() * 1000),
        "operation": "SET TBLPROPERTIES",
        "operationParameters": {"properties": json.dumps(properties)},
        "readVersion": state.version,
        "isolationLevel": "Serializable",
        "isBlindAppend": True,
        "userMetadata": user_metadata(metadata),
        "engineInfo": "duality",
        "txnId": str(uuid.uuid4()),
    }
    meta = {**state.metadata, "configuration": configuration}
    return version if _commit(root, state, info, [{"metaData": meta}]) else None


def _rows_of(file: Location, changed: pa.Table, key_columns: list[str]) -> tuple[pa.Table, int]:
    """The rows of a data file whose key is one of `changed`'s: their positions in the file
    (`_row`, as deletion vectors count them) and whether the key was deleted (`_deleted`); and
    how many rows the file has."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    filesystem, where = storage.arrow(file)
    keys = pq.read_table(where, columns=key_columns, filesystem=filesystem)
    keys = keys.append_column("_row", pa.array(np.arange(keys.num_rows, dtype=np.int64)))
    wanted = changed.cast(
        pa.schema([*(keys.schema.field(c) for c in key_columns), changed.schema.field("_deleted")])
    )
    joined = keys.join(wanted, key_columns, join_type="inner", use_threads=False)
    return joined, keys.num_rows


def read_vector(root: Location, descriptor: dict[str, Any] | None) -> BitMap64:
    """A file's deletion vector (empty when it has none)."""
    from pyroaring import BitMap64

    if not descriptor:
        return BitMap64()
    size = descriptor["sizeInBytes"]
    kind, where = descriptor["storageType"], descriptor["pathOrInlineDv"]
    if kind == "i":
        data = z85_decode(where)[:size]
    else:
        if kind == "u":
            prefix, encoded = where[:-20], where[-20:]
            name = f"deletion_vector_{uuid.UUID(bytes=z85_decode(encoded))}.bin"
            file: Location = root / prefix / name
        elif kind == "p" and isinstance(root, ObjectPath) and root.store is not None:
            file = ObjectPath.parse(where).on(root.store)
        elif kind == "p":
            file = Path(unquote(urlparse(where).path))
        else:
            raise ValueError(f"deletion vector storage type {kind!r} is not in Delta's protocol")
        with file.open("rb") as stream:
            stream.seek(descriptor.get("offset", 1))
            (stored,) = struct.unpack(">I", stream.read(4))
            data = stream.read(stored)
            (checksum,) = struct.unpack(">I", stream.read(4))
        if stored != size or zlib.crc32(data) != checksum:
            raise ValueError(f"the deletion vector in {file} does not match its descriptor")
    if data[:4] != _MAGIC:
        raise ValueError("a deletion vector is not in Delta's portable format")
    return BitMap64.deserialize(data[4:])


def _write_vectors(
    root: Location, vectors: dict[str, BitMap64], written: list[Location]
) -> dict[str, dict[str, Any]]:
    """One new deletion vector file holding `vectors`; each data file's descriptor."""
    if not vectors:
        return {}
    name = uuid.uuid4()
    content = bytearray(_DV_FILE_VERSION)
    descriptors = {}
    for path, vector in vectors.items():
        data = _MAGIC + vector.serialize()
        descriptors[path] = {
            "storageType": "u",
            "pathOrInlineDv": z85_encode(name.bytes),
            "offset": len(content),
            "sizeInBytes": len(data),
            "cardinality": len(vector),
        }
        content += struct.pack(">I", len(data)) + data + struct.pack(">I", zlib.crc32(data))
    file = root / f"deletion_vector_{name}.bin"
    written.append(file)
    file.write_bytes(bytes(content))
    return descriptors


def _append(
    root: Location, state: TableState, rows: pa.Table, now: int, written: list[Location]
) -> dict[str, Any]:
    """The new rows in a Parquet file of the table's schema; its `add` action."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [pa.field(f["name"], _arrow_type(f["type"]), f["nullable"]) for f in state.fields]
    )
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    file = root / name
    written.append(file)
    # Written whole in one request (a PUT on object storage), its size known without asking.
    sink = pa.BufferOutputStream()
    pq.write_table(rows.select(schema.names).cast(schema), sink, compression="snappy")
    data = sink.getvalue().to_pybytes()
    file.write_bytes(data)
    stats = {"numRecords": rows.num_rows}
    return {
        "path": name,
        "partitionValues": {},
        "size": len(data),
        "modificationTime": now,
        "dataChange": True,
        "stats": json.dumps(stats),
    }


def _arrow_type(delta_type: str) -> pa.DataType:
    """The Arrow type of a Delta column type (timestamps as microseconds in UTC)."""
    import pyarrow as pa

    if delta_type == "timestamp":
        return pa.timestamp("us", tz="UTC")
    return getattr(pa, _ARROW_TYPES[delta_type])()


def _removal(add: dict[str, Any], now: int) -> dict[str, Any]:
    """The `remove` of a live file as it is (with its current deletion vector, if any)."""
    kept = ["path", "partitionValues", "size", "tags", "deletionVector", "stats"]
    kept += ["baseRowId", "defaultRowCommitVersion"]
    removal = {key: add[key] for key in kept if key in add}
    return {**removal, "deletionTimestamp": now, "dataChange": True, "extendedFileMetadata": True}


def _commit(
    root: Location, state: TableState, info: dict[str, Any], actions: list[dict[str, Any]]
) -> bool:
    """Version `state.version + 1` holding `info` and `actions`, then its checksum file; False
    (and nothing written) when another writer's commit holds that version.

    The commit file is created whole or not at all (`storage.create_if_absent`: locally a hard
    link of a complete file, on object storage one PUT with `If-None-Match: *`). A request
    whose answer was lost may have created it: a refusal is then checked against the commit
    that holds the version, which is this one when it carries this commit's `txnId`."""
    log = root / "_delta_log"
    commit = log / f"{state.version + 1:020d}.json"
    lines = [{"commitInfo": info}, *actions]
    if not storage.create_if_absent(commit, _json_lines(lines).encode()):
        first = commit.read_text().split("\n", 1)[0]
        if json.loads(first).get("commitInfo", {}).get("txnId") != info["txnId"]:
            return False
    after = delta_log.advanced(state, actions)
    checksum = _json_lines([_checksum(log, after, info["txnId"])]).encode()
    # The version is committed: a checksum file the store failed to take is only left out
    # (readers then compute the state from the log).
    with contextlib.suppress(OSError, DualityError):
        storage.create_if_absent(log / f"{after.version:020d}.crc", checksum)
    return True


def _checksum(log: Location, state: TableState, txn_id: str) -> dict[str, Any]:
    """The version's checksum (PROTOCOL.md, "Version Checksum File"): Delta reads the protocol,
    the metadata and the sizes of a version from it instead of running Spark jobs over the log,
    and checks it against the log when it writes a checkpoint. Set transactions, domain metadata
    and the file size histogram's bins come from the previous version's checksum, which duality's
    commits do not change; without one they are left out (unknown to the reader)."""
    files = list(state.files.values())
    vectors = [add["deletionVector"] for add in files if add.get("deletionVector")]
    checksum: dict[str, Any] = {
        "txnId": txn_id,
        "tableSizeBytes": sum(add["size"] for add in files),
        "numFiles": len(files),
        "numDeletedRecordsOpt": sum(vector["cardinality"] for vector in vectors),
        "numDeletionVectorsOpt": len(vectors),
        "numMetadata": 1,
        "numProtocol": 1,
    }
    try:
        previous = json.loads((log / f"{state.version - 1:020d}.crc").read_text())
    except (OSError, ValueError):
        previous = {}
    for carried in ("setTransactions", "domainMetadata"):
        if isinstance(previous.get(carried), list):
            checksum[carried] = previous[carried]
    checksum.update(metadata=state.metadata, protocol=state.protocol)
    bins = (previous.get("fileSizeHistogram") or previous.get("histogramOpt") or {}).get(
        "sortedBinBoundaries"
    )
    if bins:
        counts, sizes = [0] * len(bins), [0] * len(bins)
        for add in files:
            at = bisect.bisect_right(bins, add["size"]) - 1
            counts[at], sizes[at] = counts[at] + 1, sizes[at] + add["size"]
        checksum["fileSizeHistogram"] = {
            "sortedBinBoundaries": bins,
            "fileCounts": counts,
            "totalBytes": sizes,
        }
    return checksum


def _json_lines(items: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(item, separators=(",", ":")) + "\n" for item in items)


def z85_encode(data: bytes) -> str:
    """ZeroMQ's Z85 of `data` (a multiple of 4 bytes), as Delta encodes UUIDs and inline DVs."""
    out: list[str] = []
    for (word,) in struct.iter_unpack(">I", data):
        digits = []
        for _ in range(5):
            word, digit = divmod(word, 85)
            digits.append(_Z85[digit])
        out.extend(reversed(digits))
    return "".join(out)


def z85_decode(text: str) -> bytes:
    """The bytes of a Z85 text (a multiple of 5 characters)."""
    out = bytearray()
    for start in range(0, len(text), 5):
        word = 0
        for character in text[start : start + 5]:
            word = word * 85 + _Z85_VALUE[character]
        out += struct.pack(">I", word)
    return bytes(out)
