"""Read views of operation records: what an agent or an operator is shown of one operation.

Owns: the shape of ``GET /v1/operations/{key}`` (state, result or error,
evidence, reconciliation, takeover, cancellation, compensation and the
``reversal`` word of docs/transactions.md) on the agent and the admin listener, the
takeover record (everything a person needs to settle an operation by hand:
key, target, last evidence), and listing the open operations.
Must never: change a record (resolutions are ``proxy/fronts/admin_api.py``'s and the
reconciler's), or show another tenant's operation to a tenant-bound caller
(it does not exist for them), or another subject's to an agent that its
``authorize`` check refuses.
"""

from __future__ import annotations

import re
import time
from typing import Any, Awaitable, Callable, Mapping

from .envelope import iso
from .errors import ProxyError
from .idempotency import KEY_PATTERN
from .integrity import IntegrityGuard, integrity_error
from .operations import OperationStore, Record, RecordTooLarge
from .output_filter import visible
from .registry import Registry, ToolContract
from .store import unavailable_on_fault
from .verify import model_partial

SETTLED = ("SUCCEEDED", "FAILED_FINAL", "CANCELLED")  # states whose outcome is a fact a MAC vouches for


async def find_operation(store: OperationStore, key: str, *, tenant: str | None,
                         registry: Registry | None = None,
                         authorize: Callable[[Record], Awaitable[None]] | None = None,
                         integrity: IntegrityGuard | None = None) -> dict[str, Any]:
    """``GET /v1/operations/{key}``. An agent passes its tenant and sees only its own tenant's operations
    (another tenant's key does not exist for it) and ``authorize``, the subject check of
    proxy/policy/operation_access.py; an operator passes None. With the registry the view says whether a
    committed effect can still be compensated. With ``integrity`` (the agent's listener), a settled
    record whose outcome MAC does not verify is refused (``record_integrity_failed``), never shown to the
    agent; the operator's view shows the record as stored, for a person to look at."""
    if not re.match(KEY_PATTERN, key):
        raise ProxyError("operation_not_found", "No such operation.", phase="request")
    with unavailable_on_fault("The idempotency store is unreachable.", phase="request"):
        try:
            record = await store.get(key)
        except RecordTooLarge:  # refused unread (whose it is cannot be known): like a record its MAC refuses
            if integrity is None:
                raise integrity_error("outcome", key, phase="request", committed=None) from None
            raise await integrity.refused("outcome", key, phase="request", committed=None,
                                          idempotency_key=key) from None
    if record is None or (tenant is not None and record.tenant != tenant):
        raise ProxyError("operation_not_found", "No such operation.", phase="request")
    if authorize is not None:
        await authorize(record)
    if integrity is not None:
        await refuse_unverified(store, record, integrity)
    contract = registry.get(record.tool, record.tool_version) if registry is not None else None
    view = operation_view(record, contract)
    return agent_view(view, contract) if tenant is not None else view


async def refuse_unverified(store: OperationStore, record: Record, integrity: IntegrityGuard) -> None:
    """Raise ``record_integrity_failed`` for a settled record whose outcome MAC does not verify: what every
    view an agent gets of a record checks first (the read, and the answers of a cancel and a compensate)."""
    if record.state in SETTLED and record.final_reason != "attempts_exhausted" and not store.record_verified(record):
        raise await integrity.refused("outcome", record.key, phase="request", committed=None,
                                      idempotency_key=record.key, tenant=record.tenant or None,
                                      tool=record.tool or None)


async def checked_agent_view(store: OperationStore, record: Record, registry: Registry | None,
                             integrity: IntegrityGuard) -> dict[str, Any]:
    """An agent's view of ``record`` once ``refuse_unverified`` let it through."""
    await refuse_unverified(store, record, integrity)
    contract = registry.get(record.tool, record.tool_version) if registry is not None else None
    return agent_view(operation_view(record, contract), contract)


def agent_view(view: dict[str, Any], contract: ToolContract | None) -> dict[str, Any]:
    """An operation view as an agent may see it: the result through the contract's output filter (the
    record, and the operator's view on the admin listener, keep the full result). A record whose
    contract is gone from the registry shows its result as recorded."""
    if view.get("result") is not None and contract is not None and contract.output_policy.filters:
        view["result"] = visible(contract.output_policy, view["result"])
    if view.get("partial") and contract is not None:  # committed items: pieces of that result
        view["partial"] = dict(model_partial(contract, view["partial"]))
    return view


def operation_view(record: Record, contract: ToolContract | None = None) -> dict[str, Any]:
    """What ``GET /v1/operations/{key}`` shows (``schemas/operation-view.schema.json``): state, result or
    error, evidence, takeover, and the cancellation and compensation facts (docs/transactions.md)."""
    outcome = record.outcome or {}
    cancelling = record.state == "IN_PROGRESS" and record.cancel is not None
    view: dict[str, Any] = {
        "operation_key": record.key,
        "idempotency_key": record.key,  # the same value: read operation_key
        "state": "CANCELLING" if cancelling else record.state,
        "tool": record.tool,
        "tool_version": record.tool_version,
        "attempt": record.attempt,
        "created_at": _iso(record.created_at),
        "updated_at": _iso(record.updated_at),
        "lease_expires_at": _iso(record.lease_until) if record.state == "IN_PROGRESS" else None,
        "result": outcome.get("data") if record.state == "SUCCEEDED" else None,
        "error": outcome.get("error") if record.state != "SUCCEEDED" else None,
        "side_effect": outcome.get("side_effect"),
        "evidence": _evidence(record.evidence),
        "reconciliation": None,
        "takeover": None,
        "cancellation": _cancellation(record.cancel),
        "compensation": dict(record.compensation) if record.compensation else None,
        "reversal": reversal(record, contract),
    }
    partial = outcome.get("partial")
    if partial:  # a partly applied call: its items (the committed digests are the record's own business)
        view["partial"] = {"committed": list(partial.get("committed") or ()),
                           "pending": list(partial.get("pending") or ())}
    if record.unknown_since is not None:
        view["reconciliation"] = {
            "unknown_since": _iso(record.unknown_since), "attempts": record.reconcile_attempts,
            "window_ends_at": _iso(record.reconcile_until),
            "next_check_at": _iso(record.reconcile_next) if record.state == "UNKNOWN" else None,
        }
    if record.state == "NEEDS_TAKEOVER":
        view["takeover"] = takeover_record(record)
    return view


def takeover_record(record: Record) -> dict[str, Any]:
    """Everything a human needs to settle an operation by hand (key, target, last evidence)."""
    meta = record.meta
    outcome = record.outcome or {}
    return {
        "operation_key": record.key,
        "idempotency_key": record.key,  # the same value: read operation_key
        "tool": record.tool,
        "tool_version": record.tool_version,
        "tenant": record.tenant,
        "subject": meta.get("subject"),
        "agent": meta.get("agent"),
        "target": meta.get("target"),
        "last_evidence": _evidence(record.evidence),
        "attempts": {"executions": record.attempt, "reconciliations": record.reconcile_attempts},
        "original_error": (outcome.get("error") or {}).get("code"),
        "call_id": meta.get("call_id"),
        "request_id": meta.get("request_id"),
        "trace_id": trace_id_of(meta.get("traceparent")),
        "created_at": _iso(record.created_at),
        "unknown_since": _iso(record.unknown_since),
        "takeover_at": _iso(record.takeover_at),
    }


def trace_id_of(traceparent: Any) -> str | None:
    """The trace id in a record's ``traceparent`` (the call's trace: docs/observability.md#traces)."""
    if isinstance(traceparent, str) and len(traceparent) == 55 and traceparent[2] == "-":
        return traceparent[3:35]
    return None


def _cancellation(cancel: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not cancel:
        return None
    return {"requested_at": _iso(cancel.get("at_ms")), "requested_by": cancel.get("subject"),
            "source": cancel.get("source")}


def reversal(record: Record, contract: ToolContract | None) -> str:
    """One word per situation, never one for all: ``none`` (nothing committed, nothing to undo
    yet), ``not_applied`` / ``rolled_back`` (cancelled before sending / sent, then stopped with evidence
    that nothing was applied), ``compensable``, ``compensation_requested``, ``compensated``,
    ``compensation_failed`` (frozen, a person takes over), ``compensation_unknown``,
    ``cannot_be_compensated`` (the committed effect stands: no compensation declared, or its window or
    state does not allow one)."""
    block = record.compensation
    if block:
        return {"requested": "compensation_requested", "succeeded": "compensated",
                "failed": "compensation_failed", "unknown": "compensation_unknown"}[block["status"]]
    side = (record.outcome or {}).get("side_effect") or {}
    if record.state == "CANCELLED":
        return "rolled_back" if side.get("attempted") else "not_applied"
    if side.get("committed") is not True:
        return "none"
    spec = contract.compensation if contract is not None else None
    if spec is None or record.state not in spec.from_states or \
            time.time() * 1000 > record.updated_at + spec.window_s * 1000:
        return "cannot_be_compensated"
    return "compensable"


def _evidence(evidence: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not evidence:
        return None
    shown = {k: v for k, v in evidence.items() if k != "at_ms"}
    if "at_ms" in evidence:
        shown["at"] = _iso(evidence["at_ms"])
    return shown


def _iso(ms: int | None) -> str | None:
    return None if ms is None else iso(ms / 1000.0)


async def list_takeovers(store: OperationStore, *, tenant: str | None, limit: int = 500,
                         state: str = "NEEDS_TAKEOVER") -> list[dict[str, Any]]:
    """Takeover records of the operations waiting for a human (or, with ``state="UNKNOWN"``, of those the
    reconciler is still querying), oldest first (one tenant's, unless None)."""
    records = [await store.get(key) for key in await store.open_keys(limit, tenant=tenant)]
    return [takeover_record(r) for r in records if r is not None and r.state == state
            and (tenant is None or r.tenant == tenant)]
