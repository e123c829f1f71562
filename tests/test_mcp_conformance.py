"""Acceptance: the official MCP conformance suite (npm @modelcontextprotocol/conformance, pinned in
tests/node/package-lock.json) runs its server scenarios against toolproxy's /mcp.

toolproxy fronts a real upstream MCP server (tests/support/mcp_upstream.py) implementing the
suite's test tools, registered in the registry and allowed by the demo policy. The scenarios whose
upstream asks the client back (sampling, elicitation) run over both upstream revisions: 2026-07-28
(InputRequiredResult rounds) and a legacy session (mid-call requests). Every tools-* scenario
passes, tools-call-with-logging included (the upstream's log messages of the call are relayed at the
level set by logging/setLevel, tests/test_mcp_logging.py). Scenarios for features a tools gateway
does not offer (prompts, resources, completion) are asserted to answer -32601 instead (docs/mcp.md
lists them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.mcp_upstream import conformance_registry_yaml, running_upstream
from tests.support.node import run, tool
from tests.support.stack import DEMO_REGISTRY, running_stack

# Requests the upstream sends back during the call, relayed to the suite's client (proxy/fronts/mcp/relay.py).
RELAYED = ("tools-call-sampling", "tools-call-elicitation", "elicitation-sep1034-defaults", "elicitation-sep1330-enums")
PASSING = ("server-initialize", "ping", "tools-list", "tools-call-simple-text", "tools-call-image",
           "tools-call-audio", "tools-call-embedded-resource", "tools-call-mixed-content", "tools-call-error",
           "tools-call-with-progress", "logging-set-level", "tools-call-with-logging", *RELAYED,
           "json-schema-2020-12", "server-sse-polling", "server-sse-multiple-streams", "dns-rebinding-protection")


async def scenario(url: str, name: str, out: Path) -> list[dict[str, Any]]:
    code, stdout, stderr = await run(tool("conformance"), "server", "--url", url, "--scenario", name,
                                     "-o", str(out), timeout_s=120)
    checks: list[dict[str, Any]] = []
    for path in sorted(out.rglob("checks.json")):
        checks.extend(json.loads(path.read_text()))
    assert checks, f"{name}: no checks written (exit {code}): {stdout[-1500:]} {stderr[-1500:]}"
    return checks


@pytest.mark.parametrize("upstream_mode,names", [("auto", PASSING), ("legacy", RELAYED)])
async def test_conformance_server_scenarios(tmp_path, proxy_deps, upstream_mode, names):
    async with running_upstream(json_response=False) as upstream:  # SSE: it can send progress and requests
        registry = tmp_path / "conformance.yaml"
        registry.write_text(conformance_registry_yaml(upstream.url))
        async with running_stack({**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  "mcp.upstream_mode": upstream_mode}) as stack:
            url = stack.proxy_url.replace("127.0.0.1", "localhost") + "/mcp"
            failures = {}
            for name in names:
                checks = await scenario(url, name, tmp_path / name)
                bad = [c for c in checks if c.get("status") not in ("SUCCESS", "INFO")]
                if name != "server-sse-polling" and not any(c.get("status") == "SUCCESS" for c in checks):
                    bad.append({"id": name, "status": "NO_SUCCESS"})
                if bad:
                    failures[name] = [(c.get("id"), c.get("status"), c.get("errorMessage")) for c in bad]
            assert not failures, json.dumps(failures, indent=1)[:6000]


# Scenarios of features a tools gateway does not offer: each method answers -32601 (Method not found).
NOT_OFFERED = {
    "prompts-list": ("prompts/list", {}), "prompts-get-simple": ("prompts/get", {"name": "p"}),
    "resources-list": ("resources/list", {}), "resources-read-text": ("resources/read", {"uri": "test://x"}),
    "resources-templates-read": ("resources/templates/list", {}),
    "resources-subscribe": ("resources/subscribe", {"uri": "test://x"}),
    "resources-unsubscribe": ("resources/unsubscribe", {"uri": "test://x"}),
    "completion-complete": ("completion/complete", {"ref": {"type": "ref/prompt", "name": "p"},
                                                    "argument": {"name": "a", "value": "v"}}),
}


@pytest.mark.parametrize("version", ["2025-11-25", "2025-03-26"])
async def test_features_a_tools_gateway_does_not_offer_answer_method_not_found(version, proxy_deps):
    async with running_stack(proxy_deps) as stack:
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}

        async def post(body: dict[str, Any], extra: dict[str, str]) -> tuple[int, dict[str, str], Any]:
            async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(body),
                                          headers={**headers, **extra}) as response:
                return response.status, dict(response.headers), await response.json()

        status, answer_headers, body = await post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "c", "version": "0"}}}, {})
        assert status == 200
        assert set(body["result"]["capabilities"]) == {"tools", "logging"}   # nothing else is advertised
        session = {"Mcp-Session-Id": answer_headers["Mcp-Session-Id"]}
        for n, (method, params) in enumerate(NOT_OFFERED.values()):
            status, _, body = await post({"jsonrpc": "2.0", "id": n + 1, "method": method, "params": params},
                                         session)
            assert (status, body["error"]["code"]) == (200, -32601), (method, body)
