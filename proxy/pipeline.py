"""The pipeline of one tool call: resolve, decode, normalize, authorize,
idempotency, lock, execute, verify, commit — in that order, once.

Owns: the order of the stages and the per-call state handed from one stage to
the next; turning any failure into an envelope with honest side-effect facts.
Must never: contain a stage's own rules (those live in the stage modules), or
let an unexpected exception escape as a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from .telemetry import logs, spans
from .adapters import Adapter, BackendCall
from .audit import Auditor, CallFacts, PolicyFacts
from .policy.approvals import origin_of
from .policy.authorize import Authorization, Authorizer
from .transactions.cancellation import Cancellations, audit_outcome
from .config import Config
from .decode import decode_arguments
from .drift import OPEN, Quarantine
from . import output_filter, read_after_write
from .envelope import Envelope, Timing, with_summary
from .flow import FlowLedger
from .output_filter import NO_POLICY
from .state_guard import carry_if_match, entity_tag
from .errors import ProxyError, SideEffect
from .identity import Caller
from .idempotency import (NO_RECORD, Admission, IdempotencyStage, OperationKey, RecordWrite, ReplayedError,
                          outcome_unknown)
from .locks import Frozen, Lease, LockManager, LockPlan
from .telemetry.metrics import Metrics
from .normalize import NormalizedCall, ResourceRef, canonical_json, digest, normalize, sha256_hex
from .policy.client import Decision, RequestFacts
from .policy.listing import suggest_tool
from .quotas import NO_TICKET, QuotaStage, Ticket
from .requests import CallResult, RequestMeta, ToolCallRequest  # noqa: F401  (importable from here too)
from .registry import Registry, ToolContract, service_resource
from .operation_views import takeover_record
from .store import RoundTrip, logged_on_fault, unavailable_on_fault
from .transactions.reconcile import audit_fields
from .transactions.unknowns import UnknownIndex
from .verify import model_partial, verify_output, verify_partial
from .versions import VersionResolver, deprecation, deprecation_headers

log = logging.getLogger("toolproxy.pipeline")
FREEZING_STATES = ("UNKNOWN", "NEEDS_TAKEOVER", "IN_PROGRESS")  # a mark of an operation in these stays
FROZEN_RETRIES = 4  # marks thawed (their operations settled) before a call gives up on a resource


@dataclass
class CallState:
    """What the stages have established so far about one call."""

    request: ToolCallRequest
    caller: Caller
    timing: Timing
    tool: ToolContract | None = None
    normalized: NormalizedCall | None = None
    idempotency_key: str | None = None
    admission: Admission = NO_RECORD          # the idempotency stage's reservation (or replay)
    quota: Ticket = NO_TICKET                 # the quota stage's slots and back-pressure facts
    replayed: bool = False
    fencing_token: int | None = None
    # a state_guard that reads the state and names no argument: the state the decision was made on (canonical
    # JSON), compared under the lock right before sending, and its entity tag when the backend honours If-Match
    decided_state: bytes | None = None
    decided_tag: str | None = None
    state_unread: ProxyError | None = None  # ...or why it could not be read (raised unless the call replays)
    lease: Lease | None = None                # held locks: released by the commit stage (or on cancellation)
    phase: str = "resolve"
    sent: bool = False
    # Audit facts, filled by the stage that establishes them (commit copies them into the record).
    policy: PolicyFacts | None = None         # the authorize stage's decision (None: none asked for)
    approval_id: str | None = None            # the approval this call consumed or created
    attempt: int = 1                          # nth execution of this idempotency key
    backend_request_id: str | None = None
    result_hash: str | None = None            # SHA-256 of the canonical verified output
    server_time: str | None = None            # the backend's own clock on its answer (HTTP Date)
    result: Any = None                        # the full verified result (the record keeps it; the model sees
                                              # the contract's filtered view, proxy/output_filter.py)
    evidence: Mapping[str, Any] | None = None  # a committed write's evidence
    partial: Mapping[str, Any] | None = None   # a partly applied call: {"committed": [...], "pending": [...]}
    cancellation: dict[str, Any] | None = None  # a cancel that reached this call: who asked, what was observed
    span: spans.CallSpan | None = None        # the call's span while tracing records it (proxy/telemetry/spans.py)
    cuttable: bool = False                    # running its stages, before the commit stage: a drain may cut it
    cut: bool = False                         # cut by the drain (``Pipeline.cut_running``)

    def facts(self) -> CallFacts:
        """What the audit records of this call so far (a value: later stages do not change it)."""
        return CallFacts(
            request=self.request, caller=self.caller, started_wall=self.timing.started_wall,
            deadline_ms=self.timing.deadline_ms, tool=self.tool, normalized=self.normalized,
            idempotency_key=self.idempotency_key, fencing_token=self.fencing_token,
            policy=self.policy, approval_id=self.approval_id, attempt=self.attempt,
            backend_request_id=self.backend_request_id, result_hash=self.result_hash)


@dataclass(frozen=True)
class CallQuota:
    """The quota stage of one call, as the authorize stage runs it (``QuotaGate``): once the decision allows,
    before an approval is spent, a key reserved or a lock taken. Its ticket stays on the call (``state.quota``);
    a batch call waits for its quota within the deadline."""

    quotas: QuotaStage
    state: CallState
    tool: ToolContract

    async def admit(self, decision: Decision) -> None:
        state, started = self.state, time.monotonic()
        if state.span is not None:
            state.span.enter("quota")
        try:
            meta = state.request.meta
            state.quota = await self.quotas.admit(state.caller, self.tool, decision.quota_class, meta.deadline,
                                                  wait=meta.wait_for_quota)
        finally:
            state.timing.stage("quota", time.monotonic() - started)
            if state.span is not None:
                state.span.leave("quota")


class Pipeline:
    def __init__(self, *, config: Config, registry: Registry, adapters: Mapping[str, Adapter],
                 metrics: Metrics, audit: Auditor, unknowns: UnknownIndex, authorizer: Authorizer,
                 idempotency: IdempotencyStage, locks: LockManager, versions: VersionResolver,
                 quotas: QuotaStage, redis: Any, cancellations: Cancellations,
                 flow: FlowLedger | None = None, quarantine: Quarantine = OPEN) -> None:
        self._config = config
        self._flow = flow
        self.quarantine = quarantine  # pinned MCP tools whose upstream drifted: refused at resolve (proxy/drift.py)
        self.cancellations = cancellations
        self._redis = redis
        self._versions = versions
        self._quotas = quotas
        self._locks = locks
        self._idempotency = idempotency
        self._authorizer = authorizer
        self._metrics = metrics
        self._audit = audit
        self._unknowns = unknowns
        self.registry = registry
        self._adapters = dict(adapters)
        self._running: dict[asyncio.Task[Any], CallState] = {}  # the calls in flight, by the task running each
        self._cut_all = False  # the drain cut the calls in flight: a call that starts now is refused at once

    @property
    def running(self) -> int:
        """Calls in flight in this process."""
        return len(self._running)

    def cut_running(self) -> int:
        """The drain's budget is spent: cancel every call still running its stages (never one in its commit
        stage). Each still ends with an envelope and its recorded outcome: ``shutting_down`` when its request
        did not leave (or a read's did), ``shutdown_unknown`` for a write whose request may have. The number
        cut."""
        self._cut_all, cut = True, 0
        for task, state in list(self._running.items()):
            if state.cuttable and not state.cut:
                state.cut = True
                task.cancel()
                cut += 1
        return cut

    @property
    def flow(self) -> FlowLedger | None:
        """The flow labels (the MCP relay records and reads them too: proxy/fronts/mcp/relay.py)."""
        return self._flow

    async def aclose(self) -> None:
        """Close adapters that hold connections of their own (MCP upstream sessions)."""
        for adapter in self._adapters.values():
            close = getattr(adapter, "aclose", None)
            if close is not None:
                await close()

    async def execute(self, request: ToolCallRequest, caller: Caller) -> CallResult:
        meta = request.meta
        with logs.bound(request_id=meta.request_id, trace_id=meta.trace.trace_id,
                        call_id=request.call_id if isinstance(request.call_id, str) else None):
            state = CallState(request=request, caller=caller, timing=Timing())
            state.timing.deadline_ms = meta.deadline.remaining_ms()
            tracing = spans.active()
            if tracing is not None:
                state.span = tracing.call(meta.trace, call_id=request.call_id)
            task = asyncio.current_task()
            assert task is not None
            self._running[task] = state
            try:
                return await self._execute(state)
            finally:  # whatever escaped (a bug included), held locks never outlive the call
                self._running.pop(task, None)
                if state.lease is not None and not state.lease.released:
                    await asyncio.shield(state.lease.release(unknown=state.sent))
                self.cancellations.finished(state.admission.key)
                if state.span is not None:
                    state.span.abandon(state.phase)  # ended already unless the call was interrupted

    async def _execute(self, state: CallState) -> CallResult:
        error: ProxyError | None = None
        try:
            if self._cut_all:  # e.g. the next call of a batch, after the cut
                raise _cut_error(state)
            state.cuttable = True
            try:
                data = state.result = await self._run(state)
            finally:
                state.cuttable = False  # from here on the call commits: the drain waits for it
            if state.partial is not None:
                env = self._envelope(state, side_effect=SideEffect(
                    attempted=True, committed=True if state.partial["committed"] else None),
                    partial=partial_block(model_partial(state.tool, state.partial), state.idempotency_key))
            else:
                view, truncated = self._model_view(state, data)
                env = self._envelope(state, data=view, side_effect=SideEffect(
                    attempted=True, committed=bool(state.tool and state.tool.is_write)), truncated=truncated)
        except ProxyError as exc:
            _absorb_cut(state)  # a stage turned the drain's cancel into its own error: that error stands
            error = exc.with_phase(state.phase)
            state.replayed = isinstance(exc, ReplayedError)
            env = self._envelope(state, error=error)
        except asyncio.CancelledError:
            if not state.cut:
                await asyncio.shield(self._interrupted(state))
                raise
            _absorb_cut(state)  # cut by the drain: answered and recorded like any other end of a call
            error = _cut_error(state).with_phase(state.phase)
            env = self._envelope(state, error=error)
        except Exception:
            log.exception("internal error in phase %s", state.phase)
            error = self._internal(state)
            env = self._envelope(state, error=error)
        env = with_summary(env, state.normalized)
        headers = deprecation_headers(state.tool)
        if state.replayed:
            env = env.as_replayed()
            headers["Idempotent-Replayed"] = "true"
        env = await self._commit(state, env, error)
        if state.span is not None:
            spans.finish_call(state.span, tool=state.tool, envelope=env, policy=state.policy,
                              key=state.idempotency_key, approval_id=state.approval_id, attempt=state.attempt)
        return CallResult(envelope=env, status=env.http_status, headers=headers)  # JSON at the front's edge

    async def _commit(self, state: CallState, env: Envelope, error: ProxyError | None) -> Envelope:
        """Commit stage: the operation's outcome, metrics, the unknown-outcome index, the final audit record.
        Returns the answer: ``env``, or ``outcome_unrecorded`` (unknown) when a sent write's definite outcome
        could not be recorded — no answer goes back that its record does not hold, or a retry of it would run
        the write again."""
        started = time.monotonic()
        if state.span is not None:
            state.span.enter("commit")
        if state.tool is not None:
            env = await self._record(state, state.tool, env, error)
        await self._quotas.finish(state.quota, sent=state.sent, error=error)
        self._observe(state, env)
        # A call with an operation record is indexed by the record's own transitions (proxy/operations.py);
        # answers about an already-open operation are not new unknowns.
        if env.outcome == "unknown" and not state.admission.holds and not _about_an_operation(env):
            await self._index_unknown(state, env)
        facts = state.facts()
        await self._audit.call_final(facts, env)
        if state.cancellation is not None:
            await audit_outcome(self._audit, facts, env, state.cancellation)
        self._committed(state, env, started)
        return env

    async def _record(self, state: CallState, tool: ToolContract, env: Envelope,
                      error: ProxyError | None) -> Envelope:
        """The outcome record and the lock release; the answer they allow."""
        written = await self._record_and_release(state, tool, env, error)
        if not written and state.sent and tool.is_write and env.side_effect.committed is not None:
            return with_summary(self._unrecorded(state, env), state.normalized)
        if written and isinstance(error, read_after_write.VerifyMismatch) and state.admission.holds:
            await self._takeover_raised(tool, state.admission.key)
        return env

    def _committed(self, state: CallState, env: Envelope, started: float) -> None:
        """The commit stage's own duration and span, and the call's closing log line."""
        span = state.span
        self._metrics.child(self._metrics.stage_duration, "commit").observe(
            time.monotonic() - started, span.exemplar() if span is not None else None)
        if span is not None:
            span.leave("commit")
        log.debug("tool call finished: tool=%s outcome=%s code=%s duration_ms=%s",
                  state.tool.name if state.tool else "unknown", env.outcome, env.error_code or "none",
                  env.timing["duration_ms"])

    async def _takeover_raised(self, tool: ToolContract, key: str) -> None:
        """A write its independent read contradicted went to a person: counted and audited like a takeover the
        reconciler raises (the audit record carries the evidence with both values)."""
        self._metrics.child(self._metrics.takeovers, tool.name).inc()
        record = None
        with logged_on_fault(log, "could not read the takeover of %s for its audit record", key):
            record = await self._idempotency.record(key)
        if record is not None:
            await self._audit.record("takeover", **audit_fields(record), details=takeover_record(record))

    def _unrecorded(self, state: CallState, env: Envelope) -> Envelope:
        """The answer of a sent write whose outcome record could not be written: unknown. Its key stays in
        progress and its resources frozen; when the lease runs out the reconciler asks the status endpoint, and
        a retry with the key meanwhile is ``operation_in_progress`` / ``operation_unknown``, never a second
        execution."""
        state.result, state.evidence, state.partial = None, None, None
        return self._envelope(state, error=ProxyError(
            "outcome_unrecorded", "The call was sent, but its outcome could not be recorded; it is unknown until "
            "it is reconciled. Do not repeat it with a new key: retry with the same key to learn the outcome.",
            details={"idempotency_key": state.idempotency_key, "observed": env.error_code or env.outcome},
            phase="commit", attempted=True, committed=None))

    async def _record_and_release(self, state: CallState, tool: ToolContract, env: Envelope,
                                  error: ProxyError | None) -> bool:
        """The outcome record and the lock release in one round trip. A sent write with a definite outcome lets
        its resources go only once its record holds that outcome: the release is chained after the record in
        one script (where one server holds both; else it follows in a second round trip). If the record cannot
        be written, the release freezes them instead (the key stays in progress; the freeze holds until the
        record settles). Whether the outcome was recorded (True when the call holds no record)."""
        lease = state.lease
        unknown = bool(state.partial) or outcome_unknown(error, env.side_effect)
        record_first = lease is not None and state.admission.holds and state.sent and tool.is_write and not unknown
        then = lease.release_step() if record_first else None
        trip = RoundTrip(self._redis)
        write = self._idempotency.finish_in(
            trip, state.admission, tool=tool, data=state.result if env.error is None else None,
            error=error, side_effect=env.side_effect, call_id=state.request.call_id,
            request_id=state.request.meta.request_id, cancelled=_cancelled_for_good(state, error),
            evidence=env.evidence, partial=recorded_partial(state.partial) if state.partial else None, then=then)
        if record_first:
            lease.stop_renewing()  # a renewal after the chained release would find the lease gone
        elif lease is not None:  # an unknown outcome keeps its resources frozen
            lease.release_in(trip, unknown=unknown)
        self._record_flow_in(trip, state, tool, env)
        if trip:  # (shielding costs a task: only when there is something to send)
            # a cancelled caller must not leave the locks held
            await asyncio.shield(self._send_commit(trip, lease if record_first else None, write))
        if lease is not None:
            await lease.renewer_stopped()
        return write.written

    def _record_flow_in(self, trip: RoundTrip, state: CallState, tool: ToolContract, env: Envelope) -> None:
        """The flow labels of an output that reached the model (a partial answer's committed items are pieces
        of that output), recorded in the commit's round trip."""
        if self._flow is not None and (tool.flow_produces or tool.flow_trusted_source) and \
                env.outcome in ("succeeded", "partial"):
            self._flow.record_in(trip, state.caller, state.request.meta.run_id, tool,
                                 now_ms=int(time.time() * 1000), call_id=state.request.call_id,
                                 output=state.result if state.result is not None else state.partial)

    async def _send_commit(self, trip: RoundTrip, release_after: Lease | None, write: RecordWrite) -> None:
        """The commit stage's round trip; then, for ``release_after`` whose release did not run chained after
        the record, the release the record's reply decides: a record that was not written leaves the lease's
        exclusive resources frozen for its operation."""
        await trip.send()
        if release_after is not None and not write.then_ran:
            then = RoundTrip(self._redis)
            release_after.add_release(then, unknown=not write.written)
            await then.send()

    async def record_flow(self, caller: Caller, run_id: str | None, tool: ToolContract, *, output: Any = None,
                          call_id: str = "") -> None:
        """A stored result of ``tool`` reached ``caller`` outside a call (an operation read): its labels and its
        values' provenance count as seen, as a call's do (an agent must not launder private data, or an
        attacker's target, through ``GET /v1/operations``)."""
        if self._flow is None or not (tool.flow_produces or tool.flow_trusted_source):
            return
        trip = RoundTrip(self._redis)
        self._flow.record_in(trip, caller, run_id, tool, now_ms=int(time.time() * 1000), output=output,
                             call_id=call_id)
        with unavailable_on_fault("The state store is unreachable; the result is not shown unrecorded.",
                                  phase="request"):
            await trip.send()

    async def _index_unknown(self, state: CallState, env: Envelope) -> None:
        meta = state.request.meta
        ref = UnknownIndex.ref(tenant=state.caller.tenant, tool=env.tool or "unknown",
                               request_id=meta.request_id, call_id=str(state.request.call_id))
        try:
            await self._unknowns.open(ref, state.timing.started_wall)
        except Exception as exc:  # the envelope already tells the caller; the gauge lags
            log.warning("could not index the unknown outcome (%s)", type(exc).__name__)

    def _observe(self, state: CallState, env: Envelope) -> None:
        # Unknown tool names are not echoed into labels: cardinality stays bounded.
        tool = state.tool.name if state.tool else "unknown"
        outcome = env.outcome
        code = env.error_code or "none"
        metrics = self._metrics
        metrics.child(metrics.calls, tool, outcome, code).inc()
        if state.tool is not None:  # who still calls an old or deprecated version
            metrics.child(metrics.tool_version_calls, tool, state.tool.version, state.tool.status).inc()
        exemplar = state.span.exemplar() if state.span is not None else None  # a bucket's example trace
        metrics.child(metrics.call_duration, tool, outcome).observe(time.monotonic() - state.timing.started_mono,
                                                                    exemplar)
        for stage, seconds in state.timing.stages.items():
            metrics.child(metrics.stage_duration, stage).observe(seconds, exemplar)
        if outcome == "unknown" and not _about_an_operation(env):
            metrics.child(metrics.unknown_outcomes, tool).inc()

    async def _interrupted(self, state: CallState) -> None:
        """Cancelled mid-call: release the reservation if nothing was sent, else the outcome is unknown;
        release the locks."""
        if state.lease is not None:
            await state.lease.release(unknown=state.sent)
        if state.tool is not None:
            await self._idempotency.interrupted(state.admission, tool=state.tool, sent=state.sent)
        await self._quotas.finish(state.quota, sent=False, error=None)  # a cancelled call teaches the breaker nothing

    async def _run(self, state: CallState) -> Any:
        """The stage list of one call, in order; each step below is one or two stages."""
        tool, normalized = await self._resolve_decode_normalize(state)
        self._enough_budget(tool, state.request.meta)  # a call that cannot finish is not started (nor approved)
        op = self._identify(state, tool, normalized)
        auth = await self._authorize(state, tool, normalized, op)
        plan = self._locks.plan(lock_resources(tool, normalized), tenant=state.caller.tenant, tool=tool.name,
                                is_write=tool.is_write, operation=op.key if op else None,
                                request_id=state.request.meta.request_id)
        admission = await self._reserve(state, tool, normalized, op, auth, plan)
        if admission.replay is not None:
            state.replayed = True
            state.evidence = admission.replay.get("evidence")
            return admission.replay.get("data")
        if state.state_unread is not None:  # the state the decision was made on is unknown: nothing is sent
            raise state.state_unread
        # From here on a cancel request (by key) or a withdrawal stops the call by the rules of
        # proxy/transactions/cancellation.py.
        return await self.cancellations.guard(state, admission.key,
                                              self._lock_then_run(state, tool, normalized, admission, plan))

    async def _resolve_decode_normalize(self, state: CallState) -> tuple[ToolContract, NormalizedCall]:
        request = state.request
        with self._stage(state, "resolve"):  # the run's pinned version when X-Run-Id names a run
            try:
                tool = state.tool = await self._versions.resolve(self.registry, request, state.caller)
            except ProxyError as error:
                await self._suggest(error, state.caller, request.meta)
                raise
            self.quarantine.check(tool)  # contract_drift: a pinned MCP tool whose upstream changed
        with self._stage(state, "decode"):
            arguments = decode_arguments(
                carry_if_match(tool, request.arguments, request.meta.if_match, max_depth=self._config.decode.max_depth),
                tool.input_validator, max_depth=self._config.decode.max_depth)
        with self._stage(state, "normalize"):
            normalized = state.normalized = normalize(tool, arguments)
        return tool, normalized

    async def _suggest(self, error: ProxyError, caller: Caller, meta: RequestMeta) -> None:
        """An unknown tool's name gets "did you mean" (in the message and ``details.did_you_mean``), drawn
        only from the tools this caller's listing shows, so a hidden tool's name never leaks. A retired tool
        or an unknown version names its tool already and gets none."""
        name = error.details.get("tool")
        if error.code != "tool_not_found" or not isinstance(name, str) or set(error.details) != {"tool"}:
            return
        suggestion = await suggest_tool(name, self.registry, self._authorizer.policy, caller,
                                        request_id=meta.request_id, trace_id=meta.trace.trace_id,
                                        deadline=meta.deadline, quarantine=self.quarantine)
        if suggestion is not None:
            error.details["did_you_mean"] = suggestion
            error.message = f'{error.message} Did you mean "{suggestion}"?'
            error.args = (error.message,)

    def _identify(self, state: CallState, tool: ToolContract, normalized: NormalizedCall) -> OperationKey | None:
        """The operation's key, before an approval is used (a missing required key is refused here)."""
        with self._stage(state, "idempotency"):
            op = self._idempotency.identify(caller=state.caller, tool=tool, normalized=normalized,
                                            meta=state.request.meta)
            state.idempotency_key = op.key if op else None
        return op

    async def _authorize(self, state: CallState, tool: ToolContract, normalized: NormalizedCall,
                         op: OperationKey | None) -> Authorization:
        """The OPA decision (and, inside it, the quota stage and the approval's use)."""
        request, meta = state.request, state.request.meta
        with self._stage(state, "authorize"):
            auth = await self._authorizer.authorize(
                state.caller, tool, normalized,
                RequestFacts(request_id=meta.request_id, call_id=request.call_id, run_id=meta.run_id,
                             trace_id=meta.trace.trace_id, flow_as=meta.flow_as),
                approval_id=meta.approval_id, deadline=meta.deadline,
                operation_key=op.key if op else None, quota=CallQuota(self._quotas, state, tool),
                origin=origin_of(meta, request.call_id, op))
            state.policy = auth.audit_facts()
            state.approval_id = auth.approval_id
            if auth.error is not None:
                raise auth.error
            if tool.state_at:  # the state this decision was made on: checked again under the lock before sending
                await self._capture_state(state, tool, normalized)
        return auth

    async def _reserve(self, state: CallState, tool: ToolContract, normalized: NormalizedCall,
                       op: OperationKey | None, auth: Authorization, plan: LockPlan | None) -> Admission:
        """The idempotency record, created only once the call is authorized. The first lock attempt rides
        with the reservation (one round trip, taken only if the key is reserved) where one server holds
        both; elsewhere, and when it finds the set busy, the lock stage waits."""
        meta = state.request.meta
        first_attempt = self._locks.attempt(plan) if plan is not None and op is not None else None
        with self._stage(state, "idempotency"):
            sent = time.monotonic()
            try:
                admission = state.admission = await self._idempotency.admit(
                    op, caller=state.caller, tool=tool, normalized=normalized, meta=meta,
                    call_id=state.request.call_id, replay_only_for=auth.approval_id if auth.replay_only else None,
                    then=first_attempt, marks=tuple(r.id for r in plan.wanted if r.access == "exclusive")
                    if plan is not None and tool.is_write else ())
            except BaseException as exc:  # the attempt may have taken the set before the reply was lost
                if plan is not None and first_attempt is not None and _reply_unknown(exc):
                    await self._locks.forget(plan)
                raise
            state.idempotency_key = admission.key
            state.attempt = max(1, admission.attempt)
            if plan is not None and admission.then_reply is not None:
                state.lease = self._locks.granted(plan, admission.then_reply, sent=sent, started=sent)
        return admission

    async def _lock_then_run(self, state: CallState, tool: ToolContract, normalized: NormalizedCall,
                             admission: Admission, plan: LockPlan | None) -> Any:
        meta = state.request.meta

        # A long lock wait must not let the key's lease (budget + grace) run out: the reconciler would take
        # the call for a dead one. Renewed every half grace while waiting.
        async def keep_reservation() -> None:
            await self._idempotency.before_send(admission, meta.deadline.budget(tool.timeout_ms / 1000.0))

        with self._stage(state, "lock"):  # after the key is reserved, before anything is sent
            if state.lease is None:
                state.lease = await self._acquire(state, plan, keep_reservation)
            lease = state.lease
        # The lease is released on every path: with the outcome record at commit, or on cancellation.
        return await self._run_locked(state, tool, normalized, admission, lease)

    async def _acquire(self, state: CallState, plan: LockPlan | None,
                       keep_reservation: Callable[[], Awaitable[None]]) -> Lease | None:
        """Lock stage: take the plan's set. A write that meets the freeze mark of an operation whose outcome is
        unknown (or in takeover) is refused with ``operation_unknown`` naming it; a mark whose operation has
        settled since (its thaw was lost) is thawed here and the set taken again."""
        meta = state.request.meta
        for _ in range(FROZEN_RETRIES):
            try:
                return await self._locks.acquire_planned(
                    plan, deadline=meta.deadline, while_waiting=keep_reservation,
                    keepalive_s=self._config.idempotency.lease_grace_ms / 2000.0)
            except Frozen as frozen:
                with unavailable_on_fault("The operation store is unreachable; nothing was sent.", phase="lock"):
                    operation_state = await self._idempotency.state_of(frozen.operation)
                if operation_state in FREEZING_STATES:
                    self._metrics.child(self._metrics.frozen_refusals,
                                        state.tool.name if state.tool else "unknown").inc()
                    frozen.details["state"] = operation_state
                    raise frozen
                log.info("thawing %s on %s: the operation is %s", frozen.operation, frozen.resource,
                         operation_state or "gone")
                with unavailable_on_fault("The lock store is unreachable; nothing was sent.", phase="lock"):
                    await self._locks.thaw(state.caller.tenant, [frozen.resource], frozen.operation)
        raise ProxyError("resource_busy", "A resource this call needs stays frozen; nothing was sent.",
                         phase="lock", attempted=False, committed=False)

    def _enough_budget(self, tool: ToolContract, meta: RequestMeta) -> None:
        """DeadlineValid: a call with less than the contract's ``min_budget_ms`` left is answered
        ``timeout_not_started`` and never sent, rather than sent to become ``timeout_unknown`` by the proxy's
        own doing."""
        if meta.deadline.remaining() is None:
            return
        budget_ms = int(meta.deadline.budget(tool.timeout_ms / 1000.0) * 1000)
        if budget_ms < tool.min_budget_ms:
            raise ProxyError("timeout_not_started", "Too little of the deadline is left for this call to finish; "
                             "it was not sent. Retry with a longer deadline (the same key).",
                             details={"tool": tool.name, "budget_ms": max(budget_ms, 0),
                                      "min_budget_ms": tool.min_budget_ms},
                             phase="schedule", attempted=False, committed=False)

    async def preflight(self, request: ToolCallRequest, caller: Caller) -> ProxyError | None:
        """The checks an ``all_or_nothing`` batch makes of every call before any runs: resolve, decode,
        normalize and the policy decision (``Authorizer.preflight``), without a key, a lock or a send.
        None: the call would be allowed now; else the error that refuses it."""
        meta = request.meta
        try:
            try:
                tool = await self._versions.resolve(self.registry, request, caller)
            except ProxyError as error:
                await self._suggest(error, caller, meta)
                raise
            self.quarantine.check(tool)
            arguments = decode_arguments(request.arguments, tool.input_validator,
                                         max_depth=self._config.decode.max_depth)
            normalized = normalize(tool, arguments)
        except ProxyError as error:
            return error
        return await self._authorizer.preflight(
            caller, tool, normalized,
            RequestFacts(request_id=meta.request_id, call_id=request.call_id, run_id=meta.run_id,
                         trace_id=meta.trace.trace_id), deadline=meta.deadline)

    async def _run_locked(self, state: CallState, tool: ToolContract, normalized: NormalizedCall,
                          admission: Admission, lease: Lease | None) -> Any:
        meta = state.request.meta
        state.fencing_token = lease.fencing_token if lease is not None else None
        with self._stage(state, "audit"):
            await self._audit.call_intent(tool, state.facts)  # fail-closed calls stop here if the sink is down
        with self._stage(state, "execute"):
            signal = state.request.channel.withdrawn
            if signal is not None and signal.is_set():
                raise ProxyError("cancelled", "The caller cancelled the call before it was sent.",
                                 attempted=False, committed=False)
            # A pinned MCP tool: its upstream verified recently enough, or a check now (contract_drift if it drifted)
            await self.quarantine.fresh(tool, meta.deadline.within(tool.timeout_ms / 1000.0))
            if tool.state_read is not None:  # under the lock, right before sending
                await self._check_state(state, tool, normalized)
            if tool.ownership_read is not None:  # the owner in the system of record, under the lock
                await self._check_owner(state, tool, normalized)
            self._enough_budget(tool, meta)  # again: the lock wait and the stages before took their time
            await self._idempotency.before_send(
                admission, meta.deadline.budget(tool.timeout_ms / 1000.0))
            sending = self._adapters[tool.backend.type].call(self._backend_call(state, tool, normalized))
            result = await (lease.guard(sending) if lease is not None else sending)  # lock_lost if the lease goes
            state.backend_request_id = result.backend_request_id
            state.server_time = result.server_time
            partial = result.partial
        if partial is not None:  # items of the result, not a result: each checked as one (verify_partial)
            with self._stage(state, "verify"):
                state.partial = verify_partial(tool, partial)
            return None
        with self._stage(state, "verify"):
            data = verify_output(tool, result.data)
            state.result_hash = digest(data)
            if tool.verify_read is not None and tool.is_write:  # still under the write's locks
                await self._check_after_write(state, tool, normalized, data)
            return data

    async def _read_for(self, state: CallState, read: read_after_write.VerifyRead, arguments: Mapping[str, Any],
                        result: Any, *, suffix: str) -> Any:
        """Run a contract's read (the state read before a write, the check after it) on the caller's behalf,
        under the write's lock and fencing token; its verified result."""
        target = self.registry.get(read.tool, read.version)
        read_arguments = read_after_write.read_arguments(read, arguments=arguments, result=result)
        if target is None or read_arguments is None:
            raise ProxyError("tool_not_found", "The contract's read is not in the registry or lacks an argument.")
        meta = state.request.meta
        canonical = canonical_json(read_arguments)
        trace = state.span.outgoing() if state.span is not None else meta.trace.child().headers()
        call = BackendCall(
            tool=target, canonical_arguments=canonical, arguments=read_arguments,
            call_id=f"{state.request.call_id}.{suffix}", request_id=meta.request_id,
            deadline=meta.deadline.within(target.timeout_ms / 1000.0), channel=state.request.channel,
            traceparent=trace["traceparent"], tracestate=trace.get("tracestate"), subject=state.caller.subject,
            tenant=state.caller.tenant, agent=state.caller.agent, fencing_token=state.fencing_token,
            args_hash=sha256_hex(canonical), caller_token=state.caller.token)
        return verify_output(target, (await self._adapters[target.backend.type].call(call)).data)

    async def _read_before_send(self, state: CallState, read: read_after_write.VerifyRead,
                                normalized: NormalizedCall, label: str, what: str, *, phase: str = "execute") -> Any:
        """A contract's read before sending (the guarded state, the owner); one that fails is
        ``dependency_unavailable`` with nothing sent."""
        try:
            return await self._read_for(state, read, normalized.arguments, None, suffix=label.partition("_")[0])
        except ProxyError as failed:
            raise ProxyError("dependency_unavailable", f"{what} could not be read; nothing was sent. Retry with "
                             "the same key.", details={label: f"{read.tool}@{read.version}", "read_error": failed.code},
                             phase=phase, attempted=False, committed=False) from None

    async def _capture_state(self, state: CallState, tool: ToolContract, normalized: NormalizedCall) -> None:
        """The guarded state as the decision saw it, read right after the decision allowed the call (a
        ``state_guard`` with a read and no argument): kept on the call for ``_check_state``, and sent as
        ``If-Match`` where the contract says the backend honours it. A read that fails or lacks that state (or,
        for ``If-Match``, gives one that cannot be an entity tag) is ``dependency_unavailable`` once the key is
        reserved (a duplicate of a settled operation gets its stored answer): nothing is sent."""
        read = tool.state_read
        what = "The state this write depends on"
        try:
            observed = await self._read_before_send(state, read, normalized, "state_read", what, phase="authorize")
        except ProxyError as unread:  # raised once the key is reserved: a duplicate still gets its replay
            state.state_unread = unread
            return
        value = read_after_write.pointed(observed, tool.state_at)
        tag = entity_tag(value) if tool.state_if_match else None
        if value is read_after_write.MISSING or (tool.state_if_match and tag is None):
            state.state_unread = ProxyError(
                "dependency_unavailable", f"{what} is not in the read's answer; nothing was sent.",
                details={"state_read": f"{read.tool}@{read.version}", "state": tool.state_at},
                phase="authorize", attempted=False, committed=False)
            return
        state.decided_state, state.decided_tag = canonical_json(value), tag

    async def _check_state(self, state: CallState, tool: ToolContract, normalized: NormalizedCall) -> None:
        """The guarded state, read again under the write's lock right before sending: a resource that changed
        (hands, version) since the decision is refused with ``state_changed``, and nothing is sent. It is
        compared with the guard argument, or without one with the state captured at the decision."""
        read = tool.state_read
        observed = await self._read_before_send(state, read, normalized, "state_read",
                                                "The state this write depends on")
        if tool.state_at:
            now = read_after_write.pointed(observed, tool.state_at)
            changed = now is read_after_write.MISSING or canonical_json(now) != state.decided_state
            where = {"state": tool.state_at}
        else:
            changed = bool(read_after_write.differences(read, arguments=normalized.arguments, result=None,
                                                        observed=observed))
            where = {"field": tool.state_guard}
        if changed:
            raise ProxyError("state_changed", "The resource is no longer in the state this write was decided "
                             f"on ({next(iter(where.values()))}); nothing was sent. Read it again before deciding.",
                             details={**where, "state_read": f"{read.tool}@{read.version}"},
                             phase="execute", attempted=False, committed=False)

    async def _check_owner(self, state: CallState, tool: ToolContract, normalized: NormalizedCall) -> None:
        """The resource's owning tenant, read from the system of record under the call's lock right before
        sending: another tenant's resource (or one the read cannot place) is ``forbidden``, and nothing is sent.
        This is how a deployment with more ids than OPA data could hold checks ownership (kind ``at_write``)."""
        read = tool.ownership_read
        observed = await self._read_before_send(state, read, normalized, "ownership_read", "The resource's owner")
        if read_after_write.pointed(observed, tool.owner_at) != state.caller.tenant:
            raise ProxyError("forbidden", "The resource does not belong to the caller's tenant; nothing was sent.",
                             details={"ownership_read": f"{read.tool}@{read.version}"},
                             phase="execute", attempted=False, committed=False)

    async def _check_after_write(self, state: CallState, tool: ToolContract, normalized: NormalizedCall,
                                 data: Any) -> None:
        """The contract's independent read after a committed write: its result must show what the write
        claims. A difference, or a read that fails, is ``verification_mismatch`` (the commit stage records a
        takeover with both values; the write's resources stay frozen)."""
        read = tool.verify_read
        try:
            observed = await self._read_for(state, read, normalized.arguments, data, suffix="verify")
        except ProxyError as failed:
            log.warning("the verify read %s of %s failed (%s): the write goes to an operator", read.tool,
                        tool.name, failed.code)
            raise read_after_write.mismatch(read, read_error=failed) from None
        found = read_after_write.differences(read, arguments=normalized.arguments, result=data, observed=observed)
        if found:
            log.warning("the verify read %s contradicts the commit of %s: the write goes to an operator",
                        read.tool, tool.name)
            raise read_after_write.mismatch(read, differences_found=found)

    def _model_view(self, state: CallState, data: Any) -> tuple[Any, bool]:
        """What of the verified result the model sees (the contract's filter and limit), and the evidence
        of a committed write (a replay keeps the evidence recorded when it ran)."""
        tool = state.tool
        if tool is None:
            return data, False
        if tool.is_write and state.evidence is None and not state.replayed:
            state.evidence = {
                "backend_request_id": state.backend_request_id,
                "result_digest": state.result_hash if state.result_hash is not None else digest(data),
                "server_time": state.server_time,
                "resource_keys": [r.id for r in state.normalized.resources] if state.normalized else []}
        policy = tool.output_policy
        if policy is NO_POLICY:
            return data, False
        return output_filter.fit(policy, output_filter.visible(policy, data), tool=tool.name,
                                 is_write=tool.is_write)

    def _backend_call(self, state: CallState, tool: ToolContract, normalized: NormalizedCall) -> BackendCall:
        meta = state.request.meta
        state.sent = True
        trace = state.span.outgoing() if state.span is not None else meta.trace.child().headers()
        return BackendCall(
            tool=tool, canonical_arguments=normalized.canonical, arguments=normalized.arguments,
            call_id=state.request.call_id, request_id=meta.request_id,
            deadline=meta.deadline.within(tool.timeout_ms / 1000.0), channel=state.request.channel,
            traceparent=trace["traceparent"], tracestate=trace.get("tracestate"), subject=state.caller.subject,
            tenant=state.caller.tenant, agent=state.caller.agent,
            idempotency_key=state.idempotency_key, fencing_token=state.fencing_token,
            args_hash=normalized.args_hash, decision_id=state.policy.decision_id if state.policy else None,
            approval_id=state.approval_id, caller_token=state.caller.token, captured_if_match=state.decided_tag)

    def _stage(self, state: CallState, name: str) -> "_Stage":
        return _Stage(state, name)

    def _internal(self, state: CallState) -> ProxyError:
        # An unexpected failure after a write was handed to the adapter may have
        # happened after the backend applied it: say unknown, never "not applied".
        unknown = state.sent and state.tool is not None and state.tool.is_write and state.phase == "execute"
        return ProxyError("internal_error", "The proxy failed unexpectedly.", phase=state.phase,
                          attempted=state.sent, committed=None if unknown else
                          (True if state.sent and state.phase == "verify" and state.tool and state.tool.is_write
                           else False))

    def _envelope(self, state: CallState, *, data: Any = None, error: ProxyError | None = None,
                  side_effect: SideEffect | None = None, truncated: bool = False,
                  partial: Mapping[str, Any] | None = None) -> Envelope:
        tool = state.tool
        return Envelope.of(truncated=truncated, evidence=state.evidence if error is None else None, partial=partial,
            call_id=state.request.call_id, request_id=state.request.meta.request_id,
            tool=tool.name if tool else state.request.tool if isinstance(state.request.tool, str) else None,
            tool_version=tool.version if tool else None, data=data, error=error,
            side_effect=side_effect or SideEffect(False, False), idempotency_key=state.idempotency_key,
            timing=state.timing, extra=_deprecation_block(tool))


def partial_block(partial: Mapping[str, Any], key: str | None) -> dict[str, Any]:
    """The envelope's ``partial`` member: the items, and where the rest is followed (the operation, which
    the reconciler settles; with nothing pending, a person decides what to do with the applied part)."""
    return {"committed": list(partial["committed"]), "pending": list(partial["pending"]),
            "recovery": {"operation": f"/v1/operations/{key}" if key else None,
                         "resolution": "reconcile" if partial["pending"] else "ask_user"}}


def recorded_partial(partial: Mapping[str, Any]) -> dict[str, Any]:
    """What the operation record keeps of a partial answer: the items and the digest of the committed
    ones, which recovery compares with what the status endpoint later reports."""
    return {"committed": list(partial["committed"]), "pending": list(partial["pending"]),
            "committed_digests": [digest(item) for item in partial["committed"]]}


def _deprecation_block(tool: ToolContract | None) -> dict[str, Any] | None:
    facts = deprecation(tool)
    return None if facts is None else {"deprecation": facts}


class _Stage:
    """``with self._stage(state, name):`` sets the call's phase and adds the stage's duration to its timing
    (a plain class: a generator-based context manager costs several times more, ten times per call)."""

    __slots__ = ("_state", "_name", "_started")

    def __init__(self, state: CallState, name: str) -> None:
        self._state = state
        self._name = name

    def __enter__(self) -> None:
        self._state.phase = self._name
        self._started = time.monotonic()
        if self._state.span is not None:
            self._state.span.enter(self._name)

    def __exit__(self, *exc: Any) -> None:
        self._state.timing.stage(self._name, time.monotonic() - self._started)
        if self._state.span is not None:
            self._state.span.leave(self._name, exc[1])


def lock_resources(tool: ToolContract, normalized: NormalizedCall) -> tuple[ResourceRef, ...]:
    """What a call locks: its resources, plus its service's lock where the service has a write that declares
    no resources (``ToolContract.service_lock``: that write exclusively, every other write shared)."""
    if tool.service_lock == "none":
        return normalized.resources
    return (*normalized.resources, ResourceRef(service_resource(tool), tool.service_lock))


def _reply_unknown(exc: BaseException) -> bool:
    """A store call ended without its reply (cancelled, or the store failed): what it did is unknown."""
    return isinstance(exc, asyncio.CancelledError) or (
        isinstance(exc, ProxyError) and exc.code == "dependency_unavailable")


def _cancelled_for_good(state: CallState, error: ProxyError | None) -> bool:
    """A requested cancellation ends in a final CANCELLED record; an MCP withdrawal of a call never sent
    releases the key instead (nothing happened, the client may ask again)."""
    cancel = state.cancellation
    return error is not None and error.code == "cancelled" and cancel is not None \
        and (state.sent or cancel.get("source") != "mcp")


def _about_an_operation(env: Envelope) -> bool:
    """An answer about an operation that is already running or unknown (not a new unknown of this call)."""
    return env.error_code in ("operation_unknown", "operation_in_progress")


def _absorb_cut(state: CallState) -> None:
    """The drain's cancel of this call has been handled: the task goes on to commit (not cancelled again)."""
    task = asyncio.current_task()
    if state.cut and task is not None and task.cancelling():
        task.uncancel()


def _cut_error(state: CallState) -> ProxyError:
    """A call the drain cut: a write whose request may have left has an unknown outcome (reconciled, never
    run again under a new key); anything else did nothing that stays, and is retried with the same key."""
    if state.sent and state.tool is not None and state.tool.is_write:
        return ProxyError("shutdown_unknown", "The proxy shut down before the backend answered; whether the call "
                          "took effect is unknown.", details={"idempotency_key": state.idempotency_key},
                          attempted=True, committed=None)
    return ProxyError("shutting_down", "The proxy is shutting down; nothing was done. Retry with the same key.",
                      attempted=state.sent, committed=False)
