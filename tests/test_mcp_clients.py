"""Acceptance: the clients people run, unchanged, against /mcp — the Inspector CLI (npm
@modelcontextprotocol/inspector --cli), the older Inspector CLI (npm @modelcontextprotocol/inspector-cli,
the v1 line), the Python `mcp` SDK in default (auto) and legacy modes and
openai-agents' MCPServerStreamableHttp (no model needed). Each lists the tools, calls a read, and
gets a schema violation, a forbidden and an approval_required as the proxy's message in an isError
result — never as a client-side exception; an unknown tool is the JSON-RPC error -32602 every MCP
revision's tools page names, which each client reports as the protocol error it is.
(The TypeScript SDK client runs the same matrix in tests/test_mcp_fidelity.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from mcp.shared.exceptions import MCPError

from tests.support.node import BIN, run, tool
from tests.support.stack import mcp_envelope, running_stack

HEADERS = {"X-Run-Id": "run-clients-1"}  # the run identity makes each write its own operation
READ = ("get_order", {"order_id": "ord_1001"})
FAILURES = [("refund_order", {"order_id": "ord_1001", "amount": "lots", "reason": "dup"}, "schema_violation"),
            ("get_order", {"order_id": "ord_2001"}, "forbidden"),               # another tenant's order
            ("delete_customer", {"customer_id": "cus_1001"}, "approval_required")]  # risk: destructive
UNKNOWN = "no_such_tool"  # answered -32602 "Unknown tool: no_such_tool" (a protocol error, not a result)


def check_failure(result: dict[str, Any], code: str) -> None:
    envelope = mcp_envelope(result)
    assert envelope["error"]["code"] == code
    assert result["content"][0]["type"] == "text" and result["content"][0]["text"].startswith(code + ": ")


async def check_cli_matrix(stack: Any, inspector: Any, failures: list[tuple[str, dict[str, str], str]]) -> None:
    """An Inspector CLI (``inspector(*args, failed=...)`` -> its JSON output) lists the registry's tools,
    reads, and shows each of ``failures`` as the proxy's isError result."""
    listed = await inspector("--method", "tools/list", failed=False)
    assert {t["name"] for t in listed["tools"]} == {t.name for t in stack.runtime.registry.active()}
    for name, arguments, code in [(*READ, None), *failures]:
        pairs = [f"{k}={v}" for k, v in arguments.items()]
        result = await inspector("--method", "tools/call", "--tool-name", name,
                                 *(["--tool-arg", *pairs] if pairs else []), failed=code is not None)
        if code is None:
            assert result["isError"] is False and result["structuredContent"]["order_id"] == "ord_1001"
        else:
            check_failure(result, code)


async def test_inspector_cli(proxy_deps, tmp_path):
    async with running_stack(proxy_deps) as stack:
        url = stack.proxy_url + "/mcp"
        base = [tool("mcp-inspector"), "--cli", url, "--transport", "http",
                "--header", *[f"{k}: {v}" for k, v in HEADERS.items()]]
        env = {"MCP_CATALOG_PATH": str(tmp_path / "catalog.json"), "HOME": str(tmp_path)}

        async def inspector(*args: str, failed: bool) -> dict[str, Any]:
            code, out, err = await run(*base, *args, env=env, timeout_s=90)
            # It prints an isError result and exits 5 ("tool_is_error"), not a protocol error.
            assert code == (5 if failed else 0), (args, out[-2000:], err[-2000:])
            assert out.strip(), (args, code, err[-2000:])
            return json.loads(out)

        await check_cli_matrix(stack, inspector, FAILURES)
        # The CLI itself refuses a tool the listing does not name (it never sends the call).
        code, out, err = await run(*base, "--method", "tools/call", "--tool-name", "no_such_tool", env=env,
                                   timeout_s=90)
        assert (code, json.loads(err)["error"]["code"]) == (5, "tool_not_found")


async def test_older_inspector_cli(proxy_deps):
    """npm @modelcontextprotocol/inspector-cli 1.0.3 (`mcp-inspector-cli --cli URL --transport http`)."""
    async with running_stack(proxy_deps) as stack:
        base = [tool("mcp-inspector-cli"), "--cli", stack.proxy_url + "/mcp", "--transport", "http",
                "--header", *[f"{k}: {v}" for k, v in HEADERS.items()]]
        # 1.0.3 checks fs.existsSync("../package.json") against the working directory but imports it
        # relative to its own module: it only starts from a directory whose parent holds its package.json.
        cwd = BIN.parent / "@modelcontextprotocol" / "inspector-cli" / "build"

        async def inspector(*args: str, failed: bool) -> dict[str, Any]:
            code, out, err = await run(*base, *args, cwd=cwd, timeout_s=90)
            assert code == 0, (args, out[-2000:], err[-2000:])  # it exits 0 on an isError result too
            return json.loads(out)

        await check_cli_matrix(stack, inspector, FAILURES)
        # It sends a call for a tool the listing does not name: the answer is the protocol error.
        code, out, err = await run(*base, "--method", "tools/call", "--tool-name", UNKNOWN, cwd=cwd, timeout_s=90)
        assert "-32602" in out + err and "Unknown tool: no_such_tool" in out + err, (code, out[-2000:], err[-2000:])


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_python_sdk(mode, proxy_deps):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async with running_stack(proxy_deps) as stack:
        http = httpx2.AsyncClient(headers=HEADERS, timeout=httpx2.Timeout(30.0))
        async with Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http), mode=mode) as client:
            assert {t.name for t in (await client.list_tools()).tools} == \
                {t.name for t in stack.runtime.registry.active()}
            ok = await client.call_tool(*READ)
            assert ok.is_error is False and ok.structured_content["order_id"] == "ord_1001"
            for name, arguments, code in FAILURES:
                result = await client.call_tool(name, arguments)
                check_failure(result.model_dump(by_alias=True, exclude_none=True), code)
            with pytest.raises(MCPError) as unknown:
                await client.call_tool(UNKNOWN, {})
            assert unknown.value.error.code == -32602 and unknown.value.error.data["code"] == "tool_not_found"
            with pytest.raises(MCPError) as misspelled:  # a listed tool, misspelled: the hint names it
                await client.call_tool("get_ordr", {"order_id": "ord_1001"})
            assert misspelled.value.error.data["did_you_mean"] == "get_order"
            assert misspelled.value.error.message.endswith('Did you mean "get_order"?')


async def test_openai_agents_mcp_server_streamable_http(proxy_deps):
    from agents.mcp import MCPServerStreamableHttp

    async with running_stack(proxy_deps) as stack:
        server = MCPServerStreamableHttp(params={"url": stack.proxy_url + "/mcp", "headers": HEADERS},
                                         cache_tools_list=False, client_session_timeout_seconds=30)
        async with server:
            names = {t.name for t in await server.list_tools()}
            assert names == {t.name for t in stack.runtime.registry.active()}
            ok = await server.call_tool(*READ)
            assert ok.is_error is False and ok.structured_content["order_id"] == "ord_1001"
            for name, arguments, code in FAILURES:
                result = await server.call_tool(name, arguments)
                check_failure(result.model_dump(by_alias=True, exclude_none=True), code)
            with pytest.raises(Exception) as unknown:  # the SDK's protocol error, however the framework wraps it
                await server.call_tool(UNKNOWN, {})
            assert "Unknown tool: no_such_tool" in repr(unknown.value) + str(unknown.value.__cause__ or "")
