"""The HTTP wire's slots (proxy/wire/http.py): hand-off, cancellation, caps and idle expiry, on real sockets.

A slot handed to a waiter that is cancelled in the same moment must reach the next in line; a waiter that
gives up at its deadline must leave the line without taking a slot with it; after any burst the wire
counts exactly the connections that are open. Servers are the byte-exact ``RawServer`` of
test_http_wire.py; every wait is bounded.
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.wire.http import HttpWire
from tests.unit.test_http_wire import RawServer, answer


def gated(gate: asyncio.Event, *, close: bool = False):
    """A handler that answers once ``gate`` is set (``close``: with ``Connection: close``)."""
    async def handler(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await gate.wait()
        extra = b"Connection: close\r\n" if close else b""
        writer.write(b"HTTP/1.1 200 OK\r\n" + extra + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()
        return not close
    return handler


async def _line(wire: HttpWire, count: int) -> None:
    while wire.waiting < count:
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("close", [False, True], ids=["a connection", "a slot"])
async def test_what_is_handed_to_a_waiter_cancelled_in_that_moment_goes_to_the_next_in_line(close):
    gate = asyncio.Event()
    async with asyncio.timeout(10), RawServer(gated(gate, close=close)) as server:
        wire = HttpWire(max_connections=1)
        second: asyncio.Task | None = None

        async def first() -> bytes:
            got = await wire.post(server.url, b"1")
            # This step released the connection (or its slot) and handed it to ``second``, whose task has
            # not run yet: cancelled now, it must hand it on instead of taking it with it.
            assert second is not None and not second.done()
            second.cancel()
            return got.body

        holder = asyncio.create_task(first())
        await asyncio.sleep(0)
        second = asyncio.create_task(wire.post(server.url, b"2"))
        third = asyncio.create_task(wire.post(server.url, b"3"))
        await _line(wire, 2)
        gate.set()
        assert await holder == b"1"
        with pytest.raises(asyncio.CancelledError):
            await second
        assert (await third).body == b"3"
        assert wire.waiting == 0 and wire.open_connections == (0 if close else 1)
        assert [body for _, body in server.requests] == [b"1", b"3"]
        await wire.close()


async def test_a_waiter_that_gives_up_at_its_deadline_leaves_the_line_and_takes_no_slot():
    gate = asyncio.Event()
    async with asyncio.timeout(10), RawServer(gated(gate)) as server:
        wire = HttpWire(max_connections=1)
        holder = asyncio.create_task(wire.post(server.url, b"1"))
        await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await wire.post(server.url, b"2")
        assert wire.waiting == 0
        gate.set()
        await holder
        assert (await wire.post(server.url, b"3")).body == b"3"
        assert (wire.open_connections, server.connections) == (1, 1)
        await wire.close()


async def test_five_times_the_cap_of_calls_with_deadlines_end_and_the_wire_is_whole_afterwards():
    async def slow(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    async def call(deadline_s: float) -> str:
        try:
            async with asyncio.timeout(deadline_s):
                await wire.post(server.url, b"{}")
            return "answered"
        except TimeoutError:
            return "deadline"

    async with asyncio.timeout(20), RawServer(slow) as server:
        wire = HttpWire(max_connections=2)
        ends = await asyncio.gather(*(call(0.02 + 0.03 * (i % 5)) for i in range(10)))
        assert len(ends) == 10
        assert wire.waiting == 0 and wire.open_connections <= 2
        assert [await call(10) for _ in range(4)] == ["answered"] * 4  # the backlog is gone
        assert wire.open_connections <= 2
        await wire.close()


async def test_one_origin_takes_at_most_its_share_and_another_is_served_meanwhile():
    gate = asyncio.Event()
    async with asyncio.timeout(10), RawServer(gated(gate)) as slow, RawServer(answer(b"{}")) as fast:
        wire = HttpWire(max_connections=3, max_per_origin=2)
        held = [asyncio.create_task(wire.post(slow.url, b"%d" % i)) for i in range(4)]
        await _line(wire, 2)  # two in flight, two in the slow origin's line
        assert (await wire.post(fast.url, b"{}")).body == b"{}"  # the third slot is the other origin's
        assert slow.connections == 2
        gate.set()
        assert len(await asyncio.gather(*held)) == 4
        assert slow.connections == 2 and wire.open_connections == 3
        await wire.close()


async def test_an_idle_connection_is_closed_after_the_idle_time():
    async with asyncio.timeout(10), RawServer(answer(b"{}")) as server:
        wire = HttpWire(idle_timeout_s=0.05)
        await wire.post(server.url, b"{}")
        assert wire.open_connections == 1
        while wire.open_connections:  # closed by the wire's own sweep, not by the server
            await asyncio.sleep(0.01)
        await wire.post(server.url, b"{}")
        assert server.connections == 2
        await wire.close()
