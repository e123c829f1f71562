"""Credentials against a real authorization server: Keycloak (scripts/setup.sh installs its distribution).

- Token exchange on behalf of the caller (RFC 8693, Keycloak's standard token exchange): the agent's token for
  alice (audience ``toolproxy``) becomes, at the proxy, a token for the backend ``crm`` whose ``sub`` is alice,
  which the backend verifies against Keycloak's keys; the agent's own token is refused there. One exchange serves
  100 calls of alice to ``crm``: Keycloak's own event log holds one TOKEN_EXCHANGE.
- The same on an MCP upstream (a real ``mcp`` SDK server that accepts only a token Keycloak signed for ``crm``):
  every request of each caller's session and of the stateless hot path carries that caller's exchanged token,
  two callers each their own, one exchange per caller for all of their calls.
- Client credentials with client_secret_basic, client_secret_post and private_key_jwt: one CLIENT_LOGIN per
  client for all of its calls.
- The canary search: a static key, the client secrets, a wrong secret Keycloak refuses, and the tokens the proxy
  obtained appear nowhere an agent, an operator or a log reader can see: envelopes, stdout (audit records),
  log records, the audit and decision streams, /metrics, the admin API's answers, and every span exported to a
  real Jaeger (read back through its query API).

Keycloak starts once per session (bounded by TOOLPROXY_KEYCLOAK_START_S, default 300 s on this 2-core machine).
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import jwt
import pytest

from tests.support import keycloak as kc
from tests.support.credential_backends import KeyBackend, VerifyingBackend, echo_tool as tool, write_file
from tests.support.mcp_upstream import registry_yaml, running_upstream
from tests.support.servers import session_server
from tests.support.stack import running_stack
from tests.support.tokens import Issuer
from tests.support.traces import JaegerServer, jaeger_binary
from tests.support.waits import wait_until

STATIC_KEY = "sk-canary-kc-8c7b6a5f4e3d2c1b"
WRONG_SECRET = "kc-canary-wrong-secret-0f9e8d7c"


@pytest.fixture(scope="session")
def keycloak(tmp_path_factory):
    yield from session_server(kc.keycloak_home(), "Keycloak's distribution is missing: run scripts/setup.sh (it links "
                              ".venv/keycloak)", lambda home: kc.KeycloakServer(home, tmp_path_factory.mktemp("kc")))


def secret_file(path, value: str) -> str:
    return write_file(path, value + "\n")


def keycloak_identity(keycloak: kc.KeycloakServer, admin: Issuer) -> dict:
    """The agent authenticates with Keycloak's token for alice; approvers with the test's own admin issuer."""
    return {"identity.mode": "jwt", "identity.agent_id": "agent-under-test",
            "identity.jwt": {"issuer": keycloak.issuer, "audience": "toolproxy", "jwks_url": keycloak.jwks_url,
                             "claim_scopes": "toolproxy_scopes"},
            "admin_identity.jwt": {"issuer": admin.issuer, "audience": "toolproxy-admin",
                                   "jwks_file": str(admin.jwks_file)}}


def exchange_credential(tmp_path, keycloak: kc.KeycloakServer) -> dict:
    """``crm-as-user``: the caller's Keycloak token exchanged for one to ``crm``."""
    return {"crm-as-user": {"kind": "token_exchange", "token_url": keycloak.token_url, "client_id": "toolproxy",
                            "client_secret_file": secret_file(tmp_path / "cs", kc.CLIENT_SECRET), "audience": "crm"}}


def two_callers(keycloak: kc.KeycloakServer) -> tuple[dict[str, str], dict[str, str]]:
    """Keycloak's tokens for alice and bob, and their subjects, by name."""
    tokens = {name: keycloak.user_token(name) for name in ("alice", "bob")}
    return tokens, {name: jwt.decode(token, options={"verify_signature": False})["sub"]
                    for name, token in tokens.items()}


async def test_token_exchange_gives_the_backend_the_caller_once_for_100_calls(proxy_deps, tmp_path, keycloak,
                                                                              issuers):
    crm = await VerifyingBackend(keycloak.issuer, keycloak.jwks_url, "crm").start()
    try:
        overrides = {**proxy_deps, **keycloak_identity(keycloak, issuers[1]),
                     "registry.paths": [secret_file(tmp_path / "tools.yaml",
                                                    "tools:\n" + tool("crm_echo", "crm", "crm-as-user"))],
                     "backends.services": {"crm": crm.url},
                     "credentials": exchange_credential(tmp_path, keycloak)}
        before = len(keycloak.events("TOKEN_EXCHANGE"))
        user_token = keycloak.user_token("alice")
        alice = jwt.decode(user_token, options={"verify_signature": False})["sub"]
        async with running_stack(overrides) as stack:
            stack.headers["Authorization"] = f"Bearer {user_token}"
            results = []
            for batch in range(10):  # 100 calls, ten at a time
                results += await asyncio.gather(*(stack.call("crm_echo", {"text": f"{batch}-{i}"}) for i in range(10)))
            failed = [body["error"] for _, body in results if body["outcome"] != "succeeded"]
            assert not failed, failed[:2]
            assert {body["data"]["sub"] for _, body in results} == {alice}
            # The agent's own token, straight to the backend: refused (it is for the proxy, not for crm).
            async with aiohttp.ClientSession() as session:
                async with session.post(crm.url + "/echo", json={"text": "direct"},
                                        headers={"Authorization": f"Bearer {user_token}"}) as response:
                    assert response.status == 401
            async with stack.session.get(stack.ops_url + "/metrics") as response:
                metrics = await response.text()
        assert {(c["sub"], c["aud"], c["azp"]) for c in crm.claims} == {(alice, "crm", "toolproxy")}
        exchanges = keycloak.events("TOKEN_EXCHANGE")
        assert len(exchanges) - before == 1, exchanges[:3]
        assert exchanges[0]["clientId"] == "toolproxy" and exchanges[0]["userId"] == alice
        assert 'toolproxy_credential_tokens_total{credential="crm-as-user",kind="token_exchange",result="issued"} 1.0' \
            in metrics
    finally:
        await crm.stop()


async def test_each_caller_gets_a_token_of_their_own(proxy_deps, tmp_path, keycloak, issuers):
    """Exchanged tokens are kept per subject: alice's and bob's calls, interleaved, each reach the backend as their
    own caller, with one exchange each."""
    crm = await VerifyingBackend(keycloak.issuer, keycloak.jwks_url, "crm").start()
    try:
        overrides = {**proxy_deps, **keycloak_identity(keycloak, issuers[1]),
                     "registry.paths": [secret_file(tmp_path / "tools.yaml",
                                                    "tools:\n" + tool("crm_echo", "crm", "crm-as-user"))],
                     "backends.services": {"crm": crm.url},
                     "credentials": exchange_credential(tmp_path, keycloak)}
        tokens, subjects = two_callers(keycloak)
        before = len(keycloak.events("TOKEN_EXCHANGE"))
        async with running_stack(overrides) as stack:
            calls = [stack.call("crm_echo", {"text": f"{name}-{i}"},
                                headers={"Authorization": f"Bearer {tokens[name]}"})
                     for i in range(10) for name in ("alice", "bob")]
            results = await asyncio.gather(*calls)
        for _, body in results:
            assert body["outcome"] == "succeeded", body["error"]
            assert body["data"]["sub"] == subjects[body["data"]["echo"].split("-")[0]]
        exchanges = keycloak.events("TOKEN_EXCHANGE")[: len(keycloak.events("TOKEN_EXCHANGE")) - before]
        assert sorted(e["userId"] for e in exchanges) == sorted(subjects.values())
    finally:
        await crm.stop()


@pytest.mark.parametrize("upstream_mode", ["auto", "legacy"])
async def test_an_mcp_upstream_gets_each_callers_own_exchanged_token(proxy_deps, tmp_path, keycloak, issuers,
                                                                     upstream_mode):
    """Alice's and bob's calls to an MCP upstream, interleaved: every request that reaches it (the session's
    handshake, the stateless hot path's POSTs, the SDK session's calls on a legacy upstream) carries an exchanged
    token for ``crm`` whose ``sub`` is the caller of that call; one exchange per caller for three calls each."""
    gate = await VerifyingBackend(keycloak.issuer, keycloak.jwks_url, "crm").load_keys()
    async with running_upstream(required_authorization=gate.verify) as upstream:
        registry = registry_yaml(upstream.url).replace("{type: mcp, ", "{type: mcp, auth: crm-as-user, ")
        overrides = {**proxy_deps, **keycloak_identity(keycloak, issuers[1]),
                     "registry.paths": [secret_file(tmp_path / "tools.yaml", registry)],
                     "mcp.upstream_mode": upstream_mode,
                     "credentials": exchange_credential(tmp_path, keycloak)}
        tokens, subjects = two_callers(keycloak)
        before = len(keycloak.events("TOKEN_EXCHANGE"))
        async with running_stack(overrides) as stack:
            for i in range(3):
                for name in ("alice", "bob"):
                    status, body = await stack.call("up_lookup", {"key": f"{name}-{i}"},
                                                    headers={"Authorization": f"Bearer {tokens[name]}"})
                    assert (status, body["outcome"]) == (200, "succeeded"), body
                    assert body["data"] == {"key": f"{name}-{i}", "value": f"value-of-{name}-{i}"}
        # The agent's own token, straight to the upstream: refused (it is for the proxy, not for crm).
        async with aiohttp.ClientSession() as session:
            async with session.post(upstream.url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                    headers={"Authorization": f"Bearer {tokens['alice']}",
                                             "Accept": "application/json, text/event-stream"}) as response:
                assert response.status == 401
    calls = [r for r in upstream.state.http if r["verb"] == "POST" and b'"tools/call"' in r["body"]]
    assert len(calls) == 6
    sessions: dict[str, set] = {"alice": set(), "bob": set()}
    for request in calls:  # each call reached the upstream with its own caller's token
        caller = json.loads(request["body"])["params"]["arguments"]["key"].split("-")[0]
        sub = jwt.decode(request["authorization"].partition(" ")[2], options={"verify_signature": False})["sub"]
        assert sub == subjects[caller]
        sessions[caller].add(request["session"])
    if upstream_mode == "legacy":  # a session of each caller's own
        assert len(sessions["alice"]) == len(sessions["bob"]) == 1 and not sessions["alice"] & sessions["bob"]
    assert upstream.state.http and all(r["authorization"] for r in upstream.state.http)
    assert {(c["sub"], c["aud"], c["azp"]) for c in gate.claims} == {(s, "crm", "toolproxy")
                                                                     for s in subjects.values()}
    exchanges = keycloak.events("TOKEN_EXCHANGE")[: len(keycloak.events("TOKEN_EXCHANGE")) - before]
    assert sorted(e["userId"] for e in exchanges) == sorted(subjects.values())


async def test_client_credentials_with_each_client_authentication(proxy_deps, tmp_path, keycloak):
    backend = await VerifyingBackend(keycloak.issuer, keycloak.jwks_url, None).start()
    try:
        credentials = {
            "basic": {"kind": "client_credentials", "token_url": keycloak.token_url, "client_id": "toolproxy",
                      "client_secret_file": secret_file(tmp_path / "cs", kc.CLIENT_SECRET)},
            "post": {"kind": "client_credentials", "token_url": keycloak.token_url, "client_id": "toolproxy-post",
                     "client_auth": "client_secret_post",
                     "client_secret_file": secret_file(tmp_path / "ps", kc.POST_SECRET)},
            "jwt": {"kind": "client_credentials", "token_url": keycloak.token_url, "client_id": "toolproxy-jwt",
                    "client_auth": "private_key_jwt", "private_key_file": keycloak.jwt_client_key},
        }
        tools = "".join(tool(f"echo_{name}", "app", name) for name in credentials)
        overrides = {**proxy_deps, "registry.paths": [secret_file(tmp_path / "tools.yaml", "tools:\n" + tools)],
                     "backends.services": {"app": backend.url}, "credentials": credentials}
        before = len(keycloak.events("CLIENT_LOGIN"))
        async with running_stack(overrides) as stack:
            for name in credentials:
                results = await asyncio.gather(*(stack.call(f"echo_{name}", {"text": str(i)}) for i in range(5)))
                assert [body["outcome"] for _, body in results] == ["succeeded"] * 5, results[0]
        azps = [c["azp"] for c in backend.claims]
        assert sorted(set(azps)) == ["toolproxy", "toolproxy-jwt", "toolproxy-post"] and len(azps) == 15
        logins = keycloak.events("CLIENT_LOGIN")[: len(keycloak.events("CLIENT_LOGIN")) - before]
        assert sorted(e["clientId"] for e in logins) == ["toolproxy", "toolproxy-jwt", "toolproxy-post"]
    finally:
        await backend.stop()


@pytest.fixture(scope="module")
def jaeger():
    server = JaegerServer(jaeger_binary())
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_the_canary_search_finds_no_secret_anywhere(proxy_deps, tmp_path, keycloak, issuers, caplog, capsys,
                                                         jaeger):
    """Every output the agent, an operator or a log reader sees, searched for every secret the proxy held or got."""
    crm = await VerifyingBackend(keycloak.issuer, keycloak.jwks_url, "crm").start()
    keyed = await KeyBackend("Authorization", f"Bearer {STATIC_KEY}").start()
    try:
        credentials = {
            "crm-as-user": {"kind": "token_exchange", "token_url": keycloak.token_url, "client_id": "toolproxy",
                            "client_secret_file": secret_file(tmp_path / "cs", kc.CLIENT_SECRET), "audience": "crm"},
            "refused": {"kind": "token_exchange", "token_url": keycloak.token_url, "client_id": "toolproxy",
                        "client_secret_file": secret_file(tmp_path / "ws", WRONG_SECRET), "audience": "crm"},
            "static": {"kind": "bearer", "secret_file": secret_file(tmp_path / "sk", STATIC_KEY)},
        }
        tools = tool("crm_echo", "crm", "crm-as-user") + tool("crm_refused", "crm", "refused") \
            + tool("keyed_echo", "keyed", "static")
        overrides = {**proxy_deps, **keycloak_identity(keycloak, issuers[1]),
                     "registry.paths": [secret_file(tmp_path / "tools.yaml", "tools:\n" + tools)],
                     "backends.services": {"crm": crm.url, "keyed": keyed.url}, "credentials": credentials,
                     "audit.sinks": ["stdout", "redis"], "decisions.sinks": ["redis", "stdout"],
                     "log.level": "debug", "tracing.endpoint": jaeger.otlp_url, "tracing.sampler": "always_on",
                     "tracing.stages": "spans", "tracing.schedule_delay_ms": 50}
        caplog.set_level(logging.DEBUG)
        user_token = keycloak.user_token("alice")
        seen: list[str] = []
        async with running_stack(overrides) as stack:
            stack.headers["Authorization"] = f"Bearer {user_token}"
            for name in ("crm_echo", "keyed_echo", "crm_refused", "crm_echo"):
                status, body = await stack.call(name, {"text": "canary run"})
                seen.append(json.dumps(body))
            assert json.loads(seen[2])["error"]["code"] == "credential_unavailable"
            assert json.loads(seen[2])["error"]["details"]["reason"] == "refused"
            for path in ("/metrics", "/readyz", "/.well-known/jwks.json"):
                async with stack.session.get(stack.ops_url + path) as response:
                    seen.append(await response.text())
            admin = issuers[1].token("ops", audience="toolproxy-admin", roles=["approver", "operator"])
            key = json.loads(seen[0])["idempotency_key"]
            for path in ("/v1/approvals", "/v1/approvals/decided", "/v1/denials", "/v1/unknown-calls",
                         "/v1/takeovers", "/v1/locks", "/v1/quotas", f"/v1/operations/{key}", "/ui"):
                async with stack.session.get(stack.admin_url + path,
                                             headers={"Authorization": f"Bearer {admin}"}) as response:
                    seen.append(await response.text())
            for stream in await stack.redis.keys("*stream*"):
                for _, fields in await stack.redis.xrange(stream):
                    seen.append(json.dumps({str(k): str(v) for k, v in fields.items()}))
        captured = capsys.readouterr()
        seen += [captured.out, captured.err, caplog.text]
        trace_ids = {json.loads(line)["trace_id"] for line in captured.out.splitlines()
                     if line.startswith('{"record":"toolproxy.audit') and '"trace_id"' in line}
        assert len(trace_ids) >= 4
        traces = {}
        for trace_id in trace_ids:  # every span of every call, as Jaeger stored it
            await wait_until(lambda: jaeger.raw_trace(trace_id), timeout=10, what=f"trace {trace_id}", interval=0.2)
            traces[trace_id] = jaeger.raw_trace(trace_id)
        assert sum(len(t["spans"]) for t in traces.values()) >= 8
        seen.append(json.dumps(traces))
        exchanged = set(crm.tokens)
        assert exchanged and len(keyed.seen) == 1  # the canaries did travel, to the backends only
        everything = "\n".join(seen)
        assert "toolproxy_credential_tokens_total" in everything and "credential_unavailable" in everything
        for canary in (STATIC_KEY, kc.CLIENT_SECRET, WRONG_SECRET, *exchanged, user_token):
            assert canary not in everything
    finally:
        await crm.stop()
        await keyed.stop()
