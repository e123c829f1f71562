"""Batch merge: per-call envelopes -> one batch result the next model turn can trust.

Owns: the batch result's shape (``schemas/batch-response.schema.json``):
envelopes in plan order (never completion order), the batch ``status``, the
``committed_effects`` and ``uncertain_effects``, ``next_action(s)`` and the
``conflicts`` between repeated identical reads.
Must never: merge tool outputs into one dictionary (a later value would
silently overwrite an earlier one — each output stays in its own envelope with
its source), reorder results, or call anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..envelope import Envelope, Timing
from ..errors import ProxyError
from .plan import BatchPlan, Footprint, Graph

# The order in which resolutions become the batch's next action: uncertain
# effects are resolved before anything else is retried.
NEXT_ACTION_PRIORITY = ("reconcile", "await_approval", "ask_user", "repair_arguments", "refresh_tools",
                        "retry_same_key", "retry", "poll", "inspect", "stop")


@dataclass(frozen=True)
class BatchResult:
    request_id: str
    status: str  # succeeded | partially_succeeded | uncertain | failed
    results: tuple[Envelope, ...]  # one envelope per call, plan order
    committed_effects: tuple[dict[str, Any], ...]
    uncertain_effects: tuple[dict[str, Any], ...]
    next_action: str
    next_actions: tuple[dict[str, Any], ...]
    conflicts: tuple[dict[str, Any], ...]
    plan: Mapping[str, Any]
    timing: Mapping[str, Any]
    batch_id: str | None = None  # what POST /v1/batches/{batch_id}:cancel names (the request id)

    def to_json(self) -> dict[str, Any]:
        return {
            **({"batch_id": self.batch_id} if self.batch_id is not None else {}),
            "request_id": self.request_id,
            "status": self.status,
            "results": [env.to_json() for env in self.results],
            "committed_effects": list(self.committed_effects),
            "uncertain_effects": list(self.uncertain_effects),
            "next_action": self.next_action,
            "next_actions": list(self.next_actions),
            "conflicts": list(self.conflicts),
            "plan": dict(self.plan),
            "timing": dict(self.timing),
        }


def merge(plan: BatchPlan, graph: Graph, results: Mapping[str, Envelope],
          footprints: Mapping[str, Footprint], timing: Timing) -> BatchResult:
    envelopes = tuple(results[call.call_id] for call in plan.calls)  # plan order, whatever finished first
    status = batch_status(envelopes)
    batch_timing = timing.to_json()
    batch_timing.pop("stages_ms", None)  # a batch's stages are its calls' (in their envelopes)
    return BatchResult(
        request_id=plan.meta.request_id,
        status=status,
        results=envelopes,
        committed_effects=tuple(_effect(env, footprints) for env in envelopes
                                if env.side_effect.committed is True),
        uncertain_effects=tuple(_uncertain(env, footprints) for env in envelopes
                                if env.side_effect.committed is None),
        next_action=next_action(envelopes),
        next_actions=tuple(_action(env) for env in _root_failures(envelopes)) +
        (tuple(_compensations(envelopes, footprints)) if status == "partially_succeeded" else ()),
        conflicts=tuple(read_conflicts(plan, envelopes, footprints)),
        plan=graph.to_json(),
        timing=batch_timing,
    )


def batch_status(envelopes: Sequence[Envelope]) -> str:
    """succeeded | partially_succeeded (something succeeded or committed, not everything) | uncertain
    (nothing succeeded or committed, but some effect may exist: never reported as plain
    failure) | failed (nothing succeeded, nothing committed, nothing uncertain)."""
    if all(env.outcome == "succeeded" for env in envelopes):
        return "succeeded"
    if any(env.outcome == "succeeded" or env.side_effect.committed is True for env in envelopes):
        return "partially_succeeded"
    if any(env.side_effect.committed is None for env in envelopes):
        return "uncertain"
    return "failed"


def next_action(envelopes: Sequence[Envelope]) -> str:
    wanted = {_error(env).resolution for env in _root_failures(envelopes)}
    if any(env.side_effect.committed is None for env in envelopes):
        wanted.add("reconcile")
    for env in envelopes:  # a partly applied call: follow the pending items, or a person decides
        if env.partial is not None:
            wanted.add(env.partial["recovery"]["resolution"])
    for resolution in NEXT_ACTION_PRIORITY:
        if resolution in wanted:
            return resolution
    return "stop" if wanted else "none"


def _root_failures(envelopes: Sequence[Envelope]) -> list[Envelope]:
    """Calls that did not succeed on their own account (not merely cancelled behind a failed dependency)."""
    return [env for env in envelopes if env.error is not None and not env.blocked_by]


def _footprint(env: Envelope, footprints: Mapping[str, Footprint]) -> Footprint | None:
    return footprints.get(env.call_id) if env.call_id is not None else None


def _resources(env: Envelope, footprints: Mapping[str, Footprint]) -> list[str]:
    fp = _footprint(env, footprints)
    return [r.id for r in fp.resources] if fp else []


def _effect(env: Envelope, footprints: Mapping[str, Footprint]) -> dict[str, Any]:
    return {"call_id": env.call_id, "tool": env.tool, "idempotency_key": env.idempotency_key,
            "resources": _resources(env, footprints), "outcome": env.outcome, "result": env.data}


def _uncertain(env: Envelope, footprints: Mapping[str, Footprint]) -> dict[str, Any]:
    error = env.error
    return {"call_id": env.call_id, "tool": env.tool, "idempotency_key": env.idempotency_key,
            "resources": _resources(env, footprints), "code": error.code if error else "unknown",
            "resolution": error.resolution if error else "reconcile"}


def _action(env: Envelope) -> dict[str, Any]:
    error = _error(env)
    return {"call_id": env.call_id, "code": error.code, "resolution": error.resolution,
            "retryable": error.retryable}


def _error(failed: Envelope) -> ProxyError:
    assert failed.error is not None  # a root failure
    return failed.error


def _compensations(envelopes: Sequence[Envelope], footprints: Mapping[str, Footprint]) -> list[dict[str, Any]]:
    """A batch that did not fully succeed: each committed effect whose contract declares a compensation may be
    compensated (POST /v1/operations/{key}:compensate; docs/transactions.md). Offered, never done for the caller."""
    offered = []
    for env in envelopes:
        fp = _footprint(env, footprints)
        if env.side_effect.committed is True and env.idempotency_key and fp is not None \
                and fp.tool is not None and fp.tool.compensation is not None:
            offered.append({"call_id": env.call_id, "code": "compensation_available", "resolution": "compensate",
                            "retryable": False, "compensate": f"/v1/operations/{env.idempotency_key}:compensate"})
    return offered


def read_conflicts(plan: BatchPlan, envelopes: Sequence[Envelope],
                   footprints: Mapping[str, Footprint]) -> list[dict[str, Any]]:
    """Identical successful reads (tool, version, args) whose outputs differ, field by field.

    Skipped when a write of this batch touched one of their resources: the DAG
    ordered the reads around it, so a difference is that write's effect, not a
    conflict.
    """
    conflicts = []
    for tool, members in _identical_reads(envelopes, footprints):
        fields = _differing_fields([m.data for m in members])
        if fields:
            conflicts.append({
                "tool": tool,
                "calls": [m.call_id for m in members],
                "fields": [{"field": f, "values": [{"call_id": m.call_id, "value": _field(m.data, f)}
                                                   for m in members]} for f in fields],
            })
    return conflicts


def _identical_reads(envelopes: Sequence[Envelope],
                     footprints: Mapping[str, Footprint]) -> list[tuple[str, list[Envelope]]]:
    """Groups of two or more successful reads with the same tool, version and arguments, none of them on a
    resource a write of the batch touched."""
    written: set[str] = set()
    for env in envelopes:
        fp = _footprint(env, footprints)
        if fp and fp.tool and fp.tool.is_write and env.side_effect.attempted:
            written.update(r.id for r in fp.resources)
    groups: dict[tuple[str, str, str], list[Envelope]] = {}
    for env in envelopes:
        fp = _footprint(env, footprints)
        if env.outcome == "succeeded" and _comparable_read(fp, written):
            groups.setdefault((fp.tool.name, fp.tool.version, fp.args_hash), []).append(env)  # type: ignore
    return [(tool, members) for (tool, _, _), members in groups.items() if len(members) > 1]


def _comparable_read(fp: Footprint | None, written: set[str]) -> bool:
    return (fp is not None and fp.tool is not None and not fp.tool.is_write and fp.args_hash is not None
            and not written & {r.id for r in fp.resources})


def _field(data: Any, name: str) -> Any:
    if name == "$":
        return data
    return data.get(name) if isinstance(data, dict) else None


def _differing_fields(outputs: list[Any]) -> list[str]:
    if not all(isinstance(o, dict) for o in outputs):
        return [] if all(o == outputs[0] for o in outputs) else ["$"]
    names = sorted(set().union(*(o.keys() for o in outputs)))
    return [n for n in names if any(o.get(n, _MISSING) != outputs[0].get(n, _MISSING) for o in outputs)]


_MISSING = object()
