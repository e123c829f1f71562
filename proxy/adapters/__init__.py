"""Execute stage: adapters that carry one decoded call to its backend.

Owns: the ``BackendCall``/``BackendResult`` contract shared by every adapter
and choosing the adapter for a contract. Must never: retry a call on its own,
or decide authorization, idempotency or locking.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from ..call_channel import NO_CHANNEL, CallChannel
from ..deadline import Deadline
from ..errors import ProxyError
from ..lazy import OnFirstUse
from ..registry import ToolContract


@dataclass(frozen=True)
class BackendCall:
    tool: ToolContract
    canonical_arguments: bytes
    arguments: Mapping[str, Any]
    call_id: str
    request_id: str
    deadline: Deadline  # the call's own, absolute: the caller's less the margin, within the tool's timeout
    traceparent: str
    subject: str
    tenant: str
    agent: str
    idempotency_key: str | None = None
    fencing_token: int | None = None
    args_hash: str = ""                 # the normalize stage's, bound into the call token
    decision_id: str | None = None      # the policy decision that allowed the call
    approval_id: str | None = None      # the approval it consumed
    tracestate: str | None = None       # W3C tracestate forwarded beside traceparent (the caller's, if any)
    channel: CallChannel = NO_CHANNEL   # the call's relays to its client (progress, logs, input), from its front
    # jwt mode: the caller's verified token, for a token_exchange credential (never logged or recorded)
    caller_token: str = field(default="", repr=False)
    # the entity tag of the state the decision was made on (a state_guard with a read, no argument, and
    # if_match): sent as If-Match
    captured_if_match: str | None = None


@dataclass(frozen=True)
class BackendResult:
    data: Any
    status: int
    backend_request_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    server_time: str | None = None  # the backend's clock at its answer (ISO), evidence of a committed write
    partial: Mapping[str, Any] | None = None  # a partly applied call (``partial_answer``); data is None then


class Adapter(Protocol):
    async def call(self, call: BackendCall) -> BackendResult:
        """Execute the call; raise ProxyError (with attempted/committed set) on failure."""


_CODE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def safe_value(value: Any) -> str | None:
    """A backend-supplied identifier, only if it is short and cannot carry text into logs or envelopes."""
    return value if isinstance(value, str) and _SAFE_VALUE.match(value) else None


MAX_PARTIAL_ITEMS = 1000


def partial_answer(document: Any) -> dict[str, Any] | None:
    """A backend's, status endpoint's or cancel answer's ``{"state": "partial", "committed": [...],
    "pending": [...]}`` (the items applied and those not yet), as ``{"committed", "pending"}``;
    None when the document is not one (wrong shape, items that are not objects, strings or numbers, more
    than ``MAX_PARTIAL_ITEMS`` of either). The items are the backend's untrusted data, passed on as given."""
    if not isinstance(document, dict) or document.get("state") != "partial":
        return None
    lists = {}
    for name in ("committed", "pending"):
        items = document.get(name)
        if not isinstance(items, list) or len(items) > MAX_PARTIAL_ITEMS or not all(
                isinstance(item, (dict, str, int, float)) and not isinstance(item, bool) for item in items):
            return None
        lists[name] = items
    return lists


def safe_error_fields(document: Any) -> dict[str, Any]:
    """A backend's structured ``{"error": {code, field, applied}}`` reduced to safe machine-readable
    fields. Its message is never kept: it may name hosts, queries or other tenants' data."""
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return {}
    safe: dict[str, Any] = {}
    if isinstance(error.get("code"), str) and _CODE.match(error["code"]):
        safe["code"] = error["code"]
    if safe_value(error.get("field")):
        safe["field"] = error["field"]
    if isinstance(error.get("applied"), bool):
        safe["applied"] = error["applied"]
    return safe


def unanswered(call: BackendCall, *, sent: bool, why: str, backend: str = "backend",
               details: Mapping[str, Any] | None = None) -> ProxyError:
    """The honest-outcome rule for a call that got no answer, once for every adapter and wire :
    before anything was sent it provably did not happen (retry with the same key);
    after, a write's effect is unknown (reconcile, never retry under a new key) and a read had none.

    ``why`` is what ended the wait: ``"deadline"`` (the budget ran out) or ``"connection_lost"``."""
    facts = {"tool": call.tool.name, **(details or {})}
    deadline = why == "deadline"
    if not sent:
        if deadline:
            return ProxyError("timeout_not_started", f"The deadline passed before the call reached the {backend}.",
                              details=facts, phase="execute", attempted=False, committed=False)
        return ProxyError("dependency_unavailable", f"The connection to the {backend} failed before sending.",
                          details=facts, phase="execute", attempted=False, committed=False)
    if call.tool.is_write:
        message = ("The call was sent but its result could not be confirmed before the deadline." if deadline else
                   "The connection was lost after the call was sent; its result is unknown.")
        return ProxyError("timeout_unknown", message, details={**facts, "idempotency_key": call.idempotency_key},
                          phase="execute", attempted=True, committed=None)
    if deadline:
        return ProxyError("timeout", "The read did not answer before the deadline.", details=facts,
                          phase="execute", attempted=True, committed=False)
    return ProxyError("dependency_unavailable", f"The connection to the {backend} was lost.", details=facts,
                      phase="execute", attempted=True, committed=False)


def failed_answer(call: BackendCall, *, backend: str = "backend", details: Mapping[str, Any]) -> ProxyError:
    """The rule for a failure answer that did not say nothing was applied: a write's effect is unknown, a
    read simply failed. (A failure that says ``applied: false``, or a refusal before running, is a
    definite failure and is answered by the adapter with its own code.)"""
    if call.tool.is_write:
        return ProxyError("upstream_error_unknown", f"The {backend} failed; whether the write was applied is unknown.",
                          details={**details, "idempotency_key": call.idempotency_key},
                          phase="execute", attempted=True, committed=None)
    return ProxyError("upstream_error", f"The {backend} failed to answer the read.", details=dict(details),
                      phase="execute", attempted=True, committed=False)


def deadline_passed(call: BackendCall, *, sent: bool, elapsed_s: float, backend: str = "backend") -> ProxyError:
    """A call whose budget ran out: ``unanswered`` with the budget it had when it started and the time it took."""
    budget_s = elapsed_s + (call.deadline.remaining() or 0.0)
    return unanswered(call, sent=sent, why="deadline", backend=backend,
                      details={"budget_ms": int(budget_s * 1000), "elapsed_ms": int(elapsed_s * 1000)})


class DeferredAdapter:
    """An adapter whose module is imported and whose object is built on its first use (``proxy/lazy.py``):
    the MCP adapter of a process whose registry names no MCP upstream yet (a reload may add one; its first
    call then pays for the import, once). ``cancel_by_closing`` is the built adapter's, stated up front so
    asking does not build it."""

    def __init__(self, build: Callable[[], Adapter], *, cancel_by_closing: bool = False) -> None:
        self._adapter: OnFirstUse[Any] = OnFirstUse(build)
        self.cancel_by_closing = cancel_by_closing

    def warm(self) -> None:
        self._adapter.warm()

    @property
    def built(self) -> Adapter | None:
        return self._adapter.built

    async def call(self, call: BackendCall) -> BackendResult:
        return await self._adapter.get().call(call)

    async def aclose(self) -> None:
        adapter = self._adapter.built
        if adapter is not None and hasattr(adapter, "aclose"):
            await adapter.aclose()

    def __getattr__(self, name: str) -> Any:  # any other method of the adapter (e.g. ``cancel``)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._adapter.get(), name)
