"""A replica's parts without Kafka: the table key and the position token, the SQLite store (rows
and offsets in one transaction, reopened as left), and the HTTP API over a store filled here
(404, 400, 401, 503 with Retry-After, `at`, `max_lag`, `/healthz`, `/metrics`)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from duality.config import Settings
from duality.errors import UsageError
from duality.metrics import ServingMetrics
from duality.serve.api import ApiServer
from duality.serve.keys import KeyMismatch, TableKey, TokenError, parse_token, reached, token
from duality.serve.replica import Replica
from duality.serve.store import Change, Store
from duality.spec import PipelineSpec
from tests.harness import assert_eventually, make_pipeline

TOKEN = "a-bearer-token-of-some-length"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, pipelines=tmp_path / "pipelines", local_dir=tmp_path / "local")


def _keyed(settings: Settings, key: str, kind: str) -> PipelineSpec:
    """product_sales keyed on `key` of type `kind`."""
    pipeline = make_pipeline(settings, settings.pipelines, "product_sales")
    data = pipeline.model_dump(by_alias=True, exclude_none=True)
    data["source"]["schema"][key] = kind
    data["source"]["key"] = key
    return PipelineSpec.model_validate(data)


def test_a_key_is_found_however_its_value_is_written(settings: Settings):
    product = TableKey.of(make_pipeline(settings, settings.pipelines, "product_sales"))
    assert product.decode(b"p-1") == ("p-1", "")
    assert product.parse("p-1") == "p-1"
    numbered = TableKey.of(_keyed(settings, "quantity", "long"))
    assert numbered.decode(b"42") == ("42", "")
    assert numbered.parse("042") == numbered.parse("42.0") == "42"
    with pytest.raises(KeyMismatch, match=r"'4x2' does not fit .*: quantity \(long\)"):
        numbered.parse("4x2")
    with pytest.raises(KeyMismatch, match=r"quantity \(long\)"):
        numbered.parse("4.5")
    hourly = TableKey.of(make_pipeline(settings, settings.pipelines, "sensor_stats"))
    assert hourly.windowed
    assert hourly.decode(b'["s-1","2026-11-21T10:00:00.000Z"]') == (
        "s-1",
        "2026-11-21T10:00:00.000Z",
    )
    assert hourly.parse("s-1") == "s-1"


def test_a_token_holds_its_position_and_names_its_changelog():
    text = token("t-changelog", {0: 12, 2: 5})
    assert parse_token(text, "t-changelog") == {0: 12, 2: 5}
    with pytest.raises(TokenError, match="'t-changelog', not of 'other'"):
        parse_token(text, "other")
    with pytest.raises(TokenError, match="not a position token"):
        parse_token("not-a-token", "t-changelog")
    assert reached({0: 12, 1: 0, 2: 6}, {0: 12, 2: 5})
    assert not reached({0: 11, 2: 6}, {0: 12, 2: 5})


def _row(key: str, offset: int, partition: int = 0, value: Any = "row", window: str = "") -> Change:
    data = None if value is None else json.dumps({"k": key, "v": value}).encode()
    return Change(key, window, key.encode(), data, partition, offset)


def test_the_store_writes_rows_and_offsets_together_and_reopens_as_left(tmp_path: Path):
    store = Store(tmp_path / "p.sqlite", "p-changelog")
    assert store.apply([_row("a", 0), _row("b", 1), _row("a", 2, value="new")], {0: 3, 1: 0}) == 3
    assert store.rows() == {b"a": {"k": "a", "v": "new"}, b"b": {"k": "b", "v": "row"}}
    store.apply([_row("b", 3, value=None)], {0: 4, 1: 0})  # a tombstone
    assert store.rows() == {b"a": {"k": "a", "v": "new"}}
    bad = Change("c", "", b"c", b"\xff", 0, 4)  # its value is no text: the write fails whole
    with pytest.raises(UnicodeDecodeError):
        store.apply([_row("d", 4), bad], {0: 6})
    assert store.position() == {0: 4, 1: 0} and set(store.rows()) == {b"a"}
    with pytest.raises(UsageError, match="another running `duality serve`"):
        Store(tmp_path / "p.sqlite", "p-changelog")
    read = store.read("a")
    assert read.position == {0: 4, 1: 0} and read.rows[0].offset == 2
    store.close()
    again = Store(tmp_path / "p.sqlite", "p-changelog")
    assert again.position() == {0: 4, 1: 0} and set(again.rows()) == {b"a"}
    again.close()
    other = Store(tmp_path / "p.sqlite", "another-changelog")  # another topic: starts empty
    assert other.position() == {} and other.rows() == {}
    other.close()


def test_windows_are_read_by_range_and_expire_with_their_records(tmp_path: Path):
    store = Store(tmp_path / "w.sqlite", "w-changelog")
    hours = [f"2026-11-21T{h:02d}:00:00.000Z" for h in (10, 11, 12)]
    store.apply([_row("s", n, partition=1, window=hour) for n, hour in enumerate(hours)], {1: 3})
    assert [r.window_start for r in store.read("s").rows] == hours
    assert [r.window_start for r in store.read("s", hours[1], hours[1]).rows] == hours[1:2]
    assert store.prune({1: 2}) == 2  # retention deleted the records below offset 2
    assert [r.window_start for r in store.read("s").rows] == hours[2:]
    store.close()


@pytest.fixture
def api(settings: Settings, tmp_path: Path) -> Iterator[tuple[ApiServer, Replica]]:
    """The API over a replica of product_sales whose store is filled by the test (its reader
    never started), asking for TOKEN."""
    pipeline = make_pipeline(settings, settings.pipelines, "product_sales")
    metrics = ServingMetrics()
    replica = Replica(settings, pipeline, tmp_path / "serve", metrics)
    server = ApiServer(("127.0.0.1", 0), {pipeline.name: replica}, metrics, TOKEN)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield server, replica
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        replica.store.close()


def _get(url: str, bearer: str | None = TOKEN) -> tuple[int, dict[str, Any], dict[str, str]]:
    request = urllib.request.Request(url)
    if bearer:
        request.add_header("Authorization", f"Bearer {bearer}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def _advance(replica: Replica, changes: list[Change], position: dict[int, int]) -> None:
    """What the replica's reader does with a poll: write, then move its position."""
    replica.store.apply(changes, position)
    with replica._changed:
        replica._position = dict(position)
        replica._changed.notify_all()


def test_the_api_answers_a_row_with_its_position_and_refuses_what_it_cannot_meet(api):
    server, replica = api
    rows = f"{server.url}/v1/pipelines/{replica.pipeline}/rows"
    assert _get(f"{rows}/p-1", bearer=None)[0] == 401
    assert _get(f"{rows}/p-1", bearer="a-wrong-token-of-some-length")[0] == 401
    status, body, _ = _get(f"{rows}/p-1")
    assert status == 404 and body["position"] == {} and "token" in body
    _advance(replica, [_row("p-1", 0, partition=2)], {0: 0, 1: 0, 2: 1})
    status, body, _ = _get(f"{rows}/p-1")
    assert status == 200, body
    assert body["row"] == {"k": "p-1", "v": "row"} and (body["partition"], body["offset"]) == (2, 0)
    assert body["position"] == {"0": 0, "1": 0, "2": 1} and body["lag"] == 0
    seen = body["token"]
    # The changelog moved on (its end, as the end watcher reads it): 5 records behind.
    with replica._changed:
        replica._ends = {0: 0, 1: 0, 2: 6}
    status, body, headers = _get(f"{rows}/p-1?max_lag=4")
    assert status == 503 and headers["Retry-After"] == "1" and body["lag"] == 5, body
    assert _get(f"{rows}/p-1?max_lag=5")[0] == 200
    # A token from a replica further on: this one answers nothing older, waiting if asked to.
    ahead = token(replica.topic, {2: 6})
    assert _get(f"{rows}/p-1?at={ahead}")[0] == 503
    later = threading.Timer(
        0.3, _advance, (replica, [_row("p-1", 5, 2, "newer")], {0: 0, 1: 0, 2: 6})
    )
    later.start()
    status, body, _ = _get(f"{rows}/p-1?at={ahead}&wait=10")
    later.join()
    assert status == 200 and body["row"]["v"] == "newer" and body["offset"] == 5
    assert _get(f"{rows}/p-1?at={seen}")[1]["row"]["v"] == "newer"
    status, body, _ = _get(f"{rows}/p-1?at=garbage")
    assert status == 400 and "not a position token" in body["error"]
    assert _get(f"{server.url}/v1/pipelines/nope/rows/p-1")[0] == 404
    status, body, _ = _get(f"{server.url}/v1/pipelines/{replica.pipeline}")
    assert status == 200 and body["lag"] == 0 and body["position"]["2"] == 6
    status, body, _ = _get(f"{server.url}/healthz", bearer=None)
    assert status == 503 and body["replicas"][replica.pipeline]["alive"] is False  # not started
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    assert f'duality_pull_requests_total{{code="503",pipeline="{replica.pipeline}"}} 2.0' in text
    assert "duality_pull_request_duration_seconds_bucket" in text


def test_a_key_that_does_not_fit_is_400_naming_the_key_type(settings: Settings, tmp_path: Path):
    pipeline = _keyed(settings, "quantity", "long")
    metrics = ServingMetrics()
    replica = Replica(settings, pipeline, tmp_path / "serve", metrics)
    server = ApiServer(("127.0.0.1", 0), {pipeline.name: replica}, metrics)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        status, body, _ = _get(f"{server.url}/v1/pipelines/{pipeline.name}/rows/abc", None)
        assert status == 400 and body["key_type"] == "quantity (long)", body
        assert "does not fit the key" in body["error"]
        assert _get(f"{server.url}/v1/pipelines/{pipeline.name}/rows/12", None)[0] == 404
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        replica.store.close()


def test_the_client_asks_the_next_replica_when_one_does_not_answer(api, settings: Settings):
    """`duality query`'s client: a closed port first in the list is passed over (its lag is
    unknown, so it is asked last, and its refusal is not an answer); a 503 is passed over; a
    key without a row is CheckFailed with the position, a key of the wrong type a UsageError."""
    from duality.errors import CheckFailed
    from duality.serve import client

    server, replica = api
    with socket.socket() as probe:  # a port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    both = settings.replace(replicas=f"{closed},{server.url}", serve_token=TOKEN)
    assert client.by_lag(both, replica.pipeline) == [server.url, closed]
    _advance(replica, [_row("p-1", 0)], {0: 1, 1: 0, 2: 0})
    answer = client.query(both, replica.pipeline, "p-1")
    assert answer["replica"] == server.url and answer["row"]["v"] == "row"
    with pytest.raises(CheckFailed, match="no row for key 'p-2'") as missing:
        client.query(both, replica.pipeline, "p-2")
    assert missing.value.details["position"] == {"0": 1, "1": 0, "2": 0}
    ahead = token(replica.topic, {0: 5})
    with pytest.raises(CheckFailed, match=r"no replica of .* answered: .*: 503 the replica is"):
        client.query(both, replica.pipeline, "p-1", at=ahead)
    only_closed = settings.replace(replicas=closed)
    with pytest.raises(CheckFailed, match="no answer"):
        client.query(only_closed, replica.pipeline, "p-1")
    with pytest.raises(UsageError, match="bearer token"):
        client.query(settings.replace(replicas=server.url), replica.pipeline, "p-1")


def test_a_windowed_key_answers_its_windows_in_a_range(settings: Settings, tmp_path: Path):
    """sensor_stats (hourly windows): a key's windows in window order, `from`/`to` bounding
    them, each with its changelog partition and offset."""
    pipeline = make_pipeline(settings, settings.pipelines, "sensor_stats")
    metrics = ServingMetrics()
    replica = Replica(settings, pipeline, tmp_path / "serve", metrics)
    server = ApiServer(("127.0.0.1", 0), {pipeline.name: replica}, metrics)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        hours = [f"2026-11-21T{h:02d}:00:00.000Z" for h in (10, 11, 12)]
        changes = []
        for n, hour in enumerate(hours):
            raw = json.dumps(["s-1", hour]).encode()
            value = json.dumps({"sensor_id": "s-1", "window_start": hour, "readings": n}).encode()
            changes.append(Change("s-1", hour, raw, value, 1, n))
        _advance(replica, changes, {0: 0, 1: 3, 2: 0})
        url = f"{server.url}/v1/pipelines/{pipeline.name}/rows/s-1"
        status, body, _ = _get(url, None)
        assert status == 200 and [w["window_start"] for w in body["windows"]] == hours, body
        assert [(w["partition"], w["offset"], w["row"]["readings"]) for w in body["windows"]] == [
            (1, 0, 0),
            (1, 1, 1),
            (1, 2, 2),
        ]
        status, body, _ = _get(f"{url}?from={hours[1]}&to={hours[1]}", None)
        assert [w["window_start"] for w in body["windows"]] == hours[1:2]
        assert _get(f"{server.url}/v1/pipelines/{pipeline.name}/rows/s-2", None)[0] == 404
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        replica.store.close()


def test_a_snapshot_loads_with_its_coverage_and_expires_with_it(tmp_path: Path):
    """A new replica's rows from the published snapshot: no partition or offset, the coverage
    as the position; the changelog's updates replace them; once retention passed the coverage
    on every partition, those still as the snapshot gave them are dropped."""
    store = Store(tmp_path / "s.sqlite", "s-changelog")
    rows = [(f"k{n}", "", f"k{n}".encode(), json.dumps({"k": n})) for n in range(3)]
    assert store.load_snapshot(iter(rows), {0: 10, 1: 20}) == 3
    assert store.position() == {0: 10, 1: 20} and store.snapshot_coverage() == {0: 10, 1: 20}
    (row,) = store.read("k1").rows
    assert (row.partition, row.offset, row.value) == (None, None, {"k": 1})
    store.apply([_row("k1", 12, partition=0, value="new")], {0: 13, 1: 20})
    assert store.prune({0: 9, 1: 25}) == 0  # partition 0 still holds a record it covered
    assert store.prune({0: 10, 1: 20}) == 2  # every covered record gone: k0, k2 go
    assert set(store.rows()) == {b"k1"}
    store.clear()
    assert store.snapshot_coverage() == {} and store.rows() == {}
    store.close()


BURST = 100_000  # pipelined requests, whose answers outgrow the sockets' buffers


def _exchange(sock: socket.socket, data: bytes, answers: int) -> list[tuple[str, bytes]]:
    """Send `data`; read `answers` responses (status line, body) off the connection."""
    sock.sendall(data)
    reader = sock.makefile("rb")
    got = []
    for _ in range(answers):
        status = reader.readline().decode().strip()
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        got.append((status, reader.read(length)))
    return got


def test_the_http_layer_keeps_connections_answers_in_order_and_refuses_what_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
):
    """duality.serve.http without the API: keep-alive, pipelined requests answered in order (a
    waiting one on a thread, the connection's later ones after it, other connections at once; a
    burst of them answered while read), HEAD, Connection: close, a body skipped, and
    400/405/413/431/505 for what it does not read."""
    from duality.serve import http
    from duality.serve.http import HttpServer, Request, Response

    paused: list[bool] = []
    pause = http._Connection.pause_writing
    monkeypatch.setattr(
        http._Connection, "pause_writing", lambda self: (paused.append(True), pause(self))[-1]
    )
    release = threading.Event()

    def handler(request: Request) -> Response:
        if request.target == "/boom":
            raise RuntimeError("a handler's bug")
        if request.target == "/wait":
            assert release.wait(10)
        return Response(200, request.target.encode(), "text/plain")

    server = HttpServer(("127.0.0.1", 0), handler, lambda request: request.target == "/wait")
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        address = server.server_address
        with socket.create_connection(address, timeout=10) as one:
            pipelined = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\n\r\n"
            assert _exchange(one, pipelined, 2) == [
                ("HTTP/1.1 200 OK", b"/a"),
                ("HTTP/1.1 200 OK", b"/b"),
            ]
            # A body (which a GET does not need) is read past, and the next request answered.
            body = b"GET /c HTTP/1.1\r\nContent-Length: 3\r\n\r\nxyzGET /d HTTP/1.1\r\n\r\n"
            assert [b for _, b in _exchange(one, body, 2)] == [b"/c", b"/d"]
            # A request that waits holds its connection's next one, not another connection.
            one.sendall(b"GET /wait HTTP/1.1\r\n\r\nGET /after HTTP/1.1\r\n\r\n")
            with socket.create_connection(address, timeout=10) as two:
                assert _exchange(two, b"GET /other HTTP/1.1\r\n\r\n", 1)[0][1] == b"/other"
            release.set()
            assert [b for _, b in _exchange(one, b"", 2)] == [b"/wait", b"/after"]
            status, body = _exchange(one, b"GET /boom HTTP/1.1\r\n\r\n", 1)[0]
            assert status == "HTTP/1.1 500 Internal Server Error" and b"log says why" in body
        # Many pipelined requests whose answers are not read for a while: the server stops
        # reading while its answers wait (asyncio's pause_writing), then answers each, in order.
        with socket.socket() as many:
            many.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            many.settimeout(10)
            many.connect(address)
            burst = b"".join(b"GET /m%d HTTP/1.1\r\n\r\n" % n for n in range(BURST))
            sender = threading.Thread(target=many.sendall, args=(burst,))
            sender.start()
            assert_eventually(lambda: paused, timeout=10, message="the answers never backed up")
            answers = _exchange(many, b"", BURST)
            sender.join(10)
            assert [b for _, b in answers] == [b"/m%d" % n for n in range(BURST)]
        with socket.create_connection(address, timeout=10) as head:
            head.sendall(b"HEAD /h HTTP/1.1\r\nConnection: close\r\n\r\n")
            answer = head.makefile("rb").read()
            assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\n")
            assert b"Content-Length: 2" in answer and b"Connection: close" in answer
        refused = {
            b"POST /p HTTP/1.1\r\n\r\n": 405,
            b"GARBAGE\r\n\r\n": 400,
            b"GET / HTTP/2.0\r\n\r\n": 505,
            b"GET / HTTP/1.1\r\nno colon here\r\n\r\n": 400,
            b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n": 400,
            b"GET / HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n": 413,
            b"GET / HTTP/1.1\r\nX: " + b"y" * 20_000 + b"\r\n\r\n": 431,
        }
        for request, status in refused.items():
            with socket.create_connection(address, timeout=10) as bad:
                bad.sendall(request)
                first = bad.makefile("rb").readline().decode()
                assert first.startswith(f"HTTP/1.1 {status} "), (request[:40], first)
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert not thread.is_alive()


def test_a_server_asked_to_stop_before_it_serves_stops_at_once():
    """`shutdown` before `serve_forever` (a stop that comes while `duality serve` starts): the
    loop returns as soon as it runs, rather than serving for ever on a closed socket."""
    from duality.serve.http import HttpServer, Response

    server = HttpServer(("127.0.0.1", 0), lambda request: Response(200, b""))
    server.shutdown()
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    server.server_close()
