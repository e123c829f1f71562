"""An MCP upstream behind a static key (credential kinds header, bearer, basic): the proxy attaches the key to
every request of its session and of the stateless hot path, and to the pin watcher's; the key shows nowhere."""

from __future__ import annotations

import base64
import json
import logging

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.support.mcp_upstream import registry_yaml, running_upstream
from tests.support.stack import DEMO_REGISTRY, running_stack

UPSTREAM_KEY = "upstream-static-key-7f3a9c"
PIN = "sha256:" + "0" * 64


def _registry(tmp_path, url: str, *, pinned: bool = False):
    path = tmp_path / "upstream-tools.yaml"
    auth = "auth: upkey, " + ("pin: {definition: \"%s\", tool_list: \"%s\"}, " % (PIN, PIN) if pinned else "")
    path.write_text(registry_yaml(url).replace("{type: mcp, ", "{type: mcp, " + auth))
    return path


@pytest.mark.parametrize("upstream_mode", ["auto", "legacy"])
async def test_a_bearer_key_rides_every_request_to_the_upstream_and_is_never_shown(
        tmp_path, proxy_deps, caplog, upstream_mode):
    key_file = tmp_path / "upkey"
    key_file.write_text(UPSTREAM_KEY + "\n")
    caplog.set_level(logging.DEBUG)
    async with running_upstream(required_authorization=f"Bearer {UPSTREAM_KEY}") as upstream:
        # Without the key the upstream refuses: the key is what the proxy's calls succeed by.
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(10.0)) as http:
            direct = await http.post(upstream.url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                     headers={"accept": "application/json, text/event-stream"})
        assert direct.status_code == 401
        registry = _registry(tmp_path, upstream.url)
        overrides = {**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                     "mcp.upstream_mode": upstream_mode,
                     "credentials": {"upkey": {"kind": "bearer", "secret_file": str(key_file)}}}
        envelopes = []
        async with running_stack(overrides) as stack:
            stack.auto_key = True
            for i in range(2):  # the session's handshake and the calls (plain POSTs on a 2026-07-28 upstream)
                status, env = await stack.call("up_lookup", {"key": f"k{i}"})
                envelopes.append(env)
                assert (status, env["outcome"], env["data"]) == (
                    200, "succeeded", {"key": f"k{i}", "value": f"value-of-k{i}"}), env
            status, env = await stack.call("up_adjust", {"counter": "c_a", "delta": 2})
            envelopes.append(env)
            assert (status, env["outcome"], env["data"]) == (200, "succeeded", {"counter": "c_a", "value": 2}), env
            # Through the proxy's MCP front as well (the agent's request carries no key of its own).
            http = httpx2.AsyncClient(headers={"X-Run-Id": "run-static"}, timeout=httpx2.Timeout(30.0))
            async with Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http)) as client:
                read = await client.call_tool("up_lookup", {"key": "k9"})
            assert read.is_error is False and read.structured_content == {"key": "k9", "value": "value-of-k9"}
            envelopes.append(read.model_dump(mode="json"))
            async with stack.session.get(stack.ops_url + "/metrics") as response:
                metrics = await response.text()
        assert upstream.state.count("lookup") == 3 and upstream.state.count("adjust") == 1
        sent = [r["authorization"] for r in upstream.state.http]
        assert sent and set(sent) == {f"Bearer {UPSTREAM_KEY}"}  # every request that reached the server
        if upstream_mode == "auto":
            # The stateless hot path: plain POSTs over the proxy's own wire, carrying the key too.
            assert any(r["mcp_method"] == "tools/call" and r["user_agent"].startswith("toolproxy/")
                       for r in upstream.state.http)
    seen = json.dumps(envelopes) + caplog.text + metrics
    assert UPSTREAM_KEY not in seen


@pytest.mark.parametrize("kind, extra", [("header", {"header": "X-Api-Key"}), ("basic", {"username": "toolproxy"})])
async def test_header_and_basic_keys_reach_the_upstream(tmp_path, proxy_deps, kind, extra):
    key_file = tmp_path / "upkey"
    key_file.write_text(UPSTREAM_KEY)
    async with running_upstream() as upstream:
        overrides = {**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(_registry(tmp_path, upstream.url))],
                     "credentials": {"upkey": {"kind": kind, "secret_file": str(key_file), **extra}}}
        async with running_stack(overrides) as stack:
            status, env = await stack.call("up_lookup", {"key": "k1"})
            assert (status, env["outcome"]) == (200, "succeeded"), env
        execution = upstream.state.executions[0]["headers"]
        if kind == "header":
            assert execution["x-api-key"] == UPSTREAM_KEY
        else:
            pair = base64.b64encode(f"toolproxy:{UPSTREAM_KEY}".encode()).decode()
            assert execution["authorization"] == f"Basic {pair}"


async def test_the_pin_watcher_reaches_a_keyed_upstream(tmp_path, proxy_deps):
    """The pin check lists the upstream's tools with the key: it reaches the upstream and finds the (wrong)
    pins drifted, where without the key it could only report the upstream unverified."""
    key_file = tmp_path / "upkey"
    key_file.write_text(UPSTREAM_KEY)
    async with running_upstream(required_authorization=f"Bearer {UPSTREAM_KEY}") as upstream:
        overrides = {**proxy_deps, "registry.reload_interval_ms": 0,
                     "registry.paths": [str(DEMO_REGISTRY), str(_registry(tmp_path, upstream.url, pinned=True))],
                     "credentials": {"upkey": {"kind": "bearer", "secret_file": str(key_file)}}}
        async with running_stack(overrides) as stack:
            states = {row["tool"]: row["state"] for row in stack.runtime.pins.rows()}
            assert states["up_lookup"] == "drifted", states
        assert upstream.state.http and {r["authorization"] for r in upstream.state.http} == {f"Bearer {UPSTREAM_KEY}"}


def test_a_kind_that_cannot_ride_an_mcp_upstream_is_refused_with_the_fix(tmp_path):
    from types import SimpleNamespace

    from proxy.credentials.references import check_references
    from proxy.registry import RegistryError, load_registry

    path = _registry(tmp_path, "https://mcp.example/mcp")
    entry = SimpleNamespace(kind="client_credentials", tls_cert_file="", tls_ca_file="", resource="", audience="")
    with pytest.raises(RegistryError, match="kind client_credentials cannot ride an MCP upstream; give it a "
                                            "credential of kind mcp_client_credentials"):
        check_references(load_registry([str(path)]), {"upkey": entry}, {})
    check_references(load_registry([str(path)]), {"upkey": SimpleNamespace(**{**vars(entry), "kind": "bearer"})}, {})
    exchange = SimpleNamespace(**{**vars(entry), "kind": "token_exchange"})
    # On behalf of the caller: an upstream reached by URL has no service name to stand for its audience.
    with pytest.raises(RegistryError, match="needs the upstream's audience; set credentials.upkey.audience"):
        check_references(load_registry([str(path)]), {"upkey": exchange}, {})
    exchange = SimpleNamespace(**{**vars(exchange), "audience": "mcp-crm"})
    check_references(load_registry([str(path)]), {"upkey": exchange}, {})
    with pytest.raises(RegistryError, match="a pinned tool .* is checked with no caller, and a token_exchange"):
        check_references(load_registry([str(_registry(tmp_path, "https://mcp.example/mcp", pinned=True))]),
                         {"upkey": exchange}, {})
    with pytest.raises(RegistryError, match="kind tls cannot ride an MCP upstream"):
        check_references(load_registry([str(path)]), {"upkey": SimpleNamespace(**{**vars(entry), "kind": "tls"})},
                         {})
    tls = SimpleNamespace(**{**vars(entry), "kind": "bearer", "tls_ca_file": "/etc/ca.pem"})
    with pytest.raises(RegistryError, match="reached without the credential's TLS settings; remove"):
        check_references(load_registry([str(path)]), {"upkey": tls}, {})
    oauth_tls = SimpleNamespace(**{**vars(entry), "kind": "mcp_client_credentials", "tls_cert_file": "/etc/c.pem"})
    with pytest.raises(RegistryError, match="reached without the credential's TLS settings; remove"):
        check_references(load_registry([str(path)]), {"upkey": oauth_tls}, {})
