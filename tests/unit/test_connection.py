"""A counted connection of the hot-path wires (proxy/wire/connection.py): closed at once, and its wire told
exactly once that it is gone, whoever notices first. A real socket pair carries it."""

from __future__ import annotations

import asyncio
import socket

from proxy.wire.connection import CountedConnection


class Wire:
    def __init__(self) -> None:
        self.closed = 0

    def _connection_closed(self) -> None:
        self.closed += 1


async def test_closing_aborts_the_transport_and_counts_the_connection_out_once():
    ours, peer = socket.socketpair()
    wire = Wire()
    try:
        transport, conn = await asyncio.get_running_loop().create_connection(lambda: CountedConnection(wire),
                                                                             sock=ours)
        assert conn.transport is transport and not conn.closed
        conn.close()
        conn.close()
        conn._gone()  # the peer's loss noticed after our close
        assert wire.closed == 1 and conn.closed
        await asyncio.sleep(0)  # abort: closed at once, nothing unread waited for
        assert transport.is_closing()
        peer.settimeout(5)
        assert peer.recv(1) == b""  # the peer sees the end
    finally:
        peer.close()


def test_a_connection_never_made_is_counted_out_once_too():
    wire = Wire()
    conn = CountedConnection(wire)
    conn.close()
    conn.close()
    assert wire.closed == 1 and conn.transport is None
