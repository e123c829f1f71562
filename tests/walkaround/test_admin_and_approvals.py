"""Walk-around: admin tokens, what an approver sees, and the agent listener's Host check (issue 28, section 7).

- An admin token without a tenant claim would see every tenant: it is refused
  unless it carries the explicit cross-tenant role.
- The self-approval check compares one configured claim (here ``email``) across
  the agents' and the admins' IdPs: the same person under two subjects cannot
  approve their own request.
- The approver sees every value the approval binds, in full; masked fields as
  per-field hashes; a call whose summary cannot be shown whole is refused at
  creation (``approval_summary_too_large``).
- The DNS-rebinding guard covers every agent route, not only ``/mcp``.
Real proxy, OPA, Redis, demo backend and JWTs.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import aiohttp
import pytest

from tests.support.stack import extra_tools, running_stack
from tests.support.tokens import jwt_overrides

WIPE = """
tools:
  - name: wipe_archive
    version: "1.0.0"
    description: a destructive tool (always needs an approval) with free-form arguments
    mode: write
    risk: destructive
    inputSchema:
      type: object
      additionalProperties: false
      required: [note, items]
      properties:
        note: {type: string}
        items: {type: array, items: {type: string}}
        secret_code: {type: string}
    outputSchema: {type: object}
    timeout_ms: 3000
    sensitive_fields: [secret_code]
    backend: {type: http, service: demo, path: /tools/adjust_counter}
"""


@pytest.fixture
async def stack(proxy_deps, issuers, tmp_path):
    agent, admin = issuers
    settings = {**proxy_deps, **jwt_overrides(agent, admin), **extra_tools(tmp_path, WIPE),
                "reconcile.enabled": False, "identity.person_claim": "email", "admin_identity.person_claim": "email",
                "approvals.max_summary_bytes": 200000}
    async with running_stack(settings) as s:
        s.headers["Authorization"] = f"Bearer {agent.token('alice', email='Alice@Example.com')}"
        yield s


def admin_token(issuers, subject: str, *, roles: list[str], tenant: str | None = "acme", **claims) -> str:
    return issuers[1].token(subject, audience="toolproxy-admin", roles=roles, tenant=tenant, scope="", **claims)


async def pending_wipe(stack, arguments) -> str:
    status, env = await stack.call("wipe_archive", arguments)
    assert status == 403 and env["error"]["code"] == "approval_required", env
    return env["error"]["details"]["approval_id"]


async def test_a_tenant_less_admin_token_is_refused_without_the_cross_tenant_role(stack, issuers):
    for path in ("/v1/approvals", "/v1/takeovers", "/v1/whoami", "/v1/locks"):
        status, body = await stack.admin("GET", path, admin_token(issuers, "olga", roles=["approver", "operator"],
                                                                  tenant=None))
        assert status == 403 and body["error"]["code"] == "forbidden", (path, body)
        assert body["error"]["details"]["required_role"] == "cross-tenant"
    status, _ = await stack.admin("GET", "/v1/approvals",
                                  admin_token(issuers, "olga", roles=["approver", "cross-tenant"], tenant=None))
    assert status == 200
    status, _ = await stack.admin("GET", "/v1/approvals", admin_token(issuers, "olga", roles=["approver"]))
    assert status == 200  # a tenant claim scopes the token: no cross-tenant role needed


async def test_the_same_person_cannot_approve_their_own_request_across_the_two_idps(stack, issuers):
    approval_id = await pending_wipe(stack, {"note": "clean up", "items": ["a"]})
    same_person = admin_token(issuers, "alice.admin", roles=["approver"], email="alice@example.com")
    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", same_person)
    assert status == 403 and body["error"]["details"]["reason"] == "self_approval", body
    no_claim = admin_token(issuers, "bob", roles=["approver"])
    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", no_claim)
    assert status == 403 and body["error"]["details"]["reason"] == "person_unknown", body
    other = admin_token(issuers, "bob", roles=["approver"], email="bob@example.com")
    status, body = await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", other)
    assert status == 200 and body["status"] == "approved", body


async def test_the_approver_sees_every_bound_value_in_full_and_masked_fields_as_hashes(stack, issuers):
    arguments = {"note": "n" * 5000, "items": [f"item-{i}" for i in range(120)],
                 "secret_code": "hunter2-hunter2"}
    approval_id = await pending_wipe(stack, arguments)
    status, view = await stack.admin("GET", f"/v1/approvals/{approval_id}",
                                     admin_token(issuers, "bob", roles=["approver"], email="bob@example.com"))
    assert status == 200, view
    shown = view["arguments"]
    assert shown["note"] == arguments["note"] and shown["items"] == arguments["items"]  # nothing cut
    key = stack.runtime.integrity.mac.derived_key("field-hash")  # keyed: nobody without it can test guesses
    expected = hmac.new(key, (approval_id + "\n" + json.dumps("hunter2-hunter2")).encode(), hashlib.sha256)
    assert shown["secret_code"] == f"[redacted hmac-sha256:{expected.hexdigest()}]"
    assert "hunter2" not in json.dumps(view)


async def test_a_summary_too_large_to_show_whole_refuses_the_approval_at_creation(stack):
    status, env = await stack.call("wipe_archive", {"note": "x" * 300000, "items": []})
    assert status == 422 and env["error"]["code"] == "approval_summary_too_large", env
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert env["error"]["details"]["limit_bytes"] == 200000


async def test_every_agent_route_refuses_a_foreign_host_or_origin(stack):
    async with aiohttp.ClientSession() as session:
        for method, path in (("GET", "/v1/tools"), ("POST", "/v1/tool-calls"), ("GET", "/v1/operations/ik_0"),
                             ("POST", "/v1/openai/tool-calls"), ("POST", "/v1/batches/b1:cancel")):
            for headers in ({"Host": "evil.example"}, {"Origin": "http://evil.example"}):
                async with session.request(method, stack.proxy_url + path, json={},
                                           headers={**stack.headers, **headers}) as response:
                    body = await response.json()
                    assert response.status == 403 and body["error"]["code"] == "origin_not_allowed", \
                        (path, headers, body)
        async with session.get(stack.proxy_url + "/v1/tools", headers=stack.headers) as response:
            assert response.status == 200


async def test_person_claims_both_sub_across_two_idps_are_named_at_start(proxy_deps, issuers, caplog):
    """By default both person claims are ``sub``: across two IdPs one person's agent and approver accounts
    never compare equal, so the self-approval check is inert. The start says so, naming both settings."""
    agent, admin = issuers
    with caplog.at_level("WARNING"):
        async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False}):
            pass
    named = [r.getMessage() for r in caplog.records if "self-approval check" in r.getMessage()]
    assert len(named) == 1, named
    assert "identity.person_claim" in named[0] and "admin_identity.person_claim" in named[0]
    caplog.clear()
    with caplog.at_level("WARNING"):  # a claim both IdPs carry for a person: nothing to say
        async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False,
                                  "identity.person_claim": "email", "admin_identity.person_claim": "email"}):
            pass
    assert not [r for r in caplog.records if "self-approval check" in r.getMessage()]


async def flood_approvals(stack, agent, count: int) -> list[str]:
    flood = {"Authorization": f"Bearer {agent.token('mallory')}"}
    codes = []
    for i in range(count):
        status, env = await stack.call("wipe_archive", {"note": f"flood {i}", "items": []}, headers=flood)
        codes.append(env["error"]["code"])
    return codes


async def test_one_agent_cannot_hide_another_tenants_pending_approvals(proxy_deps, issuers, tmp_path):
    """Approvals are indexed per tenant: the fleet's index, capped before it was filtered by tenant, let a
    flood from one agent hide globex's approval from globex's approver."""
    agent, admin = issuers
    settings = {**proxy_deps, **jwt_overrides(agent, admin), **extra_tools(tmp_path, WIPE),
                "reconcile.enabled": False, "approvals.max_list": 5}
    async with running_stack(settings) as stack:
        assert await flood_approvals(stack, agent, 6) == ["approval_required"] * 6
        status, env = await stack.call("wipe_archive", {"note": "globex's own", "items": []},
                                       headers={"Authorization": f"Bearer {agent.token('gina', tenant='globex')}"})
        assert env["error"]["code"] == "approval_required", env
        theirs = env["error"]["details"]["approval_id"]
        status, listed = await stack.admin("GET", "/v1/approvals",
                                           admin_token(issuers, "gus", roles=["approver"], tenant="globex"))
        assert status == 200 and [a["id"] for a in listed["approvals"]] == [theirs], listed


async def test_a_subject_has_a_quota_of_pending_approvals(proxy_deps, issuers, tmp_path):
    agent, admin = issuers
    settings = {**proxy_deps, **jwt_overrides(agent, admin), **extra_tools(tmp_path, WIPE),
                "reconcile.enabled": False, "approvals.max_pending_per_subject": 8}
    async with running_stack(settings) as stack:
        assert await flood_approvals(stack, agent, 10) == ["approval_required"] * 8 + ["rate_limited"] * 2
        status, env = await stack.call("wipe_archive", {"note": "alice's own", "items": []},
                                       headers={"Authorization": f"Bearer {agent.token('alice')}"})
        assert env["error"]["code"] == "approval_required", env  # another subject's quota is its own
