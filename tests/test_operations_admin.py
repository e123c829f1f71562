"""Operators on the admin listener: see takeovers, resolve them with evidence (real JWTs, OPA, Redis)."""

from __future__ import annotations

import pytest

from tests.support.audit import audit_records
from tests.support.stack import running_stack
from tests.support.tokens import jwt_overrides

COUNTER = {"counter": "ctr_demo", "delta": 5}  # adjust_counter has no status endpoint: unknowns need a human
KEY = {"Idempotency-Key": "counter-op-1"}


@pytest.fixture
async def stack(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False,
                              "reconcile.backoff_initial_ms": 0}) as s:
        s.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        yield s


def operator(issuers, tenant=None, roles=("operator",)) -> str:
    cross = ["cross-tenant"] if tenant is None else []  # a tenant-less admin token needs the cross-tenant role
    return issuers[1].token("olga", audience="toolproxy-admin", roles=[*roles, *cross], tenant=tenant, scope="")


async def takeover(stack) -> str:
    await stack.fault("adjust_counter", "drop_after_commit", count=1)
    _, env = await stack.call("adjust_counter", COUNTER, headers=KEY)
    assert env["error"]["code"] == "timeout_unknown"
    assert (await stack.runtime.reconciler.scan_once()).get("takeover") == 1
    return env["idempotency_key"]


async def resolve(stack, key: str, token: str | None, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with stack.session.post(f"{stack.admin_url}/v1/operations/{key}/resolve", json=body,
                                  headers=headers) as response:
        return response.status, await response.json()


async def test_operator_lists_and_resolves_a_takeover_and_repeats_get_the_result(stack, issuers, capsys):
    key = await takeover(stack)
    token = operator(issuers)
    status, listing = await stack.admin("GET", "/v1/takeovers", token)
    assert status == 200
    [record] = listing["takeovers"]
    assert record["idempotency_key"] == key and record["subject"] == "alice"
    assert record["last_evidence"]["observed"] == "no_status_endpoint"

    result = {"counter": "ctr_demo", "value": 5}
    status, body = await resolve(stack, key, token, {"outcome": "committed", "result": result,
                                                      "evidence": "backend DB shows ctr_demo = 5"})
    assert (status, body) == (200, {"idempotency_key": key, "state": "SUCCEEDED"})
    status, view = await stack.admin("GET", f"/v1/operations/{key}", token)
    assert view["state"] == "SUCCEEDED" and view["evidence"]["operator"] == "olga"
    status, again = await stack.call("adjust_counter", COUNTER, headers=KEY)
    assert again["replayed"] is True and again["data"] == result
    assert stack.backend.effect_counts()["adjust_counter"] == 1
    status, listing = await stack.admin("GET", "/v1/takeovers", token)
    assert listing["takeovers"] == []
    kinds = [(r["kind"], (r.get("details") or {}).get("to")) for r in audit_records(capsys.readouterr().out)
             if r["kind"] in ("takeover", "reconciliation")]
    assert kinds == [("takeover", None), ("reconciliation", "SUCCEEDED")]

    status, body = await resolve(stack, key, token, {"outcome": "rejected", "evidence": "second thoughts"})
    assert status == 409 and body["error"]["code"] == "operation_not_open"


async def test_only_operators_of_the_right_tenant_may_act(stack, issuers):
    key = await takeover(stack)
    approver = issuers[1].token("bob", audience="toolproxy-admin", roles=["approver", "cross-tenant"], tenant=None, scope="")
    agent_token = stack.headers["Authorization"].split()[1]
    for token in (None, approver, agent_token):
        status, body = await resolve(stack, key, token, {"outcome": "not_applied", "evidence": "x"})
        expected = (403, "forbidden") if token is approver else (401, "unauthorized")  # valid, lacks the role
        assert (status, body["error"]["code"]) == expected
    other_tenant = operator(issuers, tenant="globex")
    status, listing = await stack.admin("GET", "/v1/takeovers", other_tenant)
    assert listing["takeovers"] == []
    status, body = await resolve(stack, key, other_tenant, {"outcome": "not_applied", "evidence": "x"})
    assert status == 404 and body["error"]["code"] == "operation_not_found"
    status, body = await resolve(stack, key, operator(issuers, tenant="acme"),
                                 {"outcome": "not_applied", "evidence": "no row in the counters table"})
    assert body["state"] == "FAILED_RETRYABLE"
    # Not applied: the same key runs again, once.
    status, env = await stack.call("adjust_counter", COUNTER, headers=KEY)
    assert status == 200 and "replayed" not in env
    _, view = await stack.get(f"/v1/operations/{key}")
    assert view["state"] == "SUCCEEDED" and view["attempt"] == 2
    # The dropped call had in fact applied and the operator was wrong; the proxy followed the operator, and
    # the backend's own deduplication on the forwarded Idempotency-Key kept the effect single.
    assert stack.backend.effect_counts()["adjust_counter"] == 1


async def test_agents_see_their_own_operations_only(stack, issuers):
    key = await takeover(stack)
    status, view = await stack.get(f"/v1/operations/{key}")
    assert status == 200 and view["state"] == "NEEDS_TAKEOVER"
    assert view["takeover"]["target"]["arguments"] == COUNTER
    agent = issuers[0]
    status, body = await stack.get(f"/v1/operations/{key}",
                                   headers={"Authorization": f"Bearer {agent.token('gina', tenant='globex')}"})
    assert status == 404 and body["error"]["code"] == "operation_not_found"
