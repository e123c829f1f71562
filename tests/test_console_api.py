"""The admin API the console reads (real JWTs, OPA, Redis): sign-in roles, decided approvals with reasons,
recent denials, tenant scoping, and the security headers of the admin listener."""

from __future__ import annotations

import pytest

from proxy.fronts.console import CSP

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
