"""Commit stage, output side: result envelopes and their HTTP status.

Owns: the result envelope as a value (``Envelope``: built once, passed as a
value, turned into JSON only at the edges and in the operation record), its
exact JSON shape (``schemas/result-envelope.schema.json``), deriving
``outcome`` from the error and the side-effect facts, and the HTTP status of
an envelope. Must never: put stack traces, tokens, hostnames or raw
backend bodies into an envelope.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, Mapping, Sequence


from .errors import CATALOGUE, NO_EFFECT, ProxyError, SideEffect
from .wire import json_bytes


@dataclass
class Timing:
    """Wall-clock start for the record, monotonic for durations."""

    started_wall: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    stages: dict[str, float] = field(default_factory=dict)
    deadline_ms: int | None = None

    def stage(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def to_json(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started_mono
        return {
            "started_at": iso(self.started_wall),
            "finished_at": iso(self.started_wall + elapsed),
            "duration_ms": round(elapsed * 1000, 3),
            "stages_ms": {k: round(v * 1000, 3) for k, v in self.stages.items()},
            "deadline_ms": self.deadline_ms,
        }


def iso(ts: float) -> str:
    """``2026-12-01T04:05:34.123Z``: the text of ``datetime.fromtimestamp(ts, timezone.utc)
    .isoformat(timespec="milliseconds")`` (microseconds rounded half-even as datetime does, then cut to
    milliseconds), with the date and time of day formatted once per second: several timestamps per call
    (envelope timing, audit records) made datetime's formatting about 2% of a read's CPU."""
    global _iso_second
    frac, whole = math.modf(ts)
    micros = round(frac * 1e6)
    if micros >= 1_000_000:
        micros -= 1_000_000
        whole += 1.0
    elif micros < 0:
        micros += 1_000_000
        whole -= 1.0
    second = int(whole)
    cached_second, prefix = _iso_second
    if second != cached_second:
        prefix = datetime.fromtimestamp(second, tz=timezone.utc).isoformat(timespec="seconds")[:-6]
        _iso_second = (second, prefix)
    return f"{prefix}.{micros // 1000:03d}Z"


_iso_second: tuple[int, str] = (-1, "")  # the last second formatted, and its text


dumps = json_bytes  # the one JSON encoder of answers (proxy.wire)


def outcome_of(error: ProxyError | None, side_effect: SideEffect, partial: Mapping[str, Any] | None = None) -> str:
    if partial is not None:
        return "partial"
    if error is None:
        return "succeeded"
    if error.code == "cancelled":
        return "cancelled"
    if side_effect.committed is None:
        return "unknown"
    return "failed"


_NOTHING: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Envelope:
    """The result of one call, built once. ``side_effect`` is what is known of the effect (from the
    error when there is one); ``timing`` is frozen when the envelope is built; ``extra`` holds optional
    members (``deprecation``, a batch's ``blocked_by``)."""

    call_id: str | None
    request_id: str
    tool: str | None
    tool_version: str | None
    outcome: str
    data: Any
    error: ProxyError | None
    side_effect: SideEffect
    idempotency_key: str | None
    timing: Mapping[str, Any]
    extra: Mapping[str, Any] = field(default_factory=lambda: _NOTHING)
    replayed: bool = False  # a duplicate answered from the operation record
    evidence: Mapping[str, Any] | None = None  # a committed write's: backend request id, result digest,
                                               # server time, resource keys
    truncated: bool = False  # the contract's output_limit shortened the data (proxy/output_filter.py)
    partial: Mapping[str, Any] | None = None   # outcome partial: committed and pending items, recovery

    @classmethod
    def of(cls, *, call_id: str | None, request_id: str, tool: str | None, tool_version: str | None,
           data: Any = None, error: ProxyError | None = None, side_effect: SideEffect = NO_EFFECT,
           idempotency_key: str | None = None, timing: Timing | None = None,
           extra: Mapping[str, Any] | None = None, evidence: Mapping[str, Any] | None = None,
           truncated: bool = False, partial: Mapping[str, Any] | None = None) -> "Envelope":
        if error is not None:
            side_effect = SideEffect(attempted=error.attempted, committed=error.committed)
        if partial is not None:
            error, data = None, None
        return cls(call_id=call_id, request_id=request_id, tool=tool, tool_version=tool_version,
                   outcome=outcome_of(error, side_effect, partial), data=data if error is None else None,
                   error=error, side_effect=side_effect, idempotency_key=idempotency_key,
                   timing=MappingProxyType((timing or Timing()).to_json()),
                   extra=MappingProxyType(dict(extra)) if extra else _NOTHING,
                   evidence=MappingProxyType(dict(evidence)) if evidence and error is None else None,
                   truncated=truncated and error is None, partial=partial)

    @property
    def error_code(self) -> str | None:
        return self.error.code if self.error is not None else None

    @property
    def http_status(self) -> int:
        return 200 if self.error is None else self.error.spec.http_status

    @property
    def blocked_by(self) -> Sequence[str]:
        """The batch calls whose failure kept this one from starting (empty for every other call)."""
        return self.extra.get("blocked_by") or ()

    @property
    def deprecation(self) -> Mapping[str, Any] | None:
        return self.extra.get("deprecation")

    def as_replayed(self) -> "Envelope":
        return replace(self, replayed=True)

    def to_json(self) -> dict[str, Any]:
        body = {
            "call_id": self.call_id,
            "request_id": self.request_id,
            "tool": self.tool,
            "tool_version": self.tool_version,
            "outcome": self.outcome,
            "data": self.data,
            "error": self.error.to_error() if self.error is not None else None,
            "side_effect": self.side_effect.to_json(),
            # The operation key the proxy derived (ik_...), named apart from the caller's Idempotency-Key
            # header; "idempotency_key" carries the same value for programs that read it (deprecated).
            "operation_key": self.idempotency_key,
            "idempotency_key": self.idempotency_key,
            "timing": dict(self.timing),
        }
        body.update(self.extra)
        if self.evidence is not None:
            body["evidence"] = dict(self.evidence)
        if self.truncated:
            body["truncated"] = True
        if self.partial is not None:
            body["partial"] = self.partial
        if self.replayed:
            body["replayed"] = True
        return body


SUMMARY_RESOURCES = 5  # resource keys named in a side-effect summary; the rest are counted


def with_summary(env: Envelope, normalized: Any) -> Envelope:
    """``side_effect.summary`` of a write that committed or partly committed: built from the
    trusted contract name and the call's resource keys, never from backend text."""
    side = env.side_effect
    if env.tool is None or not side.attempted or not (side.committed is True or env.partial is not None):
        return env
    if env.partial is None and env.evidence is None and env.error is None:  # a read has no effect to summarize
        return env
    keys = [r.id for r in normalized.resources] if normalized is not None else []
    text = effect_summary(env.tool, env.tool_version, keys, env.partial)
    return replace(env, side_effect=replace(side, summary=text))


def effect_summary(tool: str, tool_version: str | None, keys: Sequence[str],
                   partial: Mapping[str, Any] | None = None) -> str:
    """The summary text of a committed (or, with ``partial``, partly applied) write on ``keys``."""
    where = ""
    if keys:
        named = ", ".join(keys[:SUMMARY_RESOURCES])
        more = len(keys) - SUMMARY_RESOURCES
        where = f" on {named}" + (f" and {more} more" if more > 0 else "")
    if partial is not None:
        done, pending = len(partial.get("committed") or ()), len(partial.get("pending") or ())
        return f"{tool} {tool_version} partly applied{where}: {done} item(s) committed, {pending} pending"
    return f"{tool} {tool_version} committed{where}"


def build(*, call_id: str | None, request_id: str, tool: str | None, tool_version: str | None,
          data: Any = None, error: ProxyError | None = None, side_effect: SideEffect = NO_EFFECT,
          idempotency_key: str | None = None, timing: Timing | None = None,
          extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An envelope's JSON at once, for the HTTP edge's answers before any call was formed (``request_error``)."""
    return Envelope.of(call_id=call_id, request_id=request_id, tool=tool, tool_version=tool_version, data=data,
                       error=error, side_effect=side_effect, idempotency_key=idempotency_key, timing=timing,
                       extra=extra).to_json()


def http_status(envelope: Mapping[str, Any]) -> int:
    """The HTTP status of an envelope's JSON (``Envelope.http_status`` of the value)."""
    error = envelope.get("error")
    if not error:
        return 200
    return CATALOGUE[error["code"]].http_status


def request_error(error: ProxyError, request_id: str, call_id: str | None = None,
                  tool: str | None = None) -> dict[str, Any]:
    """An envelope for a failure before any tool call could be formed."""
    return build(call_id=call_id, request_id=request_id, tool=tool, tool_version=None, error=error)
