"""Every read of an MCP upstream's authorization discovery is bounded: a hostile upstream (or metadata host) that
answers too much, too slowly, or names another resource costs the call one ``credential_unavailable`` with a fixed
reason, and the client's secret goes nowhere. The peers here misbehave on purpose; the well-behaved flows run
against the MCP conformance suite's servers (tests/test_mcp_oauth_conformance.py)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web

from proxy.credentials.mcp_oauth import (AuthHttp, Bounds, MemoryStorage, OAuthClientSpec, TokenSource,
                                         client_credentials_provider)
from proxy.errors import ProxyError

SECRET = "canary-client-secret-7f3a"


class Hostile:
    """An MCP upstream whose 401 names protected resource metadata at ``/prm``, answered as ``mode`` says."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> "Hostile":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request.path)
        if request.path == "/mcp":
            if self.mode == "no_challenge":
                return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {}})
            return web.Response(status=401, headers={
                "WWW-Authenticate": f'Bearer resource_metadata="{self.url}/prm"'})
        if request.path == "/prm":
            if self.mode == "huge":
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(request)
                for _ in range(64):  # 4 MiB, never all read
                    await response.write(b" " * 65536)
                return response
            if self.mode == "trickle":
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(request)
                for _ in range(600):
                    await response.write(b" ")
                    await asyncio.sleep(0.05)
                return response
            if self.mode == "mismatch":
                return web.json_response({"resource": "https://evil.example/mcp",
                                          "authorization_servers": [self.url]})
        return web.Response(status=404)


def source(url: str, bounds: Bounds) -> TokenSource:
    spec = OAuthClientSpec(grant="client_credentials", client_id="proxy", auth_method="client_secret_post",
                           issuer=url, client_secret=SECRET)
    return TokenSource(url + "/mcp", client_credentials_provider(url + "/mcp", spec, MemoryStorage()),
                       AuthHttp(bounds, connect_timeout_s=1.0), upstream="crm")


async def refusal(mode: str, bounds: Bounds) -> tuple[ProxyError, Hostile]:
    async with Hostile(mode) as peer:
        tokens = source(peer.url, bounds)
        with pytest.raises(ProxyError) as raised:
            await asyncio.wait_for(tokens.token(), timeout=bounds.timeout_s + 10)
    return raised.value, peer


@pytest.mark.parametrize("mode, reason", [("huge", "answer_too_large"), ("trickle", "timeout"),
                                          ("mismatch", "resource_mismatch"), ("no_challenge", "invalid_answer")])
async def test_a_hostile_discovery_costs_one_refusal_with_a_fixed_reason(mode, reason, caplog):
    caplog.set_level(logging.DEBUG)
    error, peer = await refusal(mode, Bounds(timeout_s=1.5, max_answer_bytes=64 * 1024))
    assert error.code == "credential_unavailable" and error.attempted is False
    assert error.details == {"reason": reason, "credential": "crm"}
    assert error.spec.retryable is True and error.retryable is (reason == "timeout")
    assert SECRET not in json.dumps(error.to_error())
    assert SECRET not in caplog.text and peer.url not in error.message
    assert not [path for path in peer.requests if "token" in path or "register" in path]  # no secret was sent


async def test_one_renewal_serves_every_waiting_call():
    """Concurrent callers share one flight (here one that fails): the upstream is probed once, not per caller."""
    async with Hostile("mismatch") as peer:
        tokens = source(peer.url, Bounds(timeout_s=2.0))
        results = await asyncio.gather(*(tokens.token() for _ in range(20)), return_exceptions=True)
    assert all(isinstance(r, ProxyError) and r.details["reason"] == "resource_mismatch" for r in results)
    assert peer.requests.count("/mcp") == 1 and peer.requests.count("/prm") == 1


async def test_the_upstreams_token_rides_every_request_of_a_call_and_nothing_else(tmp_path, proxy_deps, caplog,
                                                                                  capsys):
    """A 2026-07-28 upstream (the mcp SDK's server) behind an ``mcp_client_credentials`` credential whose token the
    proxy holds: the session's requests and each call's plain POST over the hot path's wire carry it; no envelope,
    audit record or log line does. A second credential whose upstream never challenges (it has no authorization
    server to find) fails its call closed: ``credential_unavailable``, nothing run."""
    from tests.support.mcp_upstream import registry_yaml, running_upstream
    from tests.support.stack import DEMO_REGISTRY, running_stack

    caplog.set_level(logging.INFO)
    secret = tmp_path / "client-secret"
    secret.write_text(SECRET)
    token = "canary-access-token-5d1e"
    entry = {"kind": "mcp_client_credentials", "client_id": "proxy", "issuer": "https://as.example",
             "client_secret_file": str(secret)}
    async with running_upstream() as upstream:
        registry = tmp_path / "upstream-tools.yaml"
        text = registry_yaml(upstream.url).replace("tool: lookup}", "tool: lookup, auth: held}")
        text = text.replace("tool: adjust}", "tool: adjust, auth: unfound}")
        registry.write_text(text)
        async with running_stack({**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  "credentials": {"held": entry, "unfound": entry}}) as stack:
            stack.auto_key = True
            held = stack.runtime.mcp_credentials.source("held", upstream.url, "", "")
            held._token, held._good_until = token, float("inf")  # as a finished renewal leaves it
            for key in ("k1", "k2"):
                status, envelope = await stack.call("up_lookup", {"key": key})
                assert (status, envelope["outcome"]) == (200, "succeeded"), envelope
            assert upstream.state.count("lookup") == 2
            held_requests = [r for r in upstream.state.http if r["mcp_method"] != "server/discover" or
                             r["authorization"]]
            posts = [r for r in upstream.state.http if r["mcp_method"] == "tools/call"]
            assert len(posts) == 2 and all(r["user_agent"].startswith("toolproxy/") for r in posts)  # the wire
            assert {r["authorization"] for r in posts} == {f"Bearer {token}"}
            assert f"Bearer {token}" in {r["authorization"] for r in held_requests if r not in posts}  # session
            status, refused = await stack.call("up_adjust", {"counter": "c_oauth", "delta": 1})
            assert refused["error"]["code"] == "credential_unavailable", refused
            assert refused["error"]["details"]["credential"] == "unfound"
            assert refused["side_effect"] == {"attempted": False, "committed": False}
            assert upstream.state.count("adjust") == 0
            async with stack.session.get(stack.ops_url + "/metrics") as response:
                metrics = await response.text()
            assert 'toolproxy_credential_tokens_total{credential="unfound",kind="mcp_client_credentials",' \
                   'result="invalid_answer"} 1.0' in metrics
            assert token not in metrics and SECRET not in metrics
    printed = capsys.readouterr()
    for text in (json.dumps(envelope), json.dumps(refused), printed.out, printed.err, caplog.text):
        assert token not in text and SECRET not in text


async def test_a_token_the_upstream_stops_accepting_is_renewed_once_and_the_call_fails_closed(tmp_path, proxy_deps):
    """The upstream accepts the held token, then refuses it (revoked): the next call's plain POST is answered 401
    without running, goes once more through the session (which renews: here there is no authorization server to
    find), and fails closed: ``credential_unavailable``, nothing run, no loop."""
    from tests.support.mcp_upstream import Upstream, _logged, build_server, free_port, registry_yaml
    from tests.support.stack import DEMO_REGISTRY, running_stack
    import uvicorn

    accepted = {"token": "good-token-9a7c"}

    class Refusing(Upstream):
        async def start(self) -> None:
            inner = build_server(self.state).streamable_http_app(json_response=True)

            async def app(scope, receive, send):  # type: ignore[no-untyped-def]
                headers = dict(scope.get("headers") or []) if scope["type"] == "http" else {}
                if scope["type"] == "http" and headers.get(b"authorization") != f"Bearer {accepted['token']}".encode():
                    await send({"type": "http.response.start", "status": 401, "headers": [
                        (b"www-authenticate", f'Bearer resource_metadata="{self.url}-prm"'.encode())]})
                    await send({"type": "http.response.body", "body": b""})
                    return
                await inner(scope, receive, send)

            self._server = uvicorn.Server(uvicorn.Config(_logged(app, self.state), host="127.0.0.1",
                                                         port=self.port, log_level="critical", lifespan="on"))
            self._task = asyncio.create_task(self._server.serve())
            async with asyncio.timeout(10):
                while not self._server.started:
                    await asyncio.sleep(0.02)

    secret = tmp_path / "client-secret"
    secret.write_text(SECRET)
    upstream = Refusing(port=free_port(), json_response=True)
    await upstream.start()
    try:
        registry = tmp_path / "upstream-tools.yaml"
        registry.write_text(registry_yaml(upstream.url).replace("tool: lookup}", "tool: lookup, auth: held}"))
        entry = {"kind": "mcp_client_credentials", "client_id": "proxy", "issuer": "https://as.example",
                 "client_secret_file": str(secret)}
        async with running_stack({**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  "credentials": {"held": entry}}) as stack:
            held = stack.runtime.mcp_credentials.source("held", upstream.url, "", "")
            held._token, held._good_until = accepted["token"], float("inf")
            status, first = await stack.call("up_lookup", {"key": "k1"})
            assert first["outcome"] == "succeeded", first
            accepted["token"] = "rotated-elsewhere"  # the authorization server revoked the held token
            status, second = await stack.call("up_lookup", {"key": "k2"})
    finally:
        await upstream.stop()
    assert second["error"]["code"] == "credential_unavailable" and second["error"]["details"]["credential"] == "held"
    assert second["side_effect"] == {"attempted": False, "committed": False}
    assert upstream.state.count("lookup") == 1  # the refused POST ran nothing
    calls = [r for r in upstream.state.http if r["mcp_method"] == "tools/call"]
    assert [r["user_agent"].startswith("toolproxy/") for r in calls][:2] == [True, True]  # the wire, then refused
    assert len(calls) <= 3  # the plain POST, once more through the session: no loop
