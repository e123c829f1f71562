"""Identity and authorization against the real OPA with the repo's policies and demo data."""

from __future__ import annotations

import json
import textwrap
import time
import uuid

import jwt
import pytest
from jsonschema import Draft202012Validator

from proxy.identity import Caller
from proxy.normalize import normalize
from proxy.policy.client import RequestFacts, build_input, catalog_document
from proxy.registry import load_registry, load_schema
from tests.support.mesh import mesh_headers, mesh_settings
from tests.support.servers import OpaServer
from tests.support.stack import DEMO_REGISTRY, REPO, running_stack
from tests.support.tokens import Issuer, jwt_overrides


POLICIES = REPO / "policies"
DEMO_OPA_DATA = REPO / "examples" / "opa"


@pytest.fixture
async def stack(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin)}) as s:
        yield s


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def sample(stack, name: str, labels: dict[str, str] | None = None) -> float:
    return stack.runtime.metrics.registry.get_sample_value(name, labels or {}) or 0.0


# ----------------------------------------------------------------------------- identity


async def test_missing_token_is_unauthorized_before_anything_else(stack):
    status, env = await stack.call("get_order", {"order_id": "ord_1001"})
    assert status == 401 and env["error"]["code"] == "unauthorized"
    assert stack.backend.requests == []


@pytest.mark.parametrize("case", ["expired", "wrong_audience", "wrong_issuer", "not_yet_valid", "no_tenant",
                                  "garbage"])
async def test_invalid_tokens_are_unauthorized(stack, issuers, case, tmp_path):
    agent, _ = issuers
    token = {
        "expired": lambda: agent.token("alice", ttl_s=-120),
        "wrong_audience": lambda: agent.token("alice", audience="someone-else"),
        "wrong_issuer": lambda: Issuer(tmp_path, issuer="https://evil.test", kid="agent-key")
        .token("alice"),
        "not_yet_valid": lambda: agent.token("alice", nbf=int(time.time()) + 3600),
        "no_tenant": lambda: agent.token("alice", tenant=None),
        "garbage": lambda: "not.a.jwt",
    }[case]()
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers=bearer(token))
    assert status == 401, case
    assert env["error"]["code"] == "unauthorized"
    assert token not in json.dumps(env)
    assert stack.backend.requests == []


async def test_alg_none_and_unconfigured_hmac_are_refused(stack, issuers):
    agent, _ = issuers
    claims = {"iss": agent.issuer, "aud": "toolproxy", "sub": "alice", "tenant": "acme", "roles": ["agent"],
              "scope": "tools:read", "exp": int(time.time()) + 300}
    unsigned = jwt.encode(claims, None, algorithm="none")
    hmac = jwt.encode(claims, "a-guessable-secret-of-32-bytes!!", algorithm="HS256", headers={"kid": "agent-key"})
    for token in (unsigned, hmac):
        status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers=bearer(token))
        assert status == 401 and env["error"]["code"] == "unauthorized"


async def test_valid_token_identity_reaches_the_backend(stack, issuers):
    agent, _ = issuers
    status, env = await stack.call("get_order", {"order_id": "ord_1001"},
                                   headers={**bearer(agent.token("alice")), "X-Auth-Tenant": "globex"})
    assert status == 200, env
    seen = stack.backend.requests[-1]["headers"]
    # The mesh header is ignored in jwt mode: the tenant is the token's.
    assert (seen["X-Toolproxy-Subject"], seen["X-Toolproxy-Tenant"]) == ("alice", "acme")
    assert seen["X-Toolproxy-Agent"] == "agent-under-test"


async def test_headers_mode_takes_identity_from_the_mesh_only_when_configured(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **mesh_settings(tmp_path, "mesh-agent")}) as stack:
        status, env = await stack.call("get_order", {"order_id": "ord_2001"})
        assert status == 401 and env["error"]["code"] == "unauthorized"
        status, env = await stack.call("get_order", {"order_id": "ord_2001"},
                                       headers=mesh_headers("gina", "globex", scopes="tools:read"))
        assert status == 200, env
        assert env["data"]["tenant"] == "globex"


# ----------------------------------------------------------------------------- authorization


async def test_resource_of_another_tenant_is_forbidden_without_internals(stack, issuers):
    agent, _ = issuers
    status, env = await stack.call("get_order", {"order_id": "ord_2001"}, headers=bearer(agent.token("alice")))
    assert status == 403
    assert env["error"]["code"] == "forbidden"
    assert env["error"]["phase"] == "authorize"
    assert "resource" not in json.dumps(env["error"]) and "globex" not in json.dumps(env)
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert stack.backend.requests == []
    assert sample(stack, "toolproxy_policy_decisions_total", {"result": "deny"}) == 1


async def test_forged_identity_arguments_change_nothing(proxy_deps, issuers, tmp_path):
    """A tool whose schema lets unknown fields through (strict: false): the forged fields
    reach OPA only as arguments, and the decision is the one for the token's identity."""
    loose = tmp_path / "loose.yaml"
    loose.write_text(textwrap.dedent("""
        tools:
          - name: lookup_order_loose
            version: "1.0.0"
            description: get_order with a loose schema (test only)
            mode: read
            risk: read
            strict: false
            inputSchema: {type: object, required: [order_id], properties: {order_id: {type: string}}}
            outputSchema: {type: object}
            resources: [{template: "order:{order_id}", access: none}]
            backend: {type: http, service: demo, path: /tools/get_order}
    """))
    agent, admin = issuers
    forged = {"tenant_id": "acme", "user_id": "root", "is_admin": True, "role": "support_admin",
              "confirmed": True, "approval_id": "apr_00"}
    overrides = {**proxy_deps, **jwt_overrides(agent, admin), "registry.paths": [str(DEMO_REGISTRY), str(loose)]}
    async with running_stack(overrides) as stack:
        globex = bearer(agent.token("gina", tenant="globex"))
        status, env = await stack.call("lookup_order_loose", {"order_id": "ord_1001", **forged}, headers=globex)
        assert env["error"]["code"] == "forbidden"
        status, env = await stack.call("lookup_order_loose", {"order_id": "ord_1001"}, headers=globex)
        assert env["error"]["code"] == "forbidden"
        # For the owner the same forged fields neither help nor hurt: the call is
        # authorized and reaches the backend (which then refuses the unknown fields).
        acme = bearer(agent.token("alice", tenant="acme"))
        status, env = await stack.call("lookup_order_loose", {"order_id": "ord_1001", "tenant_id": "globex"},
                                       headers=acme)
        assert env["error"]["phase"] == "execute"
        assert stack.backend.requests[-1]["headers"]["X-Toolproxy-Tenant"] == "acme"
        # Strict demo tools refuse such fields before authorization even runs.
        status, env = await stack.call("get_order", {"order_id": "ord_1001", "is_admin": True}, headers=acme)
        assert env["error"]["code"] == "schema_violation"


async def test_role_revoked_in_opa_data_denies_the_next_call(stack, issuers, opa_server):
    agent, _ = issuers
    subject = f"rev-{uuid.uuid4().hex[:8]}"
    path = f"toolproxy/subjects/acme/{subject}"
    headers = bearer(agent.token(subject, roles=[]))  # the role comes from the directory in OPA data
    opa_server.put_data(path, {"roles": ["support"]})
    try:
        status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers=headers)
        assert status == 200, env
        opa_server.put_data(path, {"roles": []})
        status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers=headers)
        assert status == 403 and env["error"]["code"] == "forbidden"
        assert len(stack.backend.requests) == 1
    finally:
        opa_server.put_data(path, {})


async def test_token_role_can_be_revoked_before_the_token_expires(stack, issuers, opa_server):
    agent, _ = issuers
    subject = f"rev-{uuid.uuid4().hex[:8]}"
    path = f"toolproxy/subjects/acme/{subject}"
    headers = bearer(agent.token(subject, roles=["agent"]))
    assert (await stack.call("get_order", {"order_id": "ord_1001"}, headers=headers))[0] == 200
    opa_server.put_data(path, {"revoked_roles": ["agent"]})
    try:
        status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers=headers)
        assert env["error"]["code"] == "forbidden"
    finally:
        opa_server.put_data(path, {})


async def test_batch_like_call_mixing_owned_and_foreign_resources_is_denied(stack, issuers):
    agent, _ = issuers
    headers = bearer(agent.token("alice"))
    status, env = await stack.call("get_orders", {"order_ids": ["ord_1001", "ord_2001"]}, headers=headers)
    assert status == 403 and env["error"]["code"] == "forbidden"
    assert stack.backend.requests == []
    status, env = await stack.call("get_orders", {"order_ids": ["ord_1001", "ord_1002"]}, headers=headers)
    assert status == 200, env
    assert [o["order_id"] for o in env["data"]["orders"]] == ["ord_1001", "ord_1002"]


async def test_scope_is_required(stack, issuers):
    agent, _ = issuers
    status, env = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1},
                                   headers=bearer(agent.token("alice", scope="tools:read")))
    assert env["error"]["code"] == "forbidden"


async def test_decision_id_and_revision_are_kept_with_the_call(proxy_deps, issuers):
    """With OPA's decision log on, the envelope of a denial names OPA's decision id
    (the key into OPA's own log) and the policy revision; never the reasons."""
    agent, admin = issuers
    with OpaServer([POLICIES, DEMO_OPA_DATA], extra_args=["--set", "decision_logs.console=true"]) as opa:
        overrides = {**proxy_deps, **jwt_overrides(agent, admin), **opa.settings}
        async with running_stack(overrides) as stack:
            headers = bearer(agent.token("alice"))
            assert (await stack.call("get_order", {"order_id": "ord_1001"}, headers=headers))[0] == 200
            status, env = await stack.call("get_order", {"order_id": "ord_2001"}, headers=headers)
            details = env["error"]["details"]
            assert details["policy_revision"] == "demo-1"
            assert "reasons" not in details
            assert details["decision_id"] in opa.log()
            assert sample(stack, "toolproxy_policy_decisions_total", {"result": "allow"}) == 1
            assert sample(stack, "toolproxy_policy_decisions_total", {"result": "deny"}) == 1
            assert sample(stack, "toolproxy_opa_request_duration_seconds_count") >= 2
            assert sample(stack, "toolproxy_dependency_up", {"dependency": "opa"}) == 1


# ----------------------------------------------------------------------------- discovery


async def test_tool_listing_follows_authorization(stack, issuers):
    agent, _ = issuers

    async def names(token):
        async with stack.session.get(stack.proxy_url + "/v1/tools", headers=bearer(token)) as response:
            assert response.status == 200
            return [t["name"] for t in (await response.json())["tools"]]

    everything = await names(agent.token("alice"))
    assert {"get_order", "refund_order", "delete_customer", "adjust_counter"} <= set(everything)
    viewer = await names(agent.token("victor", roles=["viewer"], scope="tools:read"))
    assert viewer == ["get_inventory", "get_order", "get_orders", "get_user_preferences"]
    read_only_scope = await names(agent.token("alice", scope="tools:read"))
    assert "refund_order" not in read_only_scope and "get_order" in read_only_scope
    async with stack.session.get(stack.proxy_url + "/v1/tools") as response:
        assert response.status == 401


# ----------------------------------------------------------------------------- the input contract


def test_policy_inputs_match_the_published_schema():
    registry = load_registry([DEMO_REGISTRY])
    validator = Draft202012Validator(load_schema("opa-input.schema.json"))
    caller = Caller(subject="alice", tenant="acme", roles=("agent",), scopes=("tools:read",), agent="a1",
                    source="jwt")
    tool = registry.resolve("get_orders")
    normalized = normalize(tool, {"order_ids": ["ord_1", "ord_2"]})
    digest = catalog_document(registry)["digest"]
    call = build_input("call", caller, RequestFacts(request_id="r1", call_id="c1"), catalog_digest=digest,
                       tool=tool, normalized=normalized)
    listing = build_input("list", caller, RequestFacts(request_id="r2"), catalog_digest=digest,
                          tools=registry.active())
    for document in (call, listing):
        errors = [e.message for e in validator.iter_errors(document)]
        assert not errors, errors
    assert [r["id"] for r in call["resources"]] == ["order:ord_1", "order:ord_2"]
    assert call["approval"] is None
