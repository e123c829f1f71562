"""The hot path's HTTP/1.1 wire: keep-alive POSTs for the two requests every call makes.

Owns: pools of keep-alive connections per origin (``http``, or ``https`` verified with the system's CAs
as the shared ``aiohttp`` session does; or, for a wire built with ``unix_socket``, every connection to
that one Unix socket, as OPA's is), the few other requests OPA's control plane makes (``request``: a GET
or PUT on the same pools), one request at a time per connection, a cap on open connections
in all and per origin (a request past either waits in line for one, first come first served per origin),
closing a connection idle longer than ``idle_timeout_s``, the connect timeout, reading each answer to
its end with ``httptools`` (llhttp: Content-Length, chunked and close-delimited bodies, keep-alive rules)
within limits on head bytes, header count, body bytes (an event stream's: its feed's) and the time from
an answer's first byte to its last (not for an event stream), and telling the caller how far its
request got (``Progress``: connected; handed to the kernel); an event-stream answer is handed chunk by
chunk to the caller's ``EventFeed`` until it has what it waits for. Must never:
follow a redirect, decompress, send a header value holding CR, LF or NUL, reuse a connection whose
answer was not read to the end (a timeout or a cancel closes it), lose a slot (every slot a waiter is
handed is used or handed on, also when the waiter was cancelled at that moment), or send a request
twice — except when the caller says it may (``retry_stale``: a decision query or a read, which have no
side effect) and a *reused* connection closed before a byte of its answer arrived, or when the kernel
provably took no byte of it (the connection was dead before it was written): then once more, on a
fresh connection.

The slots: a *slot* is the right to hold one open connection (connecting, busy or idle) to an origin;
``_open`` and each ``_Pool.open`` count them. A request takes an idle connection of its origin, else a
free slot, else (at the overall cap) the slot of another origin's oldest idle connection, which is
closed; otherwise it waits in its origin's line. Whatever frees capacity (an answer read to its end, a
connection closed, a slot given back) calls ``_grant``, which serves the lines while capacity lasts, so
no request waits while it could be served. A waiter is handed its connection or slot by resolving its
future; if it was cancelled in the same moment, it hands it on itself (``_give_back``).

Why not the shared ``aiohttp.ClientSession``, which still carries everything else (cancel endpoints,
the MCP SDK's own sessions, OPA's control plane (catalog push, readiness), health checks): the OPA
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
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol
from urllib.parse import SplitResult, urlsplit

import httptools
from aiohttp import BasicAuth
from yarl import URL

from .. import __version__
from .connection import CountedConnection

_USER_AGENT = f"toolproxy/{__version__}"


class WireError(ConnectionError):
    """The connection failed or the answer was not HTTP: whether the request had an effect is unknown."""


class _Stale(WireError):
    """A reused connection closed before a byte of the answer arrived (the server's idle timeout)."""


class NotSent(WireError):
    """The connection was gone before the kernel took a byte of the request: it provably never left."""


class SlowAnswer(WireError):
    """The answer began but did not end within the answer time (a peer trickling bytes)."""


class TooLarge(Exception):
    """The answer passed a limit (``what``: ``body``, ``head`` bytes or ``headers`` count); the connection
    is closed and the rest not read. ``status`` is 0 when the status line itself did not arrive."""

    def __init__(self, status: int, what: str = "body", limit: int = 0) -> None:
        super().__init__(status, what, limit)
        self.status, self.what, self.limit = status, what, limit


@dataclass(frozen=True)
class Limits:
    """What one answer may cost: head bytes (status line and headers), header count, body bytes (unless the
    caller gives its own), and seconds from its first byte to its last (None: no bound but the caller's)."""

    head_bytes: int = 64 * 1024
    headers: int = 128
    body_bytes: int = 4 * 1024 * 1024
    answer_s: float | None = 30.0


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
    key: tuple[str, str, int, int]  # scheme, host, port, and the TLS context's id (0: the wire's default)
    host: str
    port: int
    ssl: ssl.SSLContext | None
    head: bytes  # "<method> <target> HTTP/1.1" and the headers every request to this URL carries


@dataclass(eq=False)
class _Pool:
    """One origin's slots: how many are taken, its idle connections (oldest first) and its line."""

    open: int = 0
    idle: collections.deque["_Connection"] = field(default_factory=collections.deque)
    waiters: collections.deque[tuple[asyncio.Future, bool]] = field(default_factory=collections.deque)


class _Stop(Exception):
    """Raised in a parser callback to stop reading an answer that broke a limit."""


_WAIT = object()  # _take: nothing free, get in line


class _Connection(CountedConnection):
    """One keep-alive connection; the parser's callbacks fill the current answer."""

    def __init__(self, wire: "HttpWire", origin: _Origin, pool: _Pool) -> None:
        super().__init__(wire)
        self.origin, self.pool, self.limits = origin, pool, wire.limits
        self.counted = False  # its slot is the connecting request's until create_connection returned
        self.idle_since: float | None = None  # in its pool's idle line since (loop time)
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None
        self.keep_alive = False
        self.feed: EventFeed | None = None  # the caller reads event streams
        self.streaming = False  # this answer is an event stream going to ``feed``
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = 0
        self.answered = False  # a byte of the current answer arrived
        self.headers_done = False
        self.head_seen = 0  # bytes received before the head was complete
        self.head_size = 0  # bytes of the complete header lines
        self.header_count = 0
        self.timer: asyncio.TimerHandle | None = None  # the answer's time bound, once it did not come at once

    def _gone(self) -> None:
        if not self.closed:
            self.closed = True
            if self.counted:
                self.wire._connection_closed(self)

    # asyncio.Protocol
    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # nothing asked: an unsolicited answer (e.g. a 408 on idle) spoils the line
            self.close()
            return
        self.answered = True
        if not self.headers_done:
            self.head_seen += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # not HTTP, or a callback stopped it (its error is already set)
            self._fail(WireError("the answer was not HTTP/1.1"))
            self.close()
            return
        if self.waiter is None:
            return
        if not self.headers_done and self.head_seen > self.limits.head_bytes:
            self._fail(TooLarge(self.parser.get_status_code(), "head", self.limits.head_bytes))
            self.close()
        elif self.timer is None and not self.streaming and self.limits.answer_s is not None:
            self.timer = self.waiter.get_loop().call_later(self.limits.answer_s, self._too_slow)

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
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        self.head_size += len(name) + len(value) + 4
        if self.header_count > self.limits.headers:
            self._fail(TooLarge(self.parser.get_status_code(), "headers", self.limits.headers))
            raise _Stop
        if self.head_size > self.limits.head_bytes:
            self._fail(TooLarge(self.parser.get_status_code(), "head", self.limits.head_bytes))
            raise _Stop
        self.headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.feed is None or not self.headers.get("content-type", "").lower().startswith("text/event-stream"):
            return
        if 200 <= self.parser.get_status_code() < 300:
            self.streaming = True  # bounded by its bytes, its feed and the caller's deadline, not the answer time
            self._stop_timer()
        else:  # a refusal whose stream may never end: its status is the answer
            self._complete(False)
            self.close()

    def on_body(self, body: bytes) -> None:
        if self.streaming:  # the feed bounds an event stream's bytes and events itself
            self._stream(body)
            return
        self.size += len(body)
        if self.size > self.limit:
            self._fail(TooLarge(self.parser.get_status_code(), "body", self.limit))
            raise _Stop
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

    def _too_slow(self) -> None:
        self.timer = None
        self._fail(SlowAnswer("the answer did not end within the answer time"))
        self.close()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _complete(self, keep_alive: bool, event: Any = None) -> None:
        self._stop_timer()
        waiter, self.waiter = self.waiter, None
        self.keep_alive = keep_alive
        if waiter is not None and not waiter.done():
            body = b"" if event is not None else b"".join(self.chunks)
            waiter.set_result(Answer(self.parser.get_status_code(), self.headers, body, event))

    def _fail(self, exc: BaseException) -> None:
        self._stop_timer()
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def begin(self, waiter: asyncio.Future, limit: int, feed: EventFeed | None) -> None:
        self.waiter, self.limit, self.feed = waiter, limit, feed
        self.headers, self.chunks, self.size = {}, [], 0
        self.head_seen = self.head_size = self.header_count = 0
        self.answered = self.headers_done = self.streaming = self.keep_alive = False


class HttpWire:
    """POSTs over pooled keep-alive connections: at most ``max_connections`` open at once, at most
    ``max_per_origin`` of them to one origin; an idle one is closed after ``idle_timeout_s``."""

    def __init__(self, *, max_connections: int = 100, max_per_origin: int | None = None,
                 connect_timeout_s: float | None = None, idle_timeout_s: float = 15.0,
                 limits: Limits = Limits(), unix_socket: str | None = None) -> None:
        self._unix_socket = unix_socket  # every connection goes there; the URL's host fills only Host
        self._max = max_connections
        self._per_origin = min(max_per_origin or max_connections, max_connections)
        self._connect_timeout_s = connect_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self.limits = limits
        self._open = 0  # slots taken, all origins
        self._waiting = 0  # futures in the lines, all origins
        self._pools: dict[tuple[str, str, int, int], _Pool] = {}
        self._origins: dict[str, _Origin] = {}
        self._tls_origins: dict[tuple[str, ssl.SSLContext], _Origin] = {}  # URLs reached with a credential's TLS
        self._sweep: asyncio.TimerHandle | None = None
        self._ssl: ssl.SSLContext | None = None

    @property
    def open_connections(self) -> int:
        """Slots taken: connections connecting, busy or idle."""
        return self._open

    @property
    def waiting(self) -> int:
        """Requests in line for a connection."""
        return self._waiting

    async def post(self, url: str, body: bytes, headers: Iterable[tuple[str, str]] = (), *,
                   progress: Progress | None = None, max_body: int | None = None,
                   retry_stale: bool = False, feed: EventFeed | None = None,
                   tls: ssl.SSLContext | None = None) -> Answer:
        """The answer to one POST. Raises ``WireError`` or ``OSError`` when there is none (``NotSent``: it
        provably never left; ``SlowAnswer``: past the answer time), ``TimeoutError`` when connecting took
        longer than the connect timeout, ``TooLarge`` past ``max_body`` (default: the wire's limit; not
        applied to an event stream read by ``feed``, which bounds its own bytes and events) or the head
        limits, or the feed's own errors. ``tls``: the context an ``https`` URL is reached with (a client
        certificate and CA bundle of the backend's credential; its connections are pooled apart)."""
        origin = (self._origins.get(url) if tls is None else self._tls_origins.get((url, tls))) \
            or self._origin(url, tls=tls)
        return await self._send(origin, body, headers, progress, max_body, retry_stale, feed)

    async def request(self, method: str, url: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = (), *,
                      max_body: int | None = None) -> Answer:
        """The answer to one request of another method (OPA's control plane: ``GET /health``, ``PUT`` of a
        document), on the same pools and bounds as ``post``; never sent twice (``retry_stale`` off)."""
        return await self._send(self._origin(url, method), body, headers, None, max_body, False, None)

    async def _send(self, origin: _Origin, body: bytes, headers: Iterable[tuple[str, str]],
                    progress: Progress | None, max_body: int | None, retry_stale: bool,
                    feed: EventFeed | None) -> Answer:
        request = b"".join((origin.head, _headers(headers), b"Content-Length: %d\r\n\r\n" % len(body), body))
        limit = self.limits.body_bytes if max_body is None else max_body
        pool = self._pools.get(origin.key)
        if pool is None:
            pool = self._pools[origin.key] = _Pool()
        fresh = False
        while True:
            connection = await self._acquire(pool, fresh)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(origin, pool)
            try:
                return await self._exchange(connection, request, progress, limit, feed)
            except NotSent:
                if fresh or not reused:
                    raise
            except _Stale:
                if fresh or not (reused and retry_stale):
                    raise
            fresh = True  # once more, on a new connection

    async def _exchange(self, connection: _Connection, request: bytes, progress: Progress | None,
                        limit: int, feed: EventFeed | None) -> Answer:
        transport = connection.transport
        assert transport is not None
        if connection.closed or transport.is_closing():  # went away while it was handed to us
            connection.close()
            raise NotSent("the connection closed before the request")
        waiter: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        connection.begin(waiter, limit, feed)
        if progress is not None:
            progress.connected = True
        transport.write(request)
        if transport.is_closing():  # the first send failed (a reset line): the kernel took no byte
            connection.waiter = None
            connection.close()
            raise NotSent("the connection was reset before the request")
        if progress is not None:
            progress.sent = True
        try:
            answer = await waiter
        except BaseException:  # a timeout, a cancel, a broken line: this connection's answer is unread
            connection.close()
            raise
        if connection.keep_alive and not connection.closed:
            self._release(connection)
        else:
            connection.close()
        return answer

    # -- slots ------------------------------------------------------------------------------------------

    async def _acquire(self, pool: _Pool, fresh: bool) -> _Connection | None:
        """An idle connection of the pool's origin (not when ``fresh``), or None: a slot the caller now holds
        and must connect in (or give back). Waits in the origin's line while neither is free."""
        if not pool.waiters:  # nobody before us
            got = self._take(pool, fresh)
            if got is not _WAIT:
                return got  # type: ignore[return-value]
        future: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        entry = (future, fresh)
        pool.waiters.append(entry)
        self._waiting += 1
        try:
            return await future
        except BaseException:
            if future.done() and not future.cancelled():  # handed something as it gave up: pass it on
                self._give_back(pool, future.result())
            else:
                try:
                    pool.waiters.remove(entry)
                except ValueError:
                    pass  # _grant already dropped it
                else:
                    self._waiting -= 1
            raise

    def _take(self, pool: _Pool, fresh: bool) -> Any:
        """What is free for the pool's origin now: an idle connection, None (a slot, now taken), or _WAIT."""
        if pool.idle and not fresh:
            connection = pool.idle.pop()  # the most recently used: the others may expire
            since, connection.idle_since = connection.idle_since, None
            assert connection.transport is not None and since is not None
            if not connection.transport.is_closing() \
                    and asyncio.get_running_loop().time() - since < self._idle_timeout_s:
                return connection
            self._retire(connection)
            while pool.idle:  # idle longer still: expired as well, or about to be
                self._retire(pool.idle.popleft())
        if pool.open >= self._per_origin:
            if not pool.idle:
                return _WAIT
            self._retire(pool.idle.popleft())  # a fresh one asked for: an idle one of its own makes room
        elif self._open >= self._max:
            victim = self._oldest_idle()
            if victim is None:
                return _WAIT
            self._retire(victim.idle.popleft())
        pool.open += 1
        self._open += 1
        return None

    def _oldest_idle(self) -> _Pool | None:
        oldest: _Pool | None = None
        for pool in self._pools.values():
            if pool.idle and (oldest is None or pool.idle[0].idle_since < oldest.idle[0].idle_since):  # type: ignore[operator]
                oldest = pool
        return oldest

    def _retire(self, connection: _Connection) -> None:
        """Close an idle connection taken out of its line, its slot counted out here (no ``_grant``: the
        caller uses the capacity)."""
        connection.idle_since = None
        if not connection.closed:
            connection.closed = True
            connection.pool.open -= 1
            self._open -= 1
            if connection.transport is not None:
                connection.transport.abort()

    def _release(self, connection: _Connection) -> None:
        """A connection whose answer was read to its end: to the first in its origin's line, else idle."""
        pool = connection.pool
        loop = asyncio.get_running_loop()
        connection.idle_since = loop.time()
        pool.idle.append(connection)
        if self._sweep is None:
            self._sweep = loop.call_at(connection.idle_since + self._idle_timeout_s, self._close_expired)
        if self._waiting:
            self._grant(pool)

    def _give_back(self, pool: _Pool, got: _Connection | None) -> None:
        """What a cancelled waiter was handed, or a slot its connect did not use: free again."""
        if got is None:
            pool.open -= 1
            self._open -= 1
            self._grant()
        elif not got.closed:
            self._release(got)

    def _connection_closed(self, connection: _Connection) -> None:  # type: ignore[override]
        """A counted connection is gone (closed by us or the peer): its slot is free."""
        if connection.idle_since is not None:
            connection.idle_since = None
            try:
                connection.pool.idle.remove(connection)
            except ValueError:
                pass
        connection.pool.open -= 1
        self._open -= 1
        self._grant()

    def _grant(self, first: _Pool | None = None) -> None:
        """Serve the lines while there is capacity (after anything that freed some); ``first``'s line
        first (a connection just released goes to its own origin's line before another's takes its slot)."""
        if not self._waiting:
            return
        served: list[tuple[str, str, int, int]] = []
        pools = list(self._pools.items())
        if first is not None:
            pools.sort(key=lambda item: item[1] is not first)
        for key, pool in pools:
            while pool.waiters:
                future, fresh = pool.waiters[0]
                if future.done():  # cancelled: its own except clause finds it gone
                    pool.waiters.popleft()
                    self._waiting -= 1
                    continue
                got = self._take(pool, fresh)
                if got is _WAIT:
                    break
                pool.waiters.popleft()
                self._waiting -= 1
                future.set_result(got)
                served.append(key)
        for key in served:  # origins served now queue behind the others next time (no origin starves)
            self._pools[key] = self._pools.pop(key)

    def _close_expired(self) -> None:
        self._sweep = None
        loop = asyncio.get_running_loop()
        now, due = loop.time(), None
        for pool in list(self._pools.values()):
            while pool.idle and pool.idle[0].idle_since is not None \
                    and now - pool.idle[0].idle_since >= self._idle_timeout_s:
                connection = pool.idle.popleft()
                connection.idle_since = None
                connection.close()  # counted out; a waiter may take the slot
            if pool.idle and pool.idle[0].idle_since is not None:
                at = pool.idle[0].idle_since + self._idle_timeout_s
                due = at if due is None else min(due, at)
        if due is not None and self._sweep is None:
            self._sweep = loop.call_at(due, self._close_expired)

    async def _connect(self, origin: _Origin, pool: _Pool) -> _Connection:
        """A new connection in a slot the caller holds (given back if connecting fails or is cancelled)."""
        loop = asyncio.get_running_loop()
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._unix_socket is not None:
                    _, connection = await loop.create_unix_connection(
                        lambda: _Connection(self, origin, pool), self._unix_socket)
                else:
                    _, connection = await loop.create_connection(
                        lambda: _Connection(self, origin, pool), origin.host, origin.port, ssl=origin.ssl,
                        server_hostname=origin.host if origin.ssl is not None else None)
        except BaseException:
            # A protocol made before the failure is not counted: its close cannot free the slot twice.
            self._give_back(pool, None)
            raise
        connection.counted = True
        if connection.closed:  # the peer closed it before we got it: its slot was not counted out
            self._give_back(pool, None)
            raise NotSent("the connection closed as it opened")
        return connection

    def _origin(self, url: str, method: str = "POST", tls: ssl.SSLContext | None = None) -> _Origin:
        parts = self._checked_url(url, tls)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        context = self._tls_context(tls) if parts.scheme == "https" else None
        head = _request_head(url, parts, method)
        origin = _Origin((parts.scheme, parts.hostname, port, 0 if tls is None else id(tls)), parts.hostname, port,
                         context, head)
        self._remember(url, method, tls, origin)
        return origin

    def _checked_url(self, url: str, tls: ssl.SSLContext | None) -> SplitResult:
        """The URL's parts, if this wire can reach it: http(s) with a host, plain http over a Unix socket, a TLS
        context only for https."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL, got {url!r}")
        if self._unix_socket is not None and parts.scheme != "http":
            raise ValueError(f"a Unix socket wire speaks plain http, got {url!r}")
        if tls is not None and parts.scheme != "https":
            raise ValueError(f"a TLS context was given for a plain http URL, {url!r}")
        return parts

    def _tls_context(self, tls: ssl.SSLContext | None) -> ssl.SSLContext:
        """The given TLS context, else the wire's default one (made on first use)."""
        if tls is None:
            self._ssl = self._ssl or ssl.create_default_context()
        return tls or self._ssl

    def _remember(self, url: str, method: str, tls: ssl.SSLContext | None, origin: _Origin) -> None:
        # Backend URLs come from contracts: a bounded set, cached (POSTs only: the control plane's are rare).
        if method == "POST" and len(self._origins) + len(self._tls_origins) < 4096:
            if tls is None:
                self._origins[url] = origin
            else:
                self._tls_origins[(url, tls)] = origin

    async def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for pool in self._pools.values():
            while pool.idle:
                connection = pool.idle.popleft()
                connection.idle_since = None
                connection.close()


def _request_head(url: str, parts: SplitResult, method: str) -> bytes:
    """The request line and fixed headers of every request to the URL (Host, User-Agent, its user:password)."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    credentials = BasicAuth.from_url(URL(url))  # user:password in the URL, sent as aiohttp sends it
    auth = [("Authorization", credentials.encode())] if credentials is not None else []
    return f"{method} {target} HTTP/1.1\r\n".encode() + _headers(
        [("Host", parts.netloc.rpartition("@")[2]), ("User-Agent", _USER_AGENT), *auth])


def _headers(headers: Iterable[tuple[str, str]]) -> bytes:
    lines = []
    for name, value in headers:
        if "\r" in value or "\n" in value or "\x00" in value or not name.isascii() or ":" in name:
            raise ValueError("a header holds a character HTTP/1.1 does not allow")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("utf-8")


__all__ = ["Answer", "EventFeed", "HttpWire", "Limits", "NotSent", "Progress", "SlowAnswer", "TooLarge",
           "WireError"]
