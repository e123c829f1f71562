"""Cancellation: stopping a call honestly.

Owns: the calls of this process that can be cancelled (by operation key, and
the MCP / batch withdrawal signal in the call's context), delivering a cancel
to the replica that runs the call (one Redis pub/sub channel), the cancel
protocol and what a cancel request answers:

1. ``POST /v1/operations/{key}:cancel`` marks the record (``cancel``: shown as
   ``CANCELLING``) once, atomically; a second request finds the mark and gets
   the same answer (one cancel request reaches the backend).
2. Nothing sent yet: the call stops where it is (authorize, lock wait, ...)
   and ends ``cancelled`` with ``side_effect.attempted: false``.
3. Sent: the adapter is told (HTTP: the contract's ``cancel_endpoint``, then
   the stream is closed after ``cancellation.grace_ms``; MCP: the stream is
   closed at once, which sends ``notifications/cancelled`` upstream), then the
   status endpoint is asked when the contract has one. The call commits
   ``cancelled`` (evidence: the backend's own answer or the status endpoint
   says nothing was applied), ``succeeded`` (it completed anyway) or, without
   evidence, ``unknown`` (``cancel_unconfirmed``, reconciled as any unknown).

The commit stage records the outcome (``CANCELLED`` is final) and releases the
locks, as for every call. Must never: assume a sent call did not happen, send
a second cancel request for one operation, or re-run anything.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, Mapping, Protocol

from .. import store
from ..store import ChannelListener
from ..audit import Auditor, CallFacts
from ..normalize import digest
from ..config import CancellationConfig
from ..envelope import Envelope
from ..errors import ProxyError
from ..integrity import IntegrityGuard
from ..interrupts import TaskInterrupt
from ..idempotency import KEY_PATTERN
from ..operation_views import checked_agent_view
from ..telemetry import spans
from ..telemetry.metrics import Metrics
from ..operations import OperationStore, Record
from ..adapters import Adapter
from ..identity import Caller
from ..registry import Registry, ToolContract
from ..requests import ToolCallRequest

log = logging.getLogger("toolproxy.cancellation")

EARLY_CANCELS_KEPT = 1024
EARLY_CANCEL_S = 5.0  # an early cancel older than this was for a call of another replica
StatusQuery = Callable[[ToolContract, Record], Awaitable[Any]]  # Reconciler.query_status


class CancellableCall(Protocol):
    """What cancellation reads and writes of a call in flight (``pipeline.CallState`` is one): its caller and
    contract, whether its request left, and the two facts a cancel establishes for its audit record."""

    caller: Caller
    tool: ToolContract | None
    sent: bool
    cancellation: dict[str, Any] | None  # written here: who asked, what was observed
    result_hash: str | None               # written here when the status endpoint supplied the result
    partial: Mapping[str, Any] | None     # a partly applied answer (its cancellation ended partial)
    request: ToolCallRequest              # the call (its trace context; its channel's withdrawal signal)
    span: Any                             # the call's span while tracing records it (a cancel links to it)


@dataclass
class InFlight:
    """A call of this process that holds an operation record."""

    key: str
    wake: Callable[[], None]                  # wakes the guard
    requested: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    request: Mapping[str, Any] | None = None  # who asked, when


class Cancellations:
    def __init__(self, *, config: CancellationConfig, store: OperationStore, adapters: Mapping[str, Adapter],
                 audit: Auditor, metrics: Metrics, redis: store.Client | None = None, channel: str | None = None,
                 registry: Registry | None = None, integrity: IntegrityGuard) -> None:
        self._config = config
        self._integrity = integrity
        self._registry = registry
        self._store = store
        self._redis = redis
        self._channel = channel
        self._listener = ChannelListener(redis, channel, self._deliver, on_subscribed=self._subscribed,
                                         what="cancellation channel", log=log) \
            if redis is not None and channel is not None else None
        self.listening = asyncio.Event()  # subscribed to the channel other replicas publish cancels on
        self._adapters = adapters
        self._audit = audit
        self._metrics = metrics
        self._flights: dict[str, InFlight] = {}
        # Cancels that found an IN_PROGRESS record but no call here yet (its reservation's reply may still
        # be on its way to this process); the guard picks them up. Bounded: others belong to other replicas.
        self._early: collections.OrderedDict[str, tuple[float, Mapping[str, Any]]] = collections.OrderedDict()
        self.status_query: StatusQuery | None = None  # set once the reconciler exists

    # -- the pipeline's hooks ------------------------------------------------------
    async def guard(self, state: CancellableCall, key: str | None, work: Coroutine[Any, Any, Any]) -> Any:
        """Run ``work`` (lock wait, send, verify) so that a cancel request or a withdrawal stops it by the
        rules above. A call that nobody can cancel runs as is.

        The work runs in the caller's task (no task per call). A cancel that arrives starts the stop
        (``_Stop.begin``): a call not sent yet, or sent through an adapter that cancels by closing, is
        interrupted at once by cancelling this task (the guard takes that cancel back and settles the
        outcome); a sent HTTP call is asked to stop by a task of its own (cancel endpoint, then the
        grace), which interrupts it only if it has not answered by then. A cancel of the caller itself
        stays a cancel."""
        channel = state.request.channel  # who can withdraw the call: the MCP front's client, a cancelled batch
        signal = channel.withdrawn
        if key is None and signal is None:
            return await work
        stop = _Stop(self, state, key, channel.withdrawn_by)
        if key is not None:
            self._register(stop, key)
        watcher = _watch(signal, stop)
        try:
            if stop.started:  # cancelled before it began: nothing of it runs
                work.close()
                return await self._settle(state, key, stop, cancelled=True)
            return await self._run_stoppable(state, key, stop, work)
        finally:
            stop.running, stop.over = False, True
            if watcher is not None:
                watcher.cancel()
            if stop.helper is not None and not stop.helper.done():  # the caller itself was cancelled
                stop.helper.cancel()

    def _register(self, stop: "_Stop", key: str) -> None:
        """The call's flight, where a cancel request by key finds it; a cancel asked while the reservation's
        reply was on its way (kept a few seconds) starts the stop at once."""
        stop.flight = self._flights[key] = InFlight(key, wake=stop.begin)
        early = self._early.pop(key, None)
        if early is not None and time.monotonic() - early[0] < EARLY_CANCEL_S:
            stop.flight.request = early[1]
            stop.flight.requested.set()
            stop.begin()

    async def _run_stoppable(self, state: CancellableCall, key: str | None, stop: "_Stop",
                             work: Coroutine[Any, Any, Any]) -> Any:
        stop.running = True
        try:
            result = await work
        except asyncio.CancelledError:
            if not stop.take_back():
                raise  # the caller itself was cancelled: the work went with it
            stop.ended()
            return await self._settle(state, key, stop, cancelled=True)
        except Exception as error:
            stop.take_back()
            if not stop.started:
                raise
            stop.ended()
            return await self._settle(state, key, stop, error=error)
        stop.take_back()
        if not stop.started:
            return result
        stop.ended()
        return await self._settle(state, key, stop, result=result)

    def finished(self, key: str | None) -> None:
        """The call's outcome is recorded (commit stage): a waiting cancel request may read it."""
        flight = self._flights.pop(key, None) if key is not None else None
        if flight is not None:
            flight.finished.set()

    # -- delivery across replicas ------------------------------------------------------
    # A cancel request may reach a replica that does not run the call: it publishes the key on one Redis
    # channel, every replica listens, and the one that runs the call stops it.
    def start(self) -> None:
        if self._listener is not None:
            self._listener.start()

    async def stop(self) -> None:
        if self._listener is not None:
            await self._listener.stop()

    async def _subscribed(self) -> None:
        self.listening.set()

    def _deliver(self, raw: Any) -> None:
        try:
            message = json.loads(raw)
            key, request = message["key"], message["request"]
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed cancel message")
            return
        flight = self._flights.get(key)
        if flight is not None and not flight.requested.is_set():
            flight.request = request
            flight.requested.set()
            flight.wake()

    async def _publish(self, key: str, request: Mapping[str, Any]) -> None:
        if self._redis is None or self._channel is None:
            return
        # the local cancel stands; the other replicas' calls run to their deadline
        with store.logged_on_fault(log, "could not publish the cancel of %s to the other replicas", key):
            await store.redis_call(self._redis.publish(self._channel, json.dumps({"key": key, "request": request})))

    async def _settled(self, key: str) -> None:
        """Wait (bounded by the caller) until the record leaves IN_PROGRESS: a call of another replica."""
        pause = 0.02
        while True:
            record = await self._store.get(key)
            if record is None or record.state != "IN_PROGRESS":
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)

    # -- stopping one call ------------------------------------------------------------
    def adapter_for(self, tool: ToolContract) -> Adapter:
        return self._adapters[tool.backend.type]

    async def ask_backend(self, stop: "_Stop") -> None:
        """A sent call through an adapter that does not cancel by closing (HTTP): the contract's cancel
        endpoint, then up to ``grace_ms`` for the call's own answer; then its stream is closed."""
        with spans.linked("cancel", _link(stop.state), {"gen_ai.tool.name": stop.state.tool.name,
                                                         "toolproxy.cancel.source": stop.state.cancellation.get("source")}):
            await self._ask_backend(stop)

    async def _ask_backend(self, stop: "_Stop") -> None:
        state, key = stop.state, stop.key
        tool: ToolContract = state.tool
        evidence: dict[str, Any] = state.cancellation
        adapter = self._adapters[tool.backend.type]
        if key is not None and tool.cancel_endpoint is not None:
            evidence["cancel_endpoint"] = await adapter.cancel(tool, key, state.caller,
                                                               self._config.cancel_timeout_ms / 1000.0)
        if stop.running:
            await asyncio.wait({stop.done}, timeout=self._config.grace_ms / 1000.0)
        if stop.running:
            evidence["stream"] = "closed"
            stop.interrupt()

    async def _settle(self, state: CancellableCall, key: str | None, stop: "_Stop", *, cancelled: bool = False,
                      error: BaseException | None = None, result: Any = None) -> Any:
        """The outcome of a call a cancel reached, from how its work ended (its answer, its error, or
        interrupted) and what the backend was told."""
        if stop.helper is not None:
            await stop.helper  # the cancel endpoint's answer is part of the evidence
        tool: ToolContract = state.tool
        evidence: dict[str, Any] = state.cancellation
        if not stop.sent:
            if not cancelled:  # it finished first: its own outcome stands
                if error is not None:
                    raise error
                return result
            if not state.sent:
                self._metrics.child(self._metrics.cancellations, "cancelled").inc()
                raise ProxyError("cancelled", "The call was cancelled before anything was sent.",
                                 details={"cancellation": {**evidence, "observed": "not_sent"}},
                                 attempted=False, committed=False)
        if not cancelled:
            if error is None:
                return self._completed(state, evidence, "answer", result)
            if not isinstance(error, ProxyError):
                raise error
            if error.committed is False:
                if (error.details or {}).get("backend_code") == "cancelled":
                    raise self._cancelled(evidence, "backend_answer")
                raise error  # it failed on its own, nothing applied: that answer stands
            if error.committed is True:
                raise error
        if not tool.is_write:  # a read has no effect to establish: it simply did not answer
            raise self._cancelled(evidence, "read")
        return await self._ask_status(state, key, tool, evidence)

    async def _ask_status(self, state: CancellableCall, key: str | None, tool: ToolContract,
                          evidence: dict[str, Any]) -> Any:
        record = await self._store.get(key) if key is not None else None
        if record is not None and tool.status_endpoint is not None and self.status_query is not None:
            with spans.linked("cancel.status", _link(state), {"gen_ai.tool.name": tool.name}):
                verdict = await self.status_query(tool, record)
            observed = verdict.evidence.get("observed")
            evidence["status_endpoint"] = observed
            if verdict.verdict == "SUCCEEDED":
                return self._completed(state, evidence, "status_endpoint", verdict.data)
            if verdict.partial is not None:  # stopped with some items applied: the cancel ends partial
                state.partial = verdict.partial
                return self._completed(state, evidence, "status_endpoint", None)
            if observed in ("cancelled", "not_found"):
                raise self._cancelled(evidence, "status_endpoint")
            if verdict.verdict == "FAILED_FINAL":
                self._metrics.child(self._metrics.cancellations, "failed").inc()
                error, side_effect = verdict.error, verdict.side_effect
                assert error is not None and side_effect is not None  # a final failure is established
                raise ProxyError(error.code, error.message, details=error.details,
                                 attempted=True, committed=side_effect.committed)
        self._metrics.child(self._metrics.cancellations, "unknown").inc()
        raise ProxyError("cancel_unconfirmed", "The call was sent and then cancelled; whether it was applied "
                         "could not be established. It is reconciled like any unknown outcome.",
                         details={"cancellation": {**evidence, "observed": "no_evidence"},
                                  "idempotency_key": key}, attempted=True, committed=None)

    def _completed(self, state: CancellableCall, evidence: dict[str, Any], source: str, data: Any) -> Any:
        partly = state.partial is not None  # it stopped halfway: some items applied
        self._metrics.child(self._metrics.cancellations, "partial" if partly else "completed").inc()
        state.cancellation = {**evidence, "observed": "partial" if partly else "completed", "evidence": source}
        if state.result_hash is None:  # a result taken from the status endpoint: verified there
            state.result_hash = digest(data)
        return data

    def _cancelled(self, evidence: dict[str, Any], source: str) -> ProxyError:
        self._metrics.child(self._metrics.cancellations, "cancelled").inc()
        return ProxyError("cancelled", "The call was cancelled; the backend applied nothing.",
                          details={"cancellation": {**evidence, "observed": "not_applied", "evidence": source}},
                          attempted=True, committed=False)

    # -- POST /v1/operations/{key}:cancel ----------------------------------------------
    async def cancel_operation(self, key: str, *, tenant: str, subject: str, agent: str,
                               authorize: Callable[[Record], Awaitable[None]] | None = None) -> dict[str, Any]:
        """Ask for one operation's cancellation; answers the operation view once its outcome is recorded
        (or, after ``answer_wait_ms``, the CANCELLING record). Scoped like the operation read: the caller's
        tenant, and ``authorize`` (proxy/policy/operation_access.py: the same subject, or OPA's ``cancel``)."""
        if not re.match(KEY_PATTERN, key):
            raise ProxyError("operation_not_found", "No such operation.", phase="request")
        record = await self._store.get(key)
        if record is None or record.tenant != tenant:
            raise ProxyError("operation_not_found", "No such operation.", phase="request")
        if authorize is not None:
            await authorize(record)
        request = {"source": "api", "subject": subject, "agent": agent, "at_ms": int(time.time() * 1000)}
        answer = await self._store.request_cancel(key, request=request)
        if answer.status == "missing":
            raise ProxyError("operation_not_found", "No such operation.", phase="request")
        if answer.status == "settled":
            if answer.text(0) == "CANCELLED" or answer.text(1):
                return await self._view(key)  # cancelled (or asked) before: the same answer again
            self._metrics.child(self._metrics.cancellations, "refused").inc()
            raise ProxyError("operation_not_cancellable", "The operation has already finished; there is "
                             "nothing left to cancel (compensation may apply: docs/transactions.md).",
                             details={"idempotency_key": key, "state": answer.text(0)}, phase="request")
        flight = self._flights.get(key)
        if answer.status == "marked":
            await self._hand_over(key, record, request, flight)
        try:
            async with asyncio.timeout(self._config.answer_wait_ms / 1000.0):
                await (flight.finished.wait() if flight is not None else self._settled(key))
        except TimeoutError:
            pass
        return await self._view(key)

    async def _hand_over(self, key: str, record: Record, request: dict[str, Any],
                         flight: InFlight | None) -> None:
        """A cancel newly marked on the record: audited, then handed to the call here, or kept for a call whose
        reservation's reply is still on its way and published to the other replicas."""
        self._metrics.child(self._metrics.cancellations, "requested").inc()
        await self._audit.record("cancellation", idempotency_key=key, tool=record.tool or None,
                                 tool_version=record.tool_version or None, tenant=record.tenant,
                                 subject=request["subject"], agent=request["agent"],
                                 details={"from": "IN_PROGRESS", "to": "CANCELLING", "delivered": flight is not None})
        if flight is not None:
            flight.request = request
            flight.requested.set()
            flight.wake()
            return
        self._early[key] = (time.monotonic(), request)
        while len(self._early) > EARLY_CANCELS_KEPT:
            self._early.popitem(last=False)
        await self._publish(key, request)

    async def _view(self, key: str) -> dict[str, Any]:
        record = await self._store.get(key)
        if record is None:
            raise ProxyError("operation_not_found", "No such operation.", phase="request")
        # The caller is an agent: a settled outcome reaches it only once its MAC verified, as on a read.
        return await checked_agent_view(self._store, record, self._registry, self._integrity)


def _watch(signal: asyncio.Event | None, stop: "_Stop") -> "asyncio.Task[Any] | None":
    """An Event cannot call back: a withdrawal signal (MCP, batch) is watched by a small task (None when
    there is no signal, or it is already set: then the stop begins now)."""
    if signal is None:
        return None
    if signal.is_set():
        stop.begin()
        return None
    if stop.started:
        return None
    watcher = asyncio.get_running_loop().create_task(signal.wait())
    watcher.add_done_callback(stop.begin)
    return watcher


class _Stop:
    """One guarded call's stop: started at most once, by a cancel request (``InFlight.wake``) or a
    withdrawal, while the call's work runs in the caller's task."""

    __slots__ = ("_cancellations", "state", "key", "_interrupt", "_by", "flight", "started", "sent", "running",
                 "helper", "_done", "over")

    def __init__(self, cancellations: Cancellations, state: CancellableCall, key: str | None, by: str) -> None:
        self._cancellations = cancellations
        self.state, self.key, self._by = state, key, by
        self._interrupt = TaskInterrupt()  # of the caller's task, where the work runs
        self.flight: InFlight | None = None
        self.started = False          # a cancel reached the call
        self.sent = False             # ...after it was sent
        self.running = False          # the work is being awaited
        self.helper: asyncio.Task[None] | None = None
        self._done: asyncio.Future[None] | None = None
        self.over = False             # the work ended: a cancel that arrives now changes nothing

    def begin(self, _: Any = None) -> None:
        if self.started or self.over:
            return
        self.started = True
        flight, state = self.flight, self.state
        source = {"source": self._by} if flight is None or not flight.requested.is_set() \
            else dict(flight.request or {"source": "api"})
        self.sent = bool(state.sent)
        state.cancellation = {**source, "sent": self.sent}
        if not self.running:
            return  # not begun yet: the guard does not start it
        if not self.sent:
            self.interrupt()
            return
        adapter = self._cancellations.adapter_for(state.tool)
        if getattr(adapter, "cancel_by_closing", False):
            state.cancellation["told"] = "notifications/cancelled"
            self.interrupt()  # the MCP session sends notifications/cancelled for the abandoned request
            return
        self._done = asyncio.get_running_loop().create_future()
        self.helper = asyncio.get_running_loop().create_task(self._cancellations.ask_backend(self))

    @property
    def done(self) -> "asyncio.Future[None]":
        assert self._done is not None
        return self._done

    def interrupt(self) -> None:
        if self.running:
            self._interrupt.interrupt()

    def take_back(self) -> bool:
        """After the work ended: withdraw this stop's cancel of the caller's task; True if no other cancel
        of that task is pending (a ``CancelledError`` was this stop's alone)."""
        return self._interrupt.take_back()

    def ended(self) -> None:
        self.running = False
        self.over = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)


def _link(state: CancellableCall) -> str:
    """The traceparent a cancellation's span links to: the call's span, else the call's request context."""
    return state.span.link() if state.span is not None else state.request.meta.trace.traceparent


async def audit_outcome(audit: Auditor, facts: CallFacts, env: Envelope, evidence: Mapping[str, Any]) -> None:
    """The ``cancellation`` record of how a cancelled call ended (the commit stage calls it)."""
    caller = facts.caller
    await audit.record("cancellation", idempotency_key=facts.idempotency_key,
                       tool=env.tool, tool_version=env.tool_version, tenant=caller.tenant,
                       subject=caller.subject, agent=caller.agent, outcome=env.outcome,
                       error_code=env.error_code, side_effect_committed=env.side_effect.committed,
                       details={"from": "CANCELLING", "to": env.outcome, "evidence": evidence})
