"""Idempotency stage: one business operation runs once, whatever the retries.

Owns: deriving the operation key from trusted facts (the
business intent, never the transport), deciding what an
existing record means for this call (replay, in progress, conflict, retry,
unknown), reserving the key before anything is sent, and recording the
outcome at commit. The Redis state machine itself lives in
``proxy/operations.py``.

Key derivation (SHA-256 over an RFC 8785 array, so no field can bleed into
another):

* ``Idempotency-Key`` header given -> the key is scoped to (tenant, subject,
  tool, header); the record's fingerprint is (subject, contract version,
  ``args_hash``): the same header with other arguments or another contract
  version is ``idempotency_conflict``. Another subject's same header is
  another operation: a caller can neither learn whether someone else used a
  key nor take a predictable key before them. (Keys derived before the
  subject joined the scope, ``toolproxy.op/1``, are not found by a retry
  after the upgrade: docs/idempotency.md, "Upgrading".)
* else ``X-Run-Id``, the business request id (the run,
  task or conversation the agent serves, the same across its turns and
  re-plans) -> the key is (tenant, subject, tool, contract version,
  ``args_hash``, run id): within one business request the same call is the
  same operation, whichever turn or plan asks for it again.
* within a batch of ``POST /v1/tool-calls:batch`` (``RequestMeta.plan_call_id``):
  either of the above plus the call's id within the plan, so the calls of one
  batch are distinct operations (two calls to one tool under one header never
  conflict) and the same batch sent again replays call by call; never the
  plan id alone, always scoped by the request's own identity.
* the business request id is the agent's, never the transport's: the model's
  ``tool_call.id`` (OpenAI), an MCP session or JSON-RPC id and the JSON API's
  ``call_id`` change when an agent re-plans or a client re-sends, so none of
  them is ever part of a key (a re-planned refund would refund twice). A
  client that cannot set headers per call sends them where its protocol lets
  it: an MCP client puts the key in ``params._meta["io.toolproxy/idempotency-key"]``
  and the run in ``params._meta["io.toolproxy/run-id"]`` (or sets ``X-Run-Id``
  once on its transport), which the MCP front reads as the headers.
* a write with none of these: refused with ``idempotency_key_required``
  (writes require a key by default), unless its
  contract opted out with a stated reason (``idempotency: {required: false,
  reason: ...}``): then a per-request key, ``(tenant, tool, a random nonce)``.
  It can never be replayed — a retry is a new operation — but the call still
  has its operation record, so its outcome can be unknown, tracked and
  reconciled, and the backend still gets an ``Idempotency-Key``.

Which calls get a record: every write (so no write is ever sent while the
state store is unreachable), and any tool whose contract requires a key
(every write unless it opted out; a read that says ``required: true``), which
also makes the identity mandatory: ``idempotency_key_required``, before
anything is sent. Reads without ``required`` run without a record (they are
safe to retry, and caching them would serve stale data).

A call authorized only by an approval already spent on this very operation
(``replay_only_for``, see proxy/policy/authorize.py) is answered from the record
alone: SUCCEEDED replays, IN_PROGRESS / UNKNOWN / FAILED_FINAL answer as for
any duplicate, but an absent or FAILED_RETRYABLE record — which would need a
new execution — is ``approval_mismatch`` (reason ``used``): a re-run needs a
fresh approval.

Must never: send anything to a backend, re-execute an UNKNOWN operation, let
a spent approval reserve a key for a new execution, let
a write run when its record cannot be written (Redis down: fail closed), or
use caller-supplied identity other than the two headers above.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

import rfc8785

from . import compensation_contract
from .config import IdempotencyConfig, ReconcileConfig
from .deadline import Deadline
from .errors import ProxyError, SideEffect
from .identity import Caller
from .integrity import IntegrityGuard
from .telemetry import spans
from .telemetry.metrics import Metrics
from .normalize import NormalizedCall
from .operations import OperationStore, Record, RecordTooLarge, Transition
from .outcome_forms import OutcomeContext, compact, expand
from .read_after_write import VerifyMismatch
from .telemetry import record_view
from .registry import ToolContract
from .store import RoundTrip, StoreError, Then, logged_on_fault, unavailable, unavailable_on_fault

if TYPE_CHECKING:  # pragma: no cover
    from .requests import RequestMeta

log = logging.getLogger("toolproxy.idempotency")

KEY_PATTERN = r"^ik_[0-9a-f]{64}$"
MCP_KEY_META = "io.toolproxy/idempotency-key"  # where an MCP client puts its key (params._meta), if no header
MCP_RUN_META = "io.toolproxy/run-id"  # where an MCP client puts its business request id, if no X-Run-Id header
TARGET_MAX_CHARS = 200  # longer argument strings shown in clear are truncated in the stored target summary


@dataclass(frozen=True)
class OperationKey:
    key: str            # ik_<sha256 hex>: what the backend receives as Idempotency-Key
    fingerprint: str    # must match for a key to be reused
    source: str         # idempotency_key | run_id | request (an opted-out write: never replayable)


def derive_key(*, tenant: str, subject: str, tool: str, tool_version: str, args_hash: str,
               idempotency_key: str | None, run_id: str | None,
               plan_call_id: str | None = None, key_subject: str | None = None) -> OperationKey | None:
    """The operation key of a call, or None when the caller gave no stable identity. ``key_subject``: the
    subject an ``idempotency_key`` is scoped to when it is not the caller's (``RequestMeta.key_subject``)."""
    fingerprint = _digest(["toolproxy.op/1", "fp", subject, tool_version, args_hash])
    scope = [] if plan_call_id is None else ["plan-call", plan_call_id]
    if idempotency_key is not None:
        owner = subject if key_subject is None else key_subject
        return OperationKey("ik_" + _digest(["toolproxy.op/2", "header", tenant, owner, tool, idempotency_key,
                                             *scope]), fingerprint, "idempotency_key")
    if run_id is not None:
        return OperationKey("ik_" + _digest(["toolproxy.op/1", "run", tenant, subject, tool, tool_version,
                                             args_hash, run_id, *scope]), fingerprint, "run_id")
    return None


def per_request_key(*, tenant: str, subject: str, tool: str, tool_version: str, args_hash: str) -> OperationKey:
    """The record of a write the caller gave no identity: unique to this request (a random nonce), so it
    is tracked and reconciled like any other, and never matched by a retry."""
    fingerprint = _digest(["toolproxy.op/1", "fp", subject, tool_version, args_hash])
    return OperationKey("ik_" + _digest(["toolproxy.op/1", "request", tenant, tool, uuid.uuid4().hex]),
                        fingerprint, "request")


def _digest(parts: list[str]) -> str:
    return hashlib.sha256(rfc8785.dumps(parts)).hexdigest()


@dataclass(frozen=True)
class Admission:
    """The idempotency stage's answer: run under ``key`` (holding ``token``), or replay."""

    key: str | None = None
    token: int | None = None
    attempt: int = 0
    replay: Mapping[str, Any] | None = None  # a stored SUCCEEDED outcome to return instead of running
    reserved_at: float = 0.0  # monotonic time the reservation was sent (its lease started no earlier)
    lease_s: float = 0.0      # the lease the reservation was granted
    then_reply: Any = None    # the reply of ``admit``'s ``then`` call, made with the reservation (or None)
    fingerprint: str = ""     # the operation's fingerprint: the committed outcome's MAC covers it
    # What the record's meta lets its outcome leave out (outcome_forms): set only when this call created the
    # record (a retry's record keeps the first attempt's meta, whose call and request ids differ).
    outcome_context: OutcomeContext | None = None

    @property
    def holds(self) -> bool:
        return self.token is not None

    def lease_left(self, now: float) -> float:
        """A lower bound of the reservation's remaining lease, by this process's clock."""
        return self.reserved_at + self.lease_s - now


NO_RECORD = Admission()


class RecordWrite:
    """Whether a commit's outcome record was written, and whether the call chained after it (``finish_in``'s
    ``then``) ran, known once its round trip is sent (its reply sets them)."""

    __slots__ = ("written", "then_ran")

    def __init__(self, written: bool) -> None:
        self.written = written
        self.then_ran = False


class ReplayedError(ProxyError):
    """A stored definite failure returned again to a duplicate (its envelope is marked replayed)."""


def replayed_error(outcome: Mapping[str, Any]) -> ReplayedError:
    """Rebuild the stored error of a FAILED_FINAL operation (its code is from the catalogue)."""
    error = outcome["error"]
    side = outcome.get("side_effect") or {}
    return ReplayedError(error["code"], error["message"], details=error.get("details"),
                         attempted=bool(side.get("attempted")), committed=side.get("committed", False),
                         phase=error.get("phase"), retryable=error.get("retryable"),
                         resolution=error.get("resolution"))


def outcome_of(*, data: Any = None, error: ProxyError | None = None, side_effect: SideEffect,
               tool: ToolContract, call_id: str | None, request_id: str | None,
               evidence: Mapping[str, Any] | None = None, partial: Mapping[str, Any] | None = None
               ) -> dict[str, Any]:
    """The stored form of a call's result (what a duplicate gets back): the full verified result (the
    contract's output filter applies when it is shown to an agent), the committed write's evidence and,
    for a partly applied call, its committed and pending items."""
    return stored_outcome(data=data, error=error, side_effect=side_effect, tool_version=tool.version,
                          call_id=call_id, request_id=request_id, evidence=evidence, partial=partial)


def stored_outcome(*, data: Any = None, error: ProxyError | None = None, side_effect: SideEffect,
                   tool_version: str, call_id: str | None, request_id: str | None,
                   evidence: Mapping[str, Any] | None = None, partial: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
    """``outcome_of`` for a record whose contract may be gone from the registry (an operator's resolution)."""
    stored = {"data": data if error is None else None, "error": error.to_error() if error else None,
              "side_effect": side_effect.to_json(), "tool_version": tool_version, "call_id": call_id,
              "request_id": request_id}
    if evidence is not None:
        stored["evidence"] = dict(evidence)
    if partial is not None:
        stored["partial"] = dict(partial)
    return stored


def target_summary(tool: ToolContract, normalized: NormalizedCall, fingerprint_key: bytes) -> dict[str, Any]:
    """What an operator may see of the arguments (the operation's views, its takeover record): resources, and
    arguments as audit records show them (the contract's record view: fingerprints of what it does not show)."""
    return {"resources": [r.id for r in normalized.resources], "args_hash": normalized.args_hash,
            "arguments": record_view.apply(normalized.arguments, tool.record_view, fingerprint_key,
                                           max_chars=TARGET_MAX_CHARS, max_items=record_view.MAX_ITEMS)[0]}


class IdempotencyStage:
    def __init__(self, *, store: OperationStore, config: IdempotencyConfig, reconcile: ReconcileConfig,
                 metrics: Metrics, integrity: IntegrityGuard) -> None:
        self.store = store
        self._integrity = integrity
        self._fingerprint_key = integrity.mac.derived_key(record_view.KEY_PURPOSE)  # the audit records' key
        self._config = config
        self._reconcile = reconcile
        self._metrics = metrics

    def identify(self, *, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                 meta: "RequestMeta") -> OperationKey | None:
        """The call's operation key, None if it runs without a record; refuses a required key that is missing."""
        wanted = tool.is_write or tool.idempotency_required
        op = derive_key(tenant=caller.tenant, subject=caller.subject, tool=tool.name, tool_version=tool.version,
                        args_hash=normalized.args_hash, idempotency_key=meta.idempotency_key,
                        run_id=meta.run_id, plan_call_id=meta.plan_call_id,
                        key_subject=meta.key_subject) if wanted else None
        if op is None and tool.idempotency_required:
            raise ProxyError("idempotency_key_required",
                             "This write needs an operation key a retry reproduces; nothing was sent. Send the "
                             "id of the business request it serves (the run, task or conversation, the same "
                             "across turns and re-plans) as X-Run-Id, or an Idempotency-Key header; on MCP also "
                             "params._meta[\"" + MCP_RUN_META + "\"] or [\"" + MCP_KEY_META + "\"]. "
                             "A tool call id is not one: a re-planned call gets a new one.",
                             details={"tool": tool.name, "send_one_of": ["X-Run-Id", "Idempotency-Key",
                                                                          f"_meta.{MCP_RUN_META}",
                                                                          f"_meta.{MCP_KEY_META}"]},
                             phase="idempotency")
        if op is None and tool.is_write:
            op = per_request_key(tenant=caller.tenant, subject=caller.subject, tool=tool.name,
                                 tool_version=tool.version, args_hash=normalized.args_hash)
        return op

    async def admit(self, op: OperationKey | None, *, caller: Caller, tool: ToolContract,
                    normalized: NormalizedCall, meta: "RequestMeta", call_id: str,
                    replay_only_for: str | None = None, then: Then | None = None,
                    marks: tuple[str, ...] = ()) -> Admission:
        """Reserve the operation key for this call, or say why it must not run now. With
        ``replay_only_for`` (the spent approval's id) nothing is reserved: the record's outcome or nothing.
        ``then`` (the pipeline's first lock attempt) runs in the same round trip once the key is reserved,
        where the store can (``OperationStore.begin``); its reply is the admission's ``then_reply``."""
        if op is None:
            return NO_RECORD
        budget = meta.deadline.budget(tool.timeout_ms / 1000.0)
        nonce = uuid.uuid4().hex
        record_meta = {"tenant": caller.tenant, "subject": caller.subject, "agent": caller.agent,
                        "tool": tool.name, "tool_version": tool.version, "args_hash": normalized.args_hash,
                        "source": op.source, "target": target_summary(tool, normalized, self._fingerprint_key), "call_id": call_id,
                        "request_id": meta.request_id,
                        "traceparent": spans.current_link(meta.trace)}  # reconciliation links to the call
        if marks:  # the resources this write freezes while its outcome is unknown (thawed when it settles)
            record_meta["marks"] = list(marks)
        if tool.compensation is not None:  # what its compensation will need of the arguments, exactly
            record_meta["compensation_inputs"] = compensation_contract.inputs_of(tool.compensation,
                                                                                  normalized.arguments)
        wait_until = self._wait_until(meta)
        lease_ms = self._lease_ms(budget)
        while True:
            sent = time.monotonic()
            try:
                answer = await self.store.begin(
                    op.key, fingerprint=op.fingerprint, nonce=nonce, lease_ms=lease_ms,
                    retention_s=tool.retention_seconds, is_write=tool.is_write,
                    max_attempts=self._config.max_attempts, meta=record_meta,
                    first_check_ms=self._reconcile.backoff_initial_ms, window_ms=self._reconcile.window_ms,
                    observe=replay_only_for is not None, then=then if replay_only_for is None else None)
            except RecordTooLarge:  # planted: no proxy writes one; refused unread, like a record its MAC refuses
                raise await self._integrity.refused(
                    "outcome", op.key, phase="idempotency", committed=None, idempotency_key=op.key,
                    tenant=caller.tenant, subject=caller.subject, agent=caller.agent, tool=tool.name,
                    tool_version=tool.version, args_hash=normalized.args_hash) from None
            except StoreError:  # policy: per tool: reads may proceed, writes fail closed (_store_down)
                return self._store_down(tool)
            except asyncio.CancelledError:  # the script may have run: nobody would ever release what it took
                await asyncio.shield(self._withdraw(op.key, nonce))
                raise
            status = answer.status
            if status == "in_progress" and wait_until is not None:
                left = wait_until.budget()
                if left > 0:
                    await asyncio.sleep(min(left, self._config.wait_poll_ms / 1000.0))
                    continue
            if status == "not_admitted":
                raise ProxyError("approval_mismatch",
                                 "The approval was already used by this operation, which has no result to return "
                                 "and would have to run again; a new run needs a new approval.",
                                 details={"approval_id": replay_only_for, "reason": "used",
                                          "idempotency_key": op.key, "state": answer.text(0)},
                                 phase="idempotency")
            if not self._outcome_trusted(op, answer):
                raise await self._integrity.refused(
                    "outcome", op.key, phase="idempotency", committed=None, idempotency_key=op.key,
                    tenant=caller.tenant, subject=caller.subject, agent=caller.agent, tool=tool.name,
                    tool_version=tool.version, args_hash=normalized.args_hash)
            return self._decide(tool, op.key, answer, reserved_at=sent, lease_s=lease_ms / 1000.0,
                                fingerprint=op.fingerprint, context=OutcomeContext.of_meta("", record_meta))

    def _outcome_trusted(self, op: OperationKey, answer: Transition) -> bool:
        """A stored outcome about to be handed back (a replay, a final error) carries a MAC over this key,
        this fingerprint, its state and its text; anything else is never honoured (forged, altered, or
        written by a version without MACs)."""
        if answer.status == "replay":
            state, mac = "SUCCEEDED", answer.text(1)
        elif answer.status == "final" and answer.text(0) and answer.text(1) != "attempts_exhausted":
            state, mac = answer.text(3), answer.text(2)
        else:
            return True
        return self.store.outcome_verified(op.key, fingerprint=op.fingerprint, state=state,
                                           outcome=answer.text(0), mac=mac)

    async def _withdraw(self, key: str, nonce: str) -> None:
        """A cancelled ``admit``: undo the reservation its ``begin`` made, if it made one (matched by nonce)."""
        with logged_on_fault(log, "could not undo the reservation of cancelled call %s; its lease will expire", key):
            record = await self.store.get(key)
            if record is not None and record.state == "IN_PROGRESS" and record.owner == nonce:
                await self.store.commit(key, token=record.token, target="ABANDON", outcome=None,
                                        evidence={"source": "proxy", "observed": "cancelled before sending"},
                                        first_check_ms=self._reconcile.backoff_initial_ms,
                                        window_ms=self._reconcile.window_ms)

    def _decide(self, tool: ToolContract, key: str, answer: Any, *, reserved_at: float,
                lease_s: float, fingerprint: str, context: OutcomeContext) -> Admission:
        status = answer.status
        result = {"new": "new", "retry": "retry", "replay": "replayed", "in_progress": "in_progress",
                  "conflict": "conflict", "unknown": "unknown", "final": "failed_final",
                  "exhausted": "failed_final"}[status]
        self._metrics.child(self._metrics.idempotency_results, result).inc()
        details = {"idempotency_key": key}
        if status in ("new", "retry"):
            return Admission(key=key, token=answer.int(0), attempt=answer.int(1), reserved_at=reserved_at,
                             lease_s=lease_s, then_reply=answer.then_reply, fingerprint=fingerprint,
                             outcome_context=context if status == "new" else None)
        if status == "replay":  # the same call again (same fingerprint): its contract and resources derive
            return Admission(key=key, replay=expand(_loads(answer.text(0)), replace(
                context, state="SUCCEEDED", call_id=None, request_id=None)))
        if status == "in_progress":
            raise ProxyError("operation_in_progress",
                             "Another call with this operation key is running; poll, or send Prefer: wait=<s>.",
                             details={**details, "retry_after_ms": min(answer.int(0), 1000)},
                             phase="idempotency", attempted=True, committed=None)
        if status == "conflict":
            raise ProxyError("idempotency_conflict",
                             "This Idempotency-Key was used for a different call (arguments, caller or "
                             "contract version differ); nothing was executed.",
                             details=details, phase="idempotency")
        if status == "unknown":
            if answer.int(1):  # the previous executor died holding the key: this is the moment it became unknown
                self._metrics.unknown_outcomes.labels(tool.name).inc()
            state = answer.text(0)
            raise ProxyError("operation_unknown",
                             "An earlier call with this operation key may or may not have taken effect; it is "
                             "being reconciled and will not run again automatically.",
                             details={**details, "state": state}, phase="idempotency",
                             attempted=True, committed=None,
                             resolution="ask_user" if state == "NEEDS_TAKEOVER" else None)
        if status == "final" and answer.text(0) and answer.text(1) != "attempts_exhausted":
            stored = _loads(answer.text(0))
            if stored.get("error"):
                raise replayed_error(stored)
        raise ProxyError("operation_failed",
                         "This operation failed for good (its retry budget is used up); use a new operation.",
                         details=details, phase="idempotency")

    async def state_of(self, key: str) -> str | None:
        """The state of operation ``key``'s record (None: it has none): what the lock stage asks of the operation
        whose freeze mark it met. A store fault is raised as ``StoreError`` (the caller names its policy)."""
        record = await self.store.get(key)
        return record.state if record is not None else None

    async def record(self, key: str) -> Record | None:
        """Operation ``key``'s record (None: none), for an audit record about it. A store fault is raised as
        ``StoreError``."""
        return await self.store.get(key)

    def _store_down(self, tool: ToolContract) -> Admission:
        if not tool.is_write and self._config.read_policy == "proceed":
            log.warning("idempotency store unreachable: read %s proceeds without a record", tool.name)
            self._metrics.idempotency_results.labels("skipped").inc()
            return NO_RECORD
        raise unavailable("The idempotency store is unreachable; nothing was sent.", phase="idempotency")

    async def before_send(self, admission: Admission, budget_s: float) -> None:
        """Make sure, right before sending, that this call still owns the key and that its lease covers the
        send plus most of the grace; extend it when it does not (a long lock wait, a slow stage).

        A reservation confirmed moments ago needs no round trip: while its lease runs nobody else can take
        the key (``begin`` and the reconciler's ``expire`` act only on a lapsed lease; operators only on
        UNKNOWN records), and this process's clock bounds the lease from below (it started when the
        ``begin`` was sent, or later)."""
        if not admission.holds:
            return
        if admission.lease_left(time.monotonic()) >= budget_s + 0.75 * self._config.lease_grace_ms / 1000.0:
            return
        with unavailable_on_fault("The idempotency store is unreachable; nothing was sent.", phase="execute"):
            answer = await self.store.renew(admission.key, token=admission.token, lease_ms=self._lease_ms(budget_s))
        if answer.status != "ok":
            raise ProxyError("timeout_not_started", "The call's reservation ran out before it could be sent.",
                             details={"idempotency_key": admission.key, "state": answer.text(0)},
                             phase="execute", attempted=False, committed=False)

    async def finish(self, admission: Admission, *, tool: ToolContract, data: Any, error: ProxyError | None,
                     side_effect: SideEffect, call_id: str, request_id: str) -> None:
        """Commit: record the outcome. Never raises; an unrecorded outcome is found by lease expiry."""
        if not admission.holds:
            return
        trip = RoundTrip(self.store.redis)
        self.finish_in(trip, admission, tool=tool, data=data, error=error, side_effect=side_effect,
                       call_id=call_id, request_id=request_id)
        await trip.send()

    def finish_in(self, trip: RoundTrip, admission: Admission, *, tool: ToolContract, data: Any,
                  error: ProxyError | None, side_effect: SideEffect, call_id: str, request_id: str,
                  cancelled: bool = False, evidence: Mapping[str, Any] | None = None,
                  partial: Mapping[str, Any] | None = None, then: Then | None = None) -> "RecordWrite":
        """``finish`` as one step of the commit stage's round trip (sent together with the lock release).
        ``cancelled``: a requested cancellation that applied nothing ends in the final CANCELLED state.
        ``then``: a call made in the same script call only once the record holds the outcome, where one server
        holds both (``OperationStore.commit_in``). The returned ``RecordWrite`` says, once the trip is sent,
        whether the outcome was recorded and whether ``then`` ran."""
        if not admission.holds:
            return RecordWrite(True)
        target = commit_target(error, side_effect, cancelled=cancelled, partial=partial is not None)
        outcome = outcome_of(data=data, error=error, side_effect=side_effect, tool=tool, call_id=call_id,
                             request_id=request_id, evidence=evidence, partial=partial)
        if admission.outcome_context is not None:  # the record's bytes: nothing its meta or data derive
            outcome = compact(outcome, replace(admission.outcome_context, state=target))
        write = RecordWrite(False)

        def recorded(answer: Transition | BaseException) -> None:
            if isinstance(answer, BaseException):
                log.warning("could not record the outcome of %s (%s); the key stays in progress until its lease "
                            "expires and reconciliation finds it", admission.key, target)
                return
            # "stale" / "settled": the record moved on without this call (taken over, resolved); it holds an
            # outcome a retry will see. "missing": nothing holds one.
            write.written = answer.status != "missing"
            write.then_ran = answer.then_reply is not None
            if answer.status in ("stale", "settled", "missing"):
                log.warning("outcome %s of %s not recorded: the record is %s (%s)", target, admission.key,
                            answer.text(0), answer.status)

        self.store.commit_in(trip, admission.key, token=admission.token, target=target, outcome=outcome,
                             evidence=executor_evidence(error, partial=partial is not None),
                             first_check_ms=self._reconcile.backoff_initial_ms, window_ms=self._reconcile.window_ms,
                             on_reply=recorded, fingerprint=admission.fingerprint, then=then)
        return write

    async def interrupted(self, admission: Admission, *, tool: ToolContract, sent: bool) -> None:
        """The call was cancelled: release the key if nothing was sent, else mark it unknown."""
        error = ProxyError("cancelled", "The call was cancelled.", attempted=sent, committed=None if sent else False)
        await self.finish(admission, tool=tool, data=None, error=error,
                          side_effect=SideEffect(attempted=sent, committed=None if sent else False),
                          call_id="", request_id="")

    def _lease_ms(self, budget_s: float) -> int:
        return max(1, int(max(budget_s, 0.0) * 1000)) + self._config.lease_grace_ms

    def _wait_until(self, meta: "RequestMeta") -> Deadline | None:
        """How long a call waits for a running duplicate (``Prefer: wait``, bounded), within its deadline."""
        if not meta.wait_s:
            return None
        wait = meta.deadline.within(min(meta.wait_s, self._config.max_wait_ms / 1000.0))
        return None if wait.expired else wait


def commit_target(error: ProxyError | None, side_effect: SideEffect, *, cancelled: bool, partial: bool) -> str:
    """The state a commit moves its record to (the commit script's ``target``). ``cancelled``: a requested
    cancellation that applied nothing ends in the final CANCELLED state; ``partial``: some items committed,
    others pending, which the reconciler settles."""
    if partial:
        return "UNKNOWN"
    if cancelled and side_effect.committed is False:
        return "CANCELLED"
    if error is not None and not error.attempted:
        return "ABANDON"
    if isinstance(error, VerifyMismatch):  # the independent read contradicts the commit: to a person
        return "TAKEOVER"
    if side_effect.committed is None:
        return "UNKNOWN"
    if error is None:
        return "SUCCEEDED"
    return "FAILED_RETRYABLE" if side_effect.committed is False and error.retryable else "FAILED_FINAL"


def executor_evidence(error: ProxyError | None, *, partial: bool) -> dict[str, Any]:
    """What the commit records as its evidence: what the executor observed (a contradicting independent read
    brings its own)."""
    at_ms = int(time.time() * 1000)
    if isinstance(error, VerifyMismatch):
        return {**error.evidence, "at_ms": at_ms}
    observed = "partial" if partial else error.code if error else "succeeded"
    return {"source": "executor", "observed": observed, "at_ms": at_ms}


def outcome_unknown(error: ProxyError | None, side_effect: SideEffect) -> bool:
    """Whether a call's record ends UNKNOWN at commit (``finish_in``'s rule): sent, and no definite answer."""
    return side_effect.committed is None and not (error is not None and not error.attempted)


def _loads(text: str) -> dict[str, Any]:
    return json.loads(text) if text else {}
