"""`duality serve` run as users run it, for the tests of pull queries: a process group of its
own, its address read from the `serve.json` it writes, stopped with SIGTERM (or SIGKILLed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from duality import process
from duality.config import Settings
from tests.harness import assert_eventually


class ServeProcess:
    """`duality serve PIPELINE ...` with its stores in `folder`, on a free port of 127.0.0.1,
    its output appended to `folder/serve.log`."""

    def __init__(self, settings: Settings, folder: Path, *pipelines: str) -> None:
        self.settings = settings.replace(serve_dir=folder, serve_port=0)
        self.folder, self.pipelines = folder, pipelines
        self.log = folder / "serve.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> ServeProcess:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "duality", "serve", *self.pipelines],
                env={**os.environ, **self.settings.as_env()},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = assert_eventually(self._address, timeout=120, message=f"see {self.log}")
        return self

    def _address(self) -> str | None:
        assert self.process is not None and self.process.poll() is None, self.tail()
        try:
            record = json.loads((self.folder / "serve.json").read_text())
        except (OSError, ValueError):
            return None
        return str(record["url"]) if record["pid"] == self.process.pid else None

    def get(self, path: str, **params: Any) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) of GET `path` with the query `params`."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def row(self, pipeline: str, key: str, **params: Any) -> tuple[int, dict[str, Any]]:
        return self.get(
            f"/v1/pipelines/{pipeline}/rows/{urllib.parse.quote(key, safe='')}", **params
        )

    def caught_up(self, pipeline: str, ends: dict[int, int]) -> bool:
        """Whether the replica's position has reached `ends` and it knows of no lag."""
        status, body = self.get(f"/v1/pipelines/{pipeline}")
        position = {int(p): o for p, o in body.get("position", {}).items()}
        return (
            status == 200
            and body["lag"] == 0
            and all(position.get(p, 0) >= end for p, end in ends.items())
        )

    def applied(self, pipeline: str) -> float:
        """`duality_replica_records_applied_total` of `pipeline`, from /metrics."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(
                    f'duality_replica_records_applied_total{{pipeline="{pipeline}"}}'
                ):
                    return float(line.split()[-1])
        raise AssertionError(f"no applied records of {pipeline} in /metrics")

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM; it must stop by itself, with exit code 0."""
        assert self.process is not None
        killed = process.stop_group(self.process.pid, timeout, reap=self.process)
        assert not killed, (
            f"duality serve did not stop within {timeout} s of SIGTERM: {self.tail()}"
        )
        assert self.process.wait() == 0, self.tail()

    def kill(self) -> None:
        if self.process is not None:
            process.kill_group(self.process.pid, reap=self.process)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stable_ends(settings: Settings, topic: str) -> dict[int, int]:
    """The last stable offset of each partition of `topic`, read with a plain consumer."""
    config = settings.kafka_client_config()
    reader = Consumer({**config, "group.id": "stable-ends", "isolation.level": "read_committed"})
    try:
        count = len(reader.list_topics(topic, timeout=30).topics[topic].partitions)
        return {
            p: reader.get_watermark_offsets(TopicPartition(topic, p), timeout=30, cached=False)[1]
            for p in range(count)
        }
    finally:
        reader.close()
