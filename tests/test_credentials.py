"""The proxy holds the backend's credential and attaches it per call; the agent holds none.

Real backends on loopback that want a bearer key, an API key header, basic auth, or mutual TLS with a private CA
made here: a call through the proxy succeeds, the same request without the proxy is refused. A registry naming a
credential the config lacks is refused at start-up and on reload. A token endpoint that misbehaves (slow,
oversized, refusing with a secret in its error body, a token a header cannot carry) costs the call a
``credential_unavailable`` with nothing sent, and none of its words reach the envelope or a log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl

import aiohttp
import pytest
from aiohttp import web

from proxy.registry import RegistryError
from tests.support.credential_backends import KeyBackend, PrivateCA, echo_tool as tool, write_file as write
from tests.support.stack import running_stack

KEY = "sk-canary-5f1e2d3c4b5a69788796a5b4"          # planted: must appear nowhere but at the backend
API_KEY = "ak-canary-0a1b2c3d4e5f60718293"
PASSWORD = "pw-canary-9z8y7x6w5v4u3t2s"
CLIENT_SECRET = "cs-canary-1q2w3e4r5t6y7u8i9o0p"


@pytest.fixture
async def key_backends():
    backends = {"saas": KeyBackend("Authorization", f"Bearer {KEY}"),
                "apikey": KeyBackend("X-API-Key", API_KEY),
                "basic": KeyBackend("Authorization", "Basic " + __import__("base64").b64encode(
                    f"svc:{PASSWORD}".encode()).decode())}
    for backend in backends.values():
        await backend.start()
    try:
        yield backends
    finally:
        for backend in backends.values():
            await backend.stop()


def registry(tmp_path, tools: str) -> dict:
    return {"registry.paths": [write(tmp_path / "tools.yaml", "tools:\n" + tools)]}


async def test_a_keyed_backend_answers_the_proxy_and_refuses_the_same_request_without_it(
        proxy_deps, tmp_path, key_backends):
    credentials = {
        "saas-key": {"kind": "bearer", "secret_file": write(tmp_path / "key", KEY + "\n")},
        "api-key": {"kind": "header", "header": "X-API-Key", "secret_file": write(tmp_path / "ak", API_KEY)},
        "svc-basic": {"kind": "basic", "username": "svc", "secret_file": write(tmp_path / "pw", PASSWORD)},
    }
    overrides = {**proxy_deps, **registry(tmp_path, tool("saas_echo", "saas", "saas-key")
                                          + tool("apikey_echo", "apikey", "api-key")
                                          + tool("basic_echo", "basic", "svc-basic")
                                          + tool("bare_echo", "saas", None)),
                 "backends.services": {name: b.url for name, b in key_backends.items()},
                 "credentials": credentials}
    async with running_stack(overrides) as stack:
        for name in ("saas_echo", "apikey_echo", "basic_echo"):
            status, body = await stack.call(name, {"text": "hello"})
            assert status == 200 and body["outcome"] == "succeeded", body
            assert body["data"]["echo"] == "hello"
        # A contract without auth gets no credential: the backend refuses it, and says so as forbidden.
        status, body = await stack.call("bare_echo", {"text": "hello"})
        assert body["error"]["code"] == "forbidden", body
        # The agent's own request, straight to the backend with everything the agent has: refused.
        saas = key_backends["saas"]
        proxied = saas.seen[0]
        assert proxied["authorization"] == f"Bearer {KEY}" and "txn-token" in proxied
        async with aiohttp.ClientSession() as session:
            async with session.post(saas.url + "/echo", json={"text": "hello"},
                                    headers={"Authorization": "Bearer something-the-agent-has"}) as response:
                assert response.status == 401


async def test_mutual_tls_with_a_private_ca_is_the_proxys_alone(proxy_deps, tmp_path):
    ca = PrivateCA(tmp_path)
    backend = await KeyBackend("X-Toolproxy-Tool-Version", "1.0.0").start(ca.mtls_context())
    try:
        overrides = {**proxy_deps, **registry(tmp_path, tool("secure_echo", "secure", "secure-mtls")),
                     "backends.services": {"secure": backend.url},
                     "credentials": {"secure-mtls": {"kind": "tls", "tls_cert_file": ca.client_cert,
                                                     "tls_key_file": ca.client_key, "tls_ca_file": ca.ca_file}}}
        async with running_stack(overrides) as stack:
            for _ in range(3):  # the connection is pooled and reused under its own TLS context
                status, body = await stack.call("secure_echo", {"text": "over mtls"})
                assert status == 200 and body["data"]["echo"] == "over mtls", body
            # Without the client certificate (even trusting the private CA), the handshake is refused.
            agent_side = ssl.create_default_context(cafile=ca.ca_file)
            async with aiohttp.ClientSession() as session:
                with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
                    async with session.post(backend.url + "/echo", json={"text": "x"}, ssl=agent_side,
                                            headers={"X-Toolproxy-Tool-Version": "1.0.0"}) as response:
                        await response.read()
        assert len(backend.seen) == 3
    finally:
        await backend.stop()


async def test_a_registry_naming_an_unknown_credential_is_refused_at_start_and_on_reload(proxy_deps, tmp_path):
    overrides = {**proxy_deps, **registry(tmp_path, tool("echo", "saas", "nope")),
                 "backends.services": {"saas": "http://127.0.0.1:9"}}
    with pytest.raises(RegistryError, match=r"backend.auth 'nope' is not a configured credential.*credentials.nope"):
        async with running_stack(overrides):
            pass
    key = write(tmp_path / "key", KEY)
    overrides = {**overrides, **registry(tmp_path, tool("echo", "saas", "saas-key")),
                 "credentials": {"saas-key": {"kind": "bearer", "secret_file": key}}}
    async with running_stack(overrides) as stack:
        write(tmp_path / "tools.yaml", "tools:\n" + tool("echo", "saas", "sass-key"))  # a typo
        assert await stack.runtime.reloader.reload() == "refused"
        assert stack.runtime.registry.get("echo", "1.0.0").backend.auth == "saas-key"


class HostileTokenEndpoint:
    """A token endpoint that misbehaves in the way ``mode`` names; it issues nothing usable."""

    def __init__(self) -> None:
        self.mode = "slow"
        self.requests = 0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Listen on loopback; the token endpoint's URL."""
        app = web.Application()
        app.router.add_post("/token", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}/token"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        await request.read()
        if self.mode == "slow":
            await asyncio.wait_for(self.release.wait(), 30)
            return web.json_response({})
        if self.mode == "huge":
            return web.Response(body=b"{" + b" " * (2 * 1024 * 1024) + b"}", content_type="application/json")
        if self.mode == "refuse":  # its error body carries the client's own secret back, and a planted one
            return web.json_response({"error": "invalid_client", "error_description": f"bad secret {CLIENT_SECRET}",
                                      "hint": KEY}, status=401)
        if self.mode == "bad_error":  # an error word outside RFC 6749's list is not repeated either
            return web.json_response({"error": f"leak-{KEY}"}, status=400)
        # a token a header cannot carry
        return web.json_response({"access_token": "abc\r\nX-Injected: 1", "token_type": "Bearer", "expires_in": 60})


async def test_a_misbehaving_token_endpoint_costs_one_call_a_clear_error_and_leaks_nothing(
        proxy_deps, tmp_path, key_backends, caplog):
    endpoint = HostileTokenEndpoint()
    token_url = await endpoint.start()
    credentials = {"oauth": {"kind": "client_credentials", "token_url": token_url, "client_id": "toolproxy",
                             "client_secret_file": write(tmp_path / "cs", CLIENT_SECRET), "timeout_ms": 300,
                             "max_answer_bytes": 4096}}
    overrides = {**proxy_deps, **registry(tmp_path, tool("oauth_echo", "saas", "oauth")),
                 "backends.services": {"saas": key_backends["saas"].url}, "credentials": credentials}
    caplog.set_level(logging.DEBUG)
    envelopes = []
    try:
        async with running_stack(overrides) as stack:
            for mode, reason in (("slow", "timeout"), ("huge", "answer_too_large"), ("refuse", "refused"),
                                 ("bad_error", "refused"), ("crlf", "invalid_answer")):
                endpoint.mode = mode
                status, body = await stack.call("oauth_echo", {"text": "x"})
                envelopes.append(body)
                error = body["error"]
                assert status == 503 and error["code"] == "credential_unavailable", body
                assert error["details"]["reason"] == reason and error["details"]["credential"] == "oauth"
                assert body["side_effect"]["attempted"] is False
                endpoint.release.set()
            assert envelopes[2]["error"]["details"]["oauth_error"] == "invalid_client"
            assert "oauth_error" not in envelopes[3]["error"]["details"]
            async with stack.session.get(stack.ops_url + "/metrics") as response:
                metrics = await response.text()
            refused = 'toolproxy_credential_tokens_total{credential="oauth",kind="client_credentials",result="refused"}'
            assert f"{refused} 2.0" in metrics
            assert not key_backends["saas"].seen  # nothing reached the backend
    finally:
        await endpoint.runner.cleanup()
    seen = json.dumps(envelopes) + caplog.text + metrics
    for secret in (CLIENT_SECRET, KEY, "X-Injected"):
        assert secret not in seen


async def test_one_fetch_serves_every_call_waiting_for_it(proxy_deps, tmp_path, key_backends):
    """Single flight: twenty calls that need a token at once cause one request to the token endpoint."""
    endpoint = HostileTokenEndpoint()
    token_url = await endpoint.start()
    credentials = {"oauth": {"kind": "client_credentials", "token_url": token_url, "client_id": "toolproxy",
                             "timeout_ms": 500,
                             "client_secret_file": write(tmp_path / "cs", CLIENT_SECRET)}}
    overrides = {**proxy_deps, **registry(tmp_path, tool("oauth_echo", "saas", "oauth")),
                 "backends.services": {"saas": key_backends["saas"].url}, "credentials": credentials}
    try:
        async with running_stack(overrides) as stack:
            endpoint.mode = "slow"
            results = await asyncio.gather(*(stack.call("oauth_echo", {"text": str(i)}) for i in range(20)))
            assert {body["error"]["code"] for _, body in results} == {"credential_unavailable"}
            assert endpoint.requests == 1
    finally:
        endpoint.release.set()
        await endpoint.runner.cleanup()


WRITE = """
  - name: keyed_write
    version: "1.0.0"
    description: A write whose backend wants a bearer key, on its call and on its status endpoint.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [text]
      properties: {text: {type: string}}
    outputSchema: {type: object}
    timeout_ms: 600
    backend: {type: http, service: saas, path: /write, auth: saas-key}
    status_endpoint: {service: saas, path: /status}
"""


async def test_the_status_query_of_an_unknown_write_carries_the_credential_too(proxy_deps, tmp_path):
    """A write whose answer never came is reconciled through its status endpoint, which wants the same key."""
    status_headers: list[str | None] = []
    release = asyncio.Event()

    async def write_(request: web.Request) -> web.Response:
        await asyncio.wait_for(release.wait(), 30)  # answers after the call's deadline: the outcome is unknown
        return web.json_response({"ok": True})

    async def status(request: web.Request) -> web.Response:
        status_headers.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"code": "unauthenticated"}}, status=401)
        return web.json_response({"state": "committed", "result": {"ok": True}})

    app = web.Application()
    app.router.add_post("/write", write_)
    app.router.add_get("/status/{key}", status)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    overrides = {**proxy_deps, **registry(tmp_path, WRITE), "reconcile.enabled": False,
                 "reconcile.backoff_initial_ms": 0,
                 "backends.services": {"saas": f"http://127.0.0.1:{runner.addresses[0][1]}"},
                 "credentials": {"saas-key": {"kind": "bearer", "secret_file": write(tmp_path / "key", KEY)}}}
    try:
        async with running_stack(overrides) as stack:
            status_, body = await stack.call("keyed_write", {"text": "x"})
            assert body["error"]["code"] == "timeout_unknown", body
            await stack.runtime.reconciler.scan_once()
            record = await stack.runtime.operations.get(body["idempotency_key"])
            assert record is not None and record.state == "SUCCEEDED", record
            assert status_headers == [f"Bearer {KEY}"]
    finally:
        release.set()
        await runner.cleanup()
