"""The hot path's HTTP/1.1 wire: keep-alive POSTs for the two requests every call makes.

Owns: pools of keep-alive connections per origin (``http``, or ``https`` verified with the system's CAs
as the shared ``aiohttp`` session does), one request at a time per connection, a cap on open connections
(a request past it waits for one), the connect timeout, reading each answer to its end with ``httptools``
(llhttp: Content-Length, chunked and close-delimited bodies, keep-alive rules) within a size limit, and
telling the caller how far its request got (``Progress``: connected; handed to the kernel); an
event-stream answer is handed chunk by chunk to the caller's ``EventFeed`` until it has what it waits
for. Must never:
follow a redirect, decompress, send a header value holding CR, LF or NUL, reuse a connection whose
answer was not read to the end (a timeout or a cancel closes it), or send a request twice — except
when the caller says it may (``retry_stale``: a decision query, which has no side effect) and a *reused*
connection closed before a byte of its answer arrived.

Why not the shared ``aiohttp.ClientSession``, which still carries everything else (cancel endpoints,
the MCP SDK's own sessions, OPA's control plane through opa-python-client, health checks): the OPA
decision and the backend POST (an HTTP backend's, or a stateless MCP upstream's ``tools/call``) are the
two requests every tool call makes, and aiohttp's client machinery for them
(request and response objects, the session's trace signals, a body-writer task and timer handles per
request) was ~20% of a read's CPU under load. This wire does the same exchange for about a third of
that (measured in docs/performance.md, fourth round).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol
from urllib.parse import urlsplit

import httptools
from aiohttp import BasicAuth
from yarl import URL

from .. import __version__
from .connection import CountedConnection

_MAX_IDLE_PER_ORIGIN = 64
_USER_AGENT = f"toolproxy/{__version__}"


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


class EventFeed(Protocol):
    """Reads an event-stream answer as it arrives (``text/event-stream``)."""

    def feed(self, chunk: bytes) -> Any:
        """What the caller waited for once it is in, else None; raising ends the exchange with that error."""

    def end(self) -> Exception:
        """The error for a stream that ended before what the caller waited for."""


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]  # lower-case names; the first of repeated ones
    body: bytes
    event: Any = None  # an event-stream answer: what the caller's EventFeed returned (the body is not kept)


@dataclass(frozen=True)
class _Origin:
    key: tuple[str, str, int]
    host: str
    port: int
    ssl: ssl.SSLContext | None
    head: bytes  # "POST <target> HTTP/1.1" and the headers every request to this URL carries


class _Connection(CountedConnection):
    """One keep-alive connection; the parser's callbacks fill the current answer."""

    def __init__(self, wire: "HttpWire", origin: _Origin) -> None:
        super().__init__(wire)
        self.origin = origin
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None
        self.keep_alive = False
        self.feed: EventFeed | None = None  # the caller reads event streams
        self.streaming = False  # this answer is an event stream going to ``feed``
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit: int | None = None
        self.answered = False  # a byte of the current answer arrived
        self.headers_done = False

    # asyncio.Protocol
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
        self._gone()
        if self.waiter is not None and self.streaming:
            assert self.feed is not None
            self._fail(self.feed.end())
            return
        if self.waiter is not None and self.headers_done and "content-length" not in self.headers \
                and "chunked" not in self.headers.get("transfer-encoding", ""):
            self._complete(False)  # a body delimited by the end of the connection (HTTP/1.0 style)
            return
        self._fail(WireError("the connection closed before the answer") if self.answered
                   else _Stale("the connection closed before answering"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.waiter is None:  # a second answer to one request (in the same packet): the line is spoiled
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.feed is None or not self.headers.get("content-type", "").lower().startswith("text/event-stream"):
            return
        if 200 <= self.parser.get_status_code() < 300:
            self.streaming = True
        else:  # a refusal whose stream may never end: its status is the answer
            self._complete(False)
            self.close()

    def on_body(self, body: bytes) -> None:
        if self.streaming:
            self._stream(body)
            return
        self.size += len(body)
        if self.limit is not None and self.size > self.limit:
            self._fail(TooLarge(self.parser.get_status_code()))
            self.close()
            return
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.streaming:
            assert self.feed is not None
            self._fail(self.feed.end())
            return
        self._complete(self.parser.should_keep_alive())

    def _stream(self, chunk: bytes) -> None:
        if self.waiter is None:
            return  # already answered: the rest of the stream is not read (the connection is closed)
        assert self.feed is not None
        try:
            event = self.feed.feed(chunk)
        except Exception as exc:  # the feed's own error (a malformed or oversized event)
            self._fail(exc)
            self.close()
            return
        if event is not None:
            self._complete(False, event)
            self.close()

    def _complete(self, keep_alive: bool, event: Any = None) -> None:
        waiter, self.waiter = self.waiter, None
        self.keep_alive = keep_alive
        if waiter is not None and not waiter.done():
            body = b"" if event is not None else b"".join(self.chunks)
            waiter.set_result(Answer(self.parser.get_status_code(), self.headers, body, event))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def begin(self, waiter: asyncio.Future, limit: int | None, feed: EventFeed | None) -> None:
        self.waiter, self.limit, self.feed = waiter, limit, feed
        self.headers, self.chunks, self.size = {}, [], 0
        self.answered = self.headers_done = self.streaming = self.keep_alive = False


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
                   retry_stale: bool = False, feed: EventFeed | None = None) -> Answer:
        """The answer to one POST. Raises ``WireError`` or ``OSError`` when there is none, ``TimeoutError``
        when connecting took longer than the connect timeout, ``TooLarge`` past ``max_body`` (not applied to
        an event stream read by ``feed``, which bounds its own events), or the feed's own errors."""
        origin = self._origins.get(url) or self._origin(url)
        request = b"".join((origin.head, _headers(headers), b"Content-Length: %d\r\n\r\n" % len(body), body))
        idle = self._idle.get(origin.key)
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            try:
                return await self._exchange(connection, request, progress, max_body, feed)
            except _Stale:
                if not retry_stale:
                    raise
        return await self._exchange(await self._connect(origin), request, progress, max_body, feed)

    async def _exchange(self, connection: _Connection, request: bytes, progress: Progress | None,
                        max_body: int | None, feed: EventFeed | None) -> Answer:
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        connection.begin(waiter, max_body, feed)
        assert connection.transport is not None
        try:
            if progress is not None:
                progress.connected = True
            connection.transport.write(request)
            if progress is not None:
                progress.sent = True
            answer = await waiter
        except BaseException:  # a timeout, a cancel, a broken line: this connection's answer is unread
            connection.close()
            raise
        idle = self._idle.setdefault(connection.origin.key, [])
        if connection.keep_alive and not connection.closed and len(idle) < _MAX_IDLE_PER_ORIGIN:
            idle.append(connection)
            self._wake_one()  # a waiter may take this one over (its origin or, by closing it, another)
        else:
            connection.close()
        return answer

    async def _connect(self, origin: _Origin) -> _Connection:
        handed_over = False  # the slot of an idle connection to another origin, retired for this one
        while self._open >= self._max:
            if self._retire_one_idle():
                handed_over = True
                break
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await waiter
            except BaseException:  # cancelled: a slot handed to it goes to the next in line
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()
                raise
            idle = self._idle.get(origin.key)
            if idle:
                connection = idle.pop()
                if not connection.closed:
                    return connection
        if not handed_over:
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

    def _retire_one_idle(self) -> bool:
        """Close the oldest idle connection and keep its slot for the caller (no waiter is woken for it)."""
        for idle in self._idle.values():
            while idle:
                connection = idle.pop(0)
                if not connection.closed:
                    connection.closed = True  # counted out here: its slot is the caller's now
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
        credentials = BasicAuth.from_url(URL(url))  # user:password in the URL, sent as aiohttp sends it
        auth = [("Authorization", credentials.encode())] if credentials is not None else []
        head = f"POST {target} HTTP/1.1\r\n".encode() + _headers(
            [("Host", parts.netloc.rpartition("@")[2]), ("User-Agent", _USER_AGENT), *auth])
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


__all__ = ["Answer", "EventFeed", "HttpWire", "Progress", "TooLarge", "WireError"]
