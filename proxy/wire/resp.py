"""The hot path's Redis wire: Lua script calls to a standalone Redis over pooled RESP2 connections.

Owns: a pool of connections to the one server a standalone client's URL names (TCP, or TLS with the
context redis-py builds from the same settings), their handshake (``AUTH``, ``SELECT``), a cap on open
connections (past it a call waits up to the pool's timeout, then fails as redis-py's blocking pool
does), sending a batch of commands in one write and reading its replies (RESP2: ``EVALSHA``, ``WAIT``,
``SCRIPT LOAD`` replies, parsed by ``hiredis``'s C reader, never by hand) within the socket timeout.
Replies come back as redis-py gives them with ``decode_responses=False`` (bytes, int, None, lists), an
error reply as redis-py's own (public) exception class for it (``NoScriptError``, ``ReadOnlyError``,
...; ``error_reply``), in place in the batch's list. Must never: import a private name of redis-py,
send a command twice, reuse a connection whose replies were not all read (a timeout, a cancel or a
broken line closes it; the caller gets redis-py's ``TimeoutError`` / ``ConnectionError``, so whether a
script ran stays unknown to it, exactly as before), or serve Sentinel or Cluster clients (redis-py's
clients follow failovers and slots there; ``proxy.store`` only gives a standalone client a wire).

Why not redis-py's connection for these calls: a write makes three round trips of Lua scripts, and
redis-py's command path per call (pool checkout, retry wrapper, ``wait_for`` per read, RESP3 parser,
response callbacks) cost ~0.2 ms of CPU each under load, a third of a write's CPU. This wire does the
same exchange for well under half of that (measured in docs/performance.md, fifth round). Everything
else (pub/sub, admin reads, the health probe) stays on redis-py's client.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import Any, Sequence

import hiredis

from . import redis_py  # noqa: F401  # first: redis-py imported without OpenTelemetry's metrics SDK

import redis.asyncio as redis_async
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, BusyLoadingError, \
    ConnectionError as RedisConnectionError, DataError, ExecAbortError, InvalidResponse, MasterDownError, \
    NoPermissionError, NoScriptError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError, \
    TimeoutError as RedisTimeoutError

from .connection import CountedConnection

Command = Sequence[Any]


# Error replies as redis-py raises them (the classes of ``redis.exceptions``, public): the code is dropped from
# the message of a known code, as redis-py's parser does (``ERR`` by its exact message); anything else is a
# ``ResponseError`` with the whole message (tests/unit/test_resp_errors.py compares with redis-py's parser).
_ERRORS: dict[str, type[RedisError]] = {
    "NOSCRIPT": NoScriptError, "READONLY": ReadOnlyError, "LOADING": BusyLoadingError,
    "EXECABORT": ExecAbortError, "NOAUTH": AuthenticationError, "WRONGPASS": AuthenticationError,
    "NOPERM": NoPermissionError, "OOM": OutOfMemoryError, "MASTERDOWN": MasterDownError,
}
_ERR_MESSAGES: dict[str, type[RedisError]] = {
    "max number of clients reached": RedisConnectionError,
    "invalid password": AuthenticationError,
    "Client sent AUTH, but no password is set": AuthenticationError,
    "AUTH <password> called without any password configured for the default user. Are you sure your "
    "configuration is correct?": AuthenticationError,
    "wrong number of arguments for 'auth' command": AuthenticationWrongNumberOfArgsError,
    "wrong number of arguments for 'AUTH' command": AuthenticationWrongNumberOfArgsError,
}


def error_reply(message: str) -> RedisError:
    """The exception redis-py gives for an error reply's message (``NOSCRIPT ...`` -> ``NoScriptError``)."""
    code, _, rest = message.partition(" ")
    if code == "ERR":
        return _ERR_MESSAGES.get(rest, ResponseError)(rest)
    cls = _ERRORS.get(code)
    return cls(rest) if cls is not None else ResponseError(message)


def _reader() -> hiredis.Reader:
    """hiredis's RESP parser: bulk and simple strings as bytes (``decode_responses=False``), an error reply as
    its exception (a value in place: a batch reports each command's own), a malformed reply raising
    ``InvalidResponse``."""
    return hiredis.Reader(protocolError=InvalidResponse, replyError=error_reply)


def _encode(value: Any) -> bytes:
    """An argument as redis-py's encoder sends it (bytes, str as UTF-8, int, float); others refused alike."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(f"Invalid input of type: '{type(value).__name__}'. Convert to a bytes, string, int or "
                        "float first.")
    return repr(value).encode() if isinstance(value, float) else b"%d" % value


def pack(commands: Sequence[Command]) -> bytes:
    """Commands in RESP's request form, one after another (a pipeline)."""
    out = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for argument in command:
            kind = type(argument)  # (a str or bytes without a call: most arguments are keys and texts)
            data = argument.encode("utf-8") if kind is str else argument if kind is bytes else _encode(argument)
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Connection(CountedConnection):
    """One connection; ``exchange`` sends a batch and waits for as many replies."""

    def __init__(self, wire: "RespWire") -> None:
        super().__init__(wire)
        self.reader = _reader()
        self.waiter: asyncio.Future[list[Any]] | None = None
        self.expected = 0
        self.replies: list[Any] = []

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # nothing asked (a server closing with an error line): the line is spoiled
            self.close()
            return
        reader = self.reader
        reader.feed(data)
        try:
            while len(self.replies) < self.expected:
                reply = reader.gets()
                if reply is False:  # the buffer ends inside a reply: wait for more bytes
                    break
                self.replies.append(reply)
        except (InvalidResponse, ValueError):
            self._settle(InvalidResponse("the store's reply was not RESP"))
            self.close()
            return
        if len(self.replies) == self.expected:
            replies, self.replies = self.replies, []
            self._settle(None, replies)
            if reader.has_data():  # more than was asked for
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()
        self._settle(RedisConnectionError("Connection closed by server."))

    def _settle(self, error: BaseException | None, replies: list[Any] | None = None) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(replies)  # type: ignore[arg-type]

    def _timed_out(self) -> None:
        self._settle(RedisTimeoutError("Timeout reading from the store"))
        self.close()

    async def exchange(self, payload: bytes, count: int, timeout_s: float | None) -> list[Any]:
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        self.expected, self.replies = count, []
        timer = loop.call_later(timeout_s, self._timed_out) if timeout_s else None
        try:
            assert self.transport is not None
            self.transport.write(payload)
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()


class RespWire:
    """Batches of commands to one standalone server, at most ``max_connections`` connections open."""

    def __init__(self, *, host: str, port: int, ssl_context: ssl.SSLContext | None, handshake: Sequence[Command],
                 max_connections: int, pool_wait_s: float | None, timeout_s: float | None,
                 connect_timeout_s: float | None) -> None:
        self._host, self._port, self._ssl = host, port, ssl_context
        self._handshake = pack(handshake) if handshake else b""
        self._handshake_replies = len(handshake)
        self._max, self._pool_wait_s = max_connections, pool_wait_s
        self._timeout_s, self._connect_timeout_s = timeout_s, connect_timeout_s
        self._open = 0
        self._idle: list[_Connection] = []
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()

    @classmethod
    def for_client(cls, client: redis_async.Redis) -> "RespWire | None":
        """The wire to the server of a standalone client's pool, with the same address, credentials, database,
        TLS and timeouts (read by redis-py's own connection class from its URL); None for a Unix socket."""
        pool = client.connection_pool
        if pool.connection_class is UnixDomainSocketConnection:
            return None
        settings = pool.connection_class(**pool.connection_kwargs)  # not connected: redis-py's parse only
        handshake: list[Command] = []
        if settings.password:
            handshake.append(("AUTH", settings.username, settings.password) if settings.username
                             else ("AUTH", settings.password))
        if int(settings.db):
            handshake.append(("SELECT", int(settings.db)))
        context = settings.ssl_context.get() if isinstance(settings, SSLConnection) else None
        return cls(host=settings.host, port=int(settings.port), ssl_context=context, handshake=handshake,
                   max_connections=pool.max_connections, pool_wait_s=getattr(pool, "timeout", None),
                   timeout_s=settings.socket_timeout, connect_timeout_s=settings.socket_connect_timeout)

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply (an error reply as its exception, in place), sent in one write. Raises
        redis-py's ``ConnectionError`` / ``TimeoutError`` when there are none (sent or not: unknown)."""
        payload = pack(commands)
        connection = await self._checkout()
        try:
            replies = await connection.exchange(payload, len(commands), self._timeout_s)
        except BaseException:  # a timeout, a cancel, a broken line: this connection's replies are unread
            connection.close()
            raise
        self._checkin(connection)
        return replies

    async def _checkout(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        if self._open < self._max:
            self._open += 1
            return await self._connect()
        waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._pool_wait_s):
                handed = await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():  # handed something just as it gave up: pass it on
                self._hand_on(waiter.result())
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise RedisConnectionError("No connection available.") from None
            raise
        return handed if handed is not None else await self._connect()  # None: a freed slot, now ours

    def _checkin(self, connection: _Connection) -> None:
        if not connection.closed:
            self._hand_on(connection)

    def _hand_on(self, connection: _Connection | None) -> None:
        """A free connection (or, None, a free slot to connect with) to the first waiter, else kept."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        if connection is not None:
            self._idle.append(connection)
        else:
            self._open -= 1  # nobody took the slot: it is free again

    def _connection_closed(self) -> None:
        self._hand_on(None)

    async def _connect(self) -> _Connection:
        """A new connection in a slot the caller holds (given back if connecting fails)."""
        loop = asyncio.get_running_loop()
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self), self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None)
            if self._handshake:
                for reply in await connection.exchange(self._handshake, self._handshake_replies, self._timeout_s):
                    if isinstance(reply, Exception):
                        raise reply
        except BaseException as exc:
            if connection is not None and not connection.closed:
                connection.close()
            elif connection is None:
                self._connection_closed()
            if isinstance(exc, (OSError, TimeoutError)) and not isinstance(exc, RedisConnectionError):
                raise RedisConnectionError(f"Error connecting to the store ({type(exc).__name__})") from None
            raise
        return connection

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


__all__ = ["RespWire", "pack"]
