"""Misbehaving MCP peers and clients against a real proxy (real OPA, real Redis): every limit of the MCP edge
and of the stateless MCP upstream wire holds, counted in bytes and messages, ending with a stable code.

* A hostile MCP upstream, written here: a raw asyncio HTTP server that forwards the handshake to a real SDK
  upstream (tests/support/mcp_upstream.py) and answers chosen ``tools/call`` requests with floods (a huge JSON
  body, an endless chunked body, endless SSE pings, endless SSE notifications) or with SSE lines ended by a
  bare CR. It counts the bytes it managed to write before the proxy closed the connection: an upper bound of
  what the proxy read (its socket send buffer is kept small).
* Hostile clients: oversized JSON-RPC batches, batches of slow calls past the scheduler's limits, one caller
  opening sessions until the table would be full, a client that stops reading its SSE stream while its
  upstream floods it with log messages, a 900 KB admin body, garbage bearer tokens against a JWKS URL.

No assertion is on time: every wait is bounded (``asyncio.timeout``) and what is asserted is a count or a code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.support.mcp_upstream import Upstream, running_upstream
from tests.support.mesh import mesh_headers, mesh_settings
from tests.support.stack import DEMO_REGISTRY, Stack, running_stack

ACCEPT = {"Accept": "application/json, text/event-stream"}
MiB = 1024 * 1024
ANSWER_LIMIT = 1 * MiB  # mcp.upstream_max_answer_bytes in these tests
EVENT_LIMIT = 1000      # mcp.upstream_max_stream_events
FLOOD_CAP = 64 * MiB    # a flood stops here if the proxy never closes (the test then fails)
SLACK = 8 * MiB         # kernel buffers between the two ends on loopback


# -- the hostile upstream -------------------------------------------------------------------------------


@dataclass
class HostileUpstream:
    """Forwards everything to ``real`` except ``tools/call`` of the tools it floods (``FLOODS``)."""

    real: Upstream
    written: dict[str, int] = field(default_factory=dict)  # flood -> bytes written before it ended
    ended: dict[str, str] = field(default_factory=dict)    # flood -> "closed by the proxy" or "cap"
    port: int = 0
    _server: asyncio.AbstractServer | None = None
    _http: aiohttp.ClientSession | None = None

    def url(self, name: str) -> str:
        """One URL per tool: the proxy keeps one upstream session per URL (its wire state stays separate)."""
        return f"http://127.0.0.1:{self.port}/mcp/{name}"

    async def start(self) -> None:
        self._http = aiohttp.ClientSession()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()
        if self._http is not None:
            await self._http.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                flood = self._flood_of(method, headers, body)
                if flood is not None:
                    await self._flood(flood, json.loads(body).get("id"), writer)
                    return
                await self._forward(method, headers, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _flood_of(method: str, headers: dict[str, str], body: bytes) -> str | None:
        if method != "POST":
            return None
        message = json.loads(body)  # the body's method: a legacy session's POST has no Mcp-Method header
        if not isinstance(message, dict) or message.get("method") != "tools/call":
            return None
        name = message.get("params", {}).get("name")
        return name if name in FLOODS else None

    async def _forward(self, method: str, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET":  # no standalone stream here
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            return
        sent = {k: v for k, v in headers.items()
                if k not in ("host", "content-length", "connection", "transfer-encoding", "accept-encoding")}
        assert self._http is not None
        async with self._http.request(method, self.real.url, data=body, headers=sent) as response:
            payload = await response.read()
            out = [f"HTTP/1.1 {response.status} X", f"Content-Length: {len(payload)}"]
            out += [f"{name}: {response.headers[name]}" for name in ("Content-Type", "Mcp-Session-Id")
                    if name in response.headers]
        writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()

    async def _flood(self, name: str, rpc_id: Any, writer: asyncio.StreamWriter) -> None:
        head, chunk, framing = FLOODS[name]
        if name == "gzip_answer":  # ~40 KB on the wire, 40 MiB once inflated
            packed = gzip_answer(rpc_id)
            writer.write(head % len(packed) + packed)
            await writer.drain()
            self.ended[name] = "answered"
            self.written[name] = len(packed)
            return
        if name in ("cr_answer", "bad_result"):  # an answer whose SSE lines end with a bare CR
            result = {"content": [{"type": "text", "text": '{"ok": true}'}], "structuredContent": {"ok": True},
                      "isError": False, "resultType": "complete"}
            if name == "bad_result":  # not a result of the negotiated revision
                result["content"] = "not a list of blocks"
            note = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "n"}}
            events = (b": ping\r\r" + b"data: " + json.dumps(note).encode() + b"\r\r" + b"event: message\r"
                      + b"data: " + json.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": result}).encode() + b"\r\r")
            writer.write(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))
            await writer.drain()
            self.ended[name] = "answered"
            return
        written = 0
        try:
            writer.write(head)
            while written < FLOOD_CAP:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if framing == "chunked" else chunk)
                await writer.drain()
                written += len(chunk)
            self.ended[name] = "cap"
        except ConnectionError:
            self.ended[name] = "closed"
        finally:
            self.written[name] = written


_JSON_LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (FLOOD_CAP * 2)
_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
_NOTE = b"data: " + json.dumps({"jsonrpc": "2.0", "method": "notifications/message",
                                "params": {"level": "info", "data": "x" * 3000}}).encode() + b"\n\n"
# upstream tool name -> (status line and headers, the chunk repeated, framing)
FLOODS: dict[str, tuple[bytes, bytes, str]] = {
    "json_flood": (_JSON_LENGTH, b" " * 65536, "length"),                               # huge declared body
    "chunked_flood": (_CHUNKED % b"application/json", b" " * 65536, "chunked"),         # endless chunked body
    "ping_flood": (_CHUNKED % b"text/event-stream", b": ping\r\n\r\n" * 4096, "chunked"),  # endless SSE events
    "note_flood": (_CHUNKED % b"text/event-stream", _NOTE * 16, "chunked"),             # notifications, no result
    "cr_answer": (_CHUNKED % b"text/event-stream", b"", "chunked"),
    "gzip_answer": (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                    b"Content-Length: %d\r\n\r\n", b"", "length"),
    "bad_result": (_CHUNKED % b"text/event-stream", b"", "chunked"),
}


def gzip_answer(rpc_id: Any) -> bytes:
    """A valid JSON-RPC result followed by 40 MiB of spaces (still valid JSON), gzipped: about 40 KB."""
    result = {"content": [{"type": "text", "text": '{"ok": true}'}], "structuredContent": {"ok": True},
              "isError": False}
    squeezer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    packed = [squeezer.compress(json.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": result}).encode())]
    padding = b" " * MiB
    for _ in range(40):
        packed.append(squeezer.compress(padding))
    packed.append(squeezer.flush())
    return b"".join(packed)


def hostile_registry(upstream: HostileUpstream) -> str:
    text = "tools:\n"
    for name, mode in (("json_flood", "read"), ("chunked_flood", "read"), ("ping_flood", "read"),
                       ("note_flood", "read"), ("cr_answer", "read"), ("bad_result", "read"), ("gzip_answer", "read"),
                       ("json_flood", "write")):
        text += f"""  - name: h_{name}{"_write" if mode == "write" else ""}
    version: "1.0.0"
    description: A hostile upstream's {name}.
    mode: {mode}
    risk: {mode}
    inputSchema: {{type: object, additionalProperties: false, properties: {{}}}}
    outputSchema: {{type: object}}
    timeout_ms: 20000
    backend: {{type: mcp, url: "{upstream.url(name + ('-w' if mode == 'write' else ''))}", tool: {name}}}
"""
    return text


@contextlib.asynccontextmanager
async def hostile_stack(tmp_path: Path, deps: dict[str, Any],
                        overrides: dict[str, Any] | None = None) -> AsyncIterator[tuple[Stack, HostileUpstream]]:
    async with running_upstream() as real:
        hostile = HostileUpstream(real)
        await hostile.start()
        try:
            registry = tmp_path / "hostile.yaml"
            registry.write_text(hostile_registry(hostile))
            async with running_stack({**deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                      "mcp.upstream_max_answer_bytes": ANSWER_LIMIT,
                                      "mcp.upstream_max_stream_events": EVENT_LIMIT, **(overrides or {})}) as stack:
                stack.auto_key = True
                yield stack, hostile
        finally:
            await hostile.stop()


@pytest.mark.parametrize("tool,limit", [("json_flood", "body"), ("chunked_flood", "body"),
                                        ("ping_flood", "stream_events"), ("note_flood", "stream_bytes")])
async def test_a_flooding_upstream_costs_one_call_a_bounded_read(tmp_path, proxy_deps, tool, limit):
    async with hostile_stack(tmp_path, proxy_deps) as (stack, hostile):
        async with asyncio.timeout(60):
            status, env = await stack.call(f"h_{tool}", {})
        assert (status, env["outcome"], env["error"]["code"]) == (502, "failed", "output_invalid")
        assert env["error"]["details"]["limit"] == limit
        assert hostile.ended[tool] == "closed"  # the proxy hung up; the flood never reached its cap
        assert hostile.written[tool] <= ANSWER_LIMIT + SLACK
        # The sidecar goes on: the next call to a well-behaved upstream over the same wire succeeds.
        async with asyncio.timeout(30):
            status, ok = await stack.call("h_cr_answer", {})
        assert (status, ok["outcome"], ok["data"]) == (200, "succeeded", {"ok": True})


async def test_the_sdk_session_path_is_bounded_too_and_never_inflates_an_answer(tmp_path, proxy_deps):
    """A legacy session's calls go through the mcp SDK's client, not the stateless wire: the same byte cap holds
    there (it had none), and a 40 KB gzip answer that inflates to 40 MiB is refused unread (it was inflated,
    then served)."""
    async with hostile_stack(tmp_path, proxy_deps, {"mcp.upstream_mode": "legacy"}) as (stack, hostile):
        async with asyncio.timeout(60):
            status, env = await stack.call("h_gzip_answer", {})
        assert (status, env["outcome"], env["error"]["code"]) == (502, "failed", "output_invalid")
        assert env["error"]["details"]["limit"] == "content_encoding"
        for tool in ("json_flood", "note_flood"):
            async with asyncio.timeout(60):
                status, env = await stack.call(f"h_{tool}", {})
            assert (status, env["outcome"], env["error"]["code"]) == (502, "failed", "output_invalid")
            assert (env["error"]["details"]["limit"], env["error"]["details"]["limit_value"]) == ("body", ANSWER_LIMIT)
            assert hostile.ended[tool] == "closed" and hostile.written[tool] <= ANSWER_LIMIT + SLACK


async def test_the_pin_watchers_client_never_inflates_an_answer():
    """The pin watcher's own client (mcp_pins.capped_http_client) against a gzip answer under a 1 MiB cap: it
    is refused, where 40 MiB were read before."""
    import httpx2

    from proxy.adapters.mcp_pins import capped_http_client

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        packed = gzip_answer(1)
        writer.write(FLOODS["gzip_answer"][0] % len(packed) + packed)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    client = capped_http_client(ANSWER_LIMIT, 5.0)
    try:
        read, refusal = None, None
        async with asyncio.timeout(30):
            try:
                response = await client.get(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/mcp")
                read = len(await response.aread())
            except httpx2.ReadError as error:
                refusal = getattr(error, "what", None)
        assert (read, refusal) == (None, "content_encoding")  # before: all 40 MiB, read under a 1 MiB cap
    finally:
        await client.aclose()
        server.close()


async def test_a_write_whose_answer_floods_is_unknown_not_failed(tmp_path, proxy_deps):
    async with hostile_stack(tmp_path, proxy_deps) as (stack, hostile):
        async with asyncio.timeout(60):
            status, env = await stack.call("h_json_flood_write", {})
        assert env["outcome"] == "unknown" and env["error"]["code"] == "upstream_error_unknown"
        assert env["error"]["resolution"] == "reconcile" and env["side_effect"]["committed"] is None
        assert hostile.ended["json_flood"] == "closed" and hostile.written["json_flood"] <= ANSWER_LIMIT + SLACK


async def test_an_answer_that_is_not_a_result_fails_the_call_not_the_proxy(tmp_path, proxy_deps):
    async with hostile_stack(tmp_path, proxy_deps) as (stack, hostile):
        async with asyncio.timeout(30):
            status, env = await stack.call("h_bad_result", {})
        assert (status, env["outcome"], env["error"]["code"]) == (502, "failed", "output_invalid")
        assert env["error"]["details"]["answer"] == "invalid_result"


async def test_sse_lines_ended_by_a_bare_cr_are_read_per_the_spec(tmp_path, proxy_deps):
    async with hostile_stack(tmp_path, proxy_deps) as (stack, hostile):
        async with asyncio.timeout(30):
            status, env = await stack.call("h_cr_answer", {})
        assert (status, env["outcome"], env["data"]) == (200, "succeeded", {"ok": True})
        assert hostile.ended["cr_answer"] == "answered"


# -- hostile clients at the MCP edge ---------------------------------------------------------------------


async def raw(stack: Stack, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(body).encode(),
                                  headers={**ACCEPT, "Content-Type": "application/json", **(headers or {})}
                                  ) as response:
        text = await response.text()
        payload = json.loads(text) if response.content_type == "application/json" else text
        return response.status, dict(response.headers), payload


async def initialize(stack: Stack, version: str = "2025-03-26", headers: dict[str, str] | None = None
                     ) -> tuple[int, dict[str, str], Any]:
    return await raw(stack, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}, headers)


async def session_of(stack: Stack) -> dict[str, str]:
    status, headers, _ = await initialize(stack)
    assert status == 200
    return {"Mcp-Session-Id": headers["Mcp-Session-Id"]}


def call(rpc_id: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def refusals(stack: Stack, reason: str) -> float:
    return stack.runtime.metrics.registry.get_sample_value("toolproxy_mcp_refusals_total", {"reason": reason}) or 0


@dataclass
class SlowBackend:
    """An HTTP tool backend that holds each call ``hold_s`` and counts calls and the most at once."""

    hold_s: float
    calls: int = 0
    in_flight: int = 0
    most: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.in_flight -= 1
        return web.json_response({"ok": True})


SLOW_TOOL = """
tools:
  - name: slow_read
    version: "1.0.0"
    description: Answers after a while.
    mode: read
    risk: read
    inputSchema: {type: object, additionalProperties: false, properties: {n: {type: integer}}}
    outputSchema: {type: object}
    timeout_ms: 20000
    backend: {type: http, service: slow, path: /slow}
"""


@contextlib.asynccontextmanager
async def slow_stack(tmp_path: Path, deps: dict[str, Any], hold_s: float,
                     overrides: dict[str, Any]) -> AsyncIterator[tuple[Stack, SlowBackend]]:
    backend = SlowBackend(hold_s)
    app = web.Application()
    app.router.add_post("/slow", backend.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    registry = tmp_path / "slow.yaml"
    registry.write_text(SLOW_TOOL)
    try:
        async with running_stack({**deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  "backends.services": {"slow": f"http://127.0.0.1:{port}",
                                                       "demo": "http://127.0.0.1:9"},  # unused; mapped
                                  **overrides}) as stack:
            yield stack, backend
    finally:
        await runner.cleanup()


async def test_a_batch_past_its_caps_is_refused_whole_and_nothing_runs(tmp_path, proxy_deps):
    overrides = {"mcp.batch_max_members": 8, "scheduler.max_calls": 3}
    async with slow_stack(tmp_path, proxy_deps, 0.0, overrides) as (stack, backend):
        session = await session_of(stack)
        pings = [{"jsonrpc": "2.0", "id": i, "method": "ping"} for i in range(9)]
        status, _, answer = await raw(stack, pings, session)
        assert status == 413 and answer["error"]["code"] == -32600 and answer["id"] is None
        assert answer["error"]["data"] == {"code": "batch_too_large", "members": 9, "max_members": 8,
                                           "calls": 0, "max_calls": 3}
        calls = [call(i, "slow_read", {"n": i}) for i in range(4)]  # 4 members, but 4 calls > max_calls
        status, _, answer = await raw(stack, calls, session)
        assert status == 413 and answer["error"]["data"]["code"] == "batch_too_large"
        assert backend.calls == 0 and refusals(stack, "batch_too_large") == 2
        status, _, answers = await raw(stack, pings[:8], session)  # at the cap: answered
        assert status == 200 and len(answers) == 8


async def test_a_batchs_calls_run_within_the_schedulers_limits(tmp_path, proxy_deps):
    """Before: every member ran at once (past scheduler.max_parallel and the tenant/tool caps)."""
    overrides = {"scheduler.max_parallel": 2, "scheduler.tool_max_parallel": 3}
    async with slow_stack(tmp_path, proxy_deps, 0.2, overrides) as (stack, backend):
        session = await session_of(stack)
        async with asyncio.timeout(60):
            status, _, answers = await raw(stack, [call(i, "slow_read", {"n": i}) for i in range(6)], session)
        assert status == 200 and sorted(a["id"] for a in answers) == list(range(6))
        assert all(a["result"]["isError"] is False for a in answers)
        assert backend.calls == 6 and backend.most <= 2


async def test_a_batch_call_whose_slot_never_came_is_not_started(tmp_path, proxy_deps):
    """One slot at a time and a short batch deadline: members that never got a slot end
    ``timeout_not_started`` (nothing sent); every member is answered with a stable code."""
    overrides = {"scheduler.max_parallel": 1}
    async with slow_stack(tmp_path, proxy_deps, 0.5, overrides) as (stack, backend):
        session = await session_of(stack)
        async with asyncio.timeout(60):
            status, _, answers = await raw(stack, [call(i, "slow_read", {"n": i}) for i in range(8)],
                                           {**session, "Request-Timeout": "1"})
        assert status == 200 and len(answers) == 8
        codes = [a["result"]["_meta"]["io.toolproxy/envelope"]["error"]["code"] if a["result"]["isError"]
                 else "succeeded" for a in answers]
        assert "timeout_not_started" in codes
        assert set(codes) <= {"succeeded", "timeout", "timeout_not_started"}  # a read sent late: "timeout"
        assert backend.calls == codes.count("succeeded") + codes.count("timeout")
        assert backend.most == 1


async def test_one_caller_cannot_fill_the_session_table(tmp_path, proxy_deps):
    overrides = {**mesh_settings(tmp_path), "mcp.max_sessions_per_owner": 3, "mcp.max_sessions": 10}
    alice, bob = mesh_headers("alice", "acme"), mesh_headers("bob", "acme")
    async with running_stack({**proxy_deps, **overrides}) as stack:
        opened = [await initialize(stack, headers=alice) for _ in range(3)]
        assert [status for status, _, _ in opened] == [200, 200, 200]
        status, _, answer = await initialize(stack, headers=alice)
        assert status == 503 and answer["error"]["data"] == {"code": "too_many_owner_sessions"}
        status, _, _ = await initialize(stack, headers=bob)
        assert status == 200
        # Ending one of its own gives the caller room again.
        async with stack.session.delete(stack.proxy_url + "/mcp", headers={
                **alice, "Mcp-Session-Id": opened[0][1]["Mcp-Session-Id"]}) as response:
            assert response.status == 200
        status, _, _ = await initialize(stack, headers=alice)
        assert status == 200 and refusals(stack, "too_many_owner_sessions") == 1


async def test_a_client_that_stops_reading_gets_a_bounded_queue_and_the_excess_is_counted(tmp_path, proxy_deps):
    """The upstream floods a call with log messages while the client reads nothing: at most
    mcp.sse_queue_max wait in the proxy, the rest are dropped and counted, and the result still arrives."""
    count, size = 3000, 4000
    async with running_upstream(json_response=False) as upstream:
        registry = tmp_path / "flood.yaml"
        registry.write_text(f"""
tools:
  - name: log_flood
    version: "1.0.0"
    description: Logs a lot.
    mode: read
    risk: read
    inputSchema: {{type: object, additionalProperties: false, required: [count, size],
                  properties: {{count: {{type: integer}}, size: {{type: integer}}}}}}
    timeout_ms: 60000
    backend: {{type: mcp, url: "{upstream.url}", tool: log_flood}}
""")
        async with running_stack({**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  "mcp.upstream_mode": "legacy", "mcp.sse_queue_max": 16}) as stack:
            session = await session_of(stack)
            await raw(stack, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
            status, _, _ = await raw(stack, {"jsonrpc": "2.0", "id": 1, "method": "logging/setLevel",
                                             "params": {"level": "debug"}}, session)
            assert status == 200
            body = json.dumps(call(2, "log_flood", {"count": count, "size": size})).encode()
            async with asyncio.timeout(120):
                async with stack.session.post(stack.proxy_url + "/mcp", data=body, headers={
                        **ACCEPT, "Content-Type": "application/json", **session}) as response:
                    assert response.content_type == "text/event-stream"
                    while upstream.state.count("log_flood") == 0 or not _flooded(stack, count):
                        await asyncio.sleep(0.05)  # read nothing until the upstream has sent everything
                    text = await response.text()
        events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
        logs = [e for e in events if e.get("method") == "notifications/message"]
        dropped = stack.runtime.metrics.registry.get_sample_value("toolproxy_mcp_sse_dropped_total",
                                                                  {"kind": "log"})
        assert events[-1]["id"] == 2 and events[-1]["result"]["content"][0]["text"] == "flooded"
        assert dropped is not None and dropped > 0 and len(logs) + dropped == count


def _flooded(stack: Stack, count: int) -> bool:
    relayed = stack.runtime.metrics.registry.get_sample_value("toolproxy_mcp_log_messages_total",
                                                              {"result": "relayed"}) or 0
    return relayed >= count


async def test_the_admin_listener_reads_at_most_64_kib_of_a_body(jwt_stack, issuers):
    token = issuers[1].token("olga", audience="toolproxy-admin", roles=["operator"], tenant="acme", scope="")
    big = json.dumps({"request_id": "r", "call_id": "c", "outcome": "committed", "evidence": "x" * 900_000}).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with jwt_stack.session.post(jwt_stack.admin_url + "/v1/unknown-calls/settle", data=big,
                                      headers=headers) as response:
        assert response.status == 413 and (await response.json())["error"]["code"] == "payload_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds where the body is read
        for at in range(0, len(big), 65536):
            yield big[at:at + 65536]

    async with jwt_stack.session.post(jwt_stack.admin_url + "/v1/unknown-calls/settle", data=chunks(),
                                      headers=headers) as response:
        assert response.status == 413 and (await response.json())["error"]["code"] == "payload_too_large"


async def test_a_parse_error_answers_a_fixed_message(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        status, body = await stack.post("/v1/tool-calls", None, raw=b'{"call_id": "c", "tool": ')
        assert status == 400 and body["error"]["code"] == "invalid_json"
        assert body["error"]["message"] == "request body is not valid JSON at line 1, column 26"  # not the parser's text
        assert sorted(body["error"]["details"]) == ["column", "line", "position"]
        async with stack.session.post(stack.proxy_url + "/mcp", data=b"[{]", headers={
                **ACCEPT, "Content-Type": "application/json"}) as response:
            answer = await response.json()
        assert answer["error"] == {"code": -32700, "message": "Parse error"}


# -- identity: a JWKS URL is not fetched once per request -------------------------------------------------


async def test_garbage_tokens_do_not_each_fetch_the_jwks(proxy_deps):
    fetches = {"count": 0}

    async def jwks(request: web.Request) -> web.Response:
        fetches["count"] += 1
        return web.Response(status=503)  # the JWKS server is down: no key is ever cached

    app = web.Application()
    app.router.add_get("/jwks.json", jwks)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/jwks.json"
    # A well-formed header (RS256, a kid) with garbage after it: it reaches the key lookup.
    garbage = "eyJhbGciOiJSUzI1NiIsImtpZCI6Im5vLXN1Y2gta2V5IiwidHlwIjoiSldUIn0.e30.c2ln"
    try:
        async with running_stack({**proxy_deps, "identity.mode": "jwt", "identity.agent_id": "agent-1",
                                  "identity.jwt": {"jwks_url": url, "issuer": "https://x.test"}}) as stack:
            for i in range(25):
                status, body = await stack.call("get_order", {"order_id": "ord_1001"},
                                                headers={"Authorization": f"Bearer {garbage}"})
                assert status == 401 and body["error"]["code"] == "unauthorized"
            assert fetches["count"] == 1
    finally:
        await runner.cleanup()
