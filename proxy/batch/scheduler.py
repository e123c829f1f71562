"""Batch scheduler: runs a checked plan's DAG through the single-call pipeline.

Owns: when each call of a batch starts — after every predecessor in the DAG
(``proxy/batch/plan.py``) has finished, never when a ``block`` dependency did not
succeed (``cancelled`` with ``blocked_by``), never after the batch deadline
(``timeout_not_started``) — such a call still gets its one audit record
(``Auditor.call_not_started``) — and within the concurrency limits per batch, per
tenant and per tool (``scheduler.*`` settings; the tenant and tool limits are
held by the one ``Scheduler`` on the process's ``Runtime``, so they are shared
by every batch of this process). Independent ready calls run
concurrently; calls in one conflict domain run one at a time because the DAG
orders them. Must never: execute a call any other way than
``Pipeline.execute`` (authorization, idempotency and locks apply to every batch
call exactly as to a single call), or let completion order leak into the
result (``proxy/batch/merge.py`` puts results in plan order).

Programmatic use (the batch API, the OpenAI front and the MCP front's JSON-RPC batches)::

    plan = BatchPlan(calls=(PlannedCall("a", "get_order", {...}), ...), meta=request_meta)
    result = await runtime.scheduler.run(plan, caller)   # BatchResult; raises ProxyError(invalid_plan)
    body = result.to_json()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Mapping, Sequence

from ..audit import Auditor
from ..call_channel import CallChannel
from ..config import SchedulerConfig
from ..envelope import Envelope, Timing
from ..errors import ProxyError
from ..identity import Caller
from .merge import BatchResult, merge
from ..telemetry import spans
from ..telemetry.metrics import Metrics
from ..pipeline import Pipeline, RequestMeta
from .plan import (BLOCK, BatchPlan, Edge, Footprint, Graph, PlannedCall, build_graph, check, footprint,
                   unordered_writes)
from ..registry import Registry


class ConcurrencyLimits:
    """Counting slots per tenant and per tool, shared by every batch of one process."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._tenant_max = config.tenant_max_parallel
        self._tool_max = config.tool_max_parallel
        self._tool_limits = {tool: int(raw) for tool, raw in config.tool_limits.items()}  # checked by the config
        self._slots: dict[tuple[str, str], tuple[asyncio.Semaphore, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def slot(self, tenant: str, tool: str | None) -> AsyncIterator[None]:
        """Hold one tenant slot and one tool slot (always in that order)."""
        async with self._hold(("tenant", tenant), self._tenant_max):
            if tool is None:
                yield
                return
            async with self._hold(("tool", tool), self._tool_limits.get(tool, self._tool_max)):
                yield

    @contextlib.asynccontextmanager
    async def _hold(self, name: tuple[str, str], limit: int) -> AsyncIterator[None]:
        semaphore, users = self._slots.setdefault(name, (asyncio.Semaphore(limit), [0]))
        users[0] += 1
        try:
            async with semaphore:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._slots[name]  # no entry outlives its last user: the map stays bounded


FINISHED_BATCHES_KEPT = 256  # a cancel that arrives after the end still gets the batch's answer


@dataclass
class BatchRun:
    """A batch of this process, by (tenant, batch id): its cancel signal and, once done, its statuses."""

    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_requested_by: str | None = None
    results: list[dict[str, Any]] = field(default_factory=list)  # each call's status (``_call_status``)


class Scheduler:
    def __init__(self, *, pipeline: Pipeline, registry: Registry, config: SchedulerConfig,
                 metrics: Metrics, audit: Auditor,
                 cancel_answer_wait_s: float = 10.0) -> None:
        # Keyed by (tenant, subject, request id): a batch id names only its own caller's batch.
        self._batches: collections.OrderedDict[tuple[str, str, str], BatchRun] = collections.OrderedDict()
        self._cancel_answer_wait_s = cancel_answer_wait_s
        self._pipeline = pipeline
        self._audit = audit
        self._registry = registry
        self._config = config
        self._metrics = metrics
        self._limits = ConcurrencyLimits(config)

    @property
    def max_calls(self) -> int:
        return self._config.max_calls

    async def run(self, plan: BatchPlan, caller: Caller) -> BatchResult:
        """Check the plan, run it, merge the results. ``invalid_plan`` is raised before anything runs."""
        traced = spans.batch(plan.meta.trace, len(plan.calls), plan.meta.request_id)
        if traced is None:
            return await self._run(plan, caller)
        with traced:  # the batch's span: its calls' spans are its children
            result = await self._run(plan, caller)
            traced.set({"toolproxy.batch.status": result.status})
            return result

    async def _run(self, plan: BatchPlan, caller: Caller) -> BatchResult:
        timing = Timing()
        if plan.meta.if_match is not None:  # one header cannot name the state of several calls
            raise ProxyError("invalid_request", "A batch carries expected states per call (the contract's "
                             "state_guard argument), not in an If-Match header.",
                             details={"header": "If-Match"}, phase="request")
        if len(plan.calls) > self._config.max_calls:
            self._metrics.batch_calls.labels("invalid_plan").inc()
            raise ProxyError("invalid_plan", "The batch has more calls than allowed; nothing was started.",
                             details={"problems": [{"problem": "too_many_calls", "calls": len(plan.calls),
                                                    "max_calls": self._config.max_calls}]}, phase="plan")
        try:
            check(plan)
        except ProxyError:
            self._metrics.batch_calls.labels("invalid_plan").inc()
            raise
        meta = self._with_deadline(plan.meta)
        timing.deadline_ms = meta.deadline.remaining_ms()
        footprints = {call.call_id: footprint(self._registry, call) for call in plan.calls}
        unordered = unordered_writes(plan, footprints)
        if unordered:
            self._metrics.batch_calls.labels("invalid_plan").inc()
            pairs = "; ".join(" and ".join(p["calls"]) + " on " + ", ".join(p["resources"]) for p in unordered[:5])
            raise ProxyError("invalid_plan", f"Two writes on one resource have no stated order ({pairs}); nothing "
                             "was started. Order them with depends_on, or send \"order\": \"list\" if the list "
                             "order is the order you mean.", details={"problems": unordered[:50]}, phase="plan")
        graph = build_graph(plan, footprints)
        batch = BatchRun()
        self._batches[(caller.tenant, caller.subject, meta.request_id)] = batch
        try:
            refused = await self._preflight(plan, meta, caller) if plan.all_or_nothing else {}
            if refused:
                results = await self._refuse_all(plan, meta, footprints, caller, refused)
            else:
                results = await self._execute(plan, meta, graph, footprints, caller, batch)
        finally:
            batch.done.set()
            while len(self._batches) > FINISHED_BATCHES_KEPT and next(iter(self._batches.values())).done.is_set():
                self._batches.popitem(last=False)
        result = replace(merge(plan, graph, results, footprints, timing), batch_id=meta.request_id)
        batch.results = [_call_status(env) for env in result.results]
        self._metrics.batch_calls.labels(result.status).inc()
        return result

    async def cancel(self, batch_id: str, *, tenant: str, subject: str) -> dict[str, Any]:
        """``POST /v1/batches/{batch_id}:cancel``: calls not started end ``cancelled`` (``blocked_by`` behind a
        cancelled step), running calls are cancelled by the rules of proxy/transactions/cancellation.py. Answers the
        calls' outcomes once the batch has ended (or ``cancelling`` after the wait). Batches are known to the
        process that runs them (the batch id is the request's ``X-Request-Id``), and only to the caller that started
        them: another subject's batch with the same id does not exist for it."""
        batch = self._batches.get((tenant, subject, batch_id))
        if batch is None:
            raise ProxyError("batch_not_found", "No such running batch.", phase="request")
        if not batch.done.is_set() and not batch.cancel.is_set():
            batch.cancel_requested_by = subject
            batch.cancel.set()
            self._metrics.child(self._metrics.cancellations, "requested").inc()
            await self._audit.record("cancellation", tenant=tenant, subject=subject,
                                     details={"batch_id": batch_id, "from": "running", "to": "cancelling"})
        try:
            async with asyncio.timeout(self._cancel_answer_wait_s):
                await batch.done.wait()
        except TimeoutError:
            pass
        status = "cancelling" if not batch.done.is_set() else "cancelled" if batch.cancel.is_set() else "finished"
        return {"batch_id": batch_id, "status": status, "results": batch.results}

    def _with_deadline(self, meta: RequestMeta) -> RequestMeta:
        return replace(meta, deadline=meta.deadline.defaulted(self._config.default_timeout_ms / 1000.0))

    async def _execute(self, plan: BatchPlan, meta: RequestMeta, graph: Graph, footprints: Mapping[str, Footprint],
                       caller: Caller, batch: BatchRun) -> dict[str, Envelope]:
        calls = {call.call_id: call for call in plan.calls}
        incoming = graph.incoming()
        pending = list(graph.order)  # scanned in topological order, so a cancellation cascades in one pass
        results: dict[str, Envelope] = {}
        running: dict[asyncio.Task[Envelope], str] = {}
        try:
            while pending or running:
                for call_id in list(pending):
                    if any(edge.before not in results for edge in incoming[call_id]):
                        continue  # a dependency or a conflicting call has not finished
                    settled = await self._settle_unstarted(plan, calls[call_id], footprints[call_id], meta, caller,
                                                           batch, incoming[call_id], results)
                    if settled is not None:
                        results[call_id] = settled
                    elif len(running) < self._config.max_parallel:
                        task = asyncio.get_running_loop().create_task(
                            self._run_call(plan, calls[call_id], footprints[call_id], meta, caller, batch.cancel))
                        running[task] = call_id
                    else:
                        continue
                    pending.remove(call_id)
                if not running:
                    if pending:  # pragma: no cover - a checked plan always has a ready call
                        raise RuntimeError("batch scheduler stalled on an acyclic plan")
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    results[running.pop(task)] = task.result()
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        return results

    async def _settle_unstarted(self, plan: BatchPlan, call: PlannedCall, footprint: Footprint, meta: RequestMeta,
                                caller: Caller, batch: BatchRun, edges: Sequence[Edge],
                                results: Mapping[str, Envelope]) -> Envelope | None:
        """The answer of a ready call that must not start (a failed blocking dependency, a cancelled batch, no
        budget left), or None: it may run."""
        blockers = [e.before for e in edges if e.kind == "depends_on" and e.failure_policy == BLOCK
                    and results[e.before].outcome != "succeeded"]
        if blockers:
            return await self._not_started(plan, call, footprint, meta, caller, blocked_by=blockers)
        if batch.cancel.is_set():
            return await self._not_started(plan, call, footprint, meta, caller, cancelled=True)
        if meta.deadline.expired:
            return await self._not_started(plan, call, footprint, meta, caller)
        return None

    async def _preflight(self, plan: BatchPlan, meta: RequestMeta, caller: Caller) -> dict[str, ProxyError]:
        """``all_or_nothing``: every call's checks and policy decision, before any call runs (concurrently,
        within the batch's parallelism). The refused calls, by id; empty: the batch may run."""
        limit = asyncio.Semaphore(max(1, self._config.max_parallel))

        async def one(call: PlannedCall) -> ProxyError | None:
            async with limit:
                return await self._pipeline.preflight(plan.request(call, meta), caller)

        errors = await asyncio.gather(*(one(call) for call in plan.calls))
        return {call.call_id: error for call, error in zip(plan.calls, errors) if error is not None}

    async def _refuse_all(self, plan: BatchPlan, meta: RequestMeta, footprints: Mapping[str, Footprint],
                          caller: Caller, refused: Mapping[str, ProxyError]) -> dict[str, Envelope]:
        """An ``all_or_nothing`` batch with a refused call: nothing runs. The refused calls answer their own
        refusal; every other call is ``cancelled``, ``blocked_by`` the refused ones."""
        results: dict[str, Envelope] = {}
        blockers = [call.call_id for call in plan.calls if call.call_id in refused]
        for call in plan.calls:
            error = refused.get(call.call_id)
            results[call.call_id] = await self._not_started(
                plan, call, footprints[call.call_id], meta, caller, error=error,
                blocked_by=None if error is not None else blockers, all_or_nothing=True)
        return results

    async def _run_call(self, plan: BatchPlan, call: PlannedCall, fp: Footprint, meta: RequestMeta,
                        caller: Caller, cancel: asyncio.Event | None = None) -> Envelope:
        request = plan.request(call, meta)
        if cancel is not None:  # a cancelled batch withdraws the call (proxy/transactions/cancellation.py)
            request = replace(request, channel=CallChannel(withdrawn=cancel, withdrawn_by="batch"))
        async with contextlib.AsyncExitStack() as held:
            try:
                async with meta.deadline.timeout():
                    await held.enter_async_context(self._limits.slot(caller.tenant, fp.tool.name if fp.tool else None))
            except TimeoutError:
                return await self._not_started(plan, call, fp, meta, caller)
            result = await self._pipeline.execute(request, caller)
            return result.envelope

    async def _not_started(self, plan: BatchPlan, call: PlannedCall, fp: Footprint, meta: RequestMeta,
                           caller: Caller, blocked_by: list[str] | None = None,
                           cancelled: bool = False, error: ProxyError | None = None,
                           all_or_nothing: bool = False) -> Envelope:
        if error is not None:
            pass  # an all_or_nothing batch's refused call: its own refusal
        elif all_or_nothing:
            error = ProxyError("cancelled", "Not started: another call of this all_or_nothing batch was refused.",
                               details={"blocked_by": blocked_by, "reason": "all_or_nothing"}, phase="schedule")
        elif cancelled:
            error = ProxyError("cancelled", "Not started: the batch was cancelled.",
                               details={"reason": "batch_cancelled"}, phase="schedule")
        elif blocked_by:
            error = ProxyError("cancelled", "Not started: a call it depends on did not succeed.",
                               details={"blocked_by": blocked_by}, phase="schedule")
        else:
            error = ProxyError("timeout_not_started", "Not started: the batch deadline passed first.",
                               phase="schedule", attempted=False, committed=False)
        timing = Timing()
        timing.deadline_ms = meta.deadline.remaining_ms()
        tool = fp.tool.name if fp.tool else call.tool
        env = Envelope.of(call_id=call.call_id, request_id=meta.request_id, tool=tool,
                          tool_version=fp.tool.version if fp.tool else None, error=error,
                          idempotency_key=None, timing=timing,
                          extra={"blocked_by": blocked_by} if blocked_by else None)
        self._metrics.calls.labels(fp.tool.name if fp.tool else "unknown", env.outcome, error.code).inc()
        await self._audit.call_not_started(plan.request(call, meta), caller, fp, timing, env)  # fail-open: no effect
        return env


def _call_status(env: Envelope) -> dict[str, Any]:
    """One call of a finished batch, as a batch cancel answers it."""
    status = {"call_id": env.call_id, "outcome": env.outcome, "code": env.error_code,
              "idempotency_key": env.idempotency_key}
    if env.blocked_by:
        status["blocked_by"] = env.blocked_by
    return status
