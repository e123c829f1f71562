"""The MCP endpoint /mcp, driven by the real `mcp` SDK client (auto and legacy mode)
and by raw HTTP for the protocol edges the SDK client never produces."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION

from tests.support.stack import assert_envelope, running_stack, mcp_envelope

MODERN = "2026-07-28"
CLIENT_META = {"io.modelcontextprotocol/protocolVersion": MODERN,
               "io.modelcontextprotocol/clientCapabilities": {},
               "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"}}
ACCEPT = {"Accept": "application/json, text/event-stream"}


def modern_headers(method: str, name: str | None = None) -> dict[str, str]:
    headers = {**ACCEPT, "MCP-Protocol-Version": MODERN, "Mcp-Method": method}
    if name is not None:
        headers["Mcp-Name"] = name
    return headers


def rpc(method: str, params: dict[str, Any] | None = None, rpc_id: Any = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": rpc_id, "method": method}
    if params is not None:
        body["params"] = params
    return body


async def post(stack, body: Any, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json", **headers}) as response:
        text = await response.text()
        payload = None
        if response.content_type == "application/json":
            payload = json.loads(text)
        elif response.content_type == "text/event-stream":
            payload = text
        return response.status, dict(response.headers), payload


def client(stack, mode: str, headers: dict[str, str] | None = None) -> Client:
    if headers is None:
        return Client(stack.proxy_url + "/mcp", mode=mode)
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0))
    return Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http), mode=mode)


@pytest.mark.parametrize("mode,sse_after_ms", [("auto", 10000), ("legacy", 10000), ("auto", 0), ("legacy", 0)])
async def test_sdk_client_lists_calls_and_gets_envelopes(mode, sse_after_ms, proxy_deps):
    async with running_stack({**proxy_deps, "mcp.sse_after_ms": sse_after_ms}) as stack:
        async with client(stack, mode) as mcp:
            assert mcp.protocol_version == (MODERN if mode == "auto" else LATEST_HANDSHAKE_VERSION)
            listed = {tool.name: tool for tool in (await mcp.list_tools()).tools}
            registry = stack.runtime.registry
            assert sorted(listed) == [t.name for t in registry.active()]
            refund = listed["refund_order"]
            assert refund.description == registry.resolve("refund_order").description
            assert refund.input_schema["required"] == ["order_id", "amount", "reason"]
            assert refund.output_schema is not None and "refund_id" in refund.output_schema["properties"]
            assert refund.annotations.read_only_hint is False
            assert refund.annotations.destructive_hint is True      # risk: financial
            assert refund.annotations.idempotent_hint is True       # idempotency.required
            assert listed["get_order"].annotations.read_only_hint is True
            assert listed["send_email"].annotations.open_world_hint is True
            assert listed["adjust_counter"].annotations.idempotent_hint is True    # a write needs a key by default

            ok = await mcp.call_tool("get_order", {"order_id": "ord_1001"})
            assert ok.is_error is False
            assert ok.structured_content["order_id"] == "ord_1001"
            assert ok.structured_content["refundable"] == stack.backend.orders["ord_1001"]["refundable"]
            assert not list(registry.resolve("get_order").output_validator.iter_errors(ok.structured_content))
            assert json.loads(ok.content[0].text) == ok.structured_content

            bad = await mcp.call_tool("refund_order", {"order_id": "ord_1001", "amount": "100", "reason": "dup"})
            assert bad.is_error is True
            envelope = mcp_envelope(bad)
            assert_envelope(envelope)
            assert envelope["error"]["code"] == "schema_violation"
            assert envelope["side_effect"] == {"attempted": False, "committed": False}
            assert bad.content[0].text.startswith("schema_violation: ")
            assert "amount" in bad.content[0].text and "repair_arguments" in bad.content[0].text
            assert stack.backend.effect_counts().get("refund_order", 0) == 0

            with pytest.raises(MCPError) as unknown:  # a protocol error (-32602), not a tool result
                await mcp.call_tool("no_such_tool", {})
            assert unknown.value.error.code == -32602
            assert unknown.value.error.message == "Unknown tool: no_such_tool"
            assert unknown.value.error.data["code"] == "tool_not_found"


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_headers_work_as_on_the_json_api(mode, proxy_deps):
    """Deadline and request id headers reach the pipeline; a sent write that times out is unknown."""
    async with running_stack(proxy_deps) as stack:
        await stack.fault("adjust_counter", "slow", delay_ms=1500)
        headers = {"Request-Timeout": "0.3", "X-Request-Id": "req-mcp-deadline", "Idempotency-Key": f"mcp-{mode}"}
        async with client(stack, mode, headers) as mcp:
            result = await mcp.call_tool("adjust_counter", {"counter": "ctr_mcp", "delta": 1})
        envelope = mcp_envelope(result)
        assert result.is_error is True
        assert_envelope(envelope)
        assert envelope["error"]["code"] == "timeout_unknown"
        assert envelope["outcome"] == "unknown"
        assert envelope["side_effect"] == {"attempted": True, "committed": None}
        assert envelope["request_id"] == "req-mcp-deadline"
        assert envelope["timing"]["deadline_ms"] <= 300
        assert "unknown" in result.content[0].text


async def test_bad_idempotency_key_header_is_a_protocol_error(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        async with client(stack, "auto", {"Idempotency-Key": "not a valid key!"}) as mcp:
            with pytest.raises(MCPError) as refused:
                await mcp.call_tool("get_order", {"order_id": "ord_1001"})
        assert refused.value.error.code == -32600
        assert not [r for r in stack.backend.requests if r["tool"] == "get_order"]


async def test_listing_is_paginated_with_opaque_cursors(proxy_deps):
    async with running_stack({**proxy_deps, "mcp.page_size": 3}) as stack:
        async with client(stack, "auto") as mcp:
            names, cursor, pages = [], None, 0
            while True:
                page = await mcp.list_tools(cursor=cursor)
                pages += 1
                assert len(page.tools) <= 3
                names += [t.name for t in page.tools]
                cursor = page.next_cursor
                if cursor is None:
                    break
        assert names == [t.name for t in stack.runtime.registry.active()]
        assert pages == -(-len(names) // 3)
        status, _, body = await post(stack, rpc("tools/list", {"cursor": "bm90LW91cnM", "_meta": CLIENT_META}),
                                     modern_headers("tools/list"))
        assert (status, body["error"]["code"]) == (400, -32602)


async def test_call_ids_are_fresh_per_call_never_the_jsonrpc_or_session_id(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        params = {"name": "get_order", "arguments": {"order_id": "ord_1001"}, "_meta": CLIENT_META}
        envelopes = []
        for _ in range(2):
            status, _, body = await post(stack, rpc("tools/call", params, rpc_id=7),
                                         modern_headers("tools/call", "get_order"))
            assert status == 200 and body["id"] == 7
            envelopes.append(body["result"])
        status, headers, _ = await post(stack, rpc("initialize", {
            "protocolVersion": LATEST_HANDSHAKE_VERSION, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}), ACCEPT)
        session_id = headers["Mcp-Session-Id"]
        status, _, body = await post(stack, rpc("tools/call", {"name": "get_order",
                                                               "arguments": {"order_id": "ord_1001"}}, rpc_id=7),
                                     {**ACCEPT, "Mcp-Session-Id": session_id})
        assert status == 200
        assert all(e["isError"] is False for e in envelopes)
        seen = [{k.lower(): v for k, v in r["headers"].items()}.get("x-call-id")
                for r in stack.backend.requests if r["tool"] == "get_order"]
        assert len(seen) == 3 and len(set(seen)) == 3
        assert all(c.startswith("mcp-") and c not in ("7", session_id) for c in seen)


async def test_modern_header_and_version_checks(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        params = {"name": "get_order", "arguments": {"order_id": "ord_1001"}, "_meta": CLIENT_META}
        status, _, body = await post(stack, rpc("tools/call", params), modern_headers("tools/call", "refund_order"))
        assert (status, body["error"]["code"], body["id"]) == (400, -32020, 1)
        status, _, body = await post(stack, rpc("tools/call", params), modern_headers("tools/list", "get_order"))
        assert (status, body["error"]["code"]) == (400, -32020)
        assert not [r for r in stack.backend.requests if r["tool"] == "get_order"]

        future = {**CLIENT_META, "io.modelcontextprotocol/protocolVersion": "2099-01-01"}
        status, _, body = await post(stack, rpc("server/discover", {"_meta": future}),
                                     {**ACCEPT, "MCP-Protocol-Version": "2099-01-01", "Mcp-Method": "server/discover"})
        assert (status, body["error"]["code"]) == (400, -32022)
        assert body["error"]["data"]["requested"] == "2099-01-01"
        assert set(body["error"]["data"]["supported"]) == {*HANDSHAKE_PROTOCOL_VERSIONS, MODERN}

        status, _, body = await post(stack, rpc("tools/list", {}), modern_headers("tools/list"))
        assert (status, body["error"]["code"]) == (400, -32602)   # no _meta envelope

        status, _, body = await post(stack, rpc("resources/list", {"_meta": CLIENT_META}),
                                     modern_headers("resources/list"))
        assert (status, body["error"]["code"]) == (404, -32601)

        status, _, body = await post(stack, rpc("tools/call", {"arguments": {}, "_meta": CLIENT_META}),
                                     modern_headers("tools/call"))
        assert (status, body["error"]["code"]) == (400, -32602)


async def test_malformed_bodies_are_jsonrpc_errors(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        for raw, code in ((b'{"jsonrpc":"2.0","id":1,', -32700), (b'{"jsonrpc":"2.0","id":1,"id":2,"method":"ping"}', -32700),
                          (b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]', -32600),
                          (b'{"jsonrpc":"1.0","id":1,"method":"ping"}', -32600)):
            async with stack.session.post(stack.proxy_url + "/mcp", data=raw,
                                          headers={"Content-Type": "application/json", **ACCEPT}) as response:
                body = await response.json()
            assert (response.status, body["error"]["code"], body["id"]) == (400, code, None), raw
        async with stack.session.post(stack.proxy_url + "/mcp", data=b"{}",
                                      headers={"Content-Type": "text/plain", **ACCEPT}) as response:
            assert response.status == 415
        async with stack.session.post(stack.proxy_url + "/mcp", data=b"{}",
                                      headers={"Content-Type": "application/json", "Accept": "text/html"}) as response:
            assert response.status == 406
        async with stack.session.get(stack.proxy_url + "/mcp", headers={"Accept": "text/event-stream"}) as response:
            assert response.status == 405


async def test_legacy_sessions_lifecycle(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        listing = rpc("tools/list", {})
        status, _, body = await post(stack, listing, ACCEPT)
        assert (status, body["error"]["code"]) == (400, -32600)            # no session
        status, _, body = await post(stack, listing, {**ACCEPT, "Mcp-Session-Id": "made-up"})
        assert status == 404

        status, headers, body = await post(stack, rpc("initialize", {
            "protocolVersion": "1999-01-01", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}), ACCEPT)
        assert status == 200
        assert body["result"]["protocolVersion"] == LATEST_HANDSHAKE_VERSION     # counter-offer
        assert body["result"]["capabilities"] == {"tools": {"listChanged": False}, "logging": {}}
        session = {**ACCEPT, "Mcp-Session-Id": headers["Mcp-Session-Id"]}
        assert len(headers["Mcp-Session-Id"]) >= 32

        status, _, _ = await post(stack, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
        assert status == 202
        status, _, body = await post(stack, listing, session)
        assert status == 200 and len(body["result"]["tools"]) == len(stack.runtime.registry.active())
        assert "resultType" not in body["result"]
        # Any supported revision is accepted on a session, as the reference SDK servers do
        # (the conformance suite's server-sse-multiple-streams sends 2025-03-26 on a 2025-11-25 one).
        status, _, body = await post(stack, listing, {**session, "MCP-Protocol-Version": "2025-03-26"})
        assert status == 200 and len(body["result"]["tools"]) == len(stack.runtime.registry.active())
        status, _, body = await post(stack, listing, {**session, "MCP-Protocol-Version": "2024-01-01"})
        assert status == 400                                                 # not a supported revision
        status, _, body = await post(stack, rpc("ping"), session)
        assert (status, body["result"]) == (200, {})

        async with stack.session.delete(stack.proxy_url + "/mcp", headers=session) as response:
            assert response.status == 200
        status, _, body = await post(stack, listing, session)
        assert status == 404


async def test_long_call_streams_sse_with_keepalive_pings(proxy_deps):
    async with running_stack({**proxy_deps, "mcp.sse_after_ms": 50, "mcp.sse_ping_ms": 50}) as stack:
        await stack.fault("get_order", "slow", delay_ms=400)
        params = {"name": "get_order", "arguments": {"order_id": "ord_1001"}, "_meta": CLIENT_META}
        status, headers, text = await post(stack, rpc("tools/call", params, rpc_id="a"),
                                           modern_headers("tools/call", "get_order"))
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        assert ": ping" in text
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert len(events) == 1
        message = json.loads(events[0])
        assert message["id"] == "a" and message["result"]["isError"] is False
        assert message["result"]["structuredContent"]["order_id"] == "ord_1001"

        # A client that accepts only JSON waits for the JSON answer instead.
        status, headers, body = await post(stack, rpc("tools/call", params, rpc_id="b"),
                                           {**modern_headers("tools/call", "get_order"), "Accept": "application/json"})
        assert status == 200 and body["result"]["isError"] is False


@pytest.mark.parametrize("version", [*HANDSHAKE_PROTOCOL_VERSIONS, MODERN])
async def test_an_unknown_tool_is_a_json_rpc_error_in_every_supported_revision(version, proxy_deps):
    """Each revision's tools page (2024-11-05 .. 2026-07-28, "Error Handling"): an unknown tool is a protocol
    error, ``{"code": -32602, "message": "Unknown tool: ..."}``, never an isError result (seed 000 §6.3)."""
    async with running_stack(proxy_deps) as stack:
        params: dict[str, Any] = {"name": "no_such_tool", "arguments": {}}
        if version == MODERN:
            headers = modern_headers("tools/call", "no_such_tool")
            params["_meta"] = CLIENT_META
        else:
            status, answer, body = await post(stack, rpc("initialize", {
                "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "c", "version": "0"}}),
                ACCEPT)
            assert status == 200, body
            headers = {**ACCEPT, "Mcp-Session-Id": answer["Mcp-Session-Id"], "MCP-Protocol-Version": version}
        status, _, body = await post(stack, rpc("tools/call", params, rpc_id=3), headers)
        assert "result" not in body, body
        assert body["id"] == 3 and body["error"]["code"] == -32602
        assert body["error"]["message"] == "Unknown tool: no_such_tool"
        assert body["error"]["data"]["code"] == "tool_not_found"
        assert status == (400 if version == MODERN else 200)
