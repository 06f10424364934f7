"""duality's own Delta commit of a small change (duality.snapshot.dv_commit), against the byte
layouts of Delta's PROTOCOL.md; Spark and a second Delta engine read its commits in
tests/integration/snapshot/test_snapshot.py, which also races them with Delta's own writers."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from duality.snapshot import delta_log, dv_commit
from tests.harness import not_delta_s


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
    assert list(dv_commit.read_vector(tmp_path, descriptor)) == [3, 4, 7, 11, 18, 29]
    # The same bitmap inline in the log (storage type "i"), as Delta's own tests encode it.
    inline = {
        "storageType": "i",
        "pathOrInlineDv": "^Bg9^0rr910000000000iXQKl0rr91000f55c8Xg0@@D72lkbi5=-{L",
        "sizeInBytes": 44,
        "cardinality": 6,
    }
    assert list(dv_commit.read_vector(tmp_path, inline)) == [3, 4, 7, 11, 18, 29]
    # A damaged file is refused, never read as another set of rows.
    damaged = bytearray(file.read_bytes())
    damaged[-5] ^= 1
    file.write_bytes(damaged)
    with pytest.raises(ValueError, match="does not match"):
        dv_commit.read_vector(tmp_path, descriptor)


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


def _table_of_one_file(root: Path) -> Path:
    """A table of one file (keys a, b, c, d) at version 0, written by this test; its log."""
    log = root / "_delta_log"
    log.mkdir()
    base = _state()
    # Written as Spark writes timestamps by default (INT96, read back without a time zone), and
    # without statistics: the writer counts the file's rows itself.
    moment = pa.array([1_700_000_000_000_000] * 4, pa.timestamp("us"))
    data = pa.table({"k": ["a", "b", "c", "d"], "n": [1, 2, 3, 4], "t": moment})
    pq.write_table(data, root / "first.parquet", use_deprecated_int96_timestamps=True)
    add = {
        "path": "first.parquet",
        "partitionValues": {},
        "size": (root / "first.parquet").stat().st_size,
        "modificationTime": 1,
        "dataChange": True,
    }
    commit = [{"protocol": base.protocol}, {"metaData": base.metadata}, {"add": add}]
    (log / f"{0:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in commit))
    return log


def _rows(keys: list[str], numbers: list[int], deleted: list[bool]) -> pa.Table:
    """Changed keys' rows as Spark hands them over (timestamps in the session's time zone)."""
    moments = pa.array([1_700_000_000_000_000] * len(keys), pa.timestamp("us", tz="Etc/UTC"))
    return pa.table({"k": keys, "n": numbers, "t": moments, "_deleted": deleted})


def test_a_commit_replayed_as_delta_reconciles_it(tmp_path: Path):
    """Two commits written by dv_commit on a table of one file: the second extends the first's
    deletion vector; the log's state has each key once; each commit's checksum file says what
    the files on disk hold."""
    log = _table_of_one_file(tmp_path)
    base = _state()

    def change(version: int, keys: list[str], numbers: list[int], deleted: list[bool]) -> Any:
        state = delta_log.table_state(tmp_path, version)
        assert state is not None
        # A key of a string and a timestamp, as a windowed pipeline's.
        rows = _rows(keys, numbers, deleted)
        return dv_commit.write(tmp_path, state, rows, ["k", "t"], {"kind": "snapshot"})

    first = change(0, ["b", "e"], [20, 5], [False, False])
    assert first == dv_commit.Written(1, inserted=1, updated=1, deleted=0)
    second = change(1, ["c", "e", "b"], [0, 50, 0], [True, False, True])
    assert second == dv_commit.Written(2, inserted=0, updated=1, deleted=2)
    state = delta_log.table_state(tmp_path, 2)
    assert state is not None and state.rows == 3  # a, d, and e's newest row
    vector = state.files["first.parquet"]["deletionVector"]
    assert list(dv_commit.read_vector(tmp_path, vector)) == [1, 2]
    assert json.loads(state.files["first.parquet"]["stats"])["tightBounds"] is False
    live = []
    for path, add in state.files.items():
        table = pq.read_table(tmp_path / path).to_pylist()
        gone = dv_commit.read_vector(tmp_path, add.get("deletionVector"))
        live += [
            {"k": row["k"], "n": row["n"]} for index, row in enumerate(table) if index not in gone
        ]
    assert sorted(live, key=lambda r: r["k"]) == [
        {"k": "a", "n": 1},
        {"k": "d", "n": 4},
        {"k": "e", "n": 50},
    ]
    assert delta_log.history(tmp_path)[0].metrics["numTargetRowsDeleted"] == 2
    # Each commit's checksum file, field by field, from the files this test wrote: the table's
    # original file and the file the second commit appended (the first commit's is wholly
    # deleted by the second), by their sizes on disk.
    appended = {
        tuple(pq.read_table(file, columns=["k"])["k"].to_pylist()): file
        for file in tmp_path.glob("part-*.parquet")
    }
    sizes = [(tmp_path / "first.parquet").stat().st_size, appended[("e",)].stat().st_size]
    committed = json.loads((log / f"{2:020d}.json").read_text().splitlines()[0])["commitInfo"]
    checksum = json.loads((log / f"{2:020d}.crc").read_text())
    assert checksum == {
        "txnId": committed["txnId"],
        "tableSizeBytes": sum(sizes),
        "numFiles": 2,
        "numDeletedRecordsOpt": 2,  # rows b and c of the original file
        "numDeletionVectorsOpt": 1,
        "numMetadata": 1,
        "numProtocol": 1,
        "metadata": base.metadata,  # no earlier checksum: nothing carried
        "protocol": base.protocol,
    }
    # With an earlier checksum, its set transactions and histogram bins are carried.
    bins = {"sortedBinBoundaries": [0, 8192], "fileCounts": [0, 0], "totalBytes": [0, 0]}
    txn = [{"appId": "a", "version": 1}]
    (log / f"{2:020d}.crc").write_text(json.dumps({"setTransactions": txn, "histogramOpt": bins}))
    properties = dv_commit.set_properties(tmp_path, state, {"p": "1"}, {"kind": "validation"})
    assert properties == 3
    after = json.loads((log / f"{3:020d}.crc").read_text())
    assert after["setTransactions"] == txn
    assert after["metadata"]["configuration"] == {"delta.enableDeletionVectors": "true", "p": "1"}
    assert (after["numFiles"], after["tableSizeBytes"]) == (2, sum(sizes))
    small = [size for size in sizes if size < 8192]
    assert after["fileSizeHistogram"] == {
        "sortedBinBoundaries": [0, 8192],
        "fileCounts": [len(small), 2 - len(small)],
        "totalBytes": [sum(small), sum(sizes) - sum(small)],
    }
    # One part of a two-part checkpoint (another writer still writing it) is not a checkpoint.
    (log / f"{1:020d}.checkpoint.{1:010d}.{2:010d}.parquet").write_bytes(b"partial")
    assert delta_log.table_state(tmp_path, 2) == state


def test_a_version_another_writer_takes_first_is_never_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Another writer creates version 1 after this one read version 0 and wrote its files,
    just before it creates its commit: this one's commit is not made, the other's stays as it
    was, and nothing of this attempt is left, in the table or in its log."""
    log = _table_of_one_file(tmp_path)
    state = delta_log.table_state(tmp_path, 0)
    assert state is not None
    theirs = json.dumps({"commitInfo": {"operation": "OPTIMIZE"}}) + "\n"
    before, log_before = set(tmp_path.iterdir()), set(log.iterdir())
    attempt: set[Path] = set()  # the files this attempt wrote before it lost
    create = dv_commit.storage.create_if_absent

    def racing(final: Path, data: bytes) -> bool:
        if final.name == f"{1:020d}.json" and not attempt:
            attempt.update(set(tmp_path.iterdir()) - before)
            final.write_text(theirs)  # the other writer's commit
        return create(final, data)

    monkeypatch.setattr(dv_commit.storage, "create_if_absent", racing)
    rows = _rows(["b", "e"], [20, 5], [False, False])
    assert dv_commit.write(tmp_path, state, rows, ["k"], {"kind": "snapshot"}) is None
    # It had written a deletion vector (b's old row) and a data file (the new rows).
    assert sorted(file.name[:9] for file in attempt) == ["deletion_", "part-0000"]
    assert (log / f"{1:020d}.json").read_text() == theirs
    assert set(tmp_path.iterdir()) == before
    assert set(log.iterdir()) == log_before | {log / f"{1:020d}.json"}
    assert not_delta_s(tmp_path) == []
