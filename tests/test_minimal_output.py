"""The model sees the minimum by default: only the fields a contract's outputSchema declares, never a field
it marks sensitive (echoed from the arguments or not) or one that looks like a credential, with or without
an output_filter; the record keeps the whole result, and an operator's read of it is audited."""

from __future__ import annotations

import pytest

from tests.support.audit import audit_records
from tests.support.stack import extra_tools, running_stack
from tests.support.tokens import jwt_overrides
from tests.test_operations_admin import operator

CONTRACTS = """
tools:
  - name: order_brief
    version: "1.0.0"
    description: get_order under an open outputSchema that declares a few fields.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [order_id]
      properties: {order_id: {type: string, pattern: "^ord_[A-Za-z0-9]+$"}}
    outputSchema:
      type: object
      required: [order_id, status]
      properties:
        order_id: {type: string}
        tenant: {type: string}
        status: {type: string}
        total: {type: integer}
    sensitive_fields: [order_id, tenant]
    timeout_ms: 2000
    backend: {type: http, service: demo, path: /tools/get_order}
  - name: order_brief_all
    version: "1.0.0"
    description: the same, letting undeclared fields through.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [order_id]
      properties: {order_id: {type: string, pattern: "^ord_[A-Za-z0-9]+$"}}
    outputSchema:
      type: object
      properties: {order_id: {type: string}, status: {type: string}}
    output_filter: {declared_only: false}
    sensitive_fields: [order_id]
    timeout_ms: 2000
    backend: {type: http, service: demo, path: /tools/get_order}
  - name: bump_brief
    version: "1.0.0"
    description: adjust_counter whose outputSchema declares only the new value.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [counter, delta]
      properties: {counter: {type: string, pattern: "^ctr_[A-Za-z0-9_]+$"}, delta: {type: integer}}
    outputSchema: {type: object, required: [value], properties: {value: {type: integer}}}
    resources: [{template: "counter:{counter}"}]
    timeout_ms: 3000
    backend: {type: http, service: demo, path: /tools/adjust_counter}
"""


@pytest.fixture
async def stack(proxy_deps, issuers, tmp_path):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), **extra_tools(tmp_path, CONTRACTS)}) as s:
        s.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        yield s


async def test_only_declared_fields_reach_the_model_and_sensitive_ones_never(stack):
    status, env = await stack.call("order_brief", {"order_id": "ord_1001"})
    assert status == 200, env
    # Undeclared (refundable, currency) dropped; the echoed order_id and the tenant are sensitive.
    assert set(env["data"]) == {"status", "total"}, env
    status, env = await stack.call("order_brief_all", {"order_id": "ord_1001"})
    assert set(env["data"]) == {"tenant", "status", "total", "refundable", "currency"}, env  # no order_id
    # The listing advertises what the model gets.
    _, listing = await stack.get("/v1/tools")
    [brief] = [t for t in listing["tools"] if t["name"] == "order_brief"]
    assert set(brief["outputSchema"]["properties"]) == {"status", "total"}
    assert brief["outputSchema"]["required"] == ["status"]


async def test_the_record_keeps_the_whole_result_and_an_operators_read_is_audited(stack, issuers, capsys):
    status, env = await stack.call("bump_brief", {"counter": "ctr_brief", "delta": 3})
    assert status == 200 and env["data"] == {"value": 3}, env
    _, agent_view = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert agent_view["result"] == {"value": 3}
    status, view = await stack.admin("GET", f"/v1/operations/{env['idempotency_key']}", operator(issuers))
    assert status == 200 and view["result"] == {"counter": "ctr_brief", "value": 3}, view
    [read] = [r for r in audit_records(capsys.readouterr().out) if r["kind"] == "operator_read"]
    assert read["idempotency_key"] == env["idempotency_key"] and read["tool"] == "bump_brief"
    assert read["details"] == {"operator": "olga", "operator_tenant": None, "result": True}
