"""The replicas' HTTP/1.1 server: GET and HEAD over keep-alive connections, on one asyncio event
loop, each answer written whole in one send (docs/decisions/0036-serving-replicas.md).

A pull query's own work is a lookup and its JSON (about 0.04 ms); behind `http.server`'s
threading server it cost 0.33-0.36 ms of CPU, behind uvicorn 0.26 ms, behind this 0.18 ms
(2026-11-28, decision 36): the rest is the HTTP layer and the loopback's send and receive. A
request that may wait (`blocks`) runs on a thread of its own, its connection reading nothing
more until it is answered, so that answers leave in the order asked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

log = logging.getLogger("duality.serve")

# A request's line and headers may take this many bytes; more is answered 431 and closed.
MAX_HEAD_BYTES = 16_384
# A request's body (which a GET does not need) may take this many bytes; more is answered 413.
MAX_BODY_BYTES = 65_536
# Requests that may wait (`blocks`) at once; more queue for a thread.
WAITING_THREADS = 16


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    target: str  # as sent: the path and query, still quoted
    headers: Mapping[str, str]  # names in lower case


@dataclasses.dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


Handler = Callable[[Request], Response]


def _encode(response: Response, head_only: bool, close: bool) -> bytes:
    reason = HTTPStatus(response.status).phrase
    lines = [
        f"HTTP/1.1 {response.status} {reason}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        *(f"{name}: {value}" for name, value in response.headers.items()),
    ]
    if close:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body


def json_response(
    status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
) -> Response:
    return Response(status, json.dumps(body).encode(), "application/json", headers or {})


def _error(status: int, message: str) -> Response:
    return json_response(status, {"error": message})


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.waiting = False  # a request on a thread: read no further until it is answered
        self.full = False  # the client reads its answers slower than it asks: read no further
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport  # asyncio turns Nagle off: an answer leaves at once
        self.server.connections.add(transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        """Answer every whole request in the buffer, in order."""
        assert self.transport is not None
        while not (self.waiting or self.full or self.closing):
            end = self.buffer.find(b"\r\n\r\n")
            if (end if end >= 0 else len(self.buffer)) > MAX_HEAD_BYTES:
                self._finish(_error(431, "the request's headers are too large"), False, True)
                return
            if end < 0:  # the rest of its headers is still coming
                return
            parsed = _parse(bytes(self.buffer[:end]))
            if isinstance(parsed, Response):  # not HTTP/1.x as this server reads it
                self._finish(parsed, False, True)
                return
            request, version = parsed
            length = request.headers.get("content-length", "0")
            if "transfer-encoding" in request.headers or not length.isdigit():
                self._finish(_error(400, "a request body must have a Content-Length"), False, True)
                return
            if int(length) > MAX_BODY_BYTES:
                self._finish(_error(413, "a GET needs no body"), False, True)
                return
            whole = end + 4 + int(length)
            if len(self.buffer) < whole:  # its body (which a GET ignores) is still coming
                return
            del self.buffer[:whole]
            connection = request.headers.get("connection", "").lower()
            close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
            head_only = request.method == "HEAD"
            if request.method not in ("GET", "HEAD"):
                self._finish(_error(405, "this API answers GET only"), False, close)
            elif self.server.blocks(request):
                self.waiting = True
                self.transport.pause_reading()
                future = self.server.loop.run_in_executor(
                    self.server.waiters, self.server.answer, request
                )
                future.add_done_callback(functools.partial(self._answered, head_only, close))
            else:
                self._finish(self.server.answer(request), head_only, close)

    def _answered(self, head_only: bool, close: bool, done: asyncio.Future[Response]) -> None:
        self.waiting = False
        if done.cancelled() or self.transport is None or self.transport.is_closing():
            return
        self._finish(done.result(), head_only, close)
        self._resume()

    def pause_writing(self) -> None:
        # Answers pile up unread (pipelined requests never read): ask for no more meanwhile.
        assert self.transport is not None
        self.full = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.full = False
        self._resume()

    def _resume(self) -> None:
        if self.transport is None or self.closing or self.waiting or self.full:
            return
        self.transport.resume_reading()
        self._next()

    def _finish(self, response: Response, head_only: bool, close: bool) -> None:
        assert self.transport is not None
        self.transport.write(_encode(response, head_only, close))
        if close:
            self.closing = True
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server.connections.discard(self.transport)
        self.transport = None


def _parse(head: bytes) -> tuple[Request, str] | Response:
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        return _error(400, "not an HTTP request line")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        return _error(505, "this API speaks HTTP/1.1")
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return _error(400, "a header line is not `Name: value`")
        headers[name.lower()] = value.strip()
    return Request(method, target, headers), version


class HttpServer:
    """Answers `handler`'s responses on (host, port) until `shutdown`; `blocks` says which
    requests may wait (they run on threads of their own)."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: Handler,
        blocks: Callable[[Request], bool] = lambda request: False,
    ) -> None:
        self.handler, self.blocks = handler, blocks
        self.connections: set[asyncio.Transport] = set()
        self.socket = socket.create_server(address, reuse_port=False)
        self.socket.setblocking(False)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self.loop = asyncio.new_event_loop()
        self.waiters = ThreadPoolExecutor(WAITING_THREADS, thread_name_prefix="serve-wait")
        self._stop = asyncio.Event()  # set on the loop by `shutdown`, whenever it is called
        self._serving = threading.Event()  # serve_forever was entered
        self._stopped = threading.Event()  # ... and returned

    def answer(self, request: Request) -> Response:
        try:
            return self.handler(request)
        except Exception:  # the connection gets an answer; the log gets the cause
            log.exception("answering %s %s failed", request.method, request.target.split("?")[0])
            return _error(500, "the replica failed to answer; its log says why")

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{host!s}:{port}"

    def serve_forever(self) -> None:
        """Answer requests on this thread until `shutdown`, even one called before this."""
        self._serving.set()
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self._stopped.set()

    async def _serve(self) -> None:
        server = await self.loop.create_server(lambda: _Connection(self), sock=self.socket)
        await self._stop.wait()
        server.close()
        for transport in list(self.connections):
            transport.close()
        await server.wait_closed()
        await asyncio.sleep(0)  # the transports' close callbacks

    def shutdown(self) -> None:
        """Stop `serve_forever`, and wait until it returned if it was running."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self._stop.set)
        if self._serving.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        self.waiters.shutdown(wait=False, cancel_futures=True)
        self.socket.close()
        if not self.loop.is_running():
            self.loop.close()
