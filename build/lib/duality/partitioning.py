"""Where a record goes: Kafka's murmur2, the partition of a key, and a repartitioning's
partitioner. `repartition` places records with it and `skew` predicts loads with it, so a
prediction and a copy agree (docs/decisions/0005-exactly-once-repartition.md).

- key-hash: `toPositive(murmur2(key)) % N`, what Java's default partitioner (and so Spark's
  Kafka sink and `partitioner=murmur2_random`) chooses, so per-key order is kept and producers
  that switch to the target agree with it. Null keys keep their source partition modulo N.
- salted: a hot key's records go to `(key-hash + toPositive(murmur2(value)) % S) % N`, S
  distinct partitions; other keys as key-hash. Per-key order holds per (key, value hash) only.
"""

from __future__ import annotations

from collections.abc import Iterable

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (org.apache.kafka.common.utils.Utils.murmur2): a signed 32-bit int."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    blocks = length // 4
    for i in range(blocks):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    tail = length & 3
    rest = blocks * 4
    if tail == 3:
        h ^= data[rest + 2] << 16
    if tail >= 2:
        h ^= data[rest + 1] << 8
    if tail >= 1:
        h ^= data[rest]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Java's default partitioner picks for a non-null key."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class Partitioner:
    """The target partition of a record among `partitions`, the `hot_keys` salted over `salts`
    partitions (cached per key: keys repeat)."""

    def __init__(self, partitions: int, hot_keys: Iterable[str] = (), salts: int = 1):
        self.partitions = partitions
        self.salts = salts
        self.hot = {k.encode() for k in hot_keys}
        self._cache: dict[bytes, int] = {}

    def __call__(self, key: bytes | None, value: bytes | None, source_partition: int) -> int:
        if key is None:
            return source_partition % self.partitions
        base = self._cache.get(key)
        if base is None:
            base = key_partition(key, self.partitions)
            if len(self._cache) < 1_000_000:
                self._cache[key] = base
        if key in self.hot:
            salt = (murmur2(value or b"") & 0x7FFFFFFF) % self.salts
            return (base + salt) % self.partitions
        return base
