"""Batch plans without servers: checks, footprints and the DAG (proxy/batch/plan.py)."""

from __future__ import annotations

import pytest

from proxy.deadline import Deadline
from proxy.errors import ProxyError
from proxy.requests import RequestMeta
from proxy.batch.plan import BatchPlan, Dependency, PlannedCall, build_graph, check, footprint, unordered_writes
from proxy.registry import load_registry
from proxy.telemetry.tracing import accept_traceparent
from tests.unit import DEMO_REGISTRY

REGISTRY = load_registry([str(DEMO_REGISTRY)])
META = RequestMeta(request_id="req_1", trace=accept_traceparent(None), deadline=Deadline(None))


def plan(*calls: PlannedCall) -> BatchPlan:
    return BatchPlan(calls=calls, meta=META)


def counter(call_id: str, name: str = "ctr_demo", *deps: str) -> PlannedCall:
    return PlannedCall(call_id, "adjust_counter", {"counter": name, "delta": 1},
                       depends_on=tuple(Dependency(d) for d in deps))


def graph_of(p: BatchPlan):
    check(p)
    return build_graph(p, {c.call_id: footprint(REGISTRY, c) for c in p.calls})


def test_a_dependency_on_a_later_call_runs_it_first_and_conflicts_follow_that_order():
    g = graph_of(plan(counter("x", "ctr_demo", "z"), counter("y", "ctr_other"), counter("z")))
    assert g.order == ("y", "z", "x")
    assert [(e.before, e.after, e.kind) for e in g.edges] == [("z", "x", "depends_on")]  # conflict already ordered


def test_conflict_edges_only_where_one_side_writes_and_only_between_overlapping_resources():
    stock = PlannedCall("s1", "get_inventory", {"sku": "sku_widget"})
    stock2 = PlannedCall("s2", "get_inventory", {"sku": "sku_widget"})
    other = PlannedCall("r0", "reserve_inventory", {"sku": "sku_gadget", "quantity": 1, "order_id": "ord_1001"})
    reserve = PlannedCall("r1", "reserve_inventory", {"sku": "sku_widget", "quantity": 1, "order_id": "ord_1001"})
    broken = PlannedCall("bad", "reserve_inventory", '{"sku": "sku_widget"')  # cannot decode: no resources
    g = graph_of(plan(stock, stock2, other, reserve, broken))
    assert [(e.before, e.after, e.resources) for e in g.edges] == [
        ("s1", "r1", ("inventory:sku_widget",)), ("s2", "r1", ("inventory:sku_widget",))]


@pytest.mark.parametrize("calls, problem", [
    ((counter("a", "ctr_demo", "b"), counter("b", "ctr_demo", "a")), {"problem": "cycle", "cycle": ["a", "b", "a"]}),
    ((counter("a", "ctr_demo", "a"),), {"problem": "self_dependency", "call_id": "a"}),
    ((counter("a", "ctr_demo", "nope"),), {"problem": "unknown_dependency", "call_id": "a", "depends_on": "nope"}),
    ((counter("a"), counter("a")), {"problem": "duplicate_call_id", "call_id": "a"}),
    ((counter("a"), counter("b", "ctr_demo", "a", "a")),
     {"problem": "duplicate_dependency", "call_id": "b", "depends_on": "a"}),
])
def test_invalid_plans_are_refused_with_the_problem_named(calls, problem):
    with pytest.raises(ProxyError) as caught:
        check(plan(*calls))
    assert caught.value.code == "invalid_plan"
    assert problem in caught.value.details["problems"]


def unordered(p: BatchPlan):
    return unordered_writes(p, {c.call_id: footprint(REGISTRY, c) for c in p.calls})


def test_two_writes_on_one_resource_need_a_depends_on_path_or_list_order():
    read = PlannedCall("r", "get_inventory", {"sku": "sku_widget"})
    assert unordered(plan(counter("a"), read, counter("b"))) == [
        {"problem": "unordered_writes", "calls": ["a", "b"], "resources": ["counter:ctr_demo"]}]
    assert unordered(plan(counter("a"), counter("b", "ctr_demo", "a"))) == []          # ordered directly
    assert unordered(plan(counter("a"), counter("m", "ctr_other", "a"),
                          counter("b", "ctr_demo", "m"))) == []                        # through a path
    assert unordered(plan(counter("a"), counter("b", "ctr_other"))) == []             # other resources
    assert unordered(BatchPlan(calls=(counter("a"), counter("b")), meta=META, order="list")) == []
