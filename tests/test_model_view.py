"""What the model is shown of a result, and the evidence it carries (issue 29 items 8 and 9; seed 003
§3.9 and §4, seed 004 §1 and §6), end to end with real OPA, Redis and the demo backend:

* the demo's ``refund_order`` returns only its confirmation: the envelope, a replay and the agent's
  operation view carry the exposed fields; the record (the operator's view) keeps the full answer;
* a committed write carries ``evidence`` (backend request id, result digest, server time, resource
  keys) and ``side_effect.summary``;
* an oversized result is ``truncated`` where its contract allows it, ``output_invalid`` where not.
"""

from __future__ import annotations

import pytest

from proxy.normalize import digest
from proxy.operation_views import find_operation
from tests.support.stack import extra_tools, running_stack

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}
CONFIRMATION = {"refund_id", "order_id", "amount", "status"}

LIMITED = """
tools:
  - name: orders_truncated
    version: "1.0.0"
    description: get_orders whose answer is shortened to fit.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [order_ids]
      properties: {order_ids: {type: array, items: {type: string}}}
    outputSchema:
      type: object
      required: [orders]
      properties: {orders: {type: array, minItems: 1, items: {type: object}}}
    output_limit: {max_bytes: 300, truncate: true}
    backend: {type: http, service: demo, path: /tools/get_orders}
  - name: orders_bounded
    version: "1.0.0"
    description: get_orders whose answer must fit whole.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [order_ids]
      properties: {order_ids: {type: array, items: {type: string}}}
    outputSchema: {type: object, properties: {orders: {type: array}}}
    output_limit: {max_bytes: 300}
    backend: {type: http, service: demo, path: /tools/get_orders}
"""


@pytest.fixture
async def stack(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, LIMITED), "reconcile.enabled": False}) as s:
        s.auto_key = True
        yield s


async def test_a_write_shows_the_model_only_its_confirmation_and_the_record_keeps_the_rest(stack):
    status, env = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "refund-view-1"})
    assert status == 200 and env["outcome"] == "succeeded", env
    assert set(env["data"]) == CONFIRMATION  # no refundable_remaining: the order's balance is not the model's
    key = env["idempotency_key"]
    record = await stack.runtime.operations.get(key)
    full = record.outcome["data"]
    assert full["refundable_remaining"] == stack.backend.orders["ord_1001"]["refundable"]
    assert {k: full[k] for k in CONFIRMATION} == env["data"]
    # The agent's operation view and a duplicate's replay: filtered as well.
    _, view = await stack.get(f"/v1/operations/{key}")
    assert view["result"] == env["data"]
    status, again = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "refund-view-1"})
    assert again["replayed"] is True and again["data"] == env["data"]
    # The operator's view (admin listener) shows the full result.
    operator = await find_operation(stack.runtime.operations, key, tenant=None, registry=stack.runtime.registry)
    assert operator["result"] == full
    assert len(stack.backend.effects) == 1


async def test_a_committed_write_carries_its_evidence_and_summary(stack):
    status, env = await stack.call("refund_order", REFUND)
    assert status == 200, env
    evidence = env["evidence"]
    record = await stack.runtime.operations.get(env["idempotency_key"])
    assert evidence["result_digest"] == digest(record.outcome["data"])  # the full result's digest
    assert evidence["resource_keys"] == ["order:ord_1001"]
    assert evidence["server_time"] and evidence["server_time"].endswith("Z")
    assert evidence["backend_request_id"].startswith("breq_")  # the demo backend's X-Backend-Request-Id
    assert env["side_effect"]["committed"] is True
    assert env["side_effect"]["summary"] == "refund_order 1.0.0 committed on order:ord_1001"
    _, again = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "test-key-1"})
    assert again["replayed"] is True and again["evidence"] == evidence  # the evidence recorded when it ran
    # A read has no effect: no evidence, no summary.
    _, read = await stack.call("get_order", {"order_id": "ord_1001"})
    assert "evidence" not in read and "summary" not in read["side_effect"]


async def test_an_oversized_result_is_truncated_only_where_the_contract_allows_it(stack):
    ids = {"order_ids": ["ord_1001", "ord_1002", "ord_1003"]}
    status, env = await stack.call("orders_truncated", ids)
    assert status == 200 and env["outcome"] == "succeeded" and env["truncated"] is True, env
    assert 1 <= len(env["data"]["orders"]) < 3
    assert env["data"]["orders"][0]["order_id"] == "ord_1001"  # shortened from its end, in order
    status, refused = await stack.call("orders_bounded", ids)
    assert status == 502 and refused["error"]["code"] == "output_invalid"
    assert refused["error"]["details"]["limit_bytes"] == 300
    _, small = await stack.call("orders_truncated", {"order_ids": ["ord_1001"]})
    assert small["outcome"] == "succeeded" and "truncated" not in small
