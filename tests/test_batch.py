"""POST /v1/tool-calls:batch against the real stack (OPA, Redis, demo backend).

Concurrency and ordering are asserted from the demo backend's recorded request
intervals (``state.intervals``: monotonic start/end of every /tools/* request),
never from wall-clock thresholds.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Iterable, Mapping

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from tests.support.stack import REPO, Stack, assert_envelope, running_stack

_SCHEMAS = {name: json.loads((REPO / "schemas" / f"{name}.schema.json").read_text())
            for name in ("result-envelope", "batch-response")}
_RESPONSE = Draft202012Validator(
    _SCHEMAS["batch-response"], format_checker=Draft202012Validator.FORMAT_CHECKER,
    registry=Registry().with_resource(_SCHEMAS["result-envelope"]["$id"],
                                      Resource.from_contents(_SCHEMAS["result-envelope"])))

SEED_EXAMPLE = [  # seed 001 section 7: A, B, C read in parallel; D after them; E after D (and A, C)
    {"call_id": "A", "tool": "get_order", "arguments": {"order_id": "ord_1001"}},
    {"call_id": "B", "tool": "get_inventory", "arguments": {"sku": "sku_widget"}},
    {"call_id": "C", "tool": "get_user_preferences", "arguments": {"user_ref": "usr_alice"}},
    {"call_id": "D", "tool": "reserve_inventory", "arguments": {"sku": "sku_widget", "quantity": 2,
                                                                "order_id": "ord_1001"},
     "depends_on": ["A", "B", "C"]},
    {"call_id": "E", "tool": "send_confirmation", "arguments": {"order_id": "ord_1001", "channel": "email"},
     "depends_on": ["D", {"call_id": "A", "failure_policy": "block"}, "C"]},
]


async def batch(stack: Stack, calls: list[dict[str, Any]], *, headers: Mapping[str, str] | None = None,
                run_id: str | None = "run_7.turn_1", order: str | None = None) -> tuple[int, dict[str, Any]]:
    sent = {**({"X-Run-Id": run_id} if run_id else {}), **(headers or {})}
    request: dict[str, Any] = {"calls": calls, **({"order": order} if order else {})}
    status, body = await stack.post("/v1/tool-calls:batch", request, headers=sent)
    if status == 200:
        errors = [(list(e.absolute_path), e.message) for e in _RESPONSE.iter_errors(body)]
        assert not errors, errors
        for envelope in body["results"]:
            assert_envelope(envelope)
    else:
        assert_envelope(body)
    return status, body


def intervals(stack: Stack, call_ids: Iterable[str] | None = None) -> dict[str, Any]:
    wanted = set(call_ids) if call_ids is not None else None
    return {iv.call_id: iv for iv in stack.backend.intervals if wanted is None or iv.call_id in wanted}


def max_overlap(spans: Iterable[Any]) -> int:
    events = sorted([(iv.start, 1) for iv in spans] + [(iv.end, -1) for iv in spans], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def by_id(body: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {env["call_id"]: env for env in body["results"]}


async def test_seed_example_reads_overlap_the_write_waits_for_all_and_the_confirmation_for_it(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        for tool in ("get_order", "get_inventory", "get_user_preferences"):
            await stack.fault(tool, "slow", delay_ms=150)  # long enough that concurrent requests must overlap
        status, body = await batch(stack, SEED_EXAMPLE)
        assert status == 200, body
        assert body["status"] == "succeeded" and body["next_action"] == "none"
        assert [env["call_id"] for env in body["results"]] == ["A", "B", "C", "D", "E"]
        assert all(env["outcome"] == "succeeded" for env in body["results"])
        seen = intervals(stack)
        reads = [seen["A"], seen["B"], seen["C"]]
        assert max(iv.start for iv in reads) < min(iv.end for iv in reads), "the three reads did not overlap"
        assert seen["D"].start >= max(iv.end for iv in reads)
        assert seen["E"].start >= seen["D"].end
        assert [e["call_id"] for e in body["committed_effects"]] == ["D", "E"]
        reservation = body["committed_effects"][0]
        assert reservation["tool"] == "reserve_inventory" and reservation["resources"] == ["inventory:sku_widget"]
        assert reservation["idempotency_key"] == by_id(body)["D"]["idempotency_key"] is not None
        assert reservation["result"]["quantity"] == 2
        assert body["uncertain_effects"] == [] and body["conflicts"] == []
        assert {"from": "D", "to": "E", "kind": "depends_on", "failure_policy": "block"} in body["plan"]["edges"]
        assert stack.backend.inventory["sku_widget"] == {"available": 98, "reserved": 2}


async def test_seed_example_with_a_stalled_confirmation_is_partially_succeeded(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        await stack.fault("send_confirmation", "stall", count=1)
        status, body = await batch(stack, SEED_EXAMPLE, headers={"Request-Timeout": "1.5"})
        assert status == 200, body
        assert body["status"] == "partially_succeeded"
        results = by_id(body)
        assert results["D"]["outcome"] == "succeeded" and results["D"]["side_effect"]["committed"] is True
        assert results["E"]["outcome"] == "unknown" and results["E"]["error"]["code"] == "timeout_unknown"
        assert [e["call_id"] for e in body["committed_effects"]] == ["D"]
        assert [(e["call_id"], e["tool"], e["code"]) for e in body["uncertain_effects"]] == [
            ("E", "send_confirmation", "timeout_unknown")]
        assert body["uncertain_effects"][0]["idempotency_key"] == results["E"]["idempotency_key"] is not None
        assert body["next_action"] == "reconcile"
        assert stack.backend.effect_counts() == {"reserve_inventory": 1}


async def test_cycle_and_dangling_dependency_are_invalid_plans_and_nothing_reaches_a_backend(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        cycle = [{"call_id": "a", "tool": "get_order", "arguments": {"order_id": "ord_1001"}, "depends_on": ["c"]},
                 {"call_id": "b", "tool": "get_inventory", "arguments": {"sku": "sku_widget"}, "depends_on": ["a"]},
                 {"call_id": "c", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 1},
                  "depends_on": [{"call_id": "b", "failure_policy": "continue"}]}]
        status, body = await batch(stack, cycle)
        assert (status, body["error"]["code"]) == (400, "invalid_plan")
        assert body["error"]["details"]["problems"] == [{"problem": "cycle", "cycle": ["a", "c", "b", "a"]}]
        dangling = [{"call_id": "a", "tool": "get_order", "arguments": {"order_id": "ord_1001"}},
                    {"call_id": "b", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 1},
                     "depends_on": ["a", "ghost"]}]
        status, body = await batch(stack, dangling)
        assert (status, body["error"]["code"]) == (400, "invalid_plan")
        assert body["error"]["details"]["problems"] == [
            {"problem": "unknown_dependency", "call_id": "b", "depends_on": "ghost"}]
        twice = [{"call_id": "a", "tool": "get_order", "arguments": {"order_id": "ord_1001"}}] * 2
        status, body = await batch(stack, twice)
        assert (status, body["error"]["code"]) == (400, "invalid_plan")
        assert stack.backend.requests == []
        sample = stack.runtime.metrics.registry.get_sample_value
        assert sample("toolproxy_batches_total", {"status": "invalid_plan"}) == 3


async def test_result_order_is_the_plan_order_over_50_runs_with_random_latencies(proxy_deps):
    calls = [{"call_id": "o1", "tool": "get_order", "arguments": {"order_id": "ord_1001"}},
             {"call_id": "i1", "tool": "get_inventory", "arguments": {"sku": "sku_widget"}},
             {"call_id": "p1", "tool": "get_user_preferences", "arguments": {"user_ref": "usr_alice"}},
             {"call_id": "o2", "tool": "get_order", "arguments": {"order_id": "ord_1002"}},
             {"call_id": "i2", "tool": "get_inventory", "arguments": {"sku": "sku_gadget"}},
             {"call_id": "p2", "tool": "get_user_preferences", "arguments": {"user_ref": "usr_bob"}}]
    rng = random.Random(5)
    async with running_stack(proxy_deps) as stack:
        first: list[Any] | None = None
        completion_orders = set()
        for run in range(50):
            for tool in ("get_order", "get_inventory", "get_user_preferences"):
                await stack.fault(tool, "slow", delay_ms=rng.randint(0, 25))
            stack.backend.intervals.clear()
            status, body = await batch(stack, calls, run_id=f"run_order.turn_{run}")
            assert status == 200 and body["status"] == "succeeded", body
            merged = [(env["call_id"], env["tool"], env["data"]) for env in body["results"]]
            first = first or merged
            assert merged == first, f"run {run} merged differently"
            completion_orders.add(tuple(iv.call_id for iv in sorted(stack.backend.intervals, key=lambda i: i.end)))
        assert [m[0] for m in first] == [c["call_id"] for c in calls]
        assert len(completion_orders) > 1, "the latencies never changed the completion order: the test proves nothing"


async def test_writes_to_one_resource_never_overlap_and_apply_in_plan_order(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        await stack.fault("adjust_counter", "slow", delay_ms=60)
        calls = []
        for i in range(4):
            calls.append({"call_id": f"a{i}", "tool": "adjust_counter", "arguments": {"counter": "ctr_a", "delta": i + 1}})
            calls.append({"call_id": f"b{i}", "tool": "adjust_counter", "arguments": {"counter": "ctr_b", "delta": 10}})
        calls += [{"call_id": "stock_before", "tool": "get_inventory", "arguments": {"sku": "sku_gadget"}},
                  {"call_id": "reserve", "tool": "reserve_inventory",
                   "arguments": {"sku": "sku_gadget", "quantity": 3, "order_id": "ord_1002"}},
                  {"call_id": "stock_after", "tool": "get_inventory", "arguments": {"sku": "sku_gadget"}}]
        status, body = await batch(stack, calls)  # the writes on one counter state no order: refused
        assert status == 400 and body["error"]["code"] == "invalid_plan", body
        assert {"problem": "unordered_writes", "calls": ["a0", "a1"], "resources": ["counter:ctr_a"]} \
            in body["error"]["details"]["problems"]
        assert stack.backend.requests == []
        status, body = await batch(stack, calls, order="list")  # the list order is the order meant
        assert status == 200 and body["status"] == "succeeded", body
        results, seen = by_id(body), intervals(stack)
        for domain in ("a", "b"):
            spans = [seen[f"{domain}{i}"] for i in range(4)]
            assert max_overlap(spans) == 1, f"writes to ctr_{domain} overlapped"
            assert spans == sorted(spans, key=lambda iv: iv.start), "writes did not apply in plan order"
        assert [results[f"a{i}"]["data"]["value"] for i in range(4)] == [1, 3, 6, 10]
        assert stack.backend.counters["ctr_a"] == 10 and stack.backend.counters["ctr_b"] == 40
        # Different conflict domains do run concurrently.
        assert max_overlap([seen["a0"], seen["b0"]]) == 2
        # A read and a write of one resource follow the plan order too.
        assert seen["stock_before"].end <= seen["reserve"].start and seen["reserve"].end <= seen["stock_after"].start
        assert (results["stock_before"]["data"]["available"], results["stock_after"]["data"]["available"]) == (5, 2)
        conflicts = {(e["from"], e["to"]) for e in body["plan"]["edges"] if e["kind"] == "conflict"}
        assert {("a0", "a1"), ("a1", "a2"), ("b2", "b3"), ("stock_before", "reserve"),
                ("reserve", "stock_after")} <= conflicts
        assert ("a0", "a2") not in conflicts  # already ordered through a1


async def test_a_failed_blocking_dependency_cancels_its_dependents_without_a_request(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        await stack.fault("get_order", "http_503_not_applied", count=1)
        calls = [{"call_id": "order", "tool": "get_order", "arguments": {"order_id": "ord_1001"}},
                 {"call_id": "confirm", "tool": "send_confirmation",
                  "arguments": {"order_id": "ord_1001", "channel": "sms"}, "depends_on": ["order"]},
                 {"call_id": "count", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 1},
                  "depends_on": ["confirm"]},
                 {"call_id": "stock", "tool": "get_inventory", "arguments": {"sku": "sku_widget"},
                  "depends_on": [{"call_id": "order", "failure_policy": "continue"}]}]
        status, body = await batch(stack, calls)
        assert status == 200, body
        results = by_id(body)
        assert (results["order"]["outcome"], results["order"]["error"]["code"]) == ("failed", "dependency_unavailable")
        for call_id, blocker in (("confirm", "order"), ("count", "confirm")):
            env = results[call_id]
            assert (env["outcome"], env["error"]["code"], env["blocked_by"]) == ("cancelled", "cancelled", [blocker])
            assert env["side_effect"] == {"attempted": False, "committed": False}
        assert results["stock"]["outcome"] == "succeeded"  # a continue dependency only orders
        assert intervals(stack)["order"].end <= intervals(stack)["stock"].start
        assert {r["tool"] for r in stack.backend.requests} == {"get_order", "get_inventory"}
        assert body["status"] == "partially_succeeded"
        assert [a["call_id"] for a in body["next_actions"]] == ["order"]  # the cancelled calls are not root causes
        assert body["next_action"] == "retry_same_key"


async def test_per_tool_per_batch_and_per_tenant_limits_hold(proxy_deps):
    overrides = {**proxy_deps, "scheduler.tool_limits": {"get_order": "2"}, "scheduler.max_parallel": 3,
                 "scheduler.tenant_max_parallel": 4}
    async with running_stack(overrides) as stack:
        await stack.fault("get_order", "slow", delay_ms=80)
        await stack.fault("get_inventory", "slow", delay_ms=80)
        orders = [{"call_id": f"o{i}", "tool": "get_order", "arguments": {"order_id": "ord_1001"}} for i in range(6)]
        status, body = await batch(stack, orders)
        assert status == 200 and body["status"] == "succeeded"
        assert max_overlap(stack.backend.intervals) == 2  # the per-tool limit, reached and never exceeded

        stack.backend.intervals.clear()
        stock = [{"call_id": f"s{i}", "tool": "get_inventory", "arguments": {"sku": "sku_widget"}} for i in range(6)]
        status, body = await batch(stack, stock)
        assert status == 200 and body["status"] == "succeeded"
        assert max_overlap(stack.backend.intervals) == 3  # the per-batch limit

        stack.backend.intervals.clear()
        both = await asyncio.gather(batch(stack, stock, run_id="run_x"), batch(stack, stock, run_id="run_y"))
        assert all(status == 200 and body["status"] == "succeeded" for status, body in both)
        assert len(stack.backend.intervals) == 12
        assert max_overlap(stack.backend.intervals) == 4  # the tenant limit is shared by both batches


async def test_each_call_of_a_batch_is_its_own_operation_and_a_resent_batch_replays(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        calls = [{"call_id": "first", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 5}},
                 {"call_id": "second", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 7}},
                 {"call_id": "again", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 7}}]
        key = {"Idempotency-Key": "batch-42"}
        status, body = await batch(stack, calls, headers=key, run_id=None, order="list")
        assert status == 200 and body["status"] == "succeeded", body
        keys = [env["idempotency_key"] for env in body["results"]]
        assert len(set(keys)) == 3 and None not in keys  # one header, three operations, no conflict
        assert stack.backend.counters["ctr_demo"] == 19

        status, again = await batch(stack, calls, headers=key, run_id=None, order="list")
        assert status == 200 and again["status"] == "succeeded"
        assert [env.get("replayed") for env in again["results"]] == [True, True, True]
        assert [env["data"] for env in again["results"]] == [env["data"] for env in body["results"]]
        assert stack.backend.counters["ctr_demo"] == 19 and stack.backend.effect_counts()["adjust_counter"] == 3

        changed = [calls[0], {**calls[1], "arguments": {"counter": "ctr_demo", "delta": 8}}]
        status, body = await batch(stack, changed, headers=key, run_id=None, order="list")
        assert status == 200 and body["status"] == "partially_succeeded"
        assert by_id(body)["second"]["error"]["code"] == "idempotency_conflict"
        assert body["next_action"] == "repair_arguments"
        assert stack.backend.counters["ctr_demo"] == 19


async def test_a_request_wide_approval_header_is_refused(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        calls = [{"call_id": "a", "tool": "get_order", "arguments": {"order_id": "ord_1001"}}]
        status, body = await batch(stack, calls, headers={"X-Approval-Id": "apr_0123"})
        assert (status, body["error"]["code"]) == (400, "invalid_request")
        assert stack.backend.requests == []
