"""The replicas' HTTP API, version 1 (docs/serving.md), read-only, JSON:

- `GET /v1/pipelines/{p}/rows/{key}[?max_lag=N&at=TOKEN&wait=S&from=W&to=W]`: the key's row
  (a windowed table's rows, of the windows from `from` to `to`), its changelog partition and
  offset, the replica's position, its lag and the position token. 404 with the position for a
  key without a row; 400 naming the key type for a key that does not fit it; 503 with
  `Retry-After` and the position when the replica is more than `max_lag` records behind the
  changelog's committed end, or older than the token `at`, for `wait` seconds (default 0).
- `GET /v1/pipelines/{p}`: the replica's position, lag and token (what `duality query` picks
  the least lagging replica by).
- `GET /healthz` and `GET /metrics` (Prometheus).

With a bearer token set (`DUALITY_SERVE_TOKEN`), `/v1/` answers only requests that carry it
(401 otherwise); it is compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import logging
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from duality.errors import UsageError
from duality.metrics import ServingMetrics
from duality.serve.http import HttpServer, Request, Response, json_response
from duality.serve.keys import parse_token, reached, token
from duality.serve.replica import Replica

log = logging.getLogger("duality.serve")

# Longest `wait` a request may ask for, in seconds: a request holds one of the server's threads.
MAX_WAIT_S = 30.0
# Retry-After of a 503, in seconds.
RETRY_AFTER_S = 1


class _Answer(Exception):
    """An answer other than 200, raised where it is decided."""

    def __init__(self, status: int, body: Mapping[str, Any], retry_after: int | None = None):
        super().__init__(status)
        self.status, self.body, self.retry_after = status, dict(body), retry_after


class ApiServer(HttpServer):
    """The API of `replicas` (by pipeline) on (host, port)."""

    def __init__(
        self,
        address: tuple[str, int],
        replicas: Mapping[str, Replica],
        metrics: ServingMetrics,
        bearer: str | None = None,
    ) -> None:
        super().__init__(address, self._handle, _may_wait)
        self.replicas, self.metrics, self.bearer = dict(replicas), metrics, bearer

    def _handle(self, request: Request) -> Response:
        started = time.perf_counter()
        parsed = urllib.parse.urlsplit(request.target)
        # The path only, at debug: never a header (the bearer token).
        log.debug("%s %s", request.method, parsed.path)
        parts = [urllib.parse.unquote(p) for p in parsed.path.split("/")[1:]]
        query = urllib.parse.parse_qs(parsed.query)
        pipeline = None
        try:
            if parts == ["healthz"]:
                return self._health()
            if parts == ["metrics"]:
                return Response(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
            if parts[:2] != ["v1", "pipelines"] or len(parts) not in (3, 5):
                raise _Answer(404, {"error": f"no such resource: {parsed.path}"})
            self._authorize(request)
            replica = self.replicas.get(parts[2])
            if replica is None:
                served = sorted(self.replicas)
                raise _Answer(
                    404,
                    {"error": f"this server has no replica of {parts[2]!r}; it serves {served}"},
                )
            pipeline = replica.pipeline
            if len(parts) == 3:
                return json_response(
                    200, {"pipeline": pipeline, **replica.describe(), **_position_of(replica)}
                )
            if parts[3] != "rows":
                raise _Answer(404, {"error": f"no such resource: {parsed.path}"})
            answer = json_response(200, rows(replica, parts[4], query))
            self._count(pipeline, 200, started)
            return answer
        except _Answer as refused:
            headers = (
                {} if refused.retry_after is None else {"Retry-After": str(refused.retry_after)}
            )
            if pipeline is not None and len(parts) == 5:
                self._count(pipeline, refused.status, started)
            return json_response(refused.status, refused.body, headers)

    def _count(self, pipeline: str, status: int, started: float) -> None:
        self.metrics.requests.labels(pipeline, str(status)).inc()
        self.metrics.seconds.labels(pipeline).observe(time.perf_counter() - started)

    def _authorize(self, request: Request) -> None:
        expected = self.bearer
        if expected is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, credential = given.partition(" ")
        if not (
            scheme.lower() == "bearer"
            and hmac.compare_digest(credential.strip().encode(), expected.encode())
        ):
            raise _Answer(
                401, {"error": "this replica needs the bearer token (DUALITY_SERVE_TOKEN)"}
            )

    def _health(self) -> Response:
        replicas = {name: r.describe() | {"alive": r.alive()} for name, r in self.replicas.items()}
        healthy = all(r["alive"] for r in replicas.values())
        return json_response(
            200 if healthy else 503,
            {"status": "ok" if healthy else "failing", "replicas": replicas},
        )


def _may_wait(request: Request) -> bool:
    """A request that may wait for its replica (`wait`) runs on a thread of its own."""
    return "wait=" in request.target


def _position_of(replica: Replica) -> dict[str, Any]:
    position, lag = replica.position(), replica.lag()
    return {
        "position": {str(p): o for p, o in sorted(position.items())},
        "lag": sum(lag.values()),
        "token": token(replica.topic, position),
    }


def _number(query: Mapping[str, list[str]], name: str, kind: type) -> Any:
    if name not in query:
        return None
    text = query[name][-1]
    try:
        value = kind(text)
    except ValueError:
        raise _Answer(400, {"error": f"{name}={text!r} is not a number"}) from None
    if value < 0:
        raise _Answer(400, {"error": f"{name}={text!r} is negative"})
    return value


def rows(replica: Replica, key: str, query: Mapping[str, list[str]]) -> dict[str, Any]:
    """The answer to `GET /v1/pipelines/{p}/rows/{key}`, or _Answer."""
    try:
        group_key = replica.key.parse(key)
        wanted = parse_token(query["at"][-1], replica.topic) if "at" in query else None
    except UsageError as error:
        raise _Answer(400, {"error": str(error), "key_type": replica.key.describe()}) from None
    max_lag = _number(query, "max_lag", int)
    wait = min(_number(query, "wait", float) or 0.0, MAX_WAIT_S)

    def fresh(position: Mapping[int, int], lag: Mapping[int, int]) -> bool:
        return (wanted is None or reached(position, wanted)) and (
            max_lag is None or sum(lag.values()) <= max_lag
        )

    if not replica.wait_until(fresh, wait):
        reason = []
        if wanted is not None and not reached(replica.position(), wanted):
            reason.append("older than the position `at` asks for")
        if max_lag is not None:
            reason.append(f"more than max_lag={max_lag} records behind")
        raise _Answer(
            503,
            {"error": f"the replica is {' and '.join(reason) or 'stale'}", **_position_of(replica)},
            RETRY_AFTER_S,
        )
    window_from = query.get("from", [""])[-1]
    window_to = query.get("to", [""])[-1]
    found = replica.store.read(group_key, window_from, window_to)
    if wanted is not None and not reached(found.position, wanted):  # cannot be: it only grows
        raise _Answer(503, {"error": "the store is older than `at`"}, RETRY_AFTER_S)
    lag = replica.lag(found.position)
    answer: dict[str, Any] = {
        "pipeline": replica.pipeline,
        "key": key,
        "position": {str(p): o for p, o in sorted(found.position.items())},
        "lag": sum(lag.values()),
        "token": token(replica.topic, found.position),
    }
    if not found.rows:
        raise _Answer(404, {"error": f"no row for key {key!r}", **answer})
    if replica.key.windowed:
        answer["windows"] = [
            {
                "window_start": r.window_start,
                "row": r.value,
                "partition": r.partition,
                "offset": r.offset,
            }
            for r in found.rows
        ]
    else:
        (row,) = found.rows
        answer.update(row=row.value, partition=row.partition, offset=row.offset)
    return answer
