"""Call tokens (``proxy/calltokens``): what the proxy signs is what a backend's verifier accepts, and every
way a token can be wrong is refused with its own reason. Pure: keys made here, no servers."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from pathlib import Path

import jwt
import pytest

from proxy.adapters import BackendCall
from proxy.adapters.call_tokens import CallTokens, load_call_tokens
from proxy.calltokens import keys
from toolproxy_verifier.middleware import AsgiCallTokens, Expect
from proxy.calltokens.signer import CallTokenSigner
from toolproxy_verifier.verifier import CallTokenVerifier, JwksFile, Refused, ReplayCache
from proxy.config import ConfigError, load_config
from proxy.deadline import Deadline
from proxy.normalize import normalize
from proxy.registry import load_registry
from tests.unit import DEMO_REGISTRY

BODY = b'{"order_id":"ord_1001"}'
ARGS_HASH = hashlib.sha256(BODY).hexdigest()


def signer(alg: str = "EdDSA", kid: str = "") -> CallTokenSigner:
    return CallTokenSigner(keys.signing_key(keys.generate(alg), kid), issuer="toolproxy")


def token(s: CallTokenSigner, *, tool: str = "get_order", scope: str = "tool:call", key: str | None = None,
          args_hash: str = ARGS_HASH, audience: str = "demo", budget_s: float | None = 30.0,
          now: float | None = None, txn: str = "txn-1") -> str:
    context = {"tool": tool, "version": "1.0.0", "args_hash": args_hash}
    if key is not None:
        context["idempotency_key"] = key
    return s.sign(audience=audience, scope=scope, txn=txn, subject="alice", tenant="acme", agent="agent-1",
                  context=context, budget_s=budget_s, now=now)


def verifier(*signers: CallTokenSigner, **kw) -> CallTokenVerifier:
    return CallTokenVerifier({"keys": [s.key.public_jwk() for s in signers]}, audience="demo", **kw)


def refusal(v: CallTokenVerifier, t: str | None, **kw) -> str:
    with pytest.raises(Refused) as caught:
        v.verify(t, **{"tool": "get_order", "body": BODY, **kw})
    return caught.value.reason


@pytest.mark.parametrize("alg", ["EdDSA", "ES256"])
def test_a_token_follows_the_transaction_token_draft_and_verifies(alg):
    s = signer(alg)
    t = token(s, key="ik_" + "a" * 64)
    header = jwt.get_unverified_header(t)
    assert header == {"alg": alg, "typ": "txntoken+jwt", "kid": s.key.kid}
    claims = jwt.decode(t, options={"verify_signature": False})
    assert set(claims) == {"iss", "aud", "iat", "exp", "txn", "jti", "sub", "tenant", "req_wl", "scope", "tctx"}
    assert claims["jti"] != jwt.decode(token(s, key="ik_" + "a" * 64), options={"verify_signature": False})["jti"]
    assert claims["exp"] - claims["iat"] <= 30
    facts = verifier(s).verify(t, tool="get_order", body=BODY)
    assert (facts.subject, facts.tenant, facts.agent, facts.tool, facts.args_hash) == (
        "alice", "acme", "agent-1", "get_order", ARGS_HASH)


def test_exp_is_never_later_than_the_deadline_nor_five_minutes():
    s, now = signer(), 1_700_000_000.7
    claims = jwt.decode(token(s, budget_s=2.5, now=now), options={"verify_signature": False})
    assert claims["exp"] <= now + 2.5
    claims = jwt.decode(token(s, budget_s=None, now=now), options={"verify_signature": False})
    assert claims["exp"] <= now + 300
    with pytest.raises(ValueError):
        CallTokenSigner(s.key, issuer="x", ttl_s=301)


def test_every_wrong_token_is_refused_with_its_reason():
    s, other = signer(kid="proxy"), signer(kid="proxy")  # another key under the same kid: a forgery
    v = verifier(s)
    assert refusal(v, None) == "missing"
    assert refusal(v, "not-a-token") == "malformed"
    assert refusal(v, token(other)) == "bad_signature"
    assert refusal(v, token(signer(kid="elsewhere"))) == "unknown_key"
    assert refusal(v, token(s, audience="payments")) == "wrong_audience"
    assert refusal(v, token(s, now=time.time() - 100, budget_s=30)) == "expired"
    assert refusal(v, token(s, tool="refund_order")) == "wrong_tool"
    assert refusal(v, token(s, args_hash="0" * 64)) == "wrong_arguments"
    assert refusal(v, token(s, scope="tool:status", key="ik_1"), key="ik_1") == "wrong_scope"
    plain = jwt.encode({"aud": "demo"}, s.key.private, algorithm=s.key.alg, headers={"kid": s.key.kid})
    assert refusal(v, plain) == "wrong_type"
    hmac = jwt.encode({"aud": "demo"}, "secret" * 8, algorithm="HS256", headers={"kid": s.key.kid, "typ": "txntoken+jwt"})
    assert refusal(v, hmac) == "wrong_algorithm"
    unsigned = ".".join(base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()
                        for part in ({"alg": "none", "typ": "txntoken+jwt", "kid": s.key.kid}, {"aud": "demo"})) + "."
    assert refusal(v, unsigned) == "wrong_algorithm"


def test_the_body_is_hashed_in_its_canonical_form():
    s = signer()
    v = verifier(s)
    reordered = b'{ "order_id" : "ord_1001" }'
    assert v.verify(token(s, txn="t1"), tool="get_order", body=reordered).args_hash == ARGS_HASH
    assert refusal(v, token(s, txn="t2"), body=b'{"order_id":"ord_1002"}') == "wrong_arguments"


def test_status_and_cancel_tokens_are_bound_to_the_key_in_the_route():
    s = signer()
    v = verifier(s)
    t = token(s, scope="tool:status", key="ik_1", txn="ik_1")
    assert v.verify(t, tool="get_order", scope="tool:status", key="ik_1").idempotency_key == "ik_1"
    assert refusal(v, token(s, scope="tool:status", key="ik_1", txn="ik_1"), scope="tool:status",
                   key="ik_2") == "wrong_key"
    assert refusal(v, token(s, scope="tool:cancel", key="ik_1", txn="ik_1"), scope="tool:status",
                   key="ik_1") == "wrong_scope"


def test_a_token_is_taken_once_and_a_transaction_seen_before_passes_only_with_the_same_key():
    s = signer()
    v = verifier(s)
    read = token(s, txn="read-1")
    v.verify(read, tool="get_order", body=BODY)
    assert refusal(v, read) == "replayed"
    write = token(s, key="ik_w", txn="ik_w")
    v.verify(write, tool="get_order", body=BODY)
    assert refusal(v, write) == "replayed"  # the very token again: each is taken once
    v.verify(token(s, key="ik_w", txn="ik_w"), tool="get_order", body=BODY)  # the proxy's retry: a new token
    assert refusal(v, token(s, key="ik_other", txn="ik_w")) == "replayed"


def test_the_replay_memory_is_bounded_and_forgets_expired_transactions():
    cache = ReplayCache(max_seen=3)
    for i in range(10):
        assert not cache.seen(f"t{i}", None, expires=100.0, now=0.0)
    assert len(cache._seen) == 3  # noqa: SLF001 - the bound is the point of this test
    assert cache.seen("t9", None, expires=100.0, now=0.0)
    assert not cache.seen("t9", None, expires=300.0, now=200.0)  # expired: gone, seen afresh


def test_keys_rotate_by_kid_with_old_and_new_overlapping(tmp_path: Path):
    old, new = signer(kid="2026-01"), signer(kid="2026-02")
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(json.dumps(keys.jwks(old.key)))
    v = CallTokenVerifier(JwksFile(jwks_file, check_every_s=0), audience="demo")
    v.verify(token(old, txn="a"), tool="get_order", body=BODY)
    assert refusal(v, token(new, txn="b")) == "unknown_key"
    # The proxy signs with the new key and still publishes the old one: both verify.
    jwks_file.write_text(json.dumps(keys.jwks(new.key, [old.key.public_jwk()])))
    v.verify(token(new, txn="c"), tool="get_order", body=BODY)
    v.verify(token(old, txn="d"), tool="get_order", body=BODY)
    # The overlap ends: the old key is gone and its tokens with it.
    jwks_file.write_text(json.dumps(keys.jwks(new.key)))
    assert refusal(v, token(old, txn="e")) == "unknown_key"
    v.verify(token(new, txn="f"), tool="get_order", body=BODY)


def test_the_proxy_serves_its_signing_key_and_the_extra_verification_keys(tmp_path: Path):
    old = keys.signing_key(keys.generate("ES256"), "old")
    private = keys.generate("EdDSA")
    (tmp_path / "key.pem").write_bytes(keys.private_pem(private))
    (tmp_path / "old.json").write_text(json.dumps({"keys": [old.public_jwk()]}))
    config = load_config(env={}, overrides={"call_tokens.signing_key_file": str(tmp_path / "key.pem"),
                                            "call_tokens.key_id": "new",
                                            "call_tokens.verification_keys_file": str(tmp_path / "old.json")})
    tokens = load_call_tokens(config.call_tokens)
    assert [k["kid"] for k in tokens.jwks["keys"]] == ["new", "old"]
    assert all("d" not in k for k in tokens.jwks["keys"])
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        load_call_tokens(load_config(env={}, overrides={"call_tokens.signing_key_file": str(tmp_path / "bad.pem")})
                         .call_tokens)
    with pytest.raises(ConfigError, match="private member"):
        (tmp_path / "leak.json").write_text(json.dumps({"keys": [{**old.public_jwk(), "d": "x"}]}))
        load_call_tokens(load_config(env={}, overrides={"call_tokens.verification_keys_file":
                                                        str(tmp_path / "leak.json")}).call_tokens)


def test_a_backend_call_token_carries_the_calls_facts():
    registry = load_registry([str(DEMO_REGISTRY)])
    tool = registry.resolve("refund_order", None)
    normalized = normalize(tool, {"order_id": "ord_1001", "amount": 500, "reason": "damaged"})
    call = BackendCall(tool=tool, canonical_arguments=normalized.canonical, arguments=normalized.arguments,
                       call_id="c1", request_id="r1", deadline=Deadline.after(5.0), traceparent="", subject="alice", tenant="acme",
                       agent="agent-1", idempotency_key="ik_" + "b" * 64, fencing_token=7,
                       args_hash=normalized.args_hash, decision_id="dec-1", approval_id="apr_1")
    s = signer()
    t = CallTokens(s).for_call(call)
    facts = verifier(s).verify(t, tool="refund_order", body=normalized.canonical)
    assert (facts.txn, facts.idempotency_key, facts.fencing_token, facts.decision_id, facts.approval_id,
            facts.version) == ("ik_" + "b" * 64, "ik_" + "b" * 64, 7, "dec-1", "apr_1", tool.version)
    assert jwt.decode(t, options={"verify_signature": False})["aud"] == "demo"


def test_the_asgi_middleware_refuses_and_hands_the_facts_and_body_on():
    s = signer()
    seen = {}

    async def app(scope, receive, send):
        message = await receive()
        seen.update(body=message["body"], facts=scope.get("state", {}).get("call_token"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def route(method, path):
        return None if path == "/healthz" else Expect(path.rsplit("/", 1)[-1])

    wrapped = AsgiCallTokens(app, verifier(s), route)

    async def request(path: str, headers: list) -> int:
        sent = []
        chunks = [{"type": "http.request", "body": BODY[:5], "more_body": True},
                  {"type": "http.request", "body": BODY[5:], "more_body": False}]

        async def receive():
            return chunks.pop(0) if chunks else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await wrapped({"type": "http", "method": "POST", "path": path, "headers": headers}, receive, send)
        return sent[0]["status"]

    assert asyncio.run(request("/tools/get_order", [])) == 401
    assert asyncio.run(request("/tools/get_order", [(b"txn-token", token(s).encode())])) == 200
    assert seen["body"] == BODY and seen["facts"].tool == "get_order"
    assert asyncio.run(request("/healthz", [])) == 200
