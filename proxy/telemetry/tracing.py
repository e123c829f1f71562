"""Trace and request identifiers (W3C Trace Context).

Owns: accepting a caller's ``traceparent`` and ``tracestate`` through
OpenTelemetry's W3C propagator (only a well-formed pair is honoured), the
``TraceContext`` value every request carries, the child context forwarded to
backends when no span is recorded, and request ids. Must never: forward a
malformed trace header, trust a request id that could inject text into logs,
or import the OpenTelemetry SDK (the API's propagator is imported on the
first request that carries a ``traceparent``; spans live in
``proxy/telemetry/spans.py``).
"""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_propagator: Any = None


@dataclass(frozen=True)
class TraceContext:
    trace_id: str              # 32 lower-case hex digits
    parent_id: str             # 16 hex digits: the caller's span (remote) or an id made here
    flags: str = "01"
    tracestate: str | None = None  # the caller's, passed on as the propagator re-serialised it
    remote: bool = False       # the ids came from the caller's traceparent

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags}"

    @property
    def sampled(self) -> bool:
        return int(self.flags, 16) & 1 == 1

    def child(self) -> "TraceContext":
        """A new span id under this trace: what a request carries when no span of ours is recorded."""
        return TraceContext(self.trace_id, secrets.token_hex(8), self.flags, self.tracestate, self.remote)

    def headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate`` when the caller sent one) for an outgoing request."""
        if self.tracestate:
            return {"traceparent": self.traceparent, "tracestate": self.tracestate}
        return {"traceparent": self.traceparent}


def propagator() -> Any:
    """OpenTelemetry's W3C Trace Context propagator (API package only), imported on first use."""
    global _propagator
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        _propagator = TraceContextTextMapPropagator()
    return _propagator


def accept(headers: Mapping[str, str]) -> TraceContext:
    """The caller's trace context when its ``traceparent`` is valid (``tracestate`` kept only beside a valid
    one, as W3C Trace Context asks), else a new trace of our own."""
    if headers.get("traceparent"):
        from opentelemetry import trace
        carrier = {"traceparent": headers["traceparent"]}
        if headers.get("tracestate"):
            carrier["tracestate"] = headers["tracestate"]
        found = trace.get_current_span(propagator().extract(carrier)).get_span_context()
        if found.is_valid:
            state = found.trace_state.to_header() if found.trace_state else ""
            return TraceContext(format(found.trace_id, "032x"), format(found.span_id, "016x"),
                                format(int(found.trace_flags), "02x"), state or None, True)
    return TraceContext(secrets.token_hex(16), secrets.token_hex(8))


def from_meta(trace: TraceContext, meta: Any) -> TraceContext:
    """An MCP request's trace context from ``params._meta`` (``traceparent``/``tracestate``, as the MCP
    semantic conventions propagate it) when its HTTP request carried none."""
    if trace.remote or not isinstance(meta, Mapping) or not isinstance(meta.get("traceparent"), str):
        return trace
    state = meta.get("tracestate")
    found = accept({"traceparent": meta["traceparent"], **({"tracestate": state} if isinstance(state, str) else {})})
    return found if found.remote else trace


def accept_traceparent(header: str | None) -> TraceContext:
    return accept({"traceparent": header} if header else {})


def safe_id(value: str | None) -> str | None:
    """Return a caller-supplied identifier only if it is short and log-safe."""
    if value is not None and _SAFE_ID.match(value):
        return value
    return None


def new_request_id() -> str:
    return uuid.uuid4().hex
