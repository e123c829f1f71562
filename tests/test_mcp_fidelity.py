"""MCP gateway fidelity (issue 13): the ecosystem's clients and servers work through toolproxy
unchanged. One regression test per observed problem, against real processes: the TypeScript SDK
client (Node, tests/node/ts_client.mjs), the Python `mcp` SDK, real upstream MCP servers, the
`toolproxy` CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest
from mcp import Client

from tests.support.mcp_upstream import Upstream, conformance_registry_yaml, running_upstream
from tests.support.node import ts_client
from tests.support.servers import free_port, stop_group
from tests.support.stack import DEMO_REGISTRY, Stack, assert_envelope, mcp_envelope, running_stack
from tests.support.waits import wait_until

REPO = Path(__file__).resolve().parents[1]
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
CONTENT_TOOLS = ("test_simple_text", "test_image_content", "test_audio_content", "test_embedded_resource",
                 "test_multiple_content_types")
LEAKY = """
tools:
  - name: up_leaky
    version: "1.0.0"
    description: An upstream read whose output carries a key the schema does not declare.
    mode: read
    risk: read
    inputSchema: {type: object, additionalProperties: false, properties: {}}
    outputSchema:
      type: object
      additionalProperties: false
      required: [order_id]
      properties: {order_id: {type: string}}
    backend: {type: mcp, url: "URL", tool: leaky}
"""


@contextlib.asynccontextmanager
async def upstream_stack(tmp_path: Path, deps: dict[str, Any], overrides: dict[str, Any] | None = None,
                         json_response: bool = True, conformance: bool = True) -> AsyncIterator[tuple[Stack, Upstream]]:
    """The demo stack plus a real upstream MCP server whose conformance tools (and up_leaky) are registered."""
    async with running_upstream(json_response=json_response) as upstream:
        registry = tmp_path / "upstream.yaml"
        leaky = LEAKY.replace("URL", upstream.url)
        registry.write_text(conformance_registry_yaml(upstream.url) + leaky.split("tools:\n", 1)[1]
                            if conformance else leaky)
        async with running_stack({**deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  **(overrides or {})}) as stack:
            yield stack, upstream


async def raw(stack: Stack, body: Any, headers: dict[str, str] | None = None,
              method: str = "POST") -> tuple[int, dict[str, str], Any]:
    async with stack.session.request(method, stack.proxy_url + "/mcp", data=json.dumps(body).encode(),
                                     headers={**ACCEPT, **(headers or {})}) as response:
        text = await response.text()
        payload = json.loads(text) if response.content_type == "application/json" else text
        return response.status, dict(response.headers), payload


async def initialize(stack: Stack, version: str) -> dict[str, str]:
    status, headers, body = await raw(stack, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
    assert status == 200 and body["result"]["protocolVersion"] == version
    return {"Mcp-Session-Id": headers["Mcp-Session-Id"]}


# -- 1. failures reach TypeScript-SDK clients as isError results, not exceptions --------------


async def test_typescript_sdk_client_gets_the_proxys_message_for_every_failure(proxy_deps):
    """Every failed call of a tool with an outputSchema: isError + text, envelope in _meta.

    On main the envelope sat in structuredContent and the SDK threw McpError -32602
    ("Structured content does not match the tool's output schema")."""
    async with running_stack(proxy_deps) as stack:
        report = await ts_client(stack.proxy_url + "/mcp", [
            {"name": "get_order", "arguments": {"order_id": "ord_1001"}},                     # read
            {"name": "refund_order", "arguments": {"order_id": "ord_1001", "amount": "100",
                                                   "reason": "dup"}},                        # schema_violation
            {"name": "get_order", "arguments": {"order_id": "ord_2001"}},                     # other tenant
            {"name": "delete_customer", "arguments": {"customer_id": "cus_1001"}},           # destructive
            {"name": "no_such_tool", "arguments": {}},
        ], headers={"X-Run-Id": "run-ts-1"})  # the run identity makes writes one operation each
    listed = {t["name"]: t for t in report["tools"]}
    assert "outputSchema" in listed["refund_order"] and "outputSchema" in listed["get_order"]
    calls, unknown = report["calls"][:-1], report["calls"][-1]
    assert all(c["ok"] for c in calls), [c.get("error") for c in calls]
    # An unknown tool is the protocol error every revision's tools page names (-32602), which the SDK throws.
    assert unknown["ok"] is False and unknown["error"]["code"] == -32602, unknown
    assert "Unknown tool: no_such_tool" in unknown["error"]["message"]
    ok = calls[0]["result"]
    assert ok["isError"] is False and ok["structuredContent"]["order_id"] == "ord_1001"
    codes = []
    for call in calls[1:]:
        envelope = mcp_envelope(call["result"])
        codes.append(envelope["error"]["code"])
        assert call["result"]["content"][0]["text"].startswith(envelope["error"]["code"] + ": ")
    assert codes == ["schema_violation", "forbidden", "approval_required"]
    assert not [r for r in stack.backend.requests if r["tool"] in ("refund_order", "delete_customer")]


# -- 2. every content block type passes through from MCP upstreams --------------------------


async def test_upstream_content_blocks_pass_through_unchanged(tmp_path, proxy_deps):
    """Text, image, audio, embedded resources and resource links arrive as the upstream sent them.

    On main each was output_invalid ("no structured JSON result") with the effect marked attempted."""
    async with upstream_stack(tmp_path, proxy_deps) as (stack, upstream):
        async with Client(upstream.url, mode="legacy") as direct, \
                Client(stack.proxy_url + "/mcp", mode="legacy") as proxied:
            listed = {t.name: t for t in (await proxied.list_tools()).tools}
            for name in CONTENT_TOOLS:
                assert listed[name].output_schema is None  # the contract declares none: none advertised
                want = await direct.call_tool(name, {})
                got = await proxied.call_tool(name, {})
                assert got.is_error is False, got
                assert [b.model_dump(by_alias=True, exclude_none=True) for b in got.content] == \
                    [b.model_dump(by_alias=True, exclude_none=True) for b in want.content]
                assert got.structured_content is None
            failed = await proxied.call_tool("test_error_handling", {})
        # The upstream's isError stays its business failure; its text is not passed on.
        envelope = mcp_envelope(failed)
        assert envelope["error"]["code"] == "business_rejected"
        assert envelope["side_effect"] == {"attempted": True, "committed": False}

        # The JSON API: non-JSON content appears in data as {"content": [MCP content blocks]}.
        status, env = await stack.call("test_multiple_content_types", {})
        assert status == 200 and env["outcome"] == "succeeded", env
        assert_envelope(env)
        assert [b["type"] for b in env["data"]["content"]] == ["text", "image", "resource", "resource_link"]
        assert env["data"]["content"][1]["mimeType"] == "image/png" and env["data"]["content"][1]["data"]
        status, body = await stack.post("/v1/openai/tool-calls", {"tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "test_audio_content", "arguments": "{}"}}]})
        assert status == 200, body
        message = json.loads(body["messages"][0]["content"])   # the OpenAI tool message: the model's view
        assert message["data"]["content"][0]["type"] == "audio"
        assert message["data"]["content"][0]["mimeType"] == "audio/wav"


async def test_response_size_limit_still_applies_to_content(tmp_path, proxy_deps):
    async with upstream_stack(tmp_path, proxy_deps, {"backends.max_response_bytes": 64}) as (stack, _):
        status, env = await stack.call("test_image_content", {})
        assert env["error"]["code"] == "output_invalid" and env["error"]["details"]["limit_bytes"] == 64


# -- 3. another supported MCP-Protocol-Version on a session is accepted -----------------------
# (tests/test_mcp_front.py::test_legacy_sessions_lifecycle asserts it; the conformance suite's
#  server-sse-multiple-streams scenario exercises it in tests/test_mcp_conformance.py)


# -- 4. Host / Origin validation (DNS rebinding) -------------------------------------------------


async def test_foreign_host_or_origin_is_refused_on_every_method(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        session = await initialize(stack, "2025-11-25")
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "get_order", "arguments": {"order_id": "ord_1001"}}}
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "x", "version": "0"}}}
        for evil in ({"Host": "evil.example.com"}, {"Origin": "http://evil.example.com"},
                     {"Host": "evil.example.com", "Origin": "http://evil.example.com"},
                     {"Host": "localhost.evil.example.com:8787"}):
            for method, body, headers in (("POST", init, {}), ("POST", call, session), ("GET", None, session),
                                          ("DELETE", None, session)):
                status, _, answer = await raw(stack, body, {**headers, **evil}, method)
                assert status == 403, (method, evil)
                assert answer["jsonrpc"] == "2.0" and answer["error"]["code"] == -32000
                assert answer["error"]["data"] == {"code": "origin_not_allowed"}
        assert not [r for r in stack.backend.requests if r["tool"] == "get_order"]
        # Loopback names with any port, and a loopback Origin, are the default allow-list.
        for good in ({"Host": "localhost:9"}, {"Host": "[::1]:8787"}, {"Origin": "http://localhost:5173"},
                     {"Origin": "http://127.0.0.1:6274"}):
            status, _, answer = await raw(stack, call, {**session, **good})
            assert status == 200 and answer["result"]["isError"] is False, good

    async with running_stack({**proxy_deps, "mcp.allowed_hosts": ["tools.internal:8787"],
                              "mcp.allowed_origins": ["https://agent.example"]}) as stack:
        status, _, _ = await raw(stack, init, {"Host": "tools.internal:8787", "Origin": "https://agent.example"})
        assert status == 200
        for bad in ({"Host": "tools.internal:9999"}, {"Origin": "http://agent.example"}):
            status, _, _ = await raw(stack, init, {"Host": "tools.internal:8787", **bad})
            assert status == 403, bad


# -- 5. JSON-RPC batches on 2025-03-26 sessions ----------------------------------------------------


async def test_batches_are_answered_on_2025_03_26_sessions_only(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        session = await initialize(stack, "2025-03-26")
        batch = [{"jsonrpc": "2.0", "method": "notifications/initialized"},
                 {"jsonrpc": "2.0", "id": "p", "method": "ping"},
                 {"jsonrpc": "2.0", "id": "l", "method": "tools/list"},
                 {"jsonrpc": "2.0", "id": "c", "method": "tools/call",
                  "params": {"name": "get_order", "arguments": {"order_id": "ord_1001"}}},
                 {"jsonrpc": "2.0", "id": "x", "method": "prompts/list"},
                 {"jsonrpc": "2.0", "id": "i", "method": "initialize", "params": {}}]
        status, _, answers = await raw(stack, batch, session)
        assert status == 200 and isinstance(answers, list)
        by_id = {a["id"]: a for a in answers}
        assert sorted(by_id) == ["c", "i", "l", "p", "x"]
        assert by_id["p"]["result"] == {}
        assert len(by_id["l"]["result"]["tools"]) == len(stack.runtime.registry.active())
        assert by_id["c"]["result"]["structuredContent"]["order_id"] == "ord_1001"
        assert by_id["x"]["error"]["code"] == -32601
        assert by_id["i"]["error"]["code"] == -32600
        status, _, _ = await raw(stack, [{"jsonrpc": "2.0", "method": "notifications/initialized"}], session)
        assert status == 202

        later = await initialize(stack, "2025-11-25")
        status, _, answer = await raw(stack, batch[1:3], later)
        assert status == 400 and answer["error"]["code"] == -32600


# -- 6. outputSchema: only what the contract declares and the revision can carry ---------------


async def test_no_output_schema_is_advertised_when_the_contract_has_none(tmp_path, proxy_deps):
    async with upstream_stack(tmp_path, proxy_deps) as (stack, _):
        modern_meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                       "io.modelcontextprotocol/clientCapabilities": {},
                       "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"}}
        status, _, body = await raw(stack, {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
                                            "params": {"_meta": modern_meta}},
                                    {"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/list"})
        assert status == 200
        tools = {t["name"]: t for t in body["result"]["tools"]}
        assert "outputSchema" not in tools["test_simple_text"]
        assert tools["get_order"]["outputSchema"]["type"] == "object"
        assert all(t.get("outputSchema", {"type": "object"})["type"] == "object" for t in tools.values())


@pytest.mark.parametrize("schema", ["{}", "{type: array, items: {type: string}}"])
def test_check_registry_refuses_an_output_schema_mcp_cannot_carry(tmp_path, schema):
    path = tmp_path / "r.yaml"
    path.write_text(f"""
tools:
  - name: t1
    version: "1.0.0"
    description: x
    mode: read
    risk: read
    inputSchema: {{type: object, additionalProperties: false}}
    outputSchema: {schema}
    backend: {{type: mcp, url: "http://127.0.0.1:1/mcp", tool: t1}}
""")
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check-registry", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "outputSchema: must declare type: object" in done.stderr and "t1" in done.stderr
    path.write_text(path.read_text().replace(f"    outputSchema: {schema}\n", ""))
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "check-registry", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- 7. unknown output keys are counted, never named to the model -----------------------------


async def test_output_key_names_do_not_reach_the_model(tmp_path, proxy_deps):
    async with upstream_stack(tmp_path, proxy_deps, conformance=False) as (stack, _):
        status, env = await stack.call("up_leaky", {})
        async with Client(stack.proxy_url + "/mcp", mode="auto") as client:
            result = await client.call_tool("up_leaky", {})
    assert env["error"]["code"] == "output_invalid" and env["error"]["expose_to_model"] is True
    assert env["error"]["details"]["violations"] == [{"path": "$", "keyword": "additionalProperties"}]
    assert env["error"]["details"]["unknown_keys"] == 1
    for text in (json.dumps(env), json.dumps(mcp_envelope(result)), result.content[0].text):
        assert "Ignore previous" not in text and "refund" not in text


# -- 8. `toolproxy dev` serves the registry and OPA data it is given ---------------------------


@pytest.mark.parametrize("how", ["flags", "config"])
async def test_dev_stack_serves_an_imported_registry(tmp_path, how):
    async with running_upstream() as upstream:
        registry = tmp_path / "my-registry"
        registry.mkdir()
        (registry / "tools.yaml").write_text(conformance_registry_yaml(upstream.url))
        opa_data = tmp_path / "my-data"
        opa_data.mkdir()
        (opa_data / "data.json").write_text((REPO / "examples" / "opa" / "data.json").read_text())
        ports = {name: free_port() for name in ("proxy", "admin", "ops", "redis", "backend")}
        argv = [sys.executable, "-m", "proxy.cli", "dev", *[f"--{n}-port={p}" for n, p in ports.items()],
                "--opa-data", str(opa_data)]
        if how == "flags":
            argv += ["--registry", str(registry)]
        else:
            config = tmp_path / "my.yaml"
            config.write_text(f"registry:\n  paths: [{registry}]\n")
            argv += ["-c", str(config)]
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{ports['proxy']}"
            async with aiohttp.ClientSession() as http:
                async def ready() -> bool:
                    assert proc.poll() is None, proc.stdout.read().decode()[-3000:] if proc.stdout else ""
                    try:
                        async with http.get(f"http://127.0.0.1:{ports['ops']}/readyz") as response:
                            return response.status == 200
                    except aiohttp.ClientError:
                        return False
                await wait_until(ready, timeout=60, what="toolproxy dev ready", interval=0.1)
                async with http.post(base + "/v1/tool-calls", json={
                        "call_id": "c1", "tool": "test_simple_text", "arguments": {}}) as response:
                    env = await response.json()
                async with http.get(base + "/v1/tools") as response:
                    names = {t["name"] for t in (await response.json())["tools"]}
            assert env["outcome"] == "succeeded", env
            assert env["data"]["content"][0]["text"] == "This is a simple text response for testing."
            assert "json_schema_2020_12_tool" in names and "get_order" not in names
        finally:
            stop_group(proc)


# -- progress: an upstream's progress numbers reach the client on the call's SSE stream ----------


@pytest.mark.parametrize("upstream_mode", ["auto", "legacy"])
async def test_upstream_progress_reaches_the_client_without_its_text(tmp_path, proxy_deps, upstream_mode):
    async with upstream_stack(tmp_path, proxy_deps, {"mcp.upstream_mode": upstream_mode},
                              json_response=False) as (stack, _):
        session = await initialize(stack, "2025-11-25")
        call = {"jsonrpc": "2.0", "id": "c1", "method": "tools/call", "params": {
            "name": "test_tool_with_progress", "arguments": {}, "_meta": {"progressToken": "tok-1"}}}
        status, headers, text = await raw(stack, call, session)
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
        progress = [e["params"] for e in events if e.get("method") == "notifications/progress"]
        assert progress == [{"progressToken": "tok-1", "progress": p, "total": 100} for p in (0, 50, 100)]
        assert events[-1]["id"] == "c1" and events[-1]["result"]["content"][0]["text"] == "Progress test completed"
        assert "Ignore previous" not in text
        # Without a progress token the same call is one JSON answer.
        del call["params"]["_meta"]
        status, headers, body = await raw(stack, call, session)
        assert status == 200 and body["result"]["isError"] is False


# -- cancellation: withdrawn before sending -> cancelled; already sent -> its real outcome -------


async def test_cancelled_calls_have_honest_outcomes(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        await stack.fault("adjust_counter", "slow", delay_ms=1500)
        session = await initialize(stack, "2025-11-25")
        headers = {**session, "Accept": "application/json"}

        def call(rpc_id: str, delta: int) -> dict[str, Any]:
            return {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
                    "params": {"name": "adjust_counter", "arguments": {"counter": "ctr_cancel", "delta": delta},
                               "_meta": {"io.toolproxy/idempotency-key": f"cancel-{rpc_id}"}}}  # writes need a key

        def allowed() -> float:
            return stack.runtime.metrics.registry.get_sample_value(
                "toolproxy_policy_decisions_total", {"result": "allow"}) or 0.0

        before = allowed()
        sent = asyncio.create_task(raw(stack, call("a", 1), headers))
        await wait_until(lambda: any(r["tool"] == "adjust_counter" for r in stack.backend.requests),
                         timeout=10, what="the first call at the backend")
        waiting = asyncio.create_task(raw(stack, call("b", 2), headers))  # waits for ctr_cancel's lock
        await wait_until(lambda: allowed() >= before + 2, timeout=10, what="the second call authorized")
        for rpc_id in ("a", "b"):
            status, _, _ = await raw(stack, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                                             "params": {"requestId": rpc_id, "reason": "user stopped"}}, headers)
            assert status == 202
        (_, _, first), (_, _, second) = await asyncio.gather(sent, waiting)
    # Already sent: never assumed cancelled; it ran and says so.
    assert first["result"]["isError"] is False and first["result"]["structuredContent"]["value"] == 1
    # Not yet sent: withdrawn, provably without effect.
    envelope = mcp_envelope(second["result"])
    assert envelope["error"]["code"] == "cancelled" and envelope["outcome"] == "cancelled"
    assert envelope["side_effect"] == {"attempted": False, "committed": False}
    assert len([r for r in stack.backend.requests if r["tool"] == "adjust_counter"]) == 1
