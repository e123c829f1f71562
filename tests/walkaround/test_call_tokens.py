"""An agent container that shares the pod's network calls the demo backend directly: forged
``X-Toolproxy-*`` headers, no token, a token of another key, a real token replayed for another tool or
other arguments or once more, and an expired token are all refused (401, with the reason named); the
calls the proxy makes, through every front, keep working and carry a token the backend verified."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp
import jwt
import pytest
import rfc8785

from toolproxy_verifier.verifier import CallTokenVerifier, Refused
from tests.support.calltokens import TestKeys, session_keys
from tests.support import node
from tests.support.servers import free_port
from tests.support.stack import extra_tools, passthrough_read, running_stack

ORDER = {"order_id": "ord_1001"}
FORGED = {"X-Toolproxy-Subject": "admin", "X-Toolproxy-Tenant": "acme", "X-Toolproxy-Agent": "agent-under-test",
          "X-Toolproxy-Tool-Version": "1.0.0", "Idempotency-Key": "ik_" + "f" * 64, "X-Fencing-Token": "999999"}


async def direct(session: aiohttp.ClientSession, url: str, path: str, body: bytes = b"",
                 headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, dict]:
    async with session.request(method, url + path, data=body or None,
                               headers={"Content-Type": "application/json", **(headers or {})}) as response:
        return response.status, await response.json(content_type=None)


def refused(answer: tuple[int, dict], reason: str) -> bool:
    status, body = answer
    return status == 401 and body["error"] == {**body["error"], "code": "call_token_refused", "reason": reason}


def sent_tokens(state, tool: str) -> list[str]:
    return [r["headers"]["Txn-Token"] for r in state.requests if r["tool"] == tool]


@pytest.mark.asyncio
async def test_the_backend_refuses_every_call_that_did_not_come_through_the_proxy(proxy_deps, tmp_path):
    async with running_stack(proxy_deps) as stack:
        url, state, session = stack.backend_url, stack.backend, stack.session
        refund = json.dumps({"order_id": "ord_1001", "amount": 7000, "reason": "walk-around"}).encode()
        order = json.dumps(ORDER).encode()

        assert refused(await direct(session, url, "/tools/refund_order", refund, FORGED), "missing")
        other_key = TestKeys(tmp_path, kid=session_keys().kid)  # the right kid, another key
        forged = other_key.token("refund_order", refund, key=FORGED["Idempotency-Key"], subject="admin")
        assert refused(await direct(session, url, "/tools/refund_order", refund, {"Txn-Token": forged}),
                       "bad_signature")
        stranger = TestKeys(tmp_path, kid="agent-made").token("refund_order", refund)
        assert refused(await direct(session, url, "/tools/refund_order", refund, {"Txn-Token": stranger}),
                       "unknown_key")

        # A token the proxy really issued, taken off a read it made, then replayed.
        status, envelope = await stack.call("get_order", ORDER)
        assert status == 200 and envelope["outcome"] == "succeeded"
        [issued] = sent_tokens(state, "get_order")
        assert refused(await direct(session, url, "/tools/refund_order", refund, {"Txn-Token": issued}),
                       "wrong_tool")
        other_order = json.dumps({"order_id": "ord_1002"}).encode()
        assert refused(await direct(session, url, "/tools/get_order", other_order, {"Txn-Token": issued}),
                       "wrong_arguments")
        assert refused(await direct(session, url, "/tools/get_order", order, {"Txn-Token": issued}), "replayed")

        expired = session_keys().token("get_order", order, now=time.time() - 60, budget_s=5)
        assert refused(await direct(session, url, "/tools/get_order", order, {"Txn-Token": expired}), "expired")
        status_path = f"/status/refund_order/{FORGED['Idempotency-Key']}"
        assert refused(await direct(session, url, status_path, method="GET", headers=FORGED), "missing")
        cancel_path = f"/cancel/generate_report/{FORGED['Idempotency-Key']}"
        assert refused(await direct(session, url, cancel_path, headers=FORGED), "missing")

        assert state.effects == []  # nothing the agent sent had an effect
        assert (await direct(session, url, "/_control/state", method="GET"))[0] == 200  # tests' API aside


@pytest.mark.asyncio
async def test_proxied_calls_work_through_every_front_and_carry_a_verified_token(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        session = stack.session
        async with session.get(stack.ops_url + "/.well-known/jwks.json") as response:
            assert response.status == 200
            published = await response.json()
        assert [k["kid"] for k in published["keys"]] == [session_keys().kid]
        verifier = CallTokenVerifier(published, audience="demo")

        status, envelope = await stack.call("refund_order", {"order_id": "ord_1001", "amount": 100, "reason": "x"},
                                            headers={"Idempotency-Key": "walk-1"})
        assert status == 200 and envelope["outcome"] == "succeeded", envelope
        status, body = await stack.batch([{"call_id": "a", "tool": "get_order", "arguments": ORDER},
                                          {"call_id": "b", "tool": "get_inventory",
                                           "arguments": {"sku": "sku_widget"}}])
        assert status == 200 and [r["outcome"] for r in body["results"]] == ["succeeded", "succeeded"], body
        mcp = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "get_order", "arguments": ORDER, "_meta": {
                   "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                   "io.modelcontextprotocol/clientCapabilities": {},
                   "io.modelcontextprotocol/clientInfo": {"name": "walkaround", "version": "0"}}}}
        async with session.post(stack.proxy_url + "/mcp", data=json.dumps(mcp).encode(), headers={
                "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "get_order"}) as response:
            answer = await response.json(content_type=None)
        assert response.status == 200 and not answer["result"].get("isError"), answer
        openai = {"tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_inventory", "arguments": json.dumps({"sku": "sku_gadget"})}}]}
        status, body = await stack.post("/v1/openai/tool-calls", openai)
        assert status == 200, body

        # Every request the backend served carried a token of the published key, for its own tool.
        requests = stack.backend.requests
        assert len(requests) == 5
        for request in requests:
            claims = jwt.decode(request["headers"]["Txn-Token"], options={"verify_signature": False})
            assert claims["tctx"]["tool"] == request["tool"] and claims["aud"] == "demo"
            assert jwt.get_unverified_header(request["headers"]["Txn-Token"])["kid"] == session_keys().kid
        refund = next(r for r in requests if r["tool"] == "refund_order")
        claims = jwt.decode(refund["headers"]["Txn-Token"], options={"verify_signature": False})
        assert claims["txn"] == claims["tctx"]["idempotency_key"] == refund["headers"]["Idempotency-Key"]
        assert claims["tctx"]["fencing_token"] == int(refund["headers"]["X-Fencing-Token"])
        assert claims["sub"] == "dev-user" and claims["tenant"] == "acme" and claims["req_wl"] == "dev-agent"
        # The published keys verify the proxy's tokens (the backend already did, once: this is a replay).
        assert verifier.verify(refund["headers"]["Txn-Token"], tool="refund_order", body=json.dumps(
            {"order_id": "ord_1001", "amount": 100, "reason": "x"}).encode()).idempotency_key == claims["txn"]


NODE_TOOL = """
tools:
""" + passthrough_read("node_echo", "/tools/node_echo", "text", service="node")


@pytest.mark.asyncio
async def test_a_node_backend_checks_a_real_proxied_call_with_jose(proxy_deps, tmp_path):
    """docs/backends.md's Node check (tests/node/jose_backend.mjs, jose against the ops listener's JWKS)
    accepts the proxy's call and refuses the same token replayed with other arguments."""
    port = free_port()
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, NODE_TOOL),
                              "backends.services": {"demo": "http://127.0.0.1:1", "node": f"http://127.0.0.1:{port}"}},
                             ) as stack:
        proc = await asyncio.create_subprocess_exec(
            node.tool("node"), str(node.SCRIPTS / "jose_backend.mjs"), str(port),
            stack.ops_url + "/.well-known/jwks.json", "node", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=node.node_env(), cwd=str(node.SCRIPTS))
        try:
            assert proc.stdout is not None
            started = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
            assert started == {"port": port}
            status, envelope = await stack.call("node_echo", {"text": "hello"})
            assert status == 200 and envelope["outcome"] == "succeeded", envelope
            assert envelope["data"]["tool"] == "node_echo" and envelope["data"]["subject"] == "dev-user"
            status, envelope = await stack.call("node_echo", {"text": "other"}, headers={"X-Request-Id": "r2"})
            assert status == 200, envelope

            # The first call's token, replayed by the agent with other arguments: jose says no.
            token = session_keys().token("node_echo", b'{"text":"hello"}', audience="node")
            async with stack.session.post(f"http://127.0.0.1:{port}/tools/node_echo", data=b'{"text":"evil"}',
                                          headers={"Txn-Token": token}) as response:
                assert response.status == 401
                assert (await response.json())["error"]["reason"] == "wrong_arguments"
            async with stack.session.post(f"http://127.0.0.1:{port}/tools/node_echo", data=b'{"text":"evil"}',
                                          headers={"X-Toolproxy-Subject": "admin"}) as response:
                assert response.status == 401
        finally:
            proc.kill()
            await proc.wait()


@pytest.mark.asyncio
async def test_a_copied_refund_token_is_never_a_second_effect_nor_a_fence_jump(proxy_deps):
    """The agent copies the token of a genuine refund and sends it straight to the backend: with another
    Idempotency-Key, with none, exactly as it was, and with X-Fencing-Token 10^17. None of them refunds again
    (the backend keys on the token's key, and takes a token once), and the proxy's next genuine refund on the
    order still succeeds (the fence did not jump)."""
    async with running_stack(proxy_deps) as stack:
        url, state, session = stack.backend_url, stack.backend, stack.session
        arguments = {"order_id": "ord_1001", "amount": 100, "reason": "walk-around"}
        status, envelope = await stack.call("refund_order", arguments, headers={"Idempotency-Key": "genuine-1"})
        assert status == 200 and envelope["outcome"] == "succeeded", envelope
        [sent] = [r["headers"] for r in state.requests if r["tool"] == "refund_order"]
        body = rfc8785.dumps(arguments)
        copied = {name: sent[name] for name in ("Txn-Token", "Idempotency-Key", "X-Fencing-Token")}
        refunds = [e for e in state.effects if e["tool"] == "refund_order"]
        assert len(refunds) == 1

        other_key = {**copied, "Idempotency-Key": "ik_" + "e" * 64}
        assert refused(await direct(session, url, "/tools/refund_order", body, other_key), "header_mismatch")
        no_key = {k: v for k, v in copied.items() if k != "Idempotency-Key"}
        assert refused(await direct(session, url, "/tools/refund_order", body, no_key), "replayed")
        jumped = {**copied, "X-Fencing-Token": str(10 ** 17)}
        assert refused(await direct(session, url, "/tools/refund_order", body, jumped), "header_mismatch")
        assert refused(await direct(session, url, "/tools/refund_order", body, copied), "replayed")
        assert len([e for e in state.effects if e["tool"] == "refund_order"]) == 1

        status, envelope = await stack.call("refund_order", {**arguments, "amount": 50},
                                            headers={"Idempotency-Key": "genuine-2"})
        assert status == 200 and envelope["outcome"] == "succeeded", envelope  # not lock_lost
        assert len([e for e in state.effects if e["tool"] == "refund_order"]) == 2


def test_a_deeply_nested_token_header_and_a_body_with_a_duplicate_key_are_refused_with_a_reason(tmp_path):
    keys = TestKeys(tmp_path)
    verifier = CallTokenVerifier(keys.jwks, audience="demo")
    # 1400 levels within the 8 KiB a token may have: past the JSON parser's recursion limit.
    nested = base64.urlsafe_b64encode(b'{"a":[' * 700 + b"1" + b"]}" * 700).rstrip(b"=").decode()
    with pytest.raises(Refused) as refusal:
        verifier.verify(nested + ".e30.c2ln", tool="get_order")
    assert refusal.value.reason == "malformed"  # a 401 with a reason, never a RecursionError (a 500)
    # The proxy hashed {"amount": 1}; a first-wins backend would read 100000 from this body.
    token = keys.token("refund_order", b'{"amount":1}')
    with pytest.raises(Refused) as refusal:
        verifier.verify(token, tool="refund_order", body=b'{"amount":100000,"amount":1}')
    assert refusal.value.reason == "wrong_arguments"
    assert verifier.verify(token, tool="refund_order", body=b'{"amount": 1}').args_hash  # re-encoded: fine
