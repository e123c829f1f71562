"""The hot path's HTTP/1.1 wire: keep-alive POSTs for the two requests every call makes.

Owns: pools of keep-alive connections per origin (``http``, or ``https`` verified with the system's CAs
as the shared ``aiohttp`` session does), one request at a time per connection, a cap on open connections
(a request past it waits for one), the connect timeout, reading each answer to its end with ``httptools``
(llhttp: Content-Length, chunked and close-delimited bodies, keep-alive rules) within a size limit, and
telling the caller how far its request got (``Progress``: connected; handed to the kernel). Must never:
follow a redirect, decompress, send a header value holding CR, LF or NUL, reuse a connection whose
answer was not read to the end (a timeout or a cancel closes it), or send a request twice — except
when the caller says it may (``retry_stale``: a decision query, which has no side effect) and a *reused*
connection closed before a byte of its answer arrived.

Why not the shared ``aiohttp.ClientSession``, which still carries everything else (MCP upstreams, cancel
endpoints, OPA's control plane through opa-python-client, health checks): the OPA decision and the
backend POST are the two requests every tool call makes, and aiohttp's client machinery for them
(request and response objects, the session's trace signals, a body-writer task and timer handles per
request) was ~20% of a read's CPU under load. This wire does the same exchange for about a third of
that (measured in docs/performance.md, fourth round).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import ssl
from dataclasses import dataclass, field
from typing import Iterable, Mapping
from urllib.parse import unquote, urlsplit

import httptools

_MAX_IDLE_PER_ORIGIN = 64


class WireError(ConnectionError):
    """The connection failed or the answer was not HTTP: whether the request had an effect is unknown."""


class _Stale(WireError):
    """A reused connection closed before a byte of the answer arrived (the server's idle timeout)."""


class TooLarge(Exception):
    """The answer's body passed the caller's limit (the connection is closed, the body not read)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@dataclass
class Progress:
    """How far one request got: a connection to send it on, then its bytes handed to the kernel."""

    connected: bool = False
    sent: bool = False


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]  # lower-case names; the first of repeated ones
    body: bytes


@dataclass(frozen=True)
class _Origin:
    key: tuple[str, str, int]
    host: str
    port: int
    ssl: ssl.SSLContext | None
    head: bytes  # "POST <target> HTTP/1.1" and the headers every request to this URL carries


class _Connection(asyncio.Protocol):
    """One keep-alive connection; the parser's callbacks fill the current answer."""

    def __init__(self, wire: "HttpWire", origin: _Origin) -> None:
        self.wire = wire
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, dict[str, str], bytes, bool]] | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit: int | None = None
        self.answered = False  # a byte of the current answer arrived
        self.headers_done = False
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # nothing asked: an unsolicited answer (e.g. a 408 on idle) spoils the line
            self.close()
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail(WireError("the answer was not HTTP/1.1"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.wire._connection_closed()
        if self.waiter is not None and self.headers_done and "content-length" not in self.headers \
                and "chunked" not in self.headers.get("transfer-encoding", ""):
            self._complete(False)  # a body delimited by the end of the connection (HTTP/1.0 style)
            return
        self._fail(WireError("the connection closed before the answer") if self.answered
                   else _Stale("the connection closed before answering"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.limit is not None and self.size > self.limit:
            self._fail(TooLarge(self.parser.get_status_code()))
            self.close()
            return
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self._complete(self.parser.should_keep_alive())

    def _complete(self, keep_alive: bool) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), self.headers, b"".join(self.chunks), keep_alive))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def begin(self, waiter: asyncio.Future, limit: int | None) -> None:
        self.waiter, self.limit = waiter, limit
        self.headers, self.chunks, self.size = {}, [], 0
        self.answered = self.headers_done = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.wire._connection_closed()
        if self.transport is not None:
            self.transport.abort()


class HttpWire:
    """POSTs over pooled keep-alive connections, at most ``max_connections`` open at once."""

    def __init__(self, *, max_connections: int = 100, connect_timeout_s: float | None = None) -> None:
        self._max = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._open = 0
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: Iterable[tuple[str, str]] = (), *,
                   progress: Progress | None = None, max_body: int | None = None,
                   retry_stale: bool = False) -> Answer:
        """The answer to one POST. Raises ``WireError`` or ``OSError`` when there is none, ``TimeoutError``
        when connecting took longer than the connect timeout, ``TooLarge`` past ``max_body``."""
        origin = self._origins.get(url) or self._origin(url)
        request = b"".join((origin.head, _headers(headers), b"Content-Length: %d\r\n\r\n" % len(body), body))
        idle = self._idle.get(origin.key)
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            try:
                return await self._exchange(connection, request, progress, max_body)
            except _Stale:
                if not retry_stale:
                    raise
        return await self._exchange(await self._connect(origin), request, progress, max_body)

    async def _exchange(self, connection: _Connection, request: bytes, progress: Progress | None,
                        max_body: int | None) -> Answer:
        waiter = asyncio.get_running_loop().create_future()
        connection.begin(waiter, max_body)
        assert connection.transport is not None
        try:
            if progress is not None:
                progress.connected = True
            connection.transport.write(request)
            if progress is not None:
                progress.sent = True
            status, headers, body, keep_alive = await waiter
        except BaseException:  # a timeout, a cancel, a broken line: this connection's answer is unread
            connection.close()
            raise
        idle = self._idle.setdefault(connection.origin.key, [])
        if keep_alive and not connection.closed and len(idle) < _MAX_IDLE_PER_ORIGIN:
            idle.append(connection)
            self._wake_one()  # a waiter may take this one over (its origin or, by closing it, another)
        else:
            connection.close()
        return Answer(status, headers, body)

    async def _connect(self, origin: _Origin) -> _Connection:
        while self._open >= self._max:
            if not self._close_one_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._slot_waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._slot_waiters:
                        self._slot_waiters.remove(waiter)
                idle = self._idle.get(origin.key)
                if idle:
                    connection = idle.pop()
                    if not connection.closed:
                        return connection
        self._open += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, origin), origin.host, origin.port, ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl is not None else None)
        except BaseException:
            self._connection_closed()
            raise
        return connection

    def _close_one_idle(self) -> bool:
        for idle in self._idle.values():
            while idle:
                connection = idle.pop(0)
                if not connection.closed:
                    connection.close()
                    return True
        return False

    def _connection_closed(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _origin(self, url: str) -> _Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL, got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        context = None
        if parts.scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        auth: list[tuple[str, str]] = []
        if parts.username is not None:  # user:password in the URL, sent as aiohttp sends it
            token = base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode())
            auth.append(("Authorization", "Basic " + token.decode()))
        head = f"POST {target} HTTP/1.1\r\n".encode() + _headers([("Host", parts.netloc.rpartition("@")[2]), *auth])
        origin = _Origin((parts.scheme, parts.hostname, port), parts.hostname, port, context, head)
        if len(self._origins) < 4096:  # backend URLs come from contracts: a bounded set, cached
            self._origins[url] = origin
        return origin

    async def close(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()


def _headers(headers: Iterable[tuple[str, str]]) -> bytes:
    lines = []
    for name, value in headers:
        if "\r" in value or "\n" in value or "\x00" in value or not name.isascii() or ":" in name:
            raise ValueError("a header holds a character HTTP/1.1 does not allow")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("utf-8")


__all__ = ["Answer", "HttpWire", "Progress", "TooLarge", "WireError"]
