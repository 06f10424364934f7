"""duality's own Delta commit of a small change (duality.snapshot.dv_commit), against the byte
layouts of Delta's PROTOCOL.md; Spark and a second Delta engine read its commits in
tests/integration/snapshot/test_snapshot.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from duality.snapshot import delta_log, dv_commit


def test_z85_as_delta_encodes_uuids_and_inline_vectors():
    # PROTOCOL.md's relative-path example: a two-character prefix, then the UUID's 20 characters.
    encoded = "ab^-aqEH.-t@S}K{vb[*k^"
    uid = uuid.UUID(bytes=dv_commit.z85_decode(encoded[-20:]))
    assert str(uid) == "d2c639aa-8816-431a-aaf6-d3fe2512ff61"
    assert dv_commit.z85_encode(uid.bytes) == encoded[-20:]


def test_a_deletion_vector_file_in_delta_s_layout(tmp_path: Path):
    """Rows {3, 4, 7, 11, 18, 29}: the version byte, the size (big-endian), the magic number and
    the portable 64-bit bitmap (little-endian), the CRC-32 of both (big-endian)."""
    from pyroaring import BitMap64

    written: list[Path] = []
    vectors = {"a.parquet": BitMap64([3, 4, 7, 11, 18, 29], optimize=False)}
    descriptor = dv_commit._write_vectors(tmp_path, vectors, written)["a.parquet"]
    (file,) = written
    expected = (
        "01" + "0000002c" + "d1d33964" + "0100000000000000" + "00000000"
        "3a300000" + "01000000" + "0000" + "0500" + "10000000" + "030004000700"
        "0b0012001d00" + "acd74a79"
    )
    assert file.read_bytes().hex() == expected
    named = uuid.UUID(bytes=dv_commit.z85_decode(descriptor["pathOrInlineDv"]))
    assert file.name == f"deletion_vector_{named}.bin"
    assert descriptor["offset"] == 1 and descriptor["sizeInBytes"] == 44
    assert descriptor["cardinality"] == 6
    assert list(dv_commit._read_vector(tmp_path, descriptor)) == [3, 4, 7, 11, 18, 29]
    # The same bitmap inline in the log (storage type "i"), as Delta's own tests encode it.
    inline = {
        "storageType": "i",
        "pathOrInlineDv": "^Bg9^0rr910000000000iXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L",
        "sizeInBytes": 44,
        "cardinality": 6,
    }
    assert list(dv_commit._read_vector(tmp_path, inline)) == [3, 4, 7, 11, 18, 29]
    # A damaged file is refused, never read as another set of rows.
    damaged = bytearray(file.read_bytes())
    damaged[-5] ^= 1
    file.write_bytes(damaged)
    with pytest.raises(ValueError, match="does not match"):
        dv_commit._read_vector(tmp_path, descriptor)


def _state(**changes: Any) -> delta_log.TableState:
    protocol = {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": ["deletionVectors"],
        "writerFeatures": ["deletionVectors", "appendOnly", "invariants"],
    }
    fields = [
        {"name": "k", "type": "string", "nullable": True, "metadata": {}},
        {"name": "n", "type": "long", "nullable": True, "metadata": {}},
        {"name": "t", "type": "timestamp", "nullable": True, "metadata": {}},
    ]
    metadata = {
        "schemaString": json.dumps({"type": "struct", "fields": fields}),
        "partitionColumns": [],
        "configuration": {"delta.enableDeletionVectors": "true"},
    }
    protocol.update(changes.pop("protocol", {}))
    metadata.update(changes.pop("metadata", {}))
    return delta_log.TableState(0, protocol, metadata, {})


def test_a_table_asking_for_more_is_left_to_delta():
    assert dv_commit.blocker(_state()) is None
    rows = _state(protocol={"writerFeatures": ["deletionVectors", "rowTracking"]})
    assert "rowTracking" in str(dv_commit.blocker(rows))
    legacy = _state(protocol={"minReaderVersion": 1, "minWriterVersion": 2})
    assert "no deletion vectors" in str(dv_commit.blocker(legacy))
    feed = _state(
        metadata={
            "configuration": {
                "delta.enableDeletionVectors": "true",
                "delta.enableChangeDataFeed": "true",
            }
        }
    )
    assert "enableChangeDataFeed" in str(dv_commit.blocker(feed))
    off = _state(metadata={"configuration": {}})
    assert "not enabled" in str(dv_commit.blocker(off))
    decimal = json.dumps({"type": "struct", "fields": [{"name": "d", "type": "decimal(10,2)"}]})
    assert "decimal" in str(dv_commit.blocker(_state(metadata={"schemaString": decimal})))


def test_a_commit_replayed_as_delta_reconciles_it(tmp_path: Path):
    """Two commits written by dv_commit on a table of one file: the second extends the first's
    deletion vector; the log's state has each key once, and a lost race leaves nothing."""
    log = tmp_path / "_delta_log"
    log.mkdir()
    base = _state()
    # Written as Spark writes timestamps by default (INT96, read back without a time zone), and
    # without statistics: the writer counts the file's rows itself.
    moment = pa.array([1_700_000_000_000_000] * 4, pa.timestamp("us"))
    data = pa.table({"k": ["a", "b", "c", "d"], "n": [1, 2, 3, 4], "t": moment})
    pq.write_table(data, tmp_path / "first.parquet", use_deprecated_int96_timestamps=True)
    add = {
        "path": "first.parquet",
        "partitionValues": {},
        "size": (tmp_path / "first.parquet").stat().st_size,
        "modificationTime": 1,
        "dataChange": True,
    }
    commit = [{"protocol": base.protocol}, {"metaData": base.metadata}, {"add": add}]
    (log / f"{0:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in commit))

    def change(version: int, keys: list[str], numbers: list[int], deleted: list[bool]) -> Any:
        state = delta_log.table_state(tmp_path, version)
        assert state is not None
        # Timestamps as Spark hands them over: microseconds in the session's time zone.
        moments = pa.array([1_700_000_000_000_000] * len(keys), pa.timestamp("us", tz="Etc/UTC"))
        rows = pa.table({"k": keys, "n": numbers, "t": moments, "_deleted": deleted})
        # A key of a string and a timestamp, as a windowed pipeline's.
        return dv_commit.write(tmp_path, state, rows, ["k", "t"], {"kind": "snapshot"})

    first = change(0, ["b", "e"], [20, 5], [False, False])
    assert first == dv_commit.Written(1, inserted=1, updated=1, deleted=0)
    second = change(1, ["c", "e", "b"], [0, 50, 0], [True, False, True])
    assert second == dv_commit.Written(2, inserted=0, updated=1, deleted=2)
    state = delta_log.table_state(tmp_path, 2)
    assert state is not None and state.rows == 3  # a, d, and e's newest row
    vector = state.files["first.parquet"]["deletionVector"]
    assert list(dv_commit._read_vector(tmp_path, vector)) == [1, 2]
    assert json.loads(state.files["first.parquet"]["stats"])["tightBounds"] is False
    live = []
    for path, add in state.files.items():
        table = pq.read_table(tmp_path / path).to_pylist()
        gone = dv_commit._read_vector(tmp_path, add.get("deletionVector"))
        live += [
            {"k": row["k"], "n": row["n"]} for index, row in enumerate(table) if index not in gone
        ]
    assert sorted(live, key=lambda r: r["k"]) == [
        {"k": "a", "n": 1},
        {"k": "d", "n": 4},
        {"k": "e", "n": 50},
    ]
    assert delta_log.history(tmp_path)[0].metrics["numTargetRowsDeleted"] == 2
    # Each commit's checksum file says what the state holds (no earlier one: nothing carried).
    checksum = json.loads((log / f"{2:020d}.crc").read_text())
    assert checksum["numFiles"] == len(state.files) == 2
    assert checksum["tableSizeBytes"] == sum(add["size"] for add in state.files.values())
    assert (checksum["numDeletionVectorsOpt"], checksum["numDeletedRecordsOpt"]) == (1, 2)
    assert (checksum["metadata"], checksum["protocol"]) == (state.metadata, state.protocol)
    assert "setTransactions" not in checksum and "fileSizeHistogram" not in checksum
    # With an earlier checksum, its set transactions and histogram bins are carried.
    bins = {"sortedBinBoundaries": [0, 8192], "fileCounts": [0, 0], "totalBytes": [0, 0]}
    txn = [{"appId": "a", "version": 1}]
    (log / f"{2:020d}.crc").write_text(json.dumps({"setTransactions": txn, "histogramOpt": bins}))
    properties = dv_commit.set_properties(tmp_path, state, {"p": "1"}, {"kind": "validation"})
    assert properties == 3
    after = json.loads((log / f"{3:020d}.crc").read_text())
    assert after["setTransactions"] == txn and after["metadata"]["configuration"]["p"] == "1"
    sizes = [add["size"] for add in state.files.values()]
    assert after["fileSizeHistogram"]["fileCounts"] == [sum(s < 8192 for s in sizes), 0]
    assert after["fileSizeHistogram"]["totalBytes"] == [sum(s for s in sizes if s < 8192), 0]
    for name in (f"{3:020d}.json", f"{3:020d}.crc"):  # version 3 is taken below
        (log / name).unlink()
    # One part of a two-part checkpoint (another writer still writing it) is not a checkpoint.
    (log / f"{1:020d}.checkpoint.{1:010d}.{2:010d}.parquet").write_bytes(b"partial")
    assert delta_log.table_state(tmp_path, 2) == state

    # Version 3 taken meanwhile by another writer: no commit, and no file of this attempt left.
    before = set(tmp_path.iterdir())
    (log / f"{3:020d}.json").write_text(json.dumps({"commitInfo": {}}) + "\n")
    assert change(2, ["a"], [9], [False]) is None
    assert set(tmp_path.iterdir()) == before
