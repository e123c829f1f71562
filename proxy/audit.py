"""Audit records: evidence of who asked for what, what was decided and what happened.

Owns: the shape of every audit record (``schemas/audit-record.schema.json``),
its arguments as the contract's record view keeps them (``proxy/telemetry/record_view.py``: what it
shows in clear, keyed fingerprints of the rest) and its details redacted by the one rule of
``proxy/telemetry/redaction.py``, the sinks
(stdout JSON lines, a bounded Redis Stream), and the failure policy: when a
sink fails, a call that must be audited fail-closed is stopped *before* its
side effect (the intent record is written before execution), and a record that
fails after the effect is counted and logged, never used to hide an outcome.

A call's records are made from the facts the pipeline hands over (``CallFacts``,
a value) and the call's ``Envelope``; audit never reads the pipeline's state.

Must never: write tokens, cookies, passwords, headers, full request or response
bodies, backend output or stack traces into a record; raise anything but
``ProxyError("audit_unavailable")`` to a caller.

Other stages record their own events through ``Auditor.record(kind, ...)``:
``approval`` (created/approved/denied/expired/consumed), ``reconciliation``
(a state transition of an unknown operation), ``takeover`` (handed to a human),
``cancellation`` (a cancel requested, and how it ended) and ``compensation``
(a compensation requested, and how it ended; docs/transactions.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TextIO

import orjson

from .config import AuditConfig, ConfigError
from .envelope import iso
from .errors import ProxyError
from .telemetry.metrics import Metrics
from .normalize import canonical_json, sha256_hex
from .telemetry import outlet
from .telemetry import record_view
from .telemetry.redaction import redact
from .registry import ToolContract, thaw
from .store import Client, redis_call, StoreError

if TYPE_CHECKING:  # pragma: no cover
    from .envelope import Envelope, Timing
    from .identity import Caller
    from .normalize import NormalizedCall
    from .requests import ToolCallRequest

class PlannedFootprint(Protocol):
    """What audit needs of a batch plan's footprint of a call (``batch.plan.Footprint`` is one): the
    registry's contract, the resources and the normalized arguments, when the call could be decoded."""

    tool: ToolContract | None
    resources: tuple[Any, ...]
    args_hash: str | None
    arguments: Any


log = logging.getLogger("toolproxy.audit")


@dataclass(frozen=True)
class PolicyFacts:
    """The ``policy`` block of a call record: what OPA decided (``error``: it could not decide)."""

    result: str                          # allow | deny | require_approval | error
    reasons: tuple[str, ...] = ()
    decision_id: str | None = None
    policy_revision: str | None = None
    risk: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"result": self.result, "reasons": list(self.reasons), "decision_id": self.decision_id,
                "policy_revision": self.policy_revision, "risk": self.risk}


@dataclass(frozen=True)
class CallFacts:
    """What a call record is made of: the facts the stages established about one call, as a value.

    The pipeline builds it from its ``CallState`` whenever it writes a record
    (``CallState.facts``): audit never reads the orchestrator's state (it stays
    below the pipeline), and this says exactly which facts a record holds.
    """

    request: "ToolCallRequest"
    caller: "Caller"
    started_wall: float                  # when the call started (wall clock)
    deadline_ms: int | None              # what was left of its deadline then (None: no deadline)
    tool: ToolContract | None = None
    normalized: "NormalizedCall | None" = None
    idempotency_key: str | None = None
    fencing_token: int | None = None
    policy: PolicyFacts | None = None    # None: no decision was asked for
    approval_id: str | None = None       # the approval this call consumed or created
    attempt: int = 1                     # nth execution of this idempotency key
    backend_request_id: str | None = None
    result_hash: str | None = None       # SHA-256 of the canonical verified output


RECORD_TYPE = "toolproxy.audit.v1"
MAX_INTENDED = 4096  # intent records whose final record is still to come (calls in flight), at most
KINDS = frozenset({"tool_call_intent", "tool_call", "approval", "reconciliation", "takeover", "mcp_relay",
                   "cancellation", "compensation", "integrity_failure", "operator_read",
                   "pin_acknowledgement"})

# Top-level fields a caller of ``record`` may set (the schema's properties).
FIELDS = frozenset({
    "request_id", "trace_id", "call_id", "run_id", "tool", "tool_version", "schema_version", "tenant",
    "subject", "agent", "idempotency_key", "args_hash", "arguments", "resources_hash", "policy",
    "approval_id", "attempt", "started_at", "deadline_at", "finished_at", "duration_ms", "outcome",
    "error_code", "side_effect_attempted", "side_effect_committed", "blocked_by", "backend_request_id", "fencing_token", "result_hash", "details",
})

# Fields where null is a fact ("we do not know"), kept rather than dropped.
_NULL_MEANS_UNKNOWN = frozenset({"side_effect_committed"})


class Sink(Protocol):
    name: str

    def write_now(self, line: str) -> bool:
        """Write the record at once if that cannot block; False: the caller awaits ``write``."""

    async def write(self, line: str, *, durable: bool = False) -> None:
        """Persist one serialized record; raise on failure. ``durable``: return only once the record has
        left the process (an intent record of a fail-closed call); else it may still be on its way."""


class AuditBackpressure(OSError):
    """The sink's bounded queue is full: the record was dropped (counted, never silently)."""


class StdoutSink:
    """JSON lines on the process's stdout (the cluster's log pipeline collects them), never blocking the
    event loop.

    A pipe nobody reads fills up, and a blocking write to it would stall every call of the process. So a
    record to a pipe goes through the descriptor's ``Outlet`` (``proxy/telemetry/outlet.py``): straight
    out only when that cannot block (the pipe is empty and no other writer of the process is on it),
    otherwise it waits, in order, in a bounded queue that a writer thread drains with blocking writes. A
    full queue drops the record (``toolproxy_audit_dropped_records``); a queued ``durable`` record is
    awaited (within ``audit.timeout_ms``), so a fail-closed write whose intent record cannot leave is not
    sent. Streams that are not pipes (files, terminals, test captures) are written directly, as they do
    not block on a reader.
    """

    name = "stdout"

    def __init__(self, stream: TextIO | None = None, *, max_queued: int = 10000,
                 metrics: Metrics | None = None) -> None:
        self._stream = stream
        self._queued = metrics.child(metrics.audit_queued, self.name) if metrics is not None else None
        self._max_queued = max_queued

    def _outlet(self) -> tuple[TextIO, outlet.Outlet | None]:
        stream = self._stream or sys.stdout  # looked up per write: follows redirection
        fd = _fileno(stream)
        out = outlet.outlet(fd, max_queued=self._max_queued) if fd is not None else None
        return stream, out if out is not None and out.is_pipe else None

    def write_now(self, line: str) -> bool:
        """Write the record at once if that cannot block (not a pipe, or an empty pipe and nothing queued
        before it); False: it goes through ``write``. The common case without a coroutine and a timeout
        scope per record."""
        stream, out = self._outlet()
        if out is None:
            stream.write(line + "\n")
            stream.flush()
            return True
        return out.write_now((line + "\n").encode())

    async def write(self, line: str, *, durable: bool = False) -> None:
        if self.write_now(line):
            return
        _, out = self._outlet()
        assert out is not None  # only a pipe is not written at once
        if out.queued >= self._max_queued:
            raise AuditBackpressure("audit queue full")
        loop = asyncio.get_running_loop()
        done = loop.create_future() if durable else None
        on_done = (lambda: loop.call_soon_threadsafe(_resolve, done)) if done is not None else None
        if not out.enqueue((line + "\n").encode(), on_done):
            raise AuditBackpressure("audit queue full")
        if self._queued is not None:
            self._queued.inc()
        if done is not None:
            await done


def _fileno(stream: TextIO) -> int | None:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    stream.flush()  # anything buffered in the text layer goes first
    return fd


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)



class RedisStreamSink:
    """XADD to one Redis Stream, trimmed to about ``maxlen`` entries."""

    name = "redis"

    def __init__(self, redis: Client, key: str, maxlen: int) -> None:
        self._redis = redis
        self.key = key
        self._maxlen = maxlen

    def write_now(self, line: str) -> bool:
        return False  # a stream entry is a round trip: always ``write``

    async def write(self, line: str, *, durable: bool = False) -> None:
        await redis_call(self._redis.xadd(self.key, {"record": line}, maxlen=self._maxlen, approximate=True))


def schema_version(tool: ToolContract) -> str:
    """A digest of the contract's input and output schemas: changes whenever either does."""
    canonical = canonical_json({"input": thaw(tool.input_schema), "output": thaw(tool.output_schema)})
    return "sha256:" + sha256_hex(canonical)[:16]


# --------------------------------------------------------------------------- the auditor


@dataclass(frozen=True)
class AuditPolicy:
    write: str
    read: str

    def fail_closed(self, tool: ToolContract) -> bool:
        return (self.write if tool.is_write else self.read) == "fail_closed"


class Auditor:
    def __init__(self, config: AuditConfig, sinks: Sequence[Sink], metrics: Metrics, *,
                 fingerprint_key: bytes | None = None) -> None:
        check_config(config)
        self._config = config
        # The key of the arguments' fingerprints (derived from the record MAC key: every record of every
        # sidecar sharing it fingerprints one value alike; the decision records use the same one).
        self._fingerprint_key = fingerprint_key or record_view.ephemeral_key()
        self._sinks = tuple(sinks)
        self._metrics = metrics
        self._timeout_s = config.timeout_ms / 1000.0
        self.policy = AuditPolicy(write=config.on_failure_write, read=config.on_failure_read)
        self._schema_versions: dict[tuple[str, str, str], str] = {}
        # A call's arguments as its intent record kept them, until its final record takes them (by the call's
        # normalized form, the same object for both): the record view runs once per call, not once per record.
        self._intended: dict[int, tuple[NormalizedCall, Any]] = {}
        self._dropped_logged = -1e9

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return self._sinks

    async def record(self, kind: str, *, critical: bool = False, **fields: Any) -> bool:
        """Write one record of ``kind`` to every sink; True if all of them took it.

        With ``critical=True`` a failed sink raises ``ProxyError("audit_unavailable")``
        (use it when the event must not take effect unaudited, e.g. an approval
        decision). ``details`` is free-form and redacted like arguments.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown audit record kind {kind!r}")
        unknown = set(fields) - FIELDS
        if unknown:
            raise ValueError(f"unknown audit record field(s) {sorted(unknown)}")
        record: dict[str, Any] = {"record": RECORD_TYPE, "kind": kind, "time": iso_now()}
        for name, value in fields.items():
            if value is not None or name in _NULL_MEANS_UNKNOWN:
                record[name] = value
        if "details" in record:
            record["details"] = redact(record["details"], (), self._config.max_string_chars)
        ok = await self._write(record, durable=critical or kind == "tool_call_intent")
        if not ok and critical:
            raise ProxyError("audit_unavailable", "The audit trail could not be written; nothing was done.",
                             attempted=False, committed=False)
        return ok

    async def call_intent(self, tool: ToolContract, facts: Callable[[], CallFacts]) -> None:
        """Before execution: for fail-closed calls, no intent record means no call. ``facts`` is called only
        when a record is written (most tools are not fail-closed)."""
        if not self.policy.fail_closed(tool):
            return
        known = facts()
        fields = self._call_fields(known)
        if known.normalized is not None and fields["arguments"] is not None:
            if len(self._intended) >= MAX_INTENDED:  # finals that never came (a bug): forget, never grow
                self._intended.clear()
            self._intended[id(known.normalized)] = (known.normalized, fields["arguments"])
        if not await self.record("tool_call_intent", **fields):
            raise ProxyError("audit_unavailable", "The audit trail could not be written; the call was not sent.",
                             details={"tool": tool.name}, phase="audit", attempted=False, committed=False)

    async def call_final(self, facts: CallFacts, env: "Envelope") -> bool:
        """After the call: the one record of what happened. A failure here never changes the outcome."""
        fields = self._call_fields(facts)
        fields.update(
            finished_at=env.timing["finished_at"],
            duration_ms=env.timing["duration_ms"],
            outcome=env.outcome,
            error_code=env.error_code,
            side_effect_attempted=env.side_effect.attempted,
            side_effect_committed=env.side_effect.committed,
            backend_request_id=facts.backend_request_id or (
                _safe_str(env.error.details.get("backend_request_id")) if env.error is not None else None),
            result_hash=facts.result_hash,
        )
        return await self.record("tool_call", **fields)

    async def call_not_started(self, request: "ToolCallRequest", caller: "Caller", fp: "PlannedFootprint",
                               timing: "Timing", env: "Envelope") -> bool:
        """The one record of a batch call the scheduler never started (``cancelled`` behind a failed
        ``block`` dependency, or ``timeout_not_started``), from what the plan knew about it.

        Nothing was attempted, so a failed sink is counted and logged like any
        final record, never turned into an error, whatever the failure policy.
        """
        meta, tool = request.meta, fp.tool
        return await self.record(
            "tool_call", request_id=meta.request_id, trace_id=meta.trace.trace_id,
            call_id=_call_id(request.call_id), run_id=meta.run_id,
            tool=tool.name if tool else _safe_str(request.tool, truncate=True),
            tool_version=tool.version if tool else None,
            schema_version=self._schema_version(tool) if tool else None,
            tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
            args_hash=fp.args_hash,
            arguments=self._arguments(tool, fp.arguments) if tool and fp.args_hash is not None else None,
            resources_hash=sha256_hex("\n".join(r.id for r in fp.resources).encode()) if fp.resources else None,
            approval_id=meta.approval_id, attempt=0,
            started_at=env.timing["started_at"], deadline_at=_deadline_at(timing.started_wall, timing.deadline_ms),
            finished_at=env.timing["finished_at"], duration_ms=env.timing["duration_ms"],
            outcome=env.outcome, error_code=env.error_code,
            side_effect_attempted=False, side_effect_committed=False,
            blocked_by=[_call_id(c) for c in env.blocked_by] or None,
        )

    def _call_fields(self, facts: CallFacts) -> dict[str, Any]:
        request, meta, caller, tool = facts.request, facts.request.meta, facts.caller, facts.tool
        normalized = facts.normalized
        return dict(
            request_id=meta.request_id, trace_id=meta.trace.trace_id, call_id=_call_id(request.call_id),
            run_id=meta.run_id, tool=tool.name if tool else _safe_str(request.tool, truncate=True),
            tool_version=tool.version if tool else None,
            schema_version=self._schema_version(tool) if tool else None,
            tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
            idempotency_key=facts.idempotency_key,
            args_hash=normalized.args_hash if normalized else None,
            arguments=self._call_arguments(tool, normalized) if normalized and tool else None,
            resources_hash=sha256_hex("\n".join(r.id for r in normalized.resources).encode())
            if normalized and normalized.resources else None,
            policy=facts.policy.to_json() if facts.policy is not None else None,
            approval_id=facts.approval_id or meta.approval_id, attempt=facts.attempt,
            started_at=iso(facts.started_wall), deadline_at=_deadline_at(facts.started_wall, facts.deadline_ms),
            fencing_token=facts.fencing_token,
        )

    def _call_arguments(self, tool: ToolContract, normalized: "NormalizedCall") -> Any:
        """The call's arguments as records keep them: as its intent record kept them, if it has one."""
        intended = self._intended.pop(id(normalized), None)
        if intended is not None and intended[0] is normalized:
            return intended[1]
        return self._arguments(tool, normalized.arguments)

    def _arguments(self, tool: ToolContract, arguments: Any) -> Any:
        """A call's arguments as its contract's record view keeps them (long text and arrays cut)."""
        return record_view.apply(arguments, tool.record_view, self._fingerprint_key,
                                 max_chars=self._config.max_string_chars, max_items=record_view.MAX_ITEMS)[0]

    def _schema_version(self, tool: ToolContract) -> str:
        cache_key = (tool.name, tool.version, tool.source)
        version = self._schema_versions.get(cache_key)
        if version is None:
            version = self._schema_versions[cache_key] = schema_version(tool)
        return version

    async def _write(self, record: Mapping[str, Any], *, durable: bool) -> bool:
        try:
            line = orjson.dumps(record).decode()
        except orjson.JSONEncodeError:  # e.g. an integer beyond 64 bits: the standard encoder takes it
            line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        ok = True
        for sink in self._sinks:
            try:
                if sink.write_now(line):
                    continue
                async with asyncio.timeout(self._timeout_s):
                    await sink.write(line, durable=durable)
            except AuditBackpressure:
                ok = False
                self._metrics.child(self._metrics.audit_dropped, sink.name).inc()
                now = time.monotonic()
                if now - self._dropped_logged > 10.0:  # stderr may be the same blocked pipe: say it rarely
                    self._dropped_logged = now
                    log.error("audit sink %s is not being read; records are dropped (see "
                              "toolproxy_audit_dropped_records)", sink.name)
            except (OSError, ValueError, TimeoutError, StoreError) as exc:
                # policy: per audit policy: write calls fail closed, reads count it
                ok = False
                self._metrics.audit_failures.labels(sink.name).inc()
                log.error("audit sink %s failed (%s); record kind %s", sink.name, type(exc).__name__,
                          record["kind"])
        return ok


def _deadline_at(started_wall: float, deadline_ms: int | None) -> str | None:
    """The call's deadline on the wall clock (``deadline_ms`` counts from the call's start)."""
    return None if deadline_ms is None else iso(started_wall + deadline_ms / 1000.0)


def iso_now() -> str:
    return iso(time.time())


_CONTROL = re.compile("[\x00-\x1f\x7f]")  # searched in C, not a Python loop per character of every field


def _safe_str(value: Any, *, truncate: bool = False) -> str | None:
    """A short printable string, or None (untrusted text never breaks a record's shape)."""
    if not isinstance(value, str) or not value or _CONTROL.search(value) is not None:
        return None
    if len(value) > 256:
        return value[:256] if truncate else None
    return value


def check_config(config: AuditConfig) -> None:
    """Raise ConfigError for a bad audit section (the loader checked each value; this checks the whole)."""
    if config.stdout_queue_records < 1:
        raise ConfigError("audit.stdout_queue_records (TOOLPROXY_AUDIT_STDOUT_QUEUE_RECORDS): must be at least 1")
    if not config.sinks:
        raise ConfigError("audit.sinks (TOOLPROXY_AUDIT_SINKS): at least one sink is required (stdout, redis)")


def _call_id(value: Any) -> str | None:
    """The call id as given when it is a short printable string, else its digest."""
    safe = _safe_str(value)
    if safe is not None or value is None:
        return safe
    return "sha256:" + sha256_hex(str(value).encode())


def build_sinks(config: AuditConfig, redis: Client, stream_key: str,
                metrics: Metrics | None = None) -> list[Sink]:
    sinks: list[Sink] = []
    for name in config.sinks:
        if name == "stdout":
            sinks.append(StdoutSink(max_queued=config.stdout_queue_records, metrics=metrics))
        elif name == "redis":
            sinks.append(RedisStreamSink(redis, stream_key, config.stream_maxlen))
        else:
            raise ConfigError(f"audit.sinks: unknown sink {name!r} (stdout, redis)")
    return sinks

