"""A connection one of the hot path's wires counts (``http_wire``, ``resp_wire``): the part they share.

Owns: the transport of one pooled connection, closing it at once (abort: nothing unread is waited for),
and telling its wire exactly once that the connection is gone, whoever notices first (the proxy or the
peer). Must never: read or write a byte, or decide whether a connection may be reused (each wire's
protocol does both).
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class CountingWire(Protocol):
    def _connection_closed(self) -> None:
        """One of its connections is gone: its slot is free."""


class CountedConnection(asyncio.Protocol):
    def __init__(self, wire: CountingWire) -> None:
        self.wire = wire
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def close(self) -> None:
        self._gone()
        if self.transport is not None:
            self.transport.abort()

    def _gone(self) -> None:
        """Counted out of the wire's open connections once, whoever notices first (we or the peer)."""
        if not self.closed:
            self.closed = True
            self.wire._connection_closed()
