"""Acceptance: `@modelcontextprotocol/server-everything` (npm, Streamable HTTP) behind toolproxy.

`toolproxy import-mcp` drafts its registry, a reviewer keeps four tools as reads, and `echo`,
`get-sum`, `get-tiny-image` and `get-structured-content` called through toolproxy by the Python
and the TypeScript SDK clients return what they return when called directly; tools left out of
the registry stay refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import yaml
from mcp import Client
from mcp.shared.exceptions import MCPError

from tests.support.node import node_env, tool, ts_client
from tests.support.servers import free_port
from tests.support.stack import DEMO_REGISTRY, running_stack
from tests.support.waits import wait_until

REPO = Path(__file__).resolve().parents[1]
KEPT = ("echo", "get-sum", "get-tiny-image", "get-structured-content")
CALLS = [{"name": "echo", "arguments": {"message": "hello through toolproxy"}},
         {"name": "get-sum", "arguments": {"a": 2, "b": 40}},
         {"name": "get-tiny-image", "arguments": {}},
         {"name": "get-structured-content", "arguments": {"location": "Chicago"}}]


@contextlib.asynccontextmanager
async def everything() -> AsyncIterator[str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(tool("mcp-server-everything"), "streamableHttp",
                                                env=node_env({"PORT": str(port)}),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        async def listening() -> bool:
            assert proc.returncode is None, "server-everything exited"
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            return True
        await wait_until(listening, timeout=30, what="server-everything listening", interval=0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def review(draft: str) -> str:
    """What the reviewer does: keep four tools, mark them reads (they change nothing)."""
    document = yaml.safe_load(draft)
    kept = []
    for entry in document["tools"]:
        if entry["name"] in KEPT:
            entry.update(mode="read", risk="read")
            entry.pop("idempotency", None)
            kept.append(entry)
    return yaml.safe_dump({"tools": kept}, sort_keys=False)


def blocks(result: Any) -> list[dict[str, Any]]:
    return [b.model_dump(by_alias=True, exclude_none=True) for b in result.content]


async def test_server_everything_behind_toolproxy(tmp_path, proxy_deps):
    async with everything() as upstream:
        drafted = subprocess.run([sys.executable, "-m", "proxy.cli", "import-mcp", upstream], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
        assert drafted.returncode == 0, drafted.stderr
        registry = tmp_path / "everything.yaml"
        registry.write_text(review(drafted.stdout))
        checked = subprocess.run([sys.executable, "-m", "proxy.cli", "check-registry", str(registry)], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stderr

        async with running_stack({**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)]}) as stack:
            proxy = stack.proxy_url + "/mcp"
            async with Client(upstream, mode="legacy") as direct, Client(proxy, mode="auto") as proxied:
                for call in CALLS:
                    want = await direct.call_tool(call["name"], call["arguments"])
                    got = await proxied.call_tool(call["name"], call["arguments"])
                    assert got.is_error is False and want.is_error is False, (call, got)
                    assert got.structured_content == want.structured_content, call
                    if want.structured_content is None:
                        assert blocks(got) == blocks(want), call
                    else:  # the JSON text block: the same document
                        assert json.loads(got.content[0].text) == want.structured_content
                with pytest.raises(MCPError) as refused:  # not in the registry: an unknown tool (-32602)
                    await proxied.call_tool("get-env", {})
                assert refused.value.error.code == -32602 and refused.value.error.data["code"] == "tool_not_found"

            ts_direct = await ts_client(upstream, CALLS)
            ts_proxied = await ts_client(proxy, [*CALLS, {"name": "get-env", "arguments": {}}])
    assert sorted(t["name"] for t in ts_proxied["tools"] if t["name"] in KEPT) == sorted(KEPT)
    assert "get-env" not in {t["name"] for t in ts_proxied["tools"]}
    for want, got in zip(ts_direct["calls"], ts_proxied["calls"][:-1]):
        assert want["ok"] and got["ok"], (want, got)
        assert got["result"].get("structuredContent") == want["result"].get("structuredContent")
        if "structuredContent" not in want["result"]:
            assert got["result"]["content"] == want["result"]["content"]
    refused = ts_proxied["calls"][-1]
    assert refused["ok"] is False and refused["error"]["code"] == -32602, refused
