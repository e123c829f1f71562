"""MCP servers as tool backends: agent MCP client -> proxy -> real upstream MCP server (mcp SDK)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any, AsyncIterator

import httpx2
import jwt
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from proxy.normalize import canonical_json
from tests.support.mcp_upstream import Upstream, registry_yaml, running_upstream
from tests.support.stack import DEMO_REGISTRY, Stack, assert_envelope, running_stack, mcp_envelope


@contextlib.asynccontextmanager
async def mcp_stack(tmp_path: Path, deps: dict[str, Any], *, upstream_mode: str = "auto", json_response: bool = True,
                    overrides: dict[str, Any] | None = None) -> AsyncIterator[tuple[Stack, Upstream]]:
    async with running_upstream(json_response=json_response) as upstream:
        registry = tmp_path / "upstream-tools.yaml"
        registry.write_text(registry_yaml(upstream.url))
        async with running_stack({**deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  "mcp.upstream_mode": upstream_mode, **(overrides or {})}) as stack:
            stack.auto_key = True  # writes need a stable operation identity (issue 4)
            yield stack, upstream


def agent(stack: Stack, mode: str = "auto", headers: dict[str, str] | None = None) -> Client:
    # The run/turn identity makes each distinct call its own operation (issue 4); never the JSON-RPC id.
    http = httpx2.AsyncClient(headers={"X-Run-Id": "run-mcp-1", **(headers or {})}, timeout=httpx2.Timeout(30.0))
    return Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http), mode=mode)


@pytest.mark.parametrize("agent_mode,upstream_mode,json_response", [
    ("auto", "auto", True), ("legacy", "legacy", False), ("auto", "legacy", True), ("legacy", "auto", False)])
async def test_end_to_end_through_the_proxy(tmp_path, agent_mode, upstream_mode, json_response, proxy_deps):
    async with mcp_stack(tmp_path, proxy_deps, upstream_mode=upstream_mode, json_response=json_response) as (stack, upstream):
        async with agent(stack, agent_mode, {"X-Request-Id": "req-e2e", "X-Run-Id": "run-e2e"}) as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            # The registry, not the upstream, describes the tool.
            assert listed["up_adjust"].description == "Add delta to a counter on the upstream MCP server."
            assert listed["up_adjust"].annotations.read_only_hint is False
            first = await client.call_tool("up_adjust", {"counter": "c_a", "delta": 2})
            second = await client.call_tool("up_adjust", {"counter": "c_a", "delta": 3})
            read = await client.call_tool("up_lookup", {"key": "k1"})
        assert first.is_error is False and first.structured_content == {"counter": "c_a", "value": 2}
        assert second.structured_content == {"counter": "c_a", "value": 5}
        assert read.structured_content == {"key": "k1", "value": "value-of-k1"}
        assert upstream.state.count("adjust") == 2
        forwarded = upstream.state.executions[0]["headers"]
        assert forwarded["x-toolproxy-subject"] == "dev-user"
        assert forwarded["x-toolproxy-tenant"] == "acme"
        assert forwarded["x-toolproxy-agent"] == "dev-agent"
        assert forwarded["x-request-id"] == "req-e2e"
        assert forwarded["x-call-id"].startswith("mcp-")
        assert forwarded["traceparent"].startswith("00-")
        assert 0 < int(forwarded["x-request-timeout-ms"]) <= 5000
        assert forwarded["accept"] == "application/json, text/event-stream"
        # The upstream can prove the proxy sent it: a call token for the contract, its upstream tool and arguments.
        for execution in upstream.state.executions:
            token = execution["headers"]["txn-token"]
            keys = jwt.PyJWKSet.from_dict(stack.runtime.call_tokens.jwks)
            contract = stack.runtime.registry.resolve(jwt.decode(token, options={"verify_signature": False})["tctx"]["tool"])
            claims = jwt.decode(token, keys[jwt.get_unverified_header(token)["kid"]].key, algorithms=["EdDSA", "ES256"],
                                audience=stack.runtime.call_tokens.audience(contract.backend))
            assert jwt.get_unverified_header(token)["typ"] == "txntoken+jwt"
            assert claims["tctx"]["mcp_tool"] == execution["tool"] == contract.backend.tool
            assert claims["tctx"]["args_hash"] == hashlib.sha256(canonical_json(execution["arguments"])).hexdigest()
        # One upstream session served all three calls.
        assert upstream.state.handshakes() == 1


async def test_stateless_calls_are_plain_posts_over_the_hot_path_wire(tmp_path, proxy_deps):
    """A 2026-07-28 upstream gets each tools/call as one POST over the proxy's own wire (``proxy.wire.http``, no
    SDK client stack per call) carrying the SDK's own routing headers."""
    async with mcp_stack(tmp_path, proxy_deps) as (stack, upstream):
        for i in range(3):
            status, env = await stack.call("up_lookup", {"key": f"k{i}"})
            assert (status, env["outcome"], env["data"]) == (200, "succeeded", {"key": f"k{i}", "value": f"value-of-k{i}"})
        posts = [r for r in upstream.state.http if r["mcp_method"] == "tools/call"]
        assert [r["user_agent"].startswith("toolproxy/") for r in posts] == [True, True, True]
        assert upstream.state.count("lookup") == 3 and upstream.state.handshakes() == 1


async def test_an_upstream_answering_with_sse_is_read_then_handed_to_the_sdk(tmp_path, proxy_deps, monkeypatch):
    """The upstream's own SSE mode commits to a stream when a handler runs past its ping interval (shortened
    here): the plain POST reads the pings and the answer, and later calls to it go through the SDK client."""
    import mcp.server._streamable_http_modern as modern
    monkeypatch.setattr(modern, "_SSE_PING_INTERVAL", 0.1)
    async with mcp_stack(tmp_path, proxy_deps, json_response=False) as (stack, upstream):
        status, env = await stack.call("up_slow_write", {"seconds": 0.5}, headers={"X-Run-Id": "run-sse-1"})
        assert (status, env["outcome"], env["data"]) == (200, "succeeded", {"counter": "slow", "value": 1}), env
        status, env = await stack.call("up_slow_write", {"seconds": 0.5}, headers={"X-Run-Id": "run-sse-2"})
        assert (status, env["outcome"]) == (200, "succeeded"), env
        posts = [r for r in upstream.state.http if r["mcp_method"] == "tools/call"]
        assert [r["user_agent"].startswith("toolproxy/") for r in posts] == [True, False]
        assert upstream.state.count("slow_write") == 2
        # the wire's request is the one the SDK client sends for the same call, but for its JSON-RPC id
        wire_sent, sdk_sent = (json.loads(r["body"]) for r in posts)
        assert {**wire_sent, "id": None} == {**sdk_sent, "id": None}, (wire_sent, sdk_sent)


@pytest.mark.parametrize("upstream_mode", ["auto", "legacy"])
async def test_session_is_reopened_after_the_upstream_restarts(tmp_path, upstream_mode, proxy_deps):
    async with mcp_stack(tmp_path, proxy_deps, upstream_mode=upstream_mode) as (stack, upstream):
        status, env = await stack.call("up_adjust", {"counter": "c_r", "delta": 1}, headers={"X-Run-Id": "run-r1"})
        assert (status, env["outcome"]) == (200, "succeeded")
        await upstream.restart()  # legacy sessions are gone: the old session id now answers 404
        status, env = await stack.call("up_adjust", {"counter": "c_r", "delta": 1}, headers={"X-Run-Id": "run-r2"})
        assert (status, env["outcome"]) == (200, "succeeded"), env
        assert upstream.state.count("adjust") == 2          # each call ran exactly once
        # Legacy: a new session was opened; 2026-07-28 is stateless, nothing to reopen.
        assert upstream.state.handshakes() == (2 if upstream_mode == "legacy" else 1)


async def test_unreachable_upstream_is_not_started_and_recovers(tmp_path, proxy_deps):
    async with mcp_stack(tmp_path, proxy_deps) as (stack, upstream):
        await upstream.stop()
        # Not started: the same business request (same run id) may be retried.
        status, env = await stack.call("up_adjust", {"counter": "c_d", "delta": 1}, headers={"X-Run-Id": "run-d"})
        assert status == 503
        assert env["error"]["code"] == "dependency_unavailable"
        assert env["side_effect"] == {"attempted": False, "committed": False}
        await upstream.start()
        status, env = await stack.call("up_adjust", {"counter": "c_d", "delta": 1}, headers={"X-Run-Id": "run-d"})
        assert (status, env["outcome"]) == (200, "succeeded")
        assert upstream.state.count("adjust") == 1


@pytest.mark.parametrize("upstream_mode", ["auto", "legacy"])
async def test_sent_write_without_answer_is_unknown(tmp_path, upstream_mode, proxy_deps):
    async with mcp_stack(tmp_path, proxy_deps, upstream_mode=upstream_mode) as (stack, upstream):
        # Open the upstream session first, so the budget below is spent waiting for the answer,
        # not on the handshake (on a loaded machine that could leave nothing sent: not started).
        status, env = await stack.call("up_lookup", {"key": "before"})
        assert (status, env["outcome"]) == (200, "succeeded")
        status, env = await stack.call("up_slow_write", {"seconds": 5}, headers={"Request-Timeout": "1.5"})
        assert status == 504
        assert env["error"]["code"] == "timeout_unknown"
        assert env["error"]["resolution"] == "reconcile"
        assert env["side_effect"] == {"attempted": True, "committed": None}
        assert upstream.state.count("slow_write") == 1
        # The session survives an abandoned call.
        status, env = await stack.call("up_lookup", {"key": "after"})
        assert (status, env["outcome"]) == (200, "succeeded")


async def test_upstream_errors_are_classified_without_leaking_text(tmp_path, proxy_deps):
    async with mcp_stack(tmp_path, proxy_deps) as (stack, upstream):
        status, refused = await stack.call("up_refuse", {"counter": "c_x"})
        assert refused["error"]["code"] == "business_rejected"
        assert refused["side_effect"] == {"attempted": True, "committed": False}
        assert refused["error"]["details"]["backend_code"] == "limit_exceeded"
        assert refused["error"]["details"]["field"] == "counter"

        status, crashed = await stack.call("up_crash", {"counter": "c_x"})
        assert crashed["error"]["code"] == "upstream_error_unknown"
        assert crashed["side_effect"] == {"attempted": True, "committed": None}
        assert crashed["outcome"] == "unknown"

        status, strict = await stack.call("up_lookup_strict", {"key": "k"})
        assert strict["error"]["code"] == "output_invalid"   # verified against the registry, not the upstream

        status, missing = await stack.call("up_missing", {"counter": "c_x"})
        assert missing["error"]["code"] == "business_rejected"
        assert missing["side_effect"]["committed"] is False
        for env in (refused, crashed, strict, missing):
            assert_envelope(env)
            text = json.dumps(env)
            assert "db-7.corp" not in text and "secret" not in text


async def test_mcp_front_shows_upstream_failures_as_iserror(tmp_path, proxy_deps):
    async with mcp_stack(tmp_path, proxy_deps) as (stack, upstream):
        async with agent(stack) as client:
            result = await client.call_tool("up_refuse", {"counter": "c_y"})
        assert result.is_error is True
        assert mcp_envelope(result)["error"]["code"] == "business_rejected"
        assert "db-7.corp" not in result.content[0].text


async def test_duplicate_write_reaches_the_upstream_once(tmp_path, proxy_deps):
    async with mcp_stack(tmp_path, proxy_deps, upstream_mode="legacy") as (stack, upstream):
        # Two agent connections (new sessions, new JSON-RPC ids), one business request.
        async with agent(stack, "auto", {"Idempotency-Key": "order-42-adjust"}) as client:
            first = await client.call_tool("up_adjust", {"counter": "c_dup", "delta": 7})
        async with agent(stack, "legacy", {"Idempotency-Key": "order-42-adjust"}) as client:
            second = await client.call_tool("up_adjust", {"counter": "c_dup", "delta": 7})
            conflict = await client.call_tool("up_adjust", {"counter": "c_dup", "delta": 8})
        assert first.is_error is False, first.content
        assert first.structured_content == second.structured_content == {"counter": "c_dup", "value": 7}
        assert upstream.state.count("adjust") == 1
        assert upstream.state.executions[0]["headers"].get("idempotency-key")
        assert conflict.is_error is True
        assert mcp_envelope(conflict)["error"]["code"] == "idempotency_conflict"
        assert upstream.state.count("adjust") == 1
