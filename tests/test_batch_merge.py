"""Batch semantics beyond tests/test_batch.py: what the merge reports (failed status, next actions,
conflicting reads, read-after-write), batch deadlines, transitive cancellation, the programmatic API."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.deadline import Deadline
from proxy.errors import ProxyError
from proxy.pipeline import RequestMeta
from proxy.batch.plan import BatchPlan, Dependency, PlannedCall
from proxy.telemetry.tracing import accept_traceparent
from tests.support.stack import running_stack
from tests.support.waits import wait_until


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack(proxy_deps) as s:
        yield s


def interval(stack, call_id: str):
    [found] = [iv for iv in stack.backend.intervals if iv.call_id == call_id]
    return found


def sent(stack, call_id: str) -> list[dict]:
    return [r for r in stack.backend.requests if r["headers"].get("X-Call-Id") == call_id]


def by_id(body) -> dict[str, dict]:
    return {env["call_id"]: env for env in body["results"]}


async def test_a_read_after_a_write_to_its_resource_sees_the_write(stack):
    calls = [
        {"call_id": "before", "tool": "get_inventory", "arguments": {"sku": "sku_gadget"}},
        {"call_id": "reserve", "tool": "reserve_inventory",
         "arguments": {"sku": "sku_gadget", "quantity": 2, "order_id": "ord_1001"}},
        {"call_id": "after", "tool": "get_inventory", "arguments": {"sku": "sku_gadget"}},
    ]
    status, body = await stack.batch(calls, headers={"Idempotency-Key": "raw-1"})
    envs = by_id(body)
    assert envs["before"]["data"]["available"] == 5 and envs["after"]["data"]["available"] == 3
    assert [(e["from"], e["to"]) for e in body["plan"]["edges"]] == [("before", "reserve"), ("reserve", "after")]
    assert body["conflicts"] == []  # the difference is the batch's own write, not a conflict


async def test_block_cancels_dependents_transitively_and_continue_runs(stack):
    calls = [
        {"call_id": "refund", "tool": "refund_order",
         "arguments": {"order_id": "ord_1003", "amount": 100, "reason": "already refunded"}},
        {"call_id": "notify", "tool": "send_confirmation", "arguments": {"order_id": "ord_1001", "channel": "sms"},
         "depends_on": [{"call_id": "refund", "failure_policy": "block"}]},
        {"call_id": "email", "tool": "send_email",
         "arguments": {"to": "a@example.com", "subject": "s", "body": "b"}, "depends_on": ["notify"]},
        {"call_id": "recount", "tool": "get_order", "arguments": {"order_id": "ord_1001"},
         "depends_on": [{"call_id": "refund", "failure_policy": "continue"}]},
    ]
    status, body = await stack.batch(calls, headers={"Idempotency-Key": "bc-1"})
    envs = by_id(body)
    assert envs["refund"]["error"]["code"] == "business_rejected"
    for cid, blocker in (("notify", "refund"), ("email", "notify")):
        assert envs[cid]["outcome"] == "cancelled" and envs[cid]["blocked_by"] == [blocker]
        assert envs[cid]["error"]["code"] == "cancelled" and envs[cid]["error"]["phase"] == "schedule"
        assert envs[cid]["side_effect"] == {"attempted": False, "committed": False}
        assert sent(stack, cid) == []
    assert envs["recount"]["outcome"] == "succeeded"
    assert interval(stack, "recount").start >= interval(stack, "refund").end
    assert body["status"] == "partially_succeeded"
    assert body["next_actions"] == [{"call_id": "refund", "code": "business_rejected", "resolution": "ask_user",
                                     "retryable": False}]
    assert body["next_action"] == "ask_user"
    assert body["committed_effects"] == [] and body["uncertain_effects"] == []


async def test_nothing_succeeded_is_failed(stack):
    calls = [{"call_id": "x", "tool": "no_such_tool", "arguments": {}},
             {"call_id": "y", "tool": "get_order", "arguments": {"order_id": 7}, "depends_on": ["x"]}]
    status, body = await stack.batch(calls)
    assert body["status"] == "failed"
    assert [env["error"]["code"] for env in body["results"]] == ["tool_not_found", "cancelled"]
    assert body["next_action"] == "refresh_tools"


async def test_batch_deadline_stops_calls_not_yet_started(stack):
    await stack.fault("get_order", "slow", delay_ms=1000, count=1)
    calls = [{"call_id": "slow", "tool": "get_order", "arguments": {"order_id": "ord_1001"}},
             {"call_id": "late", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 1},
              "depends_on": [{"call_id": "slow", "failure_policy": "continue"}]}]
    status, body = await stack.batch(calls, headers={"Request-Timeout": "0.4"})
    envs = by_id(body)
    assert envs["slow"]["error"]["code"] == "timeout"
    assert envs["late"]["error"]["code"] == "timeout_not_started" and envs["late"]["error"]["phase"] == "schedule"
    assert envs["late"]["side_effect"] == {"attempted": False, "committed": False}
    assert sent(stack, "late") == [] and stack.backend.counters["ctr_demo"] == 0
    assert body["status"] == "failed" and body["next_action"] == "retry_same_key"


async def test_identical_reads_that_disagree_are_reported_not_merged(stack):
    await stack.fault("adjust_counter", "slow", delay_ms=300, count=1)
    calls = [{"call_id": "first", "tool": "get_inventory", "arguments": {"sku": "sku_widget"}},
             {"call_id": "between", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 1},
              "depends_on": [{"call_id": "first", "failure_policy": "continue"}]},
             {"call_id": "second", "tool": "get_inventory", "arguments": {"sku": "sku_widget"},
              "depends_on": [{"call_id": "between", "failure_policy": "continue"}]}]
    batch = asyncio.create_task(stack.batch(calls))
    await wait_until(lambda: sent(stack, "between"), what="the middle call to start")
    stack.backend.inventory["sku_widget"]["available"] = 42  # someone else changes the world meanwhile
    status, body = await asyncio.wait_for(batch, 5)
    assert body["conflicts"] == [{"tool": "get_inventory", "calls": ["first", "second"],
                                  "fields": [{"field": "available", "values": [{"call_id": "first", "value": 100},
                                                                               {"call_id": "second", "value": 42}]}]}]
    envs = by_id(body)  # each envelope keeps its own value
    assert envs["first"]["data"]["available"] == 100 and envs["second"]["data"]["available"] == 42


async def test_programmatic_api_for_other_fronts(stack):
    caller = await stack.runtime.authenticator.authenticate({})
    meta = RequestMeta(request_id="prog-1", trace=accept_traceparent(None), deadline=Deadline(time.monotonic() + 5))
    plan = BatchPlan(calls=(PlannedCall("a", "get_order", {"order_id": "ord_1001"}),
                            PlannedCall("b", "get_order", '{"order_id": "ord_1002"}',
                                        depends_on=(Dependency("a", "continue"),))), meta=meta)
    result = await stack.runtime.scheduler.run(plan, caller)
    assert result.status == "succeeded" and [env.call_id for env in result.results] == ["a", "b"]
    assert result.to_json()["request_id"] == "prog-1"
    with pytest.raises(ProxyError) as refused:
        await stack.runtime.scheduler.run(BatchPlan(calls=(PlannedCall("a", "get_order", {}, depends_on=(
            Dependency("a"),)),), meta=meta), caller)
    assert refused.value.code == "invalid_plan"

