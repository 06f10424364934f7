"""The baseline scenarios every later figure is compared to, on the same topic in the same run.

- `kafka-consumer-perf`: Kafka's own ConsumerPerformance tool (the Java client) reading the topic.
- `python-copy`: a confluent-kafka consume -> produce copy of the topic into another topic.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

from rich.progress import Progress

from duality.config import Settings, java_properties
from duality.kafka import client, offsets, records


@dataclass
class Figure:
    scenario: str
    records: int
    seconds: float
    megabytes: float

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.megabytes / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "scenario": self.scenario,
            "records": self.records,
            "seconds": round(self.seconds, 3),
            "megabytes": round(self.megabytes, 3),
            "records_per_s": round(self.records_per_s, 1),
            "mb_per_s": round(self.mb_per_s, 3),
        }


def order_events(count: int, keys: int, seed: int = 7) -> list[tuple[bytes, bytes]]:
    """`count` order events of about 100 bytes as (key, value), keys drawn uniformly."""
    rng = random.Random(seed)
    events = []
    for i in range(count):
        product = f"p{rng.randrange(keys):06d}"
        value = {
            "order_id": f"o{i:09d}",
            "product": product,
            "customer": f"c{rng.randrange(100_000):05d}",
            "quantity": rng.randint(1, 9),
            "amount": round(rng.uniform(1, 500), 2),
        }
        events.append((product.encode(), json.dumps(value, separators=(",", ":")).encode()))
    return events


def unique_events(count: int, prefix: str = "u", seed: int = 11) -> Iterator[tuple[bytes, bytes]]:
    """`count` order events of about 100 bytes, each with its own product (key), generated
    lazily: millions of them are produced without holding them in memory."""
    rng = random.Random(seed)
    for i in range(count):
        product = f"{prefix}{i:08d}"
        value = (
            f'{{"order_id":"o{i:09d}","product":"{product}",'
            f'"customer":"c{rng.randrange(100_000):05d}","quantity":{rng.randint(1, 9)},'
            f'"amount":{rng.randrange(100, 50_000) / 100}}}'
        )
        yield product.encode(), value.encode()


def preload(
    settings: Settings,
    topic: str,
    events: Iterable[tuple[bytes, bytes]],
    progress: Progress,
    total: int | None = None,
) -> float:
    """Produce the events into `topic`; returns their size in MB (keys plus values).

    `total` is the number of events when `events` is a generator (for the progress bar).
    """
    producer = client.producer(
        settings, queue_buffering_max_messages=500_000, batch_num_messages=10_000, linger_ms=50
    )
    if total is None:
        total = len(events) if isinstance(events, Sized) else None
    task = progress.add_task(f"preloading {topic}", total=total)
    size = n = 0
    for n, (key, value) in enumerate(events, 1):
        size += len(key) + len(value)
        records.send(producer, topic, key=key, value=value)
        if n % 20_000 == 0:
            producer.poll(0)
            progress.update(task, completed=n)
    if producer.flush(120) != 0:
        raise RuntimeError(f"preload of {topic}: records left undelivered after 120 s")
    progress.update(task, completed=n, total=n)
    return size / 1e6


def consumer_perf(settings: Settings, topic: str, records: int) -> Figure:
    """Kafka's ConsumerPerformance tool, read_committed like every duality consumer."""
    # The Java client's own names (sasl.jaas.config, escaped), in a file only this user reads.
    properties = {**settings.java_client_config(), "isolation.level": "read_committed"}
    properties.pop("bootstrap.servers")
    with tempfile.NamedTemporaryFile("w", suffix=".properties", delete=False) as config:
        config.write(java_properties(properties))
    command = [
        "java",
        "-Xmx1g",
        "-cp",
        f"{settings.jar_cache / 'broker'}/*",
        "org.apache.kafka.tools.ConsumerPerformance",
        "--bootstrap-server",
        settings.bootstrap_servers,
        "--topic",
        topic,
        "--messages",
        str(records),
        "--timeout",
        "60000",
        "--group",
        f"bench-perf-{time.time_ns()}",
        "--consumer.config",
        config.name,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    finally:
        Path(config.name).unlink(missing_ok=True)
    if result.returncode != 0:
        raise RuntimeError(f"ConsumerPerformance failed:\n{result.stdout}\n{result.stderr}")
    return parse_consumer_perf(result.stdout)


def parse_consumer_perf(output: str) -> Figure:
    """Read the tool's CSV summary: a header line, then one line of figures."""
    lines = [line for line in output.splitlines() if line.strip() and "," in line]
    header_at = next(i for i, line in enumerate(lines) if line.startswith("start.time"))
    names = [name.strip() for name in lines[header_at].split(",")]
    values = dict(zip(names, (v.strip() for v in lines[header_at + 1].split(",")), strict=True))
    # The tool's end.time - start.time includes the group join; fetch.time.ms is the reading.
    seconds = float(values["fetch.time.ms"]) / 1000
    return Figure(
        scenario="kafka-consumer-perf",
        records=int(values["data.consumed.in.nMsg"]),
        seconds=seconds,
        megabytes=float(values["data.consumed.in.MB"]) * 1.048576,  # the tool's MB is MiB
    )


def python_copy(
    settings: Settings, source: str, target: str, expected: int, progress: Progress
) -> Figure:
    """Consume `source` and produce every record to `target` with confluent-kafka."""
    ends = offsets.end_offsets(settings, source)
    consumer = client.consumer(settings, f"bench-copy-{time.time_ns()}", fetch_max_bytes=52_428_800)
    producer = client.producer(settings, queue_buffering_max_messages=500_000, linger_ms=50)
    consumer.subscribe([source])
    task = progress.add_task(f"copying {source} -> {target}", total=expected)
    copied = size = 0
    done: set[int] = {p for p, end in ends.items() if end == 0}
    start = time.perf_counter()
    try:
        while len(done) < len(ends):
            for msg in consumer.consume(num_messages=10_000, timeout=1.0):
                if records.end_of_partition(msg):  # raises any other error
                    done.add(msg.partition())
                    continue
                key, value = msg.key(), msg.value()
                records.send(producer, target, key=key, value=value)
                copied += 1
                size += len(key or b"") + len(value or b"")
                if msg.offset() + 1 >= ends[msg.partition()]:
                    done.add(msg.partition())
            producer.poll(0)
            progress.update(task, completed=copied)
        assert producer.flush(120) == 0, "copy: records left undelivered"
    finally:
        consumer.close()
    seconds = time.perf_counter() - start
    assert copied == expected, f"copied {copied} records, expected {expected}"
    return Figure("python-copy", copied, seconds, size / 1e6)
