"""The admin API the console reads (real JWTs, OPA, Redis): sign-in roles, decided approvals with reasons,
recent denials, tenant scoping, the security headers of the admin listener, and what an approver sees of a
request: the agent's own key and ids, the fields a contract lets approvers read (masked in every log), and
the related read run as the approver (its denial, its bound on reads at once)."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.approval_context import MAX_RELATED_READS
from proxy.fronts.console import CSP
from tests.support.audit import audit_records, fingerprinted
from tests.support.waits import wait_until

REFUND = {"order_id": "ord_1001", "amount": 6000, "reason": "dup"}


@pytest.fixture
def stack(jwt_stack):
    return jwt_stack


def admin_token(issuers, subject="amy", roles=("approver",), tenant=None) -> str:
    cross = ["cross-tenant"] if tenant is None else []  # a tenant-less admin token needs the cross-tenant role
    return issuers[1].token(subject, audience="toolproxy-admin", roles=[*roles, *cross], tenant=tenant, scope="")


async def request(stack, method, path, token, json=None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with stack.session.request(method, stack.admin_url + path, headers=headers, json=json) as response:
        return response.status, await response.json(content_type=None), response.headers


async def test_whoami_names_the_console_roles_and_refuses_other_tokens(stack, issuers):
    both = admin_token(issuers, roles=("approver", "operator", "viewer"), tenant="acme")
    status, me, headers = await request(stack, "GET", "/v1/whoami", both)
    assert (status, me) == (200, {"subject": "amy", "tenant": "acme", "roles": ["approver", "operator"]})
    assert headers["Content-Security-Policy"] == CSP and headers["X-Frame-Options"] == "DENY"
    for token in (issuers[0].token("alice"), admin_token(issuers, roles=("viewer",)), None):
        status, body, headers = await request(stack, "GET", "/v1/whoami", token)
        assert (status, body["error"]["code"]) == (401, "unauthorized")
        assert headers["X-Frame-Options"] == "DENY"  # error envelopes carry the headers too


async def test_decisions_keep_the_approvers_reason_and_are_listed_newest_first_per_tenant(stack, issuers):
    ids = []
    for key in ("k1", "k2"):
        _, envelope = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": key})
        ids.append(envelope["error"]["details"]["approval_id"])
    approver = admin_token(issuers)
    status, too_long, _ = await request(stack, "POST", f"/v1/approvals/{ids[0]}/deny", approver, {"reason": "x" * 501})
    assert (status, too_long["error"]["code"]) == (400, "invalid_request")
    status, odd, _ = await request(stack, "POST", f"/v1/approvals/{ids[0]}/deny", approver, {"note": "?"})
    assert (status, odd["error"]["code"]) == (400, "invalid_request")
    assert (await request(stack, "POST", f"/v1/approvals/{ids[0]}/deny", approver, {"reason": " wrong order "}))[0] == 200
    assert (await request(stack, "POST", f"/v1/approvals/{ids[1]}/approve", approver))[0] == 200  # no body at all
    _, decided, _ = await request(stack, "GET", "/v1/approvals/decided", approver)
    assert [(a["id"], a["status"], a["approver"], a["decision_reason"]) for a in decided["approvals"]] == [
        (ids[1], "approved", "amy", None), (ids[0], "denied", "amy", "wrong order")]
    _, pending, _ = await request(stack, "GET", "/v1/approvals", approver)
    assert pending["approvals"] == []
    _, other, _ = await request(stack, "GET", "/v1/approvals/decided", admin_token(issuers, tenant="globex"))
    assert other["approvals"] == []


async def test_recent_denials_are_grouped_by_tool_and_reason_code_and_scoped_to_the_tenant(stack, issuers):
    for order in ("ord_2001", "ord_2001"):
        _, envelope = await stack.call("get_order", {"order_id": order})
        assert envelope["error"]["code"] == "forbidden"
    operator = admin_token(issuers, roles=("operator",))
    status, denials, _ = await request(stack, "GET", "/v1/denials", operator)
    assert status == 200
    assert [(g["tool"], g["reason"], g["count"], g["examples"]) for g in denials["by_tool_and_reason"]] == [
        ("get_order", "resource_not_owned", 2, ["resource_not_owned:order:ord_2001"])]
    assert [(d["subject"], d["tenant"]) for d in denials["recent"]] == [("alice", "acme")] * 2
    _, other, _ = await request(stack, "GET", "/v1/denials", admin_token(issuers, tenant="globex"))
    assert other["by_tool_and_reason"] == [] and other["recent"] == []
    assert stack.runtime.metrics.policy_denials.labels("get_order", "resource_not_owned")._value.get() == 2


async def test_the_console_page_is_served_with_its_own_assets_and_no_inline_script(stack):
    async with stack.session.get(stack.admin_url + "/ui") as response:
        page = await response.text()
        assert response.headers["Content-Security-Policy"] == CSP
    assert '<script src="/ui/console.js" defer></script>' in page
    assert page.count("<script") == 1 and "http" not in page.split("<body>")[1]
    for asset, kind in (("console.js", "application/javascript"), ("console.css", "text/css")):
        async with stack.session.get(f"{stack.admin_url}/ui/{asset}") as response:
            assert response.status == 200 and response.content_type == kind
            assert "innerHTML" not in await response.text()
    async with stack.session.get(stack.proxy_url + "/ui") as response:
        assert response.status == 404


# -- what an approver sees of the request: the agent's key and ids, the readable field, the related read ----

REFUNDED = {"order_id": "ord_1003", "amount": 6000, "reason": "customer says duplicate charge"}  # ord_1003: refunded


def reading_approver(issuers, subject="amy", scope="tools:read", tenant="acme") -> str:
    """An approver whose admin token may also read (the demo OPA data grants the approver role get_order)."""
    return issuers[1].token(subject, audience="toolproxy-admin", roles=["approver"], tenant=tenant, scope=scope)


async def test_an_approval_shows_the_agents_own_key_its_ids_and_the_reason_while_logs_stay_masked(stack, issuers,
                                                                                                  capsys):
    _, envelope = await stack.call("refund_order", REFUNDED, call_id="call-7",
                                   headers={"Idempotency-Key": "refund-ticket-4711"})
    assert "customer says duplicate charge" not in json.dumps(envelope)  # the model's answer
    approval_id = envelope["error"]["details"]["approval_id"]
    approver = admin_token(issuers)
    _, view, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}", approver)
    assert (view["caller_key"], view["caller_key_source"], view["call_id"]) == (
        "refund-ticket-4711", "idempotency_key", "call-7")
    assert view["operation_key"] == envelope["idempotency_key"] and view["operation_key"].startswith("ik_")
    assert view["request_id"] == envelope["request_id"]
    assert view["revealed"] == {"reason": "customer says duplicate charge"}
    assert view["arguments"]["reason"].startswith("[redacted hmac-sha256:")
    assert view["related_read"] == {"tool": "get_order", "version": "1.0.0", "arguments": {"order_id": "ord_1003"}}
    _, listing, _ = await request(stack, "GET", "/v1/approvals", approver)
    assert [a["revealed"] for a in listing["approvals"]] == [{"reason": "customer says duplicate charge"}]

    assert (await request(stack, "POST", f"/v1/approvals/{approval_id}/deny", approver, {"reason": "refunded"}))[0] == 200
    _, decided, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}", approver)
    assert decided["revealed"] is None and decided["caller_key"] == "refund-ticket-4711"  # dropped once decided

    out = capsys.readouterr().out
    assert "customer says duplicate charge" not in out  # no audit record, decision record or log line holds it
    assert "refund-ticket-4711" not in out  # the agent's own key stays out of the audit log
    created = [r for r in audit_records(out) if r["kind"] == "approval" and r.get("approval_id") == approval_id
               and r["details"]["state"] == "created"]
    assert [(r["request_id"], r["call_id"], r["idempotency_key"]) for r in created] == [
        (envelope["request_id"], "call-7", envelope["idempotency_key"])]
    calls = [r for r in audit_records(out) if r["kind"] == "tool_call" and r.get("tool") == "refund_order"]
    assert calls and all(fingerprinted(r["arguments"]["reason"]) for r in calls)


async def test_the_related_read_runs_through_the_pipeline_with_the_approvers_authority(stack, issuers, capsys):
    _, envelope = await stack.call("refund_order", REFUNDED, headers={"Idempotency-Key": "refund-again"})
    approval_id = envelope["error"]["details"]["approval_id"]

    status, read, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}/related", reading_approver(issuers))
    assert status == 200, read
    assert (read["permitted"], read["outcome"], read["subject"], read["tenant"]) == (True, "succeeded", "amy", "acme")
    assert read["data"]["status"] == "refunded" and read["data"]["refundable"] == 0  # visible before approving
    reads = [r for r in audit_records(capsys.readouterr().out) if r["kind"] == "tool_call" and r.get("tool") == "get_order"]
    assert [(r["subject"], r["agent"], r["request_id"]) for r in reads] == [("amy", "toolproxy-console", read["request_id"])]

    # The approver's token without the read scope: the policy denies, the answer says so.
    status, denied, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}/related",
                                      reading_approver(issuers, scope=""))
    assert (status, denied["permitted"], denied["data"], denied["error"]["code"]) == (200, False, None, "forbidden")
    _, denials, _ = await request(stack, "GET", "/v1/denials", admin_token(issuers))
    assert ("amy", "get_order") in {(d["subject"], d["tool"]) for d in denials["recent"]}

    # Another tenant's approver does not see the approval at all; a non-approver is refused before anything runs.
    status, other, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}/related",
                                     reading_approver(issuers, tenant="globex"))
    assert (status, other["error"]["code"]) == (404, "approval_not_found")
    status, _, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}/related", issuers[0].token("alice"))
    assert status == 401


async def test_an_approval_without_a_related_read_answers_none(stack, issuers):
    _, envelope = await stack.call("delete_customer", {"customer_id": "cus_1001"},
                                   headers={"Idempotency-Key": "del-1"})
    assert envelope["error"]["code"] == "approval_required", envelope
    approval_id = envelope["error"]["details"]["approval_id"]
    status, read, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}/related", reading_approver(issuers))
    assert (status, read) == (200, {"approval_id": approval_id, "read": None})


async def test_related_reads_past_the_limit_are_refused_while_the_first_ones_wait_on_a_stalled_backend(stack, issuers):
    _, envelope = await stack.call("refund_order", REFUNDED, headers={"Idempotency-Key": "refund-busy"})
    approval_id = envelope["error"]["details"]["approval_id"]
    await stack.fault("get_order", "stall", count=MAX_RELATED_READS)  # the backend holds every read it takes
    approver = reading_approver(issuers)
    path = f"/v1/approvals/{approval_id}/related"
    held = [asyncio.ensure_future(request(stack, "GET", path, approver)) for _ in range(MAX_RELATED_READS)]

    async def all_taken() -> bool:
        return not any(f.tool == "get_order" for f in stack.backend.faults)
    await wait_until(all_taken, timeout=10, what="the stalled backend to take every read")
    status, refused, _ = await request(stack, "GET", path, approver)
    assert (status, refused["error"]["code"], refused["error"]["details"]["limit"]) == (
        429, "rate_limited", MAX_RELATED_READS)
    answers = await asyncio.gather(*held)  # each ends at get_order's own timeout, as an error on the page
    assert all(s == 200 and body["data"] is None and body["error"] is not None for s, body, _ in answers)
    status, again, _ = await request(stack, "GET", path, approver)  # the backend answers again
    assert (status, again["permitted"], again["data"]["order_id"]) == (200, True, "ord_1003")


async def test_the_related_read_is_decided_under_the_requesters_flow_labels(proxy_deps, issuers):
    """The read's arguments are the requesting agent's words: its decision sees what that agent saw (here a
    person's preferences), never the approver's clean context. Before, input.flow was the approver's, or absent."""
    from proxy.authoring.policy_replay import read_stream
    from tests.support.stack import running_stack
    from tests.support.tokens import jwt_overrides

    agent, _ = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(*issuers), "reconcile.enabled": False,
                              "decisions.enabled": True, "decisions.timeout_ms": 5000}) as stack:
        stack.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        status, env = await stack.call("get_user_preferences", {"user_ref": "usr_alice"})
        assert env["outcome"] == "succeeded", env
        _, envelope = await stack.call("refund_order", REFUNDED, headers={"Idempotency-Key": "refund-flow"})
        approval_id = envelope["error"]["details"]["approval_id"]
        status, read, _ = await request(stack, "GET", f"/v1/approvals/{approval_id}/related",
                                        reading_approver(issuers))
        assert status == 200 and read["permitted"] is True, read
        records, _ = await read_stream(proxy_deps["redis.url"], "toolproxy:decisions:{stream}")
        [decided] = [r for r in records if r["request_id"] == read["request_id"]]
        assert decided["input"]["flow"]["labels"] == ["private"]
        assert [s["tool"] for s in decided["input"]["flow"]["principal"]["seen"]] == ["get_user_preferences"]
