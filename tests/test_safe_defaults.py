"""The seeds' guarantees by default (issue 29, "Safe by default", items 1-6), with real OPA and Redis.

1. A write needs a key a retry reproduces: keyless writes are refused (saying how to send one), an MCP
   ``_meta`` key stands in for the header (never an OpenAI ``tool_call.id``), and a refund resent after
   ``timeout_unknown`` refunds once. Opting out is per tool, with a stated reason.
2. An unknown outcome freezes its resources for writes of other operations until it settles.
3. A write that declares no resources is serialized with every write of its service.
4. Two writes on one resource with no stated order are refused (``invalid_plan``); ``depends_on`` or
   ``"order": "list"`` state it.
5. A call with less than ``min_budget_ms`` left is not sent (``timeout_not_started``).
6. A batch whose only effects are uncertain is ``uncertain``, never ``failed``.
(Item 7, MCP's unknown tool as -32602, is in tests/test_mcp_front.py and the MCP client tests.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import pytest

from proxy.cli import main as cli_main
from proxy.registry import RegistryError, load_registry, notices
from tests.support.stack import DEMO_REGISTRY, extra_tools, running_stack
from tests.support.tokens import jwt_overrides
from tests.support.waits import wait_until

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}

# refund_order's backend behind a contract written before the default changed: no idempotency block.
LEGACY_REFUND = """
tools:
  - name: refund_legacy
    version: "1.0.0"
    description: refund_order under a contract that says nothing about idempotency.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [order_id, amount, reason]
      properties:
        order_id: {type: string, pattern: "^ord_[A-Za-z0-9]+$"}
        amount: {type: integer, minimum: 1}
        reason: {type: string}
    resources: [{template: "order:{order_id}"}]
    timeout_ms: 5000
    backend: {type: http, service: demo, path: /tools/refund_order}
    status_endpoint: {service: demo, path: /status/refund_order}
"""

# adjust_counter's backend: once opted out (with its reason), once with no resources, once with a budget floor.
COUNTERS = """
tools:
  - name: bump_keyless
    version: "1.0.0"
    description: adjust_counter, keyless on purpose.
    mode: write
    risk: write
    inputSchema: &counter_in
      type: object
      additionalProperties: false
      required: [counter, delta]
      properties:
        counter: {type: string, pattern: "^ctr_[A-Za-z0-9_]+$"}
        delta: {type: integer, minimum: -1000, maximum: 1000}
    resources: [{template: "counter:{counter}"}]
    idempotency: {required: false, reason: "test counters; a repeated increment is harmless here"}
    backend: {type: http, service: demo, path: /tools/adjust_counter}
  - name: bump_anything
    version: "1.0.0"
    description: adjust_counter, declaring no resources.
    mode: write
    risk: write
    inputSchema: *counter_in
    backend: {type: http, service: demo, path: /tools/adjust_counter}
  - name: bump_carefully
    version: "1.0.0"
    description: adjust_counter, never sent with less than a second left.
    mode: write
    risk: write
    inputSchema: *counter_in
    resources: [{template: "counter:{counter}"}]
    timeout_ms: 3000
    min_budget_ms: 1000
    backend: {type: http, service: demo, path: /tools/adjust_counter}
"""


def refunds(stack) -> int:
    return stack.backend.effect_counts().get("refund_order", 0)


def counter_calls(stack) -> list[Any]:
    return [iv for iv in stack.backend.intervals if iv.tool == "adjust_counter"]


def key() -> dict[str, str]:
    return {"Idempotency-Key": f"safe-{uuid.uuid4().hex}"}


def max_overlap(spans: list[Any]) -> int:
    events = sorted([(iv.start, 1) for iv in spans] + [(iv.end, -1) for iv in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


@pytest.fixture
async def stack(proxy_deps, tmp_path):
    (tmp_path / "more").mkdir()
    overrides = {**proxy_deps, **extra_tools(tmp_path, LEGACY_REFUND), "reconcile.enabled": False,
                 "reconcile.backoff_initial_ms": 1}
    (tmp_path / "more" / "counters.yaml").write_text(COUNTERS)
    overrides["registry.paths"] = [*overrides["registry.paths"], str(tmp_path / "more" / "counters.yaml")]
    async with running_stack(overrides) as s:
        s.auto_key = False  # these tests say which key each call carries
        yield s


# -- 1. a write needs a key a retry reproduces --------------------------------------------------------------


async def test_a_keyless_write_is_refused_before_anything_is_sent_and_the_answer_says_how(stack):
    status, env = await stack.call("refund_legacy", REFUND)
    assert status == 428 and env["error"]["code"] == "idempotency_key_required"
    assert "Idempotency-Key" in env["error"]["message"] and "X-Run-Id" in env["error"]["message"]
    assert "io.toolproxy/idempotency-key" in env["error"]["message"]
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert refunds(stack) == 0


async def test_a_refund_resent_after_timeout_unknown_refunds_once(stack):
    """The duplicate effect of the issue: on main a keyless resend got a fresh key and refunded twice."""
    await stack.fault("refund_order", "drop_after_commit", count=1)
    headers = key()
    _, first = await stack.call("refund_legacy", REFUND, headers=headers)
    assert first["error"]["code"] == "timeout_unknown" and refunds(stack) == 1
    status, again = await stack.call("refund_legacy", REFUND, headers=headers)  # the client's retry
    assert status == 409 and again["error"]["code"] == "operation_unknown"
    assert again["idempotency_key"] == first["idempotency_key"]
    _, keyless = await stack.call("refund_legacy", REFUND)  # a retry without its key is refused, not run
    assert keyless["error"]["code"] == "idempotency_key_required"
    assert refunds(stack) == 1


async def test_an_openai_turn_resent_after_timeout_unknown_refunds_once(stack):
    """The key comes from the business request id (X-Run-Id), never from the tool_call id: the turn resent,
    and a re-planned turn with a new id, are the same operation."""
    await stack.fault("refund_order", "drop_after_commit", count=1)
    turn = {"role": "assistant", "tool_calls": [{"id": "call_refund_1", "type": "function", "function": {
        "name": "refund_legacy", "arguments": json.dumps(REFUND)}}]}
    _, keyless = await stack.post("/v1/openai/tool-calls", turn)  # no business request id: refused, not run
    assert json.loads(keyless["messages"][0]["content"])["error"]["code"] == "idempotency_key_required"
    run = {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}
    status, first = await stack.post("/v1/openai/tool-calls", turn, headers=run)
    assert status == 200 and first["batch"]["status"] == "uncertain", first  # item 6: never "failed"
    envelope = first["envelopes"][0]
    assert envelope["error"]["code"] == "timeout_unknown"
    status, again = await stack.post("/v1/openai/tool-calls", turn, headers=run)
    resent = again["envelopes"][0]
    assert resent["error"]["code"] == "operation_unknown"
    assert resent["idempotency_key"] == envelope["idempotency_key"]
    replanned = {**turn, "tool_calls": [{**turn["tool_calls"][0], "id": "call_refund_2"}]}
    _, other = await stack.post("/v1/openai/tool-calls", replanned, headers=run)  # a re-plan: the same operation
    other_env = other["envelopes"][0]
    assert other_env["idempotency_key"] == envelope["idempotency_key"]
    assert other_env["error"]["code"] == "operation_unknown"
    _, elsewhere = await stack.post("/v1/openai/tool-calls", replanned,
                                    headers={"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"})
    # ...another business request is another operation, which the first one's unknown outcome keeps off
    # the order (item 2)
    elsewhere_env = elsewhere["envelopes"][0]
    assert elsewhere_env["idempotency_key"] != envelope["idempotency_key"]
    assert elsewhere_env["error"]["code"] == "operation_unknown"
    assert elsewhere_env["error"]["details"]["blocking_operation"] == envelope["idempotency_key"]
    assert refunds(stack) == 1


async def test_an_mcp_client_sends_its_key_in_meta(stack):
    await stack.fault("refund_order", "drop_after_commit", count=1)
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "c", "version": "0"}}}
    accept = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
    async with stack.session.post(stack.proxy_url + "/mcp", json=body, headers=accept) as response:
        session = {**accept, "Mcp-Session-Id": response.headers["Mcp-Session-Id"]}

    async def call(meta: dict[str, Any]) -> dict[str, Any]:
        params = {"name": "refund_legacy", "arguments": REFUND, "_meta": meta}
        async with stack.session.post(stack.proxy_url + "/mcp", headers=session, json={
                "jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}) as response:
            return (await response.json())["result"]["_meta"]["io.toolproxy/envelope"]

    assert (await call({}))["error"]["code"] == "idempotency_key_required"
    mcp_key = {"io.toolproxy/idempotency-key": f"mcp-{uuid.uuid4().hex}"}
    first = await call(mcp_key)
    assert first["error"]["code"] == "timeout_unknown"
    again = await call(mcp_key)
    assert again["error"]["code"] == "operation_unknown" and again["idempotency_key"] == first["idempotency_key"]
    assert refunds(stack) == 1


async def test_a_stated_opt_out_runs_keyless_and_check_registry_lists_it(stack, tmp_path, capsys):
    status, env = await stack.call("bump_keyless", {"counter": "ctr_keyless", "delta": 1})
    assert status == 200 and env["outcome"] == "succeeded"
    assert cli_main(["check-registry", "--dev", str(tmp_path / "more" / "counters.yaml")]) == 0
    out = capsys.readouterr().out
    assert "opt-out: bump_keyless 1.0.0" in out and "a repeated increment is harmless here" in out


def test_an_opt_out_without_a_reason_is_refused(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(COUNTERS.replace('reason: "test counters; a repeated increment is harmless here"', ""))
    with pytest.raises(RegistryError, match="only with a stated reason"):
        load_registry([str(path)])


async def test_a_registry_relying_on_the_old_default_is_named_at_start_up(proxy_deps, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="toolproxy.runtime")
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, LEGACY_REFUND)}):
        pass
    lines = [r.getMessage() for r in caplog.records if "refund_legacy" in r.getMessage()]
    assert lines and "requires a key a retry reproduces" in lines[0] and "reason" in lines[0], lines
    assert not [r for r in caplog.records if "adjust_counter" in r.getMessage()]  # the demo states its choice


# -- 2. an unknown outcome freezes its resources -----------------------------------------------------------


async def test_an_unknown_outcome_freezes_its_resources_until_it_is_reconciled(stack):
    await stack.fault("reserve_inventory", "drop_after_commit", count=1)
    reserve = {"sku": "sku_widget", "quantity": 1, "order_id": "ord_1001"}
    _, unknown = await stack.call("reserve_inventory", reserve, headers=key())
    assert unknown["error"]["code"] == "timeout_unknown"
    blocking = unknown["idempotency_key"]

    status, frozen = await stack.call("reserve_inventory", {**reserve, "quantity": 2}, headers=key())
    assert status == 409 and frozen["error"]["code"] == "operation_unknown"
    assert frozen["error"]["details"]["blocking_operation"] == blocking
    assert frozen["error"]["details"]["status"] == f"/v1/operations/{blocking}"
    assert frozen["error"]["details"]["state"] == "UNKNOWN"
    assert frozen["side_effect"] == {"attempted": False, "committed": False}
    assert stack.backend.effect_counts()["reserve_inventory"] == 1
    _, read = await stack.call("get_inventory", {"sku": "sku_widget"})  # reads go on
    assert read["outcome"] == "succeeded"
    _, elsewhere = await stack.call("reserve_inventory", {**reserve, "sku": "sku_gadget"}, headers=key())
    assert elsewhere["outcome"] == "succeeded"  # only its own resources are frozen
    metrics = stack.runtime.metrics.registry
    assert metrics.get_sample_value("toolproxy_frozen_refusals_total", {"tool": "reserve_inventory"}) == 1

    await stack.runtime.reconciler.scan_once()  # the status endpoint: committed
    _, record = await stack.get(f"/v1/operations/{blocking}")
    assert record["state"] == "SUCCEEDED"
    _, after = await stack.call("reserve_inventory", {**reserve, "quantity": 2}, headers=key())
    assert after["outcome"] == "succeeded", after
    marks = [f async for k in stack.redis.scan_iter(match="toolproxy:lock:*") for f in await stack.redis.hkeys(k)
             if f.startswith(b"u:")]
    assert marks == []  # thawed when the operation settled


async def test_a_mark_left_behind_by_a_settled_operation_is_thawed_by_the_next_write(stack):
    """The reconciler's thaw may be lost (Redis down at that moment): the next write checks and thaws."""
    _, done = await stack.call("adjust_counter", {"counter": "ctr_thaw", "delta": 1}, headers=key())
    assert done["outcome"] == "succeeded"
    await stack.runtime.locks.freeze("acme", ["counter:ctr_thaw"], done["idempotency_key"])  # a stale mark
    _, next_write = await stack.call("adjust_counter", {"counter": "ctr_thaw", "delta": 1}, headers=key())
    assert next_write["outcome"] == "succeeded", next_write
    assert stack.backend.counters["ctr_thaw"] == 2


async def test_the_freeze_ends_when_an_operator_resolves_the_takeover(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False,
                              "reconcile.backoff_initial_ms": 0}) as stack:
        stack.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        await stack.fault("adjust_counter", "drop_after_commit", count=1)  # no status endpoint: a takeover
        _, unknown = await stack.call("adjust_counter", {"counter": "ctr_takeover", "delta": 5})
        assert unknown["error"]["code"] == "timeout_unknown"
        await stack.runtime.reconciler.scan_once()
        _, frozen = await stack.call("adjust_counter", {"counter": "ctr_takeover", "delta": 1})
        assert frozen["error"]["code"] == "operation_unknown"
        assert frozen["error"]["details"]["state"] == "NEEDS_TAKEOVER"
        token = admin.token("olga", audience="toolproxy-admin", roles=["operator"], scope="")
        async with stack.session.post(f"{stack.admin_url}/v1/operations/{unknown['idempotency_key']}/resolve",
                                      json={"outcome": "committed", "evidence": "the counter shows 5"},
                                      headers={"Authorization": f"Bearer {token}"}) as response:
            assert response.status == 200, await response.text()
        _, after = await stack.call("adjust_counter", {"counter": "ctr_takeover", "delta": 1})
        assert after["outcome"] == "succeeded" and stack.backend.counters["ctr_takeover"] == 6


# -- 3. a write without resources conflicts with every write of its service --------------------------------


async def test_a_write_without_resources_never_runs_beside_another_write_of_its_service(stack, tmp_path, capsys):
    await stack.fault("adjust_counter", "slow", delay_ms=300, count=1)
    wide = asyncio.create_task(stack.call("bump_anything", {"counter": "ctr_wide", "delta": 1}, headers=key(),
                                          call_id="wide"))
    await wait_until(lambda: stack.backend.requests, what="the resourceless write to reach the backend")
    _, other = await stack.call("adjust_counter", {"counter": "ctr_other", "delta": 1}, headers=key(),
                                call_id="other")
    assert other["outcome"] == "succeeded" and (await wide)[1]["outcome"] == "succeeded"
    spans = counter_calls(stack)
    assert len(spans) == 2 and max_overlap(spans) == 1, spans  # the second waited for the first's service lock
    _, read = await stack.call("get_inventory", {"sku": "sku_widget"})
    assert read["outcome"] == "succeeded"

    cli_main(["check-registry", "--dev", str(tmp_path / "more" / "counters.yaml")])
    warned = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("warning: bump_anything") and "declares no resources" in line]
    assert len(warned) == 1 and "service demo:" in warned[0]

    calls = [{"call_id": "a", "tool": "bump_anything", "arguments": {"counter": "ctr_x", "delta": 1}},
             {"call_id": "b", "tool": "adjust_counter", "arguments": {"counter": "ctr_y", "delta": 1}}]
    status, refused = await stack.batch(calls, headers=key())
    assert status == 400 and refused["error"]["details"]["problems"] == [
        {"problem": "unordered_writes", "calls": ["a", "b"], "resources": ["@service:demo"]}]
    status, body = await stack.post("/v1/tool-calls:batch", {"calls": calls, "order": "list"}, headers=key())
    assert status == 200 and body["status"] == "succeeded"
    assert body["plan"]["edges"] == [{"from": "a", "to": "b", "kind": "conflict", "resources": ["@service:demo"]}]


# -- 4. two writes on one resource need a stated order -----------------------------------------------------


async def test_two_writes_on_one_resource_run_when_depends_on_orders_them(stack):
    calls = [{"call_id": "first", "tool": "adjust_counter", "arguments": {"counter": "ctr_order", "delta": 1}},
             {"call_id": "read", "tool": "get_inventory", "arguments": {"sku": "sku_widget"}},
             {"call_id": "second", "tool": "adjust_counter", "arguments": {"counter": "ctr_order", "delta": 10}}]
    status, refused = await stack.batch(calls, headers=key())
    assert status == 400 and refused["error"]["code"] == "invalid_plan"
    assert "first and second on counter:ctr_order" in refused["error"]["message"]
    assert "depends_on" in refused["error"]["message"] and '"order": "list"' in refused["error"]["message"]
    assert stack.backend.requests == []
    calls[2]["depends_on"] = ["first"]
    status, body = await stack.batch(calls, headers=key())
    assert status == 200 and [r["data"]["value"] for r in body["results"] if r["call_id"] != "read"] == [1, 11]


# -- 5. a call that cannot finish is not started -----------------------------------------------------------


async def test_a_call_below_its_min_budget_is_not_sent(stack):
    status, env = await stack.call("bump_carefully", {"counter": "ctr_budget", "delta": 1},
                                   headers={**key(), "Request-Timeout": "0.6"})
    assert status == 504 and env["error"]["code"] == "timeout_not_started"
    assert env["error"]["details"]["min_budget_ms"] == 1000 and env["error"]["details"]["budget_ms"] < 1000
    assert env["error"]["resolution"] == "retry_same_key"
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert counter_calls(stack) == []
    _, ok = await stack.call("bump_carefully", {"counter": "ctr_budget", "delta": 1},
                             headers={**key(), "Request-Timeout": "2"})
    assert ok["outcome"] == "succeeded"


def test_min_budget_defaults_to_100_ms_and_never_exceeds_the_timeout(tmp_path):
    registry = load_registry([str(DEMO_REGISTRY)])
    assert {t.min_budget_ms for t in registry.all()} == {100}
    path = tmp_path / "tools.yaml"
    path.write_text(COUNTERS.replace("min_budget_ms: 1000", "min_budget_ms: 5000"))
    with pytest.raises(RegistryError, match="exceeds timeout_ms"):
        load_registry([str(path)])


# -- 6. uncertain effects are not plain failure ------------------------------------------------------------


async def test_a_batch_whose_only_effect_is_uncertain_is_uncertain(stack):
    await stack.fault("adjust_counter", "drop_after_commit", count=1)
    calls = [{"call_id": "u", "tool": "adjust_counter", "arguments": {"counter": "ctr_unsure", "delta": 1}},
             {"call_id": "x", "tool": "no_such_tool", "arguments": {}}]
    status, body = await stack.batch(calls, headers=key())
    assert status == 200 and body["status"] == "uncertain", body
    assert [e["call_id"] for e in body["uncertain_effects"]] == ["u"] and body["next_action"] == "reconcile"


def test_the_demo_registry_relies_on_no_old_default():
    assert [line for level, line in notices(load_registry([str(DEMO_REGISTRY)])) if level == "warning"] == []
