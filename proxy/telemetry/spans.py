"""OpenTelemetry spans: one per tool call, its stages, the requests around it, and the work that settles it.

Owns: setting up the OpenTelemetry SDK and its OTLP/HTTP exporter from the
``tracing`` settings (only when an endpoint is configured: without one this
module never imports the SDK, and ``active()`` is None so every hook costs
one comparison); the names and attributes of every span (the GenAI semantic
conventions for tool execution, the MCP conventions on the MCP front); the
trace context forwarded to backends while a span is recorded; and the
exemplar that links a histogram bucket to a trace.

Must never: put an argument value, a credential, an idempotency key or an
MCP session id into an attribute (keys and sessions appear only as hashes;
every string attribute goes through the audit redaction rules); let a slow
or absent trace receiver slow a call (spans wait in a bounded queue and are
dropped past it); or set the process-wide tracer provider (libraries that
trace themselves stay silent).
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import time
from typing import Any, Mapping

from . import redaction
from .tracing import TraceContext

TracingConfig = Any  # proxy.config.TracingConfig (config sits above telemetry: not imported here)

log = logging.getLogger("toolproxy.tracing")

# The stages that take time (those named by toolproxy_stage_duration_seconds{stage}) appear on the call span:
# as events with their duration (``tracing.stages: events``, the default: the SDK's span objects and their
# OTLP encoding are most of a sampled call's tracing cost, and a call has up to eight stages) or as child
# spans (``spans``). The pure ones (resolve, decode, normalize) take microseconds and stay on the call span's
# timing only.
SPAN_STAGES = frozenset({"authorize", "quota", "idempotency", "lock", "audit", "execute", "verify", "commit"})
MAX_ATTRIBUTE_CHARS = 256
MAX_REASONS = 16

_active: "Tracing | None" = None
# The span a call (or a batch member) runs under when one encloses it: the batch, the MCP request.
_parent: contextvars.ContextVar[Any] = contextvars.ContextVar("toolproxy_span_parent", default=None)
# Trace context for requests sent outside a call while tracing is off (a status query, a cancel request):
# the call's own, kept in its operation record.
_carry: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("toolproxy_span_carry", default=None)
# The call span of the call running in this context (its operation record keeps the link).
_call: contextvars.ContextVar["CallSpan | None"] = contextvars.ContextVar("toolproxy_call_span", default=None)
# The trace id a new root span takes (the request's own, so logs, audit records and spans agree).
_root_trace_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("toolproxy_root_trace", default=None)


_TRACE_ID_LIMIT = (1 << 64) - 1  # TraceIdRatioBased samples on the trace id's low 64 bits

def active() -> "Tracing | None":
    """The configured tracing, or None when tracing is off."""
    return _active


def configure(config: TracingConfig) -> "Tracing | None":
    """Start tracing when the settings name an endpoint (importing the SDK then, never before); else off."""
    global _active
    if _active is not None:
        _active.shutdown()
        _active = None
    if config.enabled:
        _active = Tracing(config)
    return _active


def shutdown() -> None:
    """Flush and stop (bounded by the export timeout); tracing is off afterwards."""
    global _active
    if _active is not None:
        _active.shutdown()
        _active = None


def key_hash(key: str) -> str:
    """What a span says of an idempotency key or a session id: a short SHA-256, never the value."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def safe_value(name: str, value: Any, max_chars: int = MAX_ATTRIBUTE_CHARS) -> Any:
    """An attribute value after the audit rules: a credential-like name is masked, strings are scrubbed of
    credentials and truncated; sequences element-wise."""
    if redaction.looks_secret(name):
        return redaction.MASK
    if isinstance(value, str):
        text = redaction.scrub(value)
        return text if len(text) <= max_chars else text[:max_chars] + "...[truncated]"
    if isinstance(value, (list, tuple)):
        return [safe_value(name, v, max_chars) for v in value]
    return value


def safe_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: safe_value(k, v) for k, v in attributes.items() if v is not None}


def reason_ids(reasons: Any) -> list[str]:
    """A decision's reasons by id: each reason up to its first ':' (the rest may name a resource id)."""
    return [str(r).split(":", 1)[0][:64] for r in list(reasons or ())[:MAX_REASONS]]


class CallSpan:
    """The span of one tool call and its open stage spans (a stack: the quota runs inside the decision),
    recorded by the pipeline's hooks."""

    __slots__ = ("span", "_tracing", "_stages", "_ended")

    def __init__(self, tracing: "Tracing", span: Any) -> None:
        self.span = span
        self._tracing = tracing
        self._stages: list[tuple[str, Any]] = []
        self._ended = False

    # --- stages -----------------------------------------------------------------------------------------------
    # An open stage is (name, its child span) with ``tracing.stages: spans``, (name, its start in ns) with
    # ``events``: the event is added when the stage ends, at its start, with its duration.
    def enter(self, stage: str) -> None:
        if stage in SPAN_STAGES and not self._ended:
            if not self._tracing.stage_spans:
                self._stages.append((stage, time.time_ns()))
                return
            parent = self._innermost_span()
            self._stages.append((stage, self._tracing.child(parent, stage, {"toolproxy.stage": stage})))

    def leave(self, stage: str, error: BaseException | None = None) -> None:
        if self._stages and self._stages[-1][0] == stage:
            self._close(*self._stages.pop(), getattr(error, "code", None) or type(error).__name__ if error else None)

    def _close(self, stage: str, opened: Any, error_code: str | None) -> None:
        if isinstance(opened, int):
            attributes: dict[str, Any] = {"toolproxy.stage.duration_ms": round((time.time_ns() - opened) / 1e6, 3)}
            if error_code is not None:
                attributes["error.type"] = str(error_code)[:64]
            self.span.add_event(stage, attributes, timestamp=opened)
            return
        if error_code is not None:
            self._tracing.mark_error(opened, error_code)
        opened.end()

    def _innermost_span(self) -> Any:
        for _, opened in reversed(self._stages):
            if not isinstance(opened, int):
                return opened
        return self.span

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        self.span.add_event(name, safe_attributes(attributes))

    # --- context ----------------------------------------------------------------------------------------------
    def outgoing(self) -> dict[str, str]:
        """``traceparent``/``tracestate`` for a request sent now: the innermost open stage span (the backend
        call under ``execute``, with ``tracing.stages: spans``) or the call span, through the W3C propagator."""
        return self._tracing.inject(self._innermost_span())

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def link(self) -> str:
        """This span's ``traceparent``: what a later reconciliation or cancellation links to."""
        ctx = self.span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def exemplar(self) -> dict[str, str]:
        ctx = self.span.get_span_context()
        return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}

    # --- the end ----------------------------------------------------------------------------------------------
    def finish(self, attributes: Mapping[str, Any], *, name: str | None = None, error_code: str | None = None,
               failed: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        if _call.get() is self:
            _call.set(None)
        while self._stages:
            self._close(*self._stages.pop(), None)
        if name is not None:
            self.span.update_name(name)
        self.span.set_attributes(safe_attributes(attributes))
        if failed:
            self._tracing.mark_error(self.span, error_code or "failed")
        self.span.end()

    def abandon(self, phase: str) -> None:
        """End a span the call never finished (it was interrupted): outcome unknown to the span."""
        if not self._ended:
            self.finish({"toolproxy.phase": phase, "toolproxy.outcome": "interrupted"}, error_code="interrupted",
                        failed=True)


def finish_call(span: CallSpan, *, tool: Any, envelope: Any, policy: Any, key: str | None,
                approval_id: str | None, attempt: int) -> None:
    """End a call's span with what the call established: the GenAI tool attributes, the outcome, the error
    code and phase, the decision (on denials too), and the idempotency key's hash."""
    error = envelope.error
    attributes: dict[str, Any] = {
        "gen_ai.tool.name": tool.name if tool is not None else None,
        "toolproxy.tool.version": tool.version if tool is not None else None,
        "toolproxy.tool.mode": tool.mode if tool is not None else None,
        "toolproxy.tool.risk": tool.risk if tool is not None else None,
        "toolproxy.outcome": envelope.outcome,
        "toolproxy.error.code": envelope.error_code,
        "toolproxy.phase": error.phase if error is not None else None,
        "toolproxy.side_effect.attempted": envelope.side_effect.attempted,
        "toolproxy.side_effect.committed": _tristate(envelope.side_effect.committed),
        "toolproxy.idempotency.key_hash": key_hash(key) if key else None,
        "toolproxy.attempt": attempt,
        "toolproxy.approval.id": approval_id,
        "toolproxy.request.id": envelope.request_id,
    }
    if policy is not None:
        attributes.update({
            "toolproxy.decision": policy.result, "toolproxy.decision.id": policy.decision_id,
            "toolproxy.policy.revision": policy.policy_revision, "toolproxy.policy.reasons": reason_ids(policy.reasons),
        })
    failed = envelope.outcome in ("failed", "unknown", "partial")
    span.finish(attributes, name=f"execute_tool {tool.name}" if tool is not None else None,
                error_code=envelope.error_code, failed=failed)


def _tristate(value: bool | None) -> str:
    return "unknown" if value is None else "true" if value else "false"


class Tracing:
    """The SDK's tracer provider, its batch processor and the OTLP/HTTP exporter, built from the settings."""

    def __init__(self, config: TracingConfig) -> None:
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace, self._Link, self._SpanKind, self._Context = trace, Link, SpanKind, Context
        self._NonRecordingSpan, self._SpanContext = NonRecordingSpan, SpanContext
        self._Status, self._StatusCode = Status, StatusCode
        self._propagator = TraceContextTextMapPropagator()
        self.config = config
        self.stage_spans = config.stages == "spans"

        class RequestIds(RandomIdGenerator):
            """A root span takes the request's trace id (so logs, audit and decision records name it)."""

            def generate_trace_id(self) -> int:
                wanted = _root_trace_id.get()
                return wanted if wanted is not None else super().generate_trace_id()

        resource = Resource({**config.resource_attributes, "service.name": config.service_name,
                             "telemetry.sdk.language": "python", "telemetry.sdk.name": "opentelemetry"})
        self.provider = TracerProvider(sampler=_sampler(config), resource=resource, id_generator=RequestIds())
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
        self._ratio_bound = TraceIdRatioBased.get_bound_for_rate(config.sampler_arg)
        exporter = OTLPSpanExporter(endpoint=config.spans_url, headers=dict(config.headers),
                                    timeout=config.export_timeout_ms / 1000.0)
        self.processor = BatchSpanProcessor(exporter, max_queue_size=config.max_queue_size,
                                            schedule_delay_millis=config.schedule_delay_ms,
                                            max_export_batch_size=config.max_export_batch_size,
                                            export_timeout_millis=config.export_timeout_ms)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("toolproxy")
        log.info("tracing on: spans to %s (sampler %s)", config.spans_url, config.sampler)

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception as exc:  # a receiver that is away at shutdown loses its last spans, nothing else
            log.warning("tracing shutdown: %s", type(exc).__name__)

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return bool(self.provider.force_flush(timeout_ms))

    # --- contexts ---------------------------------------------------------------------------------------------
    def context_of(self, trace: TraceContext) -> Any:
        """The OpenTelemetry context to start a request's first span in: the enclosing span (batch, MCP
        request) if any, else the caller's remote span, else none (a root span taking ``trace``'s id)."""
        enclosing = _parent.get()
        if enclosing is not None:
            return enclosing
        if not trace.remote:
            return None
        from opentelemetry.trace import TraceFlags, TraceState
        state = TraceState.from_header([trace.tracestate]) if trace.tracestate else None
        remote = self._SpanContext(int(trace.trace_id, 16), int(trace.parent_id, 16), is_remote=True,
                                   trace_flags=TraceFlags(int(trace.flags, 16)), trace_state=state)
        return self._trace.set_span_in_context(self._NonRecordingSpan(remote))

    def start(self, name: str, trace: TraceContext, attributes: Mapping[str, Any], *, server: bool = False,
              links: tuple[str, ...] = (), root: bool = False) -> Any:
        token = _root_trace_id.set(int(trace.trace_id, 16))
        try:
            return self.tracer.start_span(
                name, context=(None if root else self.context_of(trace)) or self._Context(),  # never an ambient one
                attributes=safe_attributes(attributes),
                kind=self._SpanKind.SERVER if server else self._SpanKind.INTERNAL,
                links=[self._Link(c) for c in (self._span_context(t) for t in links) if c is not None])
        finally:
            _root_trace_id.reset(token)

    def child(self, parent: Any, name: str, attributes: Mapping[str, Any]) -> Any:
        return self.tracer.start_span(name, context=self._trace.set_span_in_context(parent),
                                      attributes=attributes)

    def inject(self, span: Any) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    def mark_error(self, span: Any, code: str) -> None:
        span.set_attribute("error.type", str(code)[:64])
        span.set_status(self._Status(self._StatusCode.ERROR, str(code)[:64]))

    def _span_context(self, traceparent: str) -> Any:
        found = self._trace.get_current_span(self._propagator.extract({"traceparent": traceparent}))
        ctx = found.get_span_context()
        return ctx if ctx.is_valid else None

    # --- what the hooks call ----------------------------------------------------------------------------------
    def call(self, trace: TraceContext, *, call_id: Any) -> CallSpan | None:
        """The span of one tool call (None when the sampler drops it: the request then carries the caller's
        context onward, as with tracing off)."""
        if self._drops(trace):  # most calls at the default sampler: no SDK span is made for them at all
            return None
        span = self.start("execute_tool", trace, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.type": "extension",
            "gen_ai.tool.call.id": call_id if isinstance(call_id, str) else None})
        if not span.is_recording():
            span.end()
            return None
        found = CallSpan(self, span)
        _call.set(found)
        return found

    def _drops(self, trace: TraceContext) -> bool:
        """True when the configured sampler certainly drops a call span of ``trace``: the SDK's own verdict
        (ParentBased follows a remote parent's sampled flag; TraceIdRatioBased compares the low 64 bits of the
        trace id with its bound), decided without building a span. Anything else is left to the SDK."""
        if _parent.get() is not None:
            return False
        sampler = self.config.sampler
        if trace.remote and sampler.startswith("parentbased_"):
            return not trace.sampled
        if sampler in ("always_off", "parentbased_always_off"):
            return True
        if sampler in ("traceidratio", "parentbased_traceidratio"):
            return int(trace.trace_id, 16) & _TRACE_ID_LIMIT >= self._ratio_bound
        return False

    def enclosing(self, name: str, trace: TraceContext, attributes: Mapping[str, Any],
                  *, server: bool = True) -> "Enclosing":
        """A span the calls inside it are children of (a batch, an MCP request): ``with`` it."""
        return Enclosing(self, self.start(name, trace, attributes, server=server))

    def linked(self, name: str, links: tuple[str | None, ...], attributes: Mapping[str, Any]) -> "Enclosing":
        """A span of its own trace linked to the calls it settles (reconciliation, cancellation): ``with`` it.
        Requests sent inside it carry its context."""
        fresh = TraceContext(format(self._new_trace_id(), "032x"), "0" * 16)
        return Enclosing(self, self.start(name, fresh, attributes, server=False, root=True,
                                          links=tuple(t for t in links if t)))

    def _new_trace_id(self) -> int:
        import secrets
        return int(secrets.token_hex(16), 16) or 1


class Enclosing:
    """``with tracing.enclosing(...) as span:`` — calls started inside run under ``span``."""

    __slots__ = ("_tracing", "span", "_token")

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self._tracing = tracing
        self.span = span

    def __enter__(self) -> "Enclosing":
        self._token = _parent.set(self._tracing._trace.set_span_in_context(self.span))
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        _parent.reset(self._token)
        if error is not None:
            self._tracing.mark_error(self.span, getattr(error, "code", kind.__name__))
        self.span.end()

    def set(self, attributes: Mapping[str, Any]) -> None:
        self.span.set_attributes(safe_attributes(attributes))

    def fail(self, code: str) -> None:
        self._tracing.mark_error(self.span, code)

    def outgoing(self) -> dict[str, str]:
        return self._tracing.inject(self.span)

    @property
    def recording(self) -> bool:
        return bool(self.span.is_recording())

    def settle(self, tool: str | None, error_code: str | None) -> None:
        """An MCP request's span once its call answered: named after the tool it called (when the registry
        knows it: an unknown name is the caller's text), the call's error code as ``error.type``."""
        if tool is not None:
            self.span.update_name(f"tools/call {tool}")
            self.span.set_attribute("gen_ai.tool.name", safe_value("gen_ai.tool.name", tool))
        if error_code is not None:
            self._tracing.mark_error(self.span, error_code)


def mcp_request(trace: TraceContext, protocol_version: str | None, session_id: str | None) -> Enclosing | None:
    """The MCP server span of one ``tools/call`` (the MCP semantic conventions), None when tracing is off."""
    tracing = _active
    if tracing is None:
        return None
    return tracing.enclosing("tools/call", trace, {
        "mcp.method.name": "tools/call", "mcp.protocol.version": protocol_version,
        "mcp.session.id": key_hash(session_id) if session_id else None,
        "gen_ai.operation.name": "execute_tool", "network.transport": "tcp", "network.protocol.name": "http"})


def batch(trace: TraceContext, calls: int, request_id: str) -> Enclosing | None:
    """The span of one batch, parent of its calls' spans; None when tracing is off."""
    tracing = _active
    if tracing is None:
        return None
    return tracing.enclosing("batch", trace, {"toolproxy.batch.calls": calls, "toolproxy.request.id": request_id},
                             server=False)


def outgoing() -> dict[str, str]:
    """The trace headers of a request sent outside a call (a status query, a cancel request): the enclosing
    span's (``linked``) when tracing is on, else a child of the call's own context, else nothing."""
    tracing, enclosing = _active, _parent.get()
    if tracing is not None and enclosing is not None:
        carrier: dict[str, str] = {}
        tracing._propagator.inject(carrier, context=enclosing)
        if carrier:
            return carrier
    carried = _carry.get()
    return carried.child().headers() if carried is not None else {}


def current_link(trace: TraceContext) -> str:
    """The ``traceparent`` an operation record keeps: the running call's span, else the request's context."""
    span = _call.get()
    return span.link() if span is not None else trace.traceparent


def linked(name: str, traceparent: Any, attributes: Mapping[str, Any]) -> "Enclosing | _Carry":
    """``with`` it around work that settles a call later (reconciliation, cancellation): a span of its own
    trace linked to the call's (``traceparent``, from the operation record) when tracing is on; either way,
    requests sent inside carry trace context (``outgoing``)."""
    link = traceparent if isinstance(traceparent, str) else None
    tracing = _active
    if tracing is None:
        return _Carry(link)
    return tracing.linked(name, (link,), attributes)


class _Carry:
    """Tracing off: requests sent inside continue the call's trace (``outgoing``); no span."""

    __slots__ = ("_trace", "_token")

    def __init__(self, traceparent: str | None) -> None:
        from .tracing import accept
        found = accept({"traceparent": traceparent}) if traceparent else None
        self._trace = found if found is not None and found.remote else None

    def __enter__(self) -> "_Carry":
        self._token = _carry.set(self._trace)
        return self

    def __exit__(self, *exc: Any) -> None:
        _carry.reset(self._token)

    def set(self, attributes: Mapping[str, Any]) -> None:
        pass

    def fail(self, code: str) -> None:
        pass


def _sampler(config: TracingConfig) -> Any:
    from opentelemetry.sdk.trace import sampling
    ratio = sampling.TraceIdRatioBased(config.sampler_arg)
    return {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": ratio,
        "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": sampling.ParentBased(ratio),
    }[config.sampler]
