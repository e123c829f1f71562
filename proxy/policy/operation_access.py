"""Operation access: who may read, cancel or compensate one operation.

Owns: the rule for an agent-side caller acting on an operation record: its own
subject may (within its tenant); another subject of the same tenant only with an
OPA decision (``action: read_operation | cancel``; ``compensate`` asks its own
decision, with the same ``original`` facts, in proxy/transactions/compensation.py),
which a role may grant with ``operate_others`` (policies/operations.rego). A
refusal is ``operation_not_found``: an operation the caller may not act on does
not exist for it (no oracle for guessed keys).
Must never: decide for another subject without OPA, show another tenant's
operation to an agent-side caller, or read anything but the record's trusted facts.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from ..deadline import Deadline
from ..errors import ProxyError
from ..identity import Caller
from ..operations import Record
from .client import PolicyClient, RequestFacts, build_input

Authorize = Callable[[Record], Awaitable[None]]  # raises operation_not_found when the caller may not act


def original_facts(record: Record) -> dict[str, Any]:
    """``input.original`` of an operation: trusted facts from its record."""
    return {"idempotency_key": record.key, "tool": record.tool, "version": record.tool_version,
            "tenant": record.tenant, "subject": str(record.meta.get("subject", "")), "state": record.state,
            "resources": list((record.meta.get("target") or {}).get("resources", []))}


def not_found() -> ProxyError:
    return ProxyError("operation_not_found", "No such operation.", phase="request")


def is_own(caller: Caller, record: Record) -> bool:
    return record.tenant == caller.tenant and record.meta.get("subject") == caller.subject


def authorizer(policy: PolicyClient, caller: Caller, action: str, request: RequestFacts,
               deadline: Deadline) -> Authorize:
    """The check one request runs on the record it found (``action``: read_operation or cancel)."""

    async def authorize(record: Record) -> None:
        if record.tenant != caller.tenant:
            raise not_found()
        if is_own(caller, record):
            return
        document = build_input(action, caller, request, catalog_digest=policy.catalog_digest,
                               original=original_facts(record))
        decision = await policy.decide(document, deadline=deadline)
        if not decision.allow:
            raise not_found()

    return authorize
