"""Batch plans: the calls of one model turn and the DAG they must run in.

Owns: the ``BatchPlan`` data model (also the programmatic API other fronts
build), checking a plan before anything runs (unique ids, every ``depends_on``
target exists, no self/duplicate dependency, no cycle -> ``invalid_plan``),
each call's footprint (tool contract and canonical resources, computed with the
same registry/decode/normalize functions the pipeline uses) and the graph:
explicit ``depends_on`` edges plus conflict edges between calls whose
resources overlap where at least one writes. Must never: run a call, touch
Redis or a backend, or decide anything about authorization.

Conflict edges follow the plan order. Where ``depends_on`` edges force another
order, they follow the stable topological order (Kahn's algorithm, smallest
plan index first), which equals the plan order whenever every dependency points
to an earlier call. Orienting every conflict edge along one linear order is what
keeps explicit and conflict edges together acyclic. Pairs already ordered by a
path are not given a redundant edge.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from ..decode import decode_arguments
from ..errors import ProxyError
from ..normalize import ResourceRef, normalize
from ..requests import RequestMeta, ToolCallRequest
from ..registry import Registry, ToolContract, service_resource

BLOCK, CONTINUE = "block", "continue"
DAG, LIST = "dag", "list"


@dataclass(frozen=True)
class Dependency:
    call_id: str
    failure_policy: str = BLOCK  # block | continue


@dataclass(frozen=True)
class PlannedCall:
    call_id: str
    tool: str
    arguments: Any  # untrusted: a JSON object or a JSON-encoded string
    version: str | None = None
    depends_on: tuple[Dependency, ...] = ()
    approval_id: str | None = None  # an approval granted for exactly this call (else the request's, if any)
    # The call's own identity where its protocol carries one per call (an MCP member's ``_meta``), used when
    # the request has none (a header wins, as for a single call).
    idempotency_key: str | None = None
    run_id: str | None = None


@dataclass(frozen=True)
class BatchPlan:
    """An ordered list of calls sharing one request's transport facts (and its one deadline).

    ``call_scoped_identity``: each call's operation identity is the request's
    identity (``Idempotency-Key`` or ``X-Run-Id``) plus its plan ``call_id``
    (``RequestMeta.plan_call_id``, see ``proxy/idempotency.py``), so two calls
    of one batch are never one operation and a retried batch replays call by
    call. The batch API sets it (plan ids are structure: ``depends_on`` names
    them); the OpenAI front does not (a model's call id is never part of a key).
    """

    calls: tuple[PlannedCall, ...]
    meta: RequestMeta
    call_scoped_identity: bool = False
    all_or_nothing: bool = False  # every call must pass its checks and the policy before any runs
    order: str = DAG  # dag: two writes on one resource need a depends_on path | list: the list order is meant

    def request(self, call: PlannedCall, meta: RequestMeta | None = None) -> ToolCallRequest:
        """The single-call request the pipeline executes for ``call``."""
        base = meta or self.meta
        return ToolCallRequest(call_id=call.call_id, tool=call.tool, version=call.version,
                               arguments=call.arguments,
                               meta=replace(base, plan_call_id=call.call_id if self.call_scoped_identity else None,
                                            approval_id=call.approval_id or base.approval_id,
                                            idempotency_key=base.idempotency_key or call.idempotency_key,
                                            run_id=base.run_id or call.run_id,
                                            wait_for_quota=True))  # a batch schedules around its quotas


def plan_from_json(body: Mapping[str, Any], meta: RequestMeta) -> BatchPlan:
    """Translate a schema-valid ``batch-request`` body into a plan (not yet checked).

    Approvals are per call (``approval_id`` in the body): one approval is bound
    to one call's arguments, so a request-wide ``X-Approval-Id`` is refused.
    """
    if meta.approval_id is not None:
        raise ProxyError("invalid_request", "A batch carries approvals per call (calls[].approval_id), "
                         "not in the X-Approval-Id header.", details={"header": "X-Approval-Id"}, phase="request")
    calls = []
    for raw in body["calls"]:
        deps = tuple(Dependency(d) if isinstance(d, str) else Dependency(d["call_id"], d.get("failure_policy", BLOCK))
                     for d in raw.get("depends_on", ()))
        calls.append(PlannedCall(call_id=raw["call_id"], tool=raw["tool"], arguments=raw["arguments"],
                                 version=raw.get("version"), depends_on=deps, approval_id=raw.get("approval_id")))
    return BatchPlan(calls=tuple(calls), meta=meta, call_scoped_identity=True,
                     all_or_nothing=bool(body.get("all_or_nothing", False)), order=body.get("order", DAG))


# --------------------------------------------------------------------------- checking


def check(plan: BatchPlan) -> None:
    """Raise ``invalid_plan`` listing every problem; nothing has run yet."""
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()
    for call in plan.calls:
        if call.call_id in seen:
            problems.append({"problem": "duplicate_call_id", "call_id": call.call_id})
        seen.add(call.call_id)
    for call in plan.calls:
        targets: set[str] = set()
        for dep in call.depends_on:
            if dep.failure_policy not in (BLOCK, CONTINUE):
                problems.append({"problem": "invalid_failure_policy", "call_id": call.call_id,
                                 "depends_on": dep.call_id})
            if dep.call_id == call.call_id:
                problems.append({"problem": "self_dependency", "call_id": call.call_id})
            elif dep.call_id not in seen:
                problems.append({"problem": "unknown_dependency", "call_id": call.call_id,
                                 "depends_on": dep.call_id})
            elif dep.call_id in targets:
                problems.append({"problem": "duplicate_dependency", "call_id": call.call_id,
                                 "depends_on": dep.call_id})
            targets.add(dep.call_id)
    if not problems:
        cycle = find_cycle(plan)
        if cycle:
            problems.append({"problem": "cycle", "cycle": cycle})
    if problems:
        raise ProxyError("invalid_plan", "The batch plan cannot be run as given; nothing was started.",
                         details={"problems": problems}, phase="plan")


def _explicit_edges(plan: BatchPlan) -> dict[str, list[str]]:
    """call id -> ids that must finish before it (explicit depends_on only)."""
    return {call.call_id: [d.call_id for d in call.depends_on] for call in plan.calls}


def find_cycle(plan: BatchPlan) -> list[str] | None:
    """One dependency cycle as [a, b, ..., a] (each waits for the next), or None."""
    waits_for = _explicit_edges(plan)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    for start in (c.call_id for c in plan.calls):
        if state.get(start):
            continue
        path: list[str] = []
        stack: list[tuple[str, Iterable[str]]] = [(start, iter(waits_for[start]))]
        state[start] = 1
        path.append(start)
        while stack:
            node, successors = stack[-1]
            nxt = next(successors, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(waits_for[nxt])))
    return None


# --------------------------------------------------------------------------- footprints and the graph


@dataclass(frozen=True)
class Footprint:
    """What the trusted registry says a call touches (nothing known if it cannot be decoded)."""

    tool: ToolContract | None
    resources: tuple[ResourceRef, ...] = ()
    args_hash: str | None = None  # None: the arguments could not be decoded (the call fails on its own)
    arguments: Any = field(default=None, compare=False)  # normalized (for the audit record of a call never started)


def footprint(registry: Registry, call: PlannedCall) -> Footprint:
    try:
        tool = registry.resolve(call.tool, call.version)
    except ProxyError:
        return Footprint(None)
    try:
        normalized = normalize(tool, decode_arguments(call.arguments, tool.input_validator))
    except ProxyError:
        return Footprint(tool)  # the pipeline refuses it before any effect; nothing to order
    return Footprint(tool, normalized.resources, normalized.args_hash, normalized.arguments)


def conflict(a: Footprint, b: Footprint) -> tuple[str, ...]:
    """Resource ids two calls share, if at least one of them writes (or locks exclusively) there. Two writes
    of one service conflict on the whole service (``service_resource``) when either declares no resources
    (when in doubt, no parallelism). A call that cannot be resolved or decoded conflicts with
    nothing: the pipeline refuses it before any effect, with its own envelope."""
    if a.tool is None or b.tool is None or a.args_hash is None or b.args_hash is None:
        return ()
    wide = _service_wide(a.tool, b.tool)
    access_a = {r.id: r.access for r in a.resources}
    access_b = {r.id: r.access for r in b.resources}
    shared = sorted(access_a.keys() & access_b.keys())
    if not shared:
        return wide
    if a.tool.is_write or b.tool.is_write or any("exclusive" in (access_a[r], access_b[r]) for r in shared):
        return (*shared, *wide)
    return wide


def _service_wide(a: ToolContract, b: ToolContract) -> tuple[str, ...]:
    """The whole service as the one resource two writes share, when both write to one backend and either
    declares no resources; () otherwise."""
    if a.is_write and b.is_write and (a.service_wide or b.service_wide) and a.backend_name == b.backend_name:
        return (service_resource(a),)
    return ()


def unordered_writes(plan: BatchPlan, footprints: Mapping[str, Footprint]) -> list[dict[str, Any]]:
    """Pairs of writes on one resource that no ``depends_on`` path orders ("if the order is
    not certain, do not pick one and claim the result is correct; report the conflict"). Empty when the
    plan says ``order: list`` (the caller states the list order is meant) or every such pair is ordered."""
    if plan.order == LIST:
        return []
    writes = [c.call_id for c in plan.calls if (fp := footprints.get(c.call_id)) and fp.tool and fp.tool.is_write]
    if len(writes) < 2:
        return []
    before = _explicit_ancestors(plan)
    found = []
    for i, a in enumerate(writes):
        for b in writes[i + 1:]:
            shared = conflict(footprints[a], footprints[b])
            if shared and a not in before[b] and b not in before[a]:
                found.append({"problem": "unordered_writes", "calls": [a, b], "resources": list(shared)})
    return found


def _explicit_ancestors(plan: BatchPlan) -> dict[str, set[str]]:
    """call id -> every call a ``depends_on`` path makes finish before it (the plan has no cycle)."""
    waits_for = _explicit_edges(plan)
    found: dict[str, set[str]] = {}

    def ancestors(cid: str) -> set[str]:
        if cid not in found:
            found[cid] = set()  # (no cycle: ``check`` ran first)
            result: set[str] = set()
            for dep in waits_for[cid]:
                result |= {dep} | ancestors(dep)
            found[cid] = result
        return found[cid]

    for call in plan.calls:
        ancestors(call.call_id)
    return found


@dataclass(frozen=True)
class Edge:
    before: str
    after: str
    kind: str  # depends_on | conflict
    failure_policy: str | None = None
    resources: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"from": self.before, "to": self.after, "kind": self.kind}
        if self.failure_policy is not None:
            out["failure_policy"] = self.failure_policy
        if self.resources:
            out["resources"] = list(self.resources)
        return out


@dataclass(frozen=True)
class Graph:
    order: tuple[str, ...]  # stable topological order
    edges: tuple[Edge, ...]

    def incoming(self) -> dict[str, list[Edge]]:
        result: dict[str, list[Edge]] = {cid: [] for cid in self.order}
        for edge in self.edges:
            result[edge.after].append(edge)
        return result

    def to_json(self) -> dict[str, Any]:
        return {"order": list(self.order), "edges": [e.to_json() for e in self.edges]}


def build_graph(plan: BatchPlan, footprints: Mapping[str, Footprint]) -> Graph:
    """The DAG of a checked plan (``check`` first: this assumes no cycle and no dangling id)."""
    index = {call.call_id: i for i, call in enumerate(plan.calls)}
    order = _stable_topological_order(plan, index)
    edges = [Edge(dep.call_id, call.call_id, "depends_on", dep.failure_policy)
             for call in plan.calls for dep in call.depends_on]
    preds: dict[str, set[str]] = {cid: set() for cid in order}
    for edge in edges:
        preds[edge.after].add(edge.before)
    reach_to: dict[str, set[str]] = {}  # every call that finishes before this one starts
    for pos, after in enumerate(order):
        reach = set()
        for p in preds[after]:
            reach |= reach_to[p] | {p}
        for before in reversed(order[:pos]):  # closest first, so longer chains make later edges redundant
            if before in reach:
                continue
            shared = conflict(footprints[before], footprints[after])
            if shared:
                edges.append(Edge(before, after, "conflict", resources=shared))
                reach |= reach_to[before] | {before}
        reach_to[after] = reach
    position = {cid: i for i, cid in enumerate(order)}
    edges.sort(key=lambda e: (position[e.after], position[e.before], e.kind))
    return Graph(order=tuple(order), edges=tuple(edges))


def _stable_topological_order(plan: BatchPlan, index: Mapping[str, int]) -> list[str]:
    waits_for = _explicit_edges(plan)
    indegree = {cid: len(deps) for cid, deps in waits_for.items()}
    unblocks: dict[str, list[str]] = {cid: [] for cid in waits_for}
    for cid, deps in waits_for.items():
        for dep in deps:
            unblocks[dep].append(cid)
    ready = [index[cid] for cid, n in indegree.items() if n == 0]
    heapq.heapify(ready)
    ids: Sequence[str] = [call.call_id for call in plan.calls]
    order: list[str] = []
    while ready:
        cid = ids[heapq.heappop(ready)]
        order.append(cid)
        for nxt in unblocks[cid]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                heapq.heappush(ready, index[nxt])
    if len(order) != len(ids):  # pragma: no cover - check() rejects cycles first
        raise ProxyError("invalid_plan", "The batch plan has a dependency cycle.", phase="plan")
    return order
