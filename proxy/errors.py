"""The error catalogue: every stable error code the proxy can emit.

Owns: the one typed exception (``ProxyError``) that stages raise, and the
static facts about each code (category, retryable, resolution, HTTP status,
exposure). Must never: format messages from exceptions of other libraries,
include stack traces, hostnames, tokens or raw backend bodies in a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class ErrorSpec:
    category: str
    retryable: bool
    resolution: str
    http_status: int
    expose_to_model: bool = True
    expose_to_user: bool = False


# Categories: protocol (the request to the proxy itself is malformed),
# contract (arguments or outputs break the tool contract), identity,
# authorization, business, dependency, execution, concurrency, internal.
CATALOGUE: Mapping[str, ErrorSpec] = MappingProxyType({
    # protocol
    "invalid_request": ErrorSpec("protocol", False, "repair_arguments", 400),
    "payload_too_large": ErrorSpec("protocol", False, "stop", 413),
    "unsupported_media_type": ErrorSpec("protocol", False, "stop", 415),
    "route_not_found": ErrorSpec("protocol", False, "stop", 404),
    "method_not_allowed": ErrorSpec("protocol", False, "stop", 405),
    "origin_not_allowed": ErrorSpec("protocol", False, "stop", 403),
    "tool_not_found": ErrorSpec("protocol", False, "refresh_tools", 404),
    # contract
    "invalid_json": ErrorSpec("contract", False, "repair_arguments", 400),
    "invalid_arguments": ErrorSpec("contract", False, "repair_arguments", 422),
    "schema_violation": ErrorSpec("contract", False, "repair_arguments", 422),
    "output_invalid": ErrorSpec("contract", False, "inspect", 502),
    # a pinned MCP tool whose upstream changed since review: quarantined until re-pinned (proxy/drift.py)
    "contract_drift": ErrorSpec("contract", False, "refresh_tools", 409, expose_to_user=True),
    # identity and authorization
    "unauthorized": ErrorSpec("identity", False, "stop", 401),
    "forbidden": ErrorSpec("authorization", False, "stop", 403),
    "policy_unavailable": ErrorSpec("dependency", True, "retry", 503),
    "approval_required": ErrorSpec("authorization", False, "await_approval", 403, expose_to_user=True),
    "approval_mismatch": ErrorSpec("authorization", False, "ask_user", 403, expose_to_user=True),
    "approval_summary_too_large": ErrorSpec("authorization", False, "repair_arguments", 422, expose_to_user=True),
    "approval_not_found": ErrorSpec("protocol", False, "stop", 404),
    "approval_not_pending": ErrorSpec("concurrency", False, "stop", 409),
    # business (the backend refused with a definite answer)
    "business_rejected": ErrorSpec("business", False, "ask_user", 422, expose_to_user=True),
    # the proxy read the guarded state under the write's lock and it changed since the decision: nothing sent
    "state_changed": ErrorSpec("business", False, "repair_arguments", 412),
    "rate_limited": ErrorSpec("dependency", True, "retry", 429),
    # dependency / execution outcomes
    "dependency_unavailable": ErrorSpec("dependency", True, "retry_same_key", 503),
    # a credential the backend needs (proxy/credentials) could not be had: nothing was sent
    "credential_unavailable": ErrorSpec("dependency", True, "retry_same_key", 503),
    # the tool acts with the user's own account at an MCP upstream, and the user has not connected it (or the
    # grant was revoked or refused on refresh): the agent asks the user to connect it in the console
    "user_grant_required": ErrorSpec("authorization", False, "ask_user", 403, expose_to_user=True),
    "timeout_not_started": ErrorSpec("execution", True, "retry_same_key", 504),
    "timeout": ErrorSpec("execution", True, "retry", 504),
    "timeout_unknown": ErrorSpec("execution", False, "reconcile", 504, expose_to_user=True),
    "upstream_error": ErrorSpec("dependency", True, "retry", 502),
    "upstream_error_unknown": ErrorSpec("execution", False, "reconcile", 502, expose_to_user=True),
    # concurrency and idempotency
    "idempotency_key_required": ErrorSpec("contract", False, "stop", 428),
    "idempotency_conflict": ErrorSpec("concurrency", False, "repair_arguments", 422),
    "operation_in_progress": ErrorSpec("concurrency", True, "poll", 409),
    "operation_unknown": ErrorSpec("execution", False, "reconcile", 409, expose_to_user=True),
    "outcome_unrecorded": ErrorSpec("execution", False, "reconcile", 503, expose_to_user=True),
    # the backend said a write committed and the contract's independent read afterwards disagrees: a takeover
    "verification_mismatch": ErrorSpec("execution", False, "ask_user", 409, expose_to_user=True),
    "operation_failed": ErrorSpec("execution", False, "stop", 409),
    "operation_not_found": ErrorSpec("protocol", False, "stop", 404),
    "operation_not_open": ErrorSpec("concurrency", False, "stop", 409),
    "resource_busy": ErrorSpec("concurrency", True, "retry", 409),
    "lock_lost": ErrorSpec("concurrency", False, "reconcile", 409),
    "invalid_plan": ErrorSpec("protocol", False, "repair_arguments", 400),
    "cancelled": ErrorSpec("execution", False, "stop", 409),
    # cancellation and compensation (docs/transactions.md)
    "cancel_unconfirmed": ErrorSpec("execution", False, "reconcile", 504, expose_to_user=True),
    "operation_not_cancellable": ErrorSpec("concurrency", False, "stop", 409),
    "batch_not_found": ErrorSpec("protocol", False, "stop", 404),
    "not_compensable": ErrorSpec("business", False, "ask_user", 409, expose_to_user=True),
    "compensation_state_not_allowed": ErrorSpec("business", False, "stop", 409, expose_to_user=True),
    "compensation_window_closed": ErrorSpec("business", False, "ask_user", 409, expose_to_user=True),
    "operation_frozen": ErrorSpec("execution", False, "ask_user", 409, expose_to_user=True),
    "audit_unavailable": ErrorSpec("dependency", True, "retry_same_key", 503),
    # the process is draining (SIGTERM): a new call, or one cut before its request left, is retried elsewhere
    "shutting_down": ErrorSpec("dependency", True, "retry_same_key", 503),
    # a write cut by the drain's budget after its request left: the outcome is reconciled
    "shutdown_unknown": ErrorSpec("execution", False, "reconcile", 503, expose_to_user=True),
    # a stored approval or outcome whose MAC does not verify (proxy/integrity.py): never honoured
    "record_integrity_failed": ErrorSpec("internal", False, "ask_user", 409, expose_to_user=True),
    # internal
    "internal_error": ErrorSpec("internal", False, "stop", 500, expose_to_model=False),
})

# One vocabulary for where a call is: the stages of one tool call in the order they run (the README's
# diagram, ``timing.stages_ms`` keys, the ``stage`` label of ``toolproxy_stage_duration_seconds``) are the
# ``phase`` values of the errors they raise. ``identity`` runs in the fronts, before the body is read;
# ``idempotency`` runs twice (the key before ``authorize``, the reservation after it); ``quota`` runs
# inside ``authorize`` (after the decision, before an approval is spent). The other phases are not
# stages of a call: the request itself, an approver's decision, a batch plan and its scheduling, and
# the reconciler.
CALL_STAGES = ("identity", "resolve", "decode", "normalize", "idempotency", "authorize", "quota", "lock",
               "audit", "execute", "verify", "commit")
OTHER_PHASES = ("request", "approval", "plan", "schedule", "reconcile")
PHASES = frozenset(CALL_STAGES + OTHER_PHASES)

RESOLUTIONS = frozenset({
    "retry", "retry_same_key", "repair_arguments", "ask_user", "await_approval",
    "reconcile", "refresh_tools", "stop", "poll", "inspect",
})


class ProxyError(Exception):
    """Raised by any stage; carries a catalogue code and safe, structured details.

    ``committed`` records what is known about the side effect when the error
    happened: False (nothing applied), None (unknown), True (applied).
    ``attempted`` says whether the backend request may have left the proxy.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        attempted: bool = False,
        committed: bool | None = False,
        phase: str | None = None,
        retryable: bool | None = None,
        resolution: str | None = None,
    ) -> None:
        if code not in CATALOGUE:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = dict(details or {})
        self.attempted = attempted
        self.committed = committed
        self.phase = phase
        self._retryable = retryable
        self._resolution = resolution

    @property
    def spec(self) -> ErrorSpec:
        return CATALOGUE[self.code]

    @property
    def retryable(self) -> bool:
        return self.spec.retryable if self._retryable is None else self._retryable

    @property
    def resolution(self) -> str:
        return self.spec.resolution if self._resolution is None else self._resolution

    def with_phase(self, phase: str) -> "ProxyError":
        if self.phase is None:
            self.phase = phase
        return self

    def to_error(self) -> dict[str, Any]:
        """The ``error`` member of an envelope."""
        spec = self.spec
        return {
            "code": self.code,
            "category": spec.category,
            "phase": self.phase or "request",
            "message": self.message,
            "retryable": self.retryable,
            "resolution": self.resolution,
            "expose_to_model": spec.expose_to_model,
            "expose_to_user": spec.expose_to_user,
            "details": self.details,
        }


@dataclass(frozen=True)
class SideEffect:
    attempted: bool
    committed: bool | None
    summary: str | None = None  # what was (partly) applied, from trusted facts (proxy/envelope.py)

    def to_json(self) -> dict[str, Any]:
        if self.summary is None:
            return {"attempted": self.attempted, "committed": self.committed}
        return {"attempted": self.attempted, "committed": self.committed, "summary": self.summary}


NO_EFFECT = SideEffect(attempted=False, committed=False)
