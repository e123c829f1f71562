"""Read views of operation records: what an agent or an operator is shown of one operation.

Owns: the shape of ``GET /v1/operations/{key}`` (state, result or error,
evidence, reconciliation, takeover) on the agent and the admin listener, the
takeover record (everything a person needs to settle an operation by hand,
seed 004: key, target, last evidence), and listing the open operations.
Must never: change a record (resolutions are ``proxy/admin_api.py``'s and the
reconciler's), or show another tenant's operation to a tenant-bound caller
(it does not exist for them).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from .envelope import iso
from .errors import ProxyError
from .idempotency import KEY_PATTERN
from .operations import OperationStore, Record
from .store import StoreError, unavailable


async def find_operation(store: OperationStore, key: str, *, tenant: str | None) -> dict[str, Any]:
    """``GET /v1/operations/{key}``. An agent passes its tenant and sees only its own tenant's operations
    (another tenant's key does not exist for it); an operator passes None."""
    if not re.match(KEY_PATTERN, key):
        raise ProxyError("operation_not_found", "No such operation.", phase="request")
    try:
        record = await store.get(key)
    except StoreError:
        raise unavailable("The idempotency store is unreachable.", phase="request") from None
    if record is None or (tenant is not None and record.tenant != tenant):
        raise ProxyError("operation_not_found", "No such operation.", phase="request")
    return operation_view(record)


def operation_view(record: Record) -> dict[str, Any]:
    """What ``GET /v1/operations/{key}`` shows: state, result or error, evidence, takeover."""
    outcome = record.outcome or {}
    view: dict[str, Any] = {
        "idempotency_key": record.key,
        "state": record.state,
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
    }
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
    """Everything a human needs to settle an operation by hand (seed 004: key, target, last evidence)."""
    meta = record.meta
    outcome = record.outcome or {}
    return {
        "idempotency_key": record.key,
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
        "created_at": _iso(record.created_at),
        "unknown_since": _iso(record.unknown_since),
        "takeover_at": _iso(record.takeover_at),
    }


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
    records = [await store.get(key) for key in await store.open_keys(limit)]
    return [takeover_record(r) for r in records if r is not None and r.state == state
            and (tenant is None or r.tenant == tenant)]
