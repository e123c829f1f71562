"""The hot path's Redis wire (proxy/wire/resp.py) against a real redis-server, and raw TCP stubs for what a
real server will not do on demand (answer twice). Replies are compared with what redis-py itself returns for
the same command; pool limits, timeouts and cancels are checked at the server (``CLIENT LIST``) as well as
in the wire's own count. Every wait is bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as redis_async
from redis.exceptions import (ConnectionError as RedisConnectionError, NoScriptError,
                              ResponseError, TimeoutError as RedisTimeoutError)

from proxy.config import load_config
from proxy.wire.resp import RespWire
from proxy.store import WiredRedis, close_client, create_client
from tests.support.servers import RedisServer, free_port

SHAPES = """
return {1, -7, 'text', 'with\\r\\nCRLF and \\0 byte', {'nested', {2, false}}, redis.status_reply('FINE'),
        false, {}}
"""


def _wire(port: int, **overrides) -> RespWire:
    settings = {"host": "127.0.0.1", "port": port, "ssl_context": None, "handshake": (), "max_connections": 4,
                "pool_wait_s": 1.0, "timeout_s": 2.0, "connect_timeout_s": 1.0, **overrides}
    return RespWire(**settings)


async def _wire_clients(server_client: redis_async.Redis) -> int:
    """Connections the server has open, not counting the asking one."""
    return len(await server_client.client_list()) - 1


async def test_replies_read_as_redis_py_reads_them(redis_url):
    client = create_client(load_config(env={}, overrides={"redis.url": redis_url}).redis)
    plain = redis_async.Redis.from_url(redis_url)
    try:
        assert isinstance(client, WiredRedis) and client.wire is not None
        sha = await plain.script_load(SHAPES)
        expected = await plain.evalsha(sha, 0)
        async with asyncio.timeout(10):
            got = await client.wire.execute([("EVALSHA", sha, 0)])
        assert got == [expected]
        assert expected[3] == b"with\r\nCRLF and \x00 byte" and expected[4] == [b"nested", [2, None]]
        # str, int and float arguments go out as redis-py encodes them
        echo = await plain.script_load("return ARGV")
        assert await client.wire.execute([("EVALSHA", echo, 0, "é", 7, 1.5, b"\xff")]) == \
            [await plain.evalsha(echo, 0, "é", 7, 1.5, b"\xff")]
    finally:
        await plain.aclose()
        await close_client(client)


async def test_a_batch_reports_each_commands_error_in_place(redis_url):
    wire = _wire(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    try:
        async with asyncio.timeout(10):
            replies = await wire.execute([("EVALSHA", "0" * 40, 0), ("EVAL", "return redis.error_reply('MINE no')", 0),
                                          ("EVAL", "return 5", 0), ("WAIT", 0, 10)])
        assert isinstance(replies[0], NoScriptError)
        assert isinstance(replies[1], ResponseError) and "no" in str(replies[1])
        assert replies[2:] == [5, 0]
    finally:
        await wire.close()


async def test_a_script_the_server_lost_is_loaded_and_run_once_more(redis_url):
    client = create_client(load_config(env={}, overrides={"redis.url": redis_url}).redis)
    plain = redis_async.Redis.from_url(redis_url)
    try:
        incr = client.register_script("return redis.call('INCR', KEYS[1])")
        async with asyncio.timeout(10):
            assert await incr(keys=["wire:n"]) == 1
            await plain.script_flush()
            assert await incr(keys=["wire:n"]) == 2  # NOSCRIPT, SCRIPT LOAD, EVALSHA: run once, not twice
            assert int(await plain.get("wire:n")) == 2
            with pytest.raises(ResponseError):
                await client.register_script("return redis.error_reply('ERR refused')")()
    finally:
        await plain.aclose()
        await close_client(client)


async def test_open_connections_stay_within_the_cap_and_callers_wait_their_turn(redis_url):
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    wire = _wire(port, max_connections=2)
    watcher = redis_async.Redis.from_url(redis_url)
    try:
        calls = [asyncio.ensure_future(wire.execute([("BLPOP", f"wire:empty{i}", 0.1)])) for i in range(6)]
        async with asyncio.timeout(10):
            await asyncio.sleep(0.05)
            assert await _wire_clients(watcher) == 2
            assert await asyncio.gather(*calls) == [[None]] * 6
        assert wire._open == 2 and len(wire._idle) == 2
    finally:
        await watcher.aclose()
        await wire.close()


async def test_past_the_cap_a_caller_waits_only_as_long_as_the_pool_timeout(redis_url):
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    wire = _wire(port, max_connections=1, pool_wait_s=0.05)
    try:
        async with asyncio.timeout(10):
            holder = asyncio.ensure_future(wire.execute([("BLPOP", "wire:empty", 0.5)]))
            await asyncio.sleep(0.05)
            with pytest.raises(RedisConnectionError, match="No connection available"):
                await wire.execute([("PING",)])
            assert await holder == [None]
            assert await wire.execute([("PING",)]) == [b"PONG"]
    finally:
        await wire.close()


async def test_a_timed_out_or_cancelled_exchange_closes_its_connection(redis_url):
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    wire = _wire(port, max_connections=1, timeout_s=0.1)
    watcher = redis_async.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(10):
            with pytest.raises(RedisTimeoutError):
                await wire.execute([("BLPOP", "wire:empty", 1)])
            assert wire._open == 0 and not wire._idle
            call = asyncio.ensure_future(wire.execute([("BLPOP", "wire:empty", 0.05)]))
            await asyncio.sleep(0.02)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert wire._open == 0
            # the late reply of the abandoned BLPOP never reaches the next caller: a new connection answers
            assert await wire.execute([("ECHO", "mine")]) == [b"mine"]
            await asyncio.sleep(0.1)
            assert await wire.execute([("ECHO", "again")]) == [b"again"]
            assert await _wire_clients(watcher) == 1
    finally:
        await watcher.aclose()
        await wire.close()


async def test_a_refused_connection_and_a_restarted_server():
    with RedisServer() as server:
        wire = _wire(server.port)
        try:
            async with asyncio.timeout(20):
                assert await wire.execute([("PING",)]) == [b"PONG"]
                server.stop()
                with pytest.raises(RedisConnectionError):
                    await wire.execute([("PING",)])
                assert wire._open == 0
                server.start()
                assert await wire.execute([("PING",)]) == [b"PONG"]
        finally:
            await wire.close()
    closed = _wire(free_port())
    with pytest.raises(RedisConnectionError):
        async with asyncio.timeout(10):
            await closed.execute([("PING",)])
    assert closed._open == 0


async def test_the_wire_selects_the_urls_database(redis_url):
    """(AUTH and TLS on the wire: tests/test_redis_connection.py, whose checks run a script too.)"""
    url = redis_url.rsplit("/", 1)[0] + "/3"
    client = create_client(load_config(env={}, overrides={"redis.url": url}).redis)
    check, db0 = redis_async.Redis.from_url(url), redis_async.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(10):
            await client.register_script("return redis.call('SET', KEYS[1], 'here')")(keys=["wire:db"])
            assert await check.get("wire:db") == b"here"
            assert await db0.get("wire:db") is None
    finally:
        await check.aclose()
        await db0.aclose()
        await close_client(client)


async def test_an_answer_nobody_asked_for_spoils_the_connection():
    """A server that answers one command twice: the extra reply is never handed to the next caller."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while await reader.readuntil(b"PING\r\n"):
                writer.write(b"+PONG\r\n:1\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    stub = await asyncio.start_server(serve, "127.0.0.1", 0)
    wire = _wire(stub.sockets[0].getsockname()[1])
    try:
        async with asyncio.timeout(10):
            assert await wire.execute([("PING",)]) == [b"PONG"]
            assert await wire.execute([("PING",)]) == [b"PONG"]
        assert connections == 2 and wire._open == 0
    finally:
        await wire.close()
        stub.close()
        await stub.wait_closed()
