"""The MCP endpoint under real identity (signed JWTs) and real OPA decisions (repo policies, demo data)."""

from __future__ import annotations

import json

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.support.stack import assert_envelope, running_stack, mcp_envelope
from tests.support.tokens import jwt_overrides

VIEWER_TOOLS = ["get_inventory", "get_order", "get_orders", "get_user_preferences"]
REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}


@pytest.fixture
async def stack(proxy_deps, issuers):
    async with running_stack({**proxy_deps, **jwt_overrides(*issuers)}) as s:
        yield s


def agent(stack, token: str, mode: str) -> Client:
    # X-Run-Id: writes need a stable operation identity, checked before authorization (issue 4).
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}", "X-Run-Id": "run-mcp-authz"},
                              timeout=httpx2.Timeout(30.0))
    return Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http), mode=mode)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_listing_hides_what_the_caller_may_not_call_and_calls_are_forbidden(stack, issuers, mode):
    platform, _ = issuers
    viewer = platform.token("victor", roles=["viewer"], scope="tools:read")
    async with agent(stack, viewer, mode) as client:
        assert sorted(t.name for t in (await client.list_tools()).tools) == VIEWER_TOOLS
        ok = await client.call_tool("get_order", {"order_id": "ord_1001"})
        refused = await client.call_tool("refund_order", REFUND)
    assert ok.is_error is False and ok.structured_content["order_id"] == "ord_1001"
    assert refused.is_error is True
    envelope = mcp_envelope(refused)
    assert_envelope(envelope)
    assert envelope["error"]["code"] == "forbidden"
    assert envelope["side_effect"] == {"attempted": False, "committed": False}
    assert refused.content[0].text.startswith("forbidden: ")
    assert not [r for r in stack.backend.requests if r["tool"] == "refund_order"]

    everyone = platform.token("alice")
    async with agent(stack, everyone, mode) as client:
        names = {t.name for t in (await client.list_tools()).tools}
    assert {"refund_order", "delete_customer", *VIEWER_TOOLS} <= names


async def test_approval_required_is_an_iserror_result_with_the_approval_id(stack, issuers):
    platform, _ = issuers
    async with agent(stack, platform.token("alice"), "auto") as client:
        result = await client.call_tool("delete_customer", {"customer_id": "cus_1001"})
    assert result.is_error is True
    envelope = mcp_envelope(result)
    assert envelope["error"]["code"] == "approval_required"
    assert envelope["error"]["resolution"] == "await_approval"
    assert envelope["error"]["details"]["approval_id"]
    assert not [r for r in stack.backend.requests if r["tool"] == "delete_customer"]


async def test_unauthenticated_requests_and_foreign_sessions_are_refused(stack, issuers):
    platform, _ = issuers
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(init), headers=base) as response:
        body = await response.json()
        assert response.status == 401 and body["error"]["code"] == -32600
        assert "Mcp-Session-Id" not in response.headers

    alice = {**base, "Authorization": f"Bearer {platform.token('alice')}"}
    async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(init), headers=alice) as response:
        assert response.status == 200
        session_id = response.headers["Mcp-Session-Id"]
    listing = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
    mallory = {**base, "Authorization": f"Bearer {platform.token('mallory')}", "Mcp-Session-Id": session_id}
    async with stack.session.post(stack.proxy_url + "/mcp", data=listing, headers=mallory) as response:
        assert response.status == 404       # another caller's session does not exist for them
    async with stack.session.post(stack.proxy_url + "/mcp", data=listing,
                                  headers={**alice, "Mcp-Session-Id": session_id}) as response:
        assert response.status == 200

    # The SDK client cannot even connect: discover and the initialize fallback both get 401.
    with pytest.raises((MCPError, BaseExceptionGroup)) as refused:
        async with agent(stack, "not.a.jwt", "auto") as client:
            await client.list_tools()
    error = refused.value
    while isinstance(error, BaseExceptionGroup):
        matched, _ = error.split(MCPError)
        assert matched is not None
        error = matched.exceptions[0]
    assert "credential" in str(error)
