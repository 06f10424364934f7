"""Kafka's murmur2, key placement and the repartition partitioner: no services."""

from __future__ import annotations

from collections import Counter

import pytest

from duality.partitioning import Partitioner, key_partition, murmur2
from duality.repartition import Plan


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # The cases of Kafka's own UtilsTest.testMurmur2 (Java's Utils.murmur2).
        (b"21", -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        (b"abc", 479470107),
    ],
)
def test_murmur2_equals_kafkas(data: bytes, expected: int):
    assert murmur2(data) == expected


def test_key_partition_is_positive_murmur2_modulo():
    assert key_partition(b"21", 7) == (-973932308 & 0x7FFFFFFF) % 7
    assert all(0 <= key_partition(f"k{i}".encode(), 6) < 6 for i in range(1000))


def test_key_hash_ignores_values_and_keeps_null_keys_by_source_partition():
    place = Partitioner(6)
    assert {place(b"key", f"v{i}".encode(), 0) for i in range(100)} == {key_partition(b"key", 6)}
    assert [place(None, b"v", p) for p in range(8)] == [0, 1, 2, 3, 4, 5, 0, 1]


def test_salted_spreads_a_hot_key_over_exactly_s_partitions():
    place = Partitioner(8, ["hot"], 3)
    spread = Counter(place(b"hot", f"value-{i}".encode(), 0) for i in range(3000))
    base = key_partition(b"hot", 8)
    assert set(spread) == {base, (base + 1) % 8, (base + 2) % 8}
    assert max(spread.values()) / min(spread.values()) < 1.2
    # The same record always goes to the same place; other keys as key-hash.
    assert place(b"hot", b"value-1", 0) == place(b"hot", b"value-1", 3)
    assert place(b"cold", b"x", 0) == key_partition(b"cold", 8)


def test_a_plan_salts_only_under_the_salted_strategy():
    assert Plan("s", "t", 8, "salted", ("hot",), 3).partitioner().hot == {b"hot"}
    assert Plan("s", "t", 8, "key-hash", ("hot",), 3).partitioner().hot == set()
