"""Skew of a topic's partitions: load per partition, the heaviest keys, and what to do about it
(docs/repartition.md: what each figure is measured from)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any

from duality.config import Settings
from duality.errors import UsageError
from duality.kafka import offsets, records, topics
from duality.partitioning import key_partition
from duality.storage import Location

# A partition is hot when its load is this much above the mean; a recommendation aims below it.
HOT_FACTOR = 1.3
# A key is hot (worth salting) when it alone holds more than this fraction of one partition's
# fair share (1 / partitions) of the records.
HOT_KEY_SHARE_OF_PARTITION = 0.5
# Auto hot keys: salt more of the heaviest keys while the predicted skew is above this.
SALTED_GOAL = 1.15
MIN_GAIN = 0.02
SAMPLE_PER_PARTITION = 2_000
MAX_HOT_KEYS = 16
TOP_KEYS = 5  # the heaviest keys a report names, per partition and for the topic


def ratio(values: list[float] | list[int]) -> float:
    """Max over mean: 1.0 is perfectly even; 0 records anywhere reads as even."""
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return float(max(values) / mean) if mean > 0 else 1.0


def hot(values: list[float] | list[int], factor: float = HOT_FACTOR) -> list[int]:
    """Indexes of the values above `factor` times the mean."""
    if not values:
        return []
    mean = sum(values) / len(values)
    return [i for i, v in enumerate(values) if mean > 0 and v > factor * mean]


def parse_window(text: str) -> float:
    """`60s`, `5m`, `1h` or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    raw = text.strip().lower()
    try:
        seconds = float(raw[:-1]) * units[raw[-1]] if raw[-1:] in units else float(raw)
    except (ValueError, IndexError):
        raise UsageError(
            f"--window {text!r} is not a duration: write it like 60s, 5m or 1h"
        ) from None
    if seconds <= 0:
        raise UsageError(f"--window must be positive, got {text!r}")
    return seconds


@dataclasses.dataclass
class PartitionLoad:
    partition: int
    records: int
    bytes: int
    rate: float  # records per second over the window
    lag: int | None
    sampled: int
    top_keys: list[tuple[str, int]]  # (key, estimated records) in this partition

    def as_dict(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "records": self.records,
            "bytes": self.bytes,
            "rate": round(self.rate, 3),
            "lag": self.lag,
            "sampled": self.sampled,
            "top_keys": [{"key": k, "records": n} for k, n in self.top_keys],
        }


@dataclasses.dataclass
class SkewReport:
    topic: str
    group: str | None
    window_s: float
    partitions: list[PartitionLoad]
    keys: list[tuple[str, int, float]]  # (key, estimated records, share of the topic)
    recommendation: dict[str, Any]

    @property
    def skew_rate(self) -> float:
        return ratio([p.rate for p in self.partitions])

    @property
    def skew_size(self) -> float:
        return ratio([p.records for p in self.partitions])

    @property
    def hot_partitions(self) -> list[int]:
        by_rate = hot([p.rate for p in self.partitions])
        by_size = hot([p.records for p in self.partitions])
        return sorted({self.partitions[i].partition for i in by_rate + by_size})

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "group": self.group,
            "window_s": self.window_s,
            "records": sum(p.records for p in self.partitions),
            "skew_rate": round(self.skew_rate, 3),
            "skew_size": round(self.skew_size, 3),
            "hot_partitions": self.hot_partitions,
            "partitions": [p.as_dict() for p in self.partitions],
            "heaviest_keys": [
                {"key": k, "records": n, "share": round(s, 4)} for k, n, s in self.keys
            ],
            "recommendation": self.recommendation,
        }


def _decode(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return None  # only UTF-8 keys can be named on the command line


def sample(settings: Settings, topic: str) -> dict[int, tuple[Counter[bytes | None], int, int]]:
    """Per partition: key counts, record count and bytes of (at most) its last records."""
    keys: dict[int, Counter[bytes | None]] = {}
    counts: Counter[int] = Counter()
    sizes: Counter[int] = Counter()
    for message in records.read_to_end(
        settings, topic, isolation="read_uncommitted", last=SAMPLE_PER_PARTITION, timeout=60
    ):
        partition, key = message.partition(), message.key()
        assert partition is not None
        keys.setdefault(partition, Counter())[key] += 1
        counts[partition] += 1
        sizes[partition] += len(key or b"") + len(message.value() or b"")
    return {
        p: (keys.get(p, Counter()), counts[p], sizes[p])
        for p in range(topics.partition_count(settings, topic))
    }


def key_estimates(
    partitions: dict[int, tuple[Counter[bytes | None], int, int]], records: dict[int, int]
) -> Counter[bytes | None]:
    """Estimated records per key in the whole topic: sample shares scaled by partition sizes."""
    estimate: Counter[bytes | None] = Counter()
    for partition, (keys, sampled, _) in partitions.items():
        if not sampled:
            continue
        scale = records.get(partition, 0) / sampled
        for key, count in keys.items():
            estimate[key] += round(count * scale)
    return estimate


def hot_keys(
    estimates: Counter[bytes | None], target_partitions: int, salts: int | None = None
) -> list[str]:
    """The keys to salt: every key above half a partition's fair share (1 / partitions); then,
    while the predicted skew is above SALTED_GOAL, the heaviest key of the most loaded
    partition, as long as salting it lowers the predicted skew by MIN_GAIN or more (so light
    keys are not salted to chase the sample's noise); at most MAX_HOT_KEYS keys."""
    total = sum(estimates.values())
    if not total:
        return []
    salts = salts or target_partitions
    threshold = HOT_KEY_SHARE_OF_PARTITION / target_partitions
    named = {key: _decode(key) for key in estimates if key is not None}
    chosen = [
        name
        for key, count in estimates.most_common()
        if key is not None and count / total > threshold and (name := named[key]) is not None
    ][:MAX_HOT_KEYS]
    if not chosen:
        return []  # no key dominates: the skew is not the keys' doing; salting won't help
    while len(chosen) < MAX_HOT_KEYS:
        loads = predicted_loads(estimates, target_partitions, chosen, salts)
        now = ratio(loads)
        if now <= SALTED_GOAL:
            break
        hottest = loads.index(max(loads))
        candidates = [
            (count, name)
            for key, count in estimates.items()
            if key is not None
            and (name := named[key]) is not None
            and name not in chosen
            and key_partition(key, target_partitions) == hottest
        ]
        if not candidates:
            break
        count, name = max(candidates)
        after = ratio(predicted_loads(estimates, target_partitions, [*chosen, name], salts))
        if count < 2 or now - after < MIN_GAIN:
            break
        chosen.append(name)
    return chosen


def predicted_loads(
    estimates: Counter[bytes | None], partitions: int, hot: list[str] | None = None, salts: int = 1
) -> list[float]:
    """The load per partition a copy into `partitions` would give, from the key estimates."""
    loads = [0.0] * partitions
    salted = {k.encode() for k in hot or []}
    for key, count in estimates.items():
        if key is None:
            for p in range(partitions):  # null keys keep their spread (source partition mod N)
                loads[p] += count / partitions
        elif key in salted:
            base = key_partition(key, partitions)
            for s in range(salts):
                loads[(base + s) % partitions] += count / salts
        else:
            loads[key_partition(key, partitions)] += count
    return loads


def recommend(estimates: Counter[bytes | None], current: int, skew_now: float) -> dict[str, Any]:
    """Key-hash into the fewest partitions that evens the load, else salt the hot keys."""
    if not sum(estimates.values()):
        return {"action": "none", "reason": "the topic is empty"}
    if skew_now <= HOT_FACTOR:
        return {"action": "none", "reason": f"skew {skew_now:.2f} is within {HOT_FACTOR}"}
    for partitions in range(current, 2 * current + 1):
        predicted = ratio(predicted_loads(estimates, partitions))
        if predicted <= HOT_FACTOR:
            return {
                "action": "repartition",
                "strategy": "key-hash",
                "partitions": partitions,
                "predicted_skew": round(predicted, 3),
                "reason": "no single key dominates; a different partition count evens the hash",
            }
    keys = hot_keys(estimates, current, current)
    predicted = ratio(predicted_loads(estimates, current, keys, current))
    return {
        "action": "repartition",
        "strategy": "salted",
        "partitions": current,
        "salts": current,
        "hot_keys": keys,
        "predicted_skew": round(predicted, 3),
        "reason": "a few keys hold more than a partition's share: spread them with a salt",
    }


def analyse(
    settings: Settings, topic: str, *, group: str | None = None, window_s: float = 60.0
) -> SkewReport:
    """Load per partition of `topic` and a recommendation; reads only a bounded sample."""
    count = topics.partition_count(settings, topic)  # UsageError when the topic is missing
    ends = offsets.end_offsets(settings, topic, "read_uncommitted")
    starts = offsets.beginning_offsets(settings, topic)
    since = offsets.offsets_for_time(settings, topic, int((time.time() - window_s) * 1000))
    committed = offsets.committed_offsets(settings, group, topic) if group else {}
    sampled = sample(settings, topic)
    records = {p: ends[p] - starts[p] for p in range(count)}
    loads = []
    for p in range(count):
        keys, n, size = sampled[p]
        recent = max(0, ends[p] - since[p])
        scale = records[p] / n if n else 0.0
        loads.append(
            PartitionLoad(
                partition=p,
                records=records[p],
                bytes=round(size * scale),
                rate=recent / window_s,
                lag=max(0, ends[p] - committed[p][0]) if p in committed else None,
                sampled=n,
                top_keys=[
                    (_decode(k) or repr(k), round(c * scale)) for k, c in keys.most_common(TOP_KEYS)
                ],
            )
        )
    estimates = key_estimates(sampled, records)
    total = sum(estimates.values()) or 1
    heaviest = [(_decode(k) or repr(k), n, n / total) for k, n in estimates.most_common(TOP_KEYS)]
    skew_now = max(ratio([p.rate for p in loads]), ratio([p.records for p in loads]))
    return SkewReport(
        topic, group, window_s, loads, heaviest, recommend(estimates, count, skew_now)
    )


def plot(report: SkewReport, path: Location) -> Location:
    """A bar chart of records and rate per partition, hot partitions in red, as a PNG file at
    `path` (local or on object storage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    partitions = [p.partition for p in report.partitions]
    hot_set = set(report.hot_partitions)
    colours = ["tab:red" if p in hot_set else "tab:blue" for p in partitions]
    figure, (size_axis, rate_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for axis, values, title in (
        (size_axis, [p.records for p in report.partitions], "records"),
        (rate_axis, [p.rate for p in report.partitions], f"records/s over {report.window_s:g}s"),
    ):
        axis.bar(partitions, values, color=colours)
        mean = sum(values) / len(values) if values else 0
        axis.axhline(mean, color="black", linestyle="--", linewidth=1, label="mean")
        axis.axhline(mean * HOT_FACTOR, color="tab:red", linestyle=":", linewidth=1, label="hot")
        axis.set_xlabel("partition")
        axis.set_title(f"{title} (skew {ratio(values):.2f})")
        axis.set_xticks(partitions)
        axis.legend()
    figure.suptitle(f"{report.topic}: hot partitions {report.hot_partitions or 'none'}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        figure.savefig(file, format="png", dpi=100)
    plt.close(figure)
    return path
