"""Repartition scenarios of `make bench`, on topics preloaded in the same run.

- `repartition-key-hash`: the exactly-once copy of the baselines' topic (6 partitions, uniform
  keys) into 12 partitions by murmur2, comparable to `python-copy` (an at-least-once copy of the
  same topic with one consumer and one producer).
- `repartition-salted`: the same number of events where one key holds 30% of the records,
  copied into 6 partitions with the hot keys found automatically and salted; the figure carries
  the skew (max over mean of records per partition) before and after.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rich.progress import Progress

from baselines import Figure, order_events, preload
from duality import repartition, skew
from duality.config import Settings
from duality.kafka import offsets, topics

HOT_SHARE = 0.3


@dataclass
class RepartitionFigure(Figure):
    skew_before: float = 1.0
    skew_after: float = 1.0
    transactions: int = 0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            **super().as_dict(),
            "skew_before": round(self.skew_before, 3),
            "skew_after": round(self.skew_after, 3),
            "transactions": self.transactions,
        }


def hot_events(count: int, keys: int, seed: int = 9) -> list[tuple[bytes, bytes]]:
    """Order events where product `p-hot` holds HOT_SHARE of the records."""
    rng = random.Random(seed)
    events = order_events(count, keys, seed)
    hot = b"p-hot"
    return [
        (hot, value.replace(key, hot, 1)) if rng.random() < HOT_SHARE else (key, value)
        for key, value in events
    ]


def _copy(
    settings: Settings,
    scenario: str,
    plan: repartition.Plan,
    megabytes: float,
    progress: Progress,
) -> RepartitionFigure:
    task = progress.add_task(f"repartitioning {plan.source} -> {plan.target}", total=None)
    report = repartition.run(
        settings,
        plan,
        progress=lambda done, total: progress.update(task, completed=done, total=total),
    )
    sizes = offsets.end_offsets(settings, plan.source, "read_uncommitted")
    before = skew.ratio(list(sizes.values()))
    progress.console.print(
        f"{scenario}: {report.copied:,} records in {report.seconds:.1f}s, "
        f"skew {before:.2f} -> {report.skew_after:.2f}"
    )
    return RepartitionFigure(
        scenario,
        report.copied,
        report.seconds,
        megabytes,
        skew_before=before,
        skew_after=report.skew_after,
        transactions=report.transactions,
    )


def repartition_scenarios(
    settings: Settings, source: str, records: int, keys: int, megabytes: float, progress: Progress
) -> list[Figure]:
    figures: list[Figure] = []
    plan = repartition.plan(settings, source, f"{source}-12p", 12)
    figures.append(_copy(settings, "repartition-key-hash", plan, megabytes, progress))

    hot_topic = f"{source}-hot"
    topics.create_topic(settings, hot_topic, 6)
    hot_megabytes = preload(settings, hot_topic, hot_events(records, keys), progress)
    plan = repartition.plan(settings, hot_topic, f"{hot_topic}-salted", 6, "salted", "auto")
    figures.append(_copy(settings, "repartition-salted", plan, hot_megabytes, progress))
    return figures
