"""Batch merge without servers: plan order, status, effects, next action, read conflicts (proxy/batch/merge.py)."""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from proxy.deadline import Deadline
from proxy.envelope import Envelope, Timing
from proxy.errors import ProxyError, SideEffect
from proxy.batch.merge import batch_status, merge, next_action
from proxy.requests import RequestMeta
from proxy.batch.plan import BatchPlan, PlannedCall, build_graph, check, footprint
from proxy.registry import load_registry
from proxy.telemetry.tracing import accept_traceparent
from tests.unit import DEMO_REGISTRY, REPO

REGISTRY = load_registry([str(DEMO_REGISTRY)])
META = RequestMeta(request_id="req_1", trace=accept_traceparent(None), deadline=Deadline(None))


def ok(call_id: str, data, tool: str = "get_inventory", committed: bool | None = False) -> Envelope:
    return Envelope.of(call_id=call_id, request_id="req_1", tool=tool, tool_version="1.0.0", data=data,
                       side_effect=SideEffect(attempted=committed is not False, committed=committed),
                       idempotency_key=f"ik_{call_id}" if committed else None)


def failed(call_id: str, code: str, *, attempted: bool = False, committed: bool | None = False,
           blocked_by: list[str] | None = None) -> Envelope:
    error = ProxyError(code, "no", attempted=attempted, committed=committed)
    extra = {"blocked_by": blocked_by} if blocked_by else None
    return Envelope.of(call_id=call_id, request_id="req_1", tool="reserve_inventory", tool_version="1.0.0",
                       error=error, extra=extra)


def merged(calls: tuple[PlannedCall, ...], results: dict[str, Envelope]):
    plan = BatchPlan(calls=calls, meta=META)
    check(plan)
    footprints = {c.call_id: footprint(REGISTRY, c) for c in calls}
    return merge(plan, build_graph(plan, footprints), results, footprints, Timing(deadline_ms=None))


def read(call_id: str, sku: str = "sku_widget") -> PlannedCall:
    return PlannedCall(call_id, "get_inventory", {"sku": sku})


def test_results_come_back_in_plan_order_whatever_finished_first():
    calls = (read("b"), read("a", "sku_gadget"))
    results = {"a": ok("a", {"sku": "sku_gadget"}), "b": ok("b", {"sku": "sku_widget"})}
    batch = merged(calls, results).to_json()
    assert [r["call_id"] for r in batch["results"]] == ["b", "a"]
    assert batch["status"] == "succeeded" and batch["next_action"] == "none"


def test_status_is_partial_when_something_succeeded_or_committed_and_failed_otherwise():
    assert batch_status([ok("a", 1), failed("b", "invalid_arguments")]) == "partially_succeeded"
    assert batch_status([failed("a", "invalid_arguments"),
                         failed("b", "business_rejected", attempted=True, committed=True)]
                        ) == "partially_succeeded"
    assert batch_status([failed("a", "invalid_arguments"), failed("b", "forbidden")]) == "failed"


def test_a_batch_with_an_uncertain_effect_is_uncertain_never_failed():
    """Seed 001 sections 7 and 11: while an effect may exist, the batch is not reported as plain failure."""
    unknown = failed("b", "timeout_unknown", attempted=True, committed=None)
    assert batch_status([failed("a", "invalid_arguments"), unknown]) == "uncertain"
    assert batch_status([unknown]) == "uncertain"
    assert batch_status([ok("a", 1), unknown]) == "partially_succeeded"  # committed and uncertain facts both listed


def test_an_uncertain_effect_makes_reconcile_the_next_action_before_anything_else():
    envelopes = [failed("a", "invalid_arguments"), failed("b", "timeout_unknown", attempted=True, committed=None)]
    assert next_action(envelopes) == "reconcile"
    assert next_action([failed("a", "invalid_arguments")]) == "repair_arguments"


def test_calls_blocked_by_a_failed_dependency_are_not_root_failures():
    envelopes = [failed("a", "forbidden"), failed("b", "cancelled", blocked_by=["a"])]
    calls = (PlannedCall("a", "get_inventory", {"sku": "sku_widget"}),
             PlannedCall("b", "get_inventory", {"sku": "sku_gadget"}))
    batch = merged(calls, {"a": envelopes[0], "b": envelopes[1]})
    assert [a["call_id"] for a in batch.next_actions] == ["a"]


def test_committed_and_uncertain_effects_name_their_resources():
    calls = (PlannedCall("w", "reserve_inventory", {"sku": "sku_widget", "quantity": 1, "order_id": "ord_1"}),
             PlannedCall("u", "reserve_inventory", {"sku": "sku_gadget", "quantity": 1, "order_id": "ord_2"}))
    results = {"w": ok("w", {"reserved": 1}, tool="reserve_inventory", committed=True),
               "u": failed("u", "timeout_unknown", attempted=True, committed=None)}
    batch = merged(calls, results)
    assert [(e["call_id"], e["resources"]) for e in batch.committed_effects] == [("w", ["inventory:sku_widget"])]
    assert [(e["call_id"], e["code"], e["resolution"]) for e in batch.uncertain_effects] == [
        ("u", "timeout_unknown", "reconcile")]


def test_identical_reads_that_disagree_are_reported_field_by_field_not_merged():
    calls = (read("r1"), read("r2"))
    results = {"r1": ok("r1", {"sku": "sku_widget", "available": 3}),
               "r2": ok("r2", {"sku": "sku_widget", "available": 2})}
    batch = merged(calls, results)
    assert batch.conflicts == ({"tool": "get_inventory", "calls": ["r1", "r2"],
                                "fields": [{"field": "available", "values": [{"call_id": "r1", "value": 3},
                                                                             {"call_id": "r2", "value": 2}]}]},)
    assert [r.data["available"] for r in batch.results] == [3, 2]


def test_reads_around_a_write_of_the_same_batch_are_not_a_conflict():
    calls = (read("r1"), PlannedCall("w", "reserve_inventory",
                                     {"sku": "sku_widget", "quantity": 1, "order_id": "ord_1"}), read("r2"))
    results = {"r1": ok("r1", {"available": 3}), "w": ok("w", {"reserved": 1}, "reserve_inventory", True),
               "r2": ok("r2", {"available": 2})}
    assert merged(calls, results).conflicts == ()


def test_the_batch_json_holds_each_typed_envelope_as_its_json_and_matches_the_schema():
    schemas = {name: json.loads((REPO / "schemas" / f"{name}.schema.json").read_text())
               for name in ("result-envelope", "batch-response")}
    validator = Draft202012Validator(schemas["batch-response"], registry=Registry().with_resource(
        schemas["result-envelope"]["$id"], Resource.from_contents(schemas["result-envelope"])))
    calls = (PlannedCall("w", "reserve_inventory", {"sku": "sku_widget", "quantity": 1, "order_id": "ord_1"}),
             PlannedCall("f", "reserve_inventory", {"sku": "sku_gadget", "quantity": 1, "order_id": "ord_2"}),
             PlannedCall("b", "get_inventory", {"sku": "sku_widget"}))
    results = {"w": ok("w", {"reserved": 1}, tool="reserve_inventory", committed=True),
               "f": failed("f", "business_rejected", attempted=True, committed=False),
               "b": failed("b", "cancelled", blocked_by=["f"])}
    batch = merged(calls, results)
    body = batch.to_json()
    validator.validate(body)
    assert body["results"] == [results[c].to_json() for c in ("w", "f", "b")]  # each envelope's JSON, plan order
    assert body["status"] == "partially_succeeded" and body["next_action"] == "ask_user"  # business_rejected's
    assert [(a["call_id"], a["code"]) for a in body["next_actions"]] == [
        ("f", "business_rejected"), ("w", "compensation_available")]
    assert body["next_actions"][1]["compensate"] == "/v1/operations/ik_w:compensate"
