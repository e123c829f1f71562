"""The human approval flow (seed 000 section 3.4) against real OPA and Redis."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from proxy.policy.approvals import now_ms
from proxy.store import key
from tests.support.audit import audit_records
from tests.support.stack import running_stack
from tests.support.tokens import jwt_overrides
from tests.support.modes import all_redis_modes

BIG_REFUND = {"order_id": "ord_1001", "amount": 6000, "reason": "customer complaint #4711"}


@pytest.fixture
async def stack(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin)}) as s:
        s.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        s.auto_key = True  # writes need a stable operation identity (issue 4)
        yield s


@pytest.fixture
def approver(issuers):
    _, admin = issuers
    return admin.token("bob", audience="toolproxy-admin", roles=["approver", "cross-tenant"], tenant=None, scope="")


def sample(stack, name: str, labels: dict[str, str] | None = None) -> float:
    return stack.runtime.metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def request_approval(stack, arguments=BIG_REFUND, headers=None) -> str:
    status, env = await stack.call("refund_order", arguments, headers=headers)
    assert status == 403, env
    assert env["error"]["code"] == "approval_required"
    assert env["error"]["resolution"] == "await_approval"
    assert env["side_effect"] == {"attempted": False, "committed": False}
    return env["error"]["details"]["approval_id"]


@all_redis_modes
async def test_refund_above_threshold_needs_approval_then_runs_once(stack, approver, capsys):
    approval_id = await request_approval(stack)
    assert stack.backend.effect_counts().get("refund_order", 0) == 0

    status, listing = await stack.admin("GET", "/v1/approvals", approver)
    assert status == 200
    [pending] = [a for a in listing["approvals"] if a["id"] == approval_id]
    assert (pending["tool"], pending["subject"], pending["tenant"], pending["risk"]) == \
        ("refund_order", "alice", "acme", "financial")
    assert {k: pending["arguments"][k] for k in ("order_id", "amount")} == {"order_id": "ord_1001", "amount": 6000}
    assert re.fullmatch(r"\[redacted hmac-sha256:[0-9a-f]{64}\]", pending["arguments"]["reason"])  # a per-field hash
    assert pending["resources"] == ["order:ord_1001"]
    # The contract lets an approver read the reason (approver_may_read), apart from the masked arguments only.
    assert "complaint" not in json.dumps({**listing, "approvals": [{**a, "revealed": None} for a in listing["approvals"]]})
    assert "complaint" in pending["revealed"]["reason"]

    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver)
    assert status == 200 and body["status"] == "approved" and body["approver"] == "bob"

    status, env = await stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": approval_id})
    assert status == 200, env
    assert env["side_effect"]["attempted"] is True and env["side_effect"]["committed"] is True
    assert stack.backend.effect_counts()["refund_order"] == 1

    status, env = await stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": approval_id})
    assert env["error"]["code"] == "approval_mismatch"
    assert env["error"]["details"]["reason"] == "used"
    assert stack.backend.effect_counts()["refund_order"] == 1
    assert sample(stack, "toolproxy_approvals_total", {"state": "created"}) == 1
    assert sample(stack, "toolproxy_approvals_total", {"state": "approved"}) == 1
    assert sample(stack, "toolproxy_approvals_total", {"state": "consumed"}) == 1

    records = audit_records(capsys.readouterr().out)
    events = [r["details"]["state"] for r in records if r["kind"] == "approval"]
    assert events == ["created", "approved", "consumed"]
    calls = [r for r in records if r["kind"] == "tool_call"]
    # The spent approval is refused before OPA is asked: that call has no policy result.
    assert [c.get("policy", {}).get("result") for c in calls] == ["require_approval", "allow", None]
    assert calls[2]["error_code"] == "approval_mismatch"
    assert calls[0]["policy"]["reasons"] == ["amount_over_threshold"]
    assert calls[1]["policy"]["policy_revision"] == "demo-1"
    assert calls[1]["policy"]["risk"] == "financial"
    assert calls[1]["approval_id"] == approval_id


async def test_approval_for_100_does_not_cover_10000(stack, approver, issuers):
    """globex approves every refund (threshold 0): the approved 100 cannot become 10000."""
    agent, _ = issuers
    globex = {"Authorization": f"Bearer {agent.token('gina', tenant='globex')}"}
    small = {"order_id": "ord_2001", "amount": 100, "reason": "duplicate"}
    approval_id = await request_approval(stack, small, headers=globex)
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    status, env = await stack.call("refund_order", {**small, "amount": 10000},
                                   headers={**globex, "X-Approval-Id": approval_id})
    assert status == 403
    assert env["error"]["code"] == "approval_mismatch"
    assert env["error"]["details"]["reason"] == "mismatch"
    assert stack.backend.effect_counts().get("refund_order", 0) == 0
    # The mismatch did not spend it: the approved call itself still runs.
    status, env = await stack.call("refund_order", small, headers={**globex, "X-Approval-Id": approval_id})
    assert status == 200, env


async def test_expired_approval_is_refused(stack, approver, redis_server):
    approval_id = await request_approval(stack)
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    client = redis_server.client()
    try:  # time passes: the stored expiry is now in the past
        client.hset(key("toolproxy", "approval", approval_id), "expires_at_ms", now_ms() - 1)
    finally:
        client.close()
    status, env = await stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": approval_id})
    assert env["error"]["code"] == "approval_mismatch"
    assert env["error"]["details"]["reason"] == "expired"
    assert stack.backend.effect_counts().get("refund_order", 0) == 0


async def test_self_approval_is_refused(stack, issuers):
    _, admin = issuers
    approval_id = await request_approval(stack)
    alice_as_approver = admin.token("alice", audience="toolproxy-admin", roles=["approver"])
    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", alice_as_approver)
    assert status == 403
    assert body["error"]["code"] == "forbidden" and body["error"]["details"]["reason"] == "self_approval"
    status, env = await stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": approval_id})
    assert env["error"]["code"] == "approval_required"  # still pending


async def test_agent_credential_cannot_use_the_admin_listener(stack, issuers):
    agent, admin = issuers
    approval_id = await request_approval(stack)
    agent_token = stack.headers["Authorization"].split(" ", 1)[1]
    agent_with_role = agent.token("alice", roles=["approver", "agent"])
    wrong_audience = admin.token("bob", audience="toolproxy", roles=["approver"])
    no_role = admin.token("bob", audience="toolproxy-admin", roles=["agent"])
    for token in (None, agent_token, agent_with_role, wrong_audience, no_role):
        for method, path in (("GET", "/v1/approvals"), ("POST", f"/v1/approvals/{approval_id}/approve")):
            status, body = await stack.admin(method, path, token)
            # A valid admin token without the approver role is known, not allowed: 403 forbidden.
            expected = (403, "forbidden") if token is no_role else (401, "unauthorized")
            assert (status, body["error"]["code"]) == expected, (token, path)
    # and the admin credential is no agent credential either
    status, env = await stack.call("get_order", {"order_id": "ord_1001"},
                                   headers={"Authorization": f"Bearer {admin.token('bob', audience='toolproxy-admin')}"})
    assert status == 401


@all_redis_modes
async def test_concurrent_resubmits_use_the_approval_once(stack, approver):
    approval_id = await request_approval(stack)
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    results = await asyncio.gather(*[
        stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": approval_id}) for _ in range(8)])
    codes = sorted(env["error"]["code"] if env["error"] else "ok" for _, env in results)
    assert codes == ["approval_mismatch"] * 7 + ["ok"]
    assert stack.backend.effect_counts()["refund_order"] == 1


async def test_pending_and_denied_approvals(stack, approver):
    approval_id = await request_approval(stack)
    status, env = await stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": approval_id})
    assert env["error"]["code"] == "approval_required"
    assert env["error"]["details"]["approval_id"] == approval_id
    assert sample(stack, "toolproxy_pending_approvals") == 1

    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/deny", approver)
    assert status == 200 and body["status"] == "denied"
    assert sample(stack, "toolproxy_pending_approvals") == 0
    status, env = await stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": approval_id})
    assert env["error"]["code"] == "approval_mismatch" and env["error"]["details"]["reason"] == "denied"
    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver)
    assert status == 409 and body["error"]["code"] == "approval_not_pending"
    assert stack.backend.effect_counts().get("refund_order", 0) == 0


async def test_approvals_are_scoped_to_tenant_and_caller(stack, issuers, approver):
    agent, admin = issuers
    approval_id = await request_approval(stack)
    globex_approver = admin.token("gus", audience="toolproxy-admin", roles=["approver"], tenant="globex")
    status, body = await stack.admin("GET", "/v1/approvals", globex_approver)
    assert status == 200 and approval_id not in json.dumps(body)
    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", globex_approver)
    assert status == 404 and body["error"]["code"] == "approval_not_found"
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    # Another caller of the same tenant cannot borrow alice's approval.
    other = {"Authorization": f"Bearer {agent.token('mallory')}", "X-Approval-Id": approval_id}
    status, env = await stack.call("refund_order", BIG_REFUND, headers=other)
    assert env["error"]["code"] == "approval_mismatch" and env["error"]["details"]["reason"] == "mismatch"
    # An unknown id is a mismatch, not a hint about what exists.
    status, env = await stack.call("refund_order", BIG_REFUND, headers={"X-Approval-Id": "apr_0123"})
    assert env["error"]["code"] == "approval_mismatch" and env["error"]["details"]["reason"] == "not_found"


async def test_destructive_tool_always_needs_approval(stack, approver):
    status, env = await stack.call("delete_customer", {"customer_id": "cus_1002"})
    assert env["error"]["code"] == "approval_required"
    approval_id = env["error"]["details"]["approval_id"]
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    status, env = await stack.call("delete_customer", {"customer_id": "cus_1002"},
                                   headers={"X-Approval-Id": approval_id})
    assert status == 200, env


async def approved(stack, approver, key: str, arguments=BIG_REFUND) -> str:
    approval_id = await request_approval(stack, arguments, headers={"Idempotency-Key": key})
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    return approval_id


@all_redis_modes
async def test_lost_response_is_replayed_with_the_spent_approval(stack, approver, capsys):
    """The answer to an approved write was lost: the same call, approval and key get the stored result."""
    same = {"Idempotency-Key": "refund-4711"}
    approval_id = await approved(stack, approver, "refund-4711")
    status, first = await stack.call("refund_order", BIG_REFUND, headers={**same, "X-Approval-Id": approval_id})
    assert status == 200 and "replayed" not in first, first
    assert stack.backend.effect_counts()["refund_order"] == 1

    status, again = await stack.call("refund_order", BIG_REFUND, headers={**same, "X-Approval-Id": approval_id})
    assert status == 200, again
    assert again["replayed"] is True
    assert again["data"] == first["data"] and again["idempotency_key"] == first["idempotency_key"]
    assert stack.backend.effect_counts()["refund_order"] == 1
    assert sample(stack, "toolproxy_approvals_total", {"state": "consumed"}) == 1

    records = audit_records(capsys.readouterr().out)
    assert [r["details"]["state"] for r in records if r["kind"] == "approval"] == ["created", "approved", "consumed"]
    calls = [r for r in records if r["kind"] == "tool_call"]
    # Authorization was recomputed for the duplicate too: OPA was asked and allowed it.
    assert [c.get("policy", {}).get("result") for c in calls] == ["require_approval", "allow", "allow"]


async def test_spent_approval_cannot_cover_another_operation(stack, approver, issuers):
    agent, _ = issuers
    same = {"Idempotency-Key": "refund-4712"}
    approval_id = await approved(stack, approver, "refund-4712")
    status, env = await stack.call("refund_order", BIG_REFUND, headers={**same, "X-Approval-Id": approval_id})
    assert status == 200, env
    # another Idempotency-Key: a new operation, which the spent approval cannot authorize
    status, env = await stack.call("refund_order", BIG_REFUND,
                                   headers={"Idempotency-Key": "refund-4713", "X-Approval-Id": approval_id})
    assert status == 403 and env["error"]["code"] == "approval_mismatch", env
    assert env["error"]["details"]["reason"] == "used"
    # other arguments under the same key
    status, env = await stack.call("refund_order", {**BIG_REFUND, "amount": 7000},
                                   headers={**same, "X-Approval-Id": approval_id})
    assert env["error"]["code"] == "approval_mismatch" and env["error"]["details"]["reason"] == "used"
    # the same call by another caller of the tenant
    status, env = await stack.call("refund_order", BIG_REFUND, headers={
        **same, "X-Approval-Id": approval_id, "Authorization": f"Bearer {agent.token('mallory')}"})
    assert env["error"]["code"] == "approval_mismatch" and env["error"]["details"]["reason"] == "used"
    assert stack.backend.effect_counts()["refund_order"] == 1


async def test_spent_approval_does_not_rerun_a_retryable_failure(stack, approver):
    """The approved run failed without effect (FAILED_RETRYABLE): running it again needs a fresh approval."""
    same = {"Idempotency-Key": "refund-4714"}
    approval_id = await approved(stack, approver, "refund-4714")
    await stack.fault("refund_order", "http_503_not_applied", count=1)
    status, env = await stack.call("refund_order", BIG_REFUND, headers={**same, "X-Approval-Id": approval_id})
    assert env["error"]["code"] == "dependency_unavailable" and env["side_effect"]["committed"] is False, env
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "FAILED_RETRYABLE"

    status, env = await stack.call("refund_order", BIG_REFUND, headers={**same, "X-Approval-Id": approval_id})
    assert status == 403 and env["error"]["code"] == "approval_mismatch", env
    assert env["error"]["details"]["reason"] == "used"
    assert env["error"]["details"]["state"] == "FAILED_RETRYABLE"
    assert env["side_effect"] == {"attempted": False, "committed": False}
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "FAILED_RETRYABLE" and record["attempt"] == 1  # nothing was reserved
    assert stack.backend.effect_counts().get("refund_order", 0) == 0

    fresh = await approved(stack, approver, "refund-4714")
    status, env = await stack.call("refund_order", BIG_REFUND, headers={**same, "X-Approval-Id": fresh})
    assert status == 200, env
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "SUCCEEDED" and record["attempt"] == 2
    assert stack.backend.effect_counts()["refund_order"] == 1
