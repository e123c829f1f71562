"""Request values: what a front hands the pipeline for one tool call, and what it gets back.

Owns: the transport facts of a request (``RequestMeta``, built by
``proxy/fronts/ingress.py``), the untrusted call itself (``ToolCallRequest``) and the
pipeline's answer (``CallResult``). Every layer reads these, so they sit below
all of them: this module imports only plain value types.
Must never: hold behaviour, or anything a stage establishes about the call
(that is the pipeline's ``CallState``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .call_channel import NO_CHANNEL, CallChannel
from .deadline import Deadline
from .envelope import Envelope
from .telemetry.tracing import TraceContext


@dataclass(frozen=True)
class RequestMeta:
    """Transport facts of one request, already validated by the ingress."""

    request_id: str
    trace: TraceContext
    deadline: Deadline
    run_id: str | None = None
    idempotency_key: str | None = None
    approval_id: str | None = None
    wait_s: float | None = None  # Prefer: wait=<s> — how long to wait for a running duplicate
    plan_call_id: str | None = None  # the call's id within a batch plan, when it scopes the operation key
    wait_for_quota: bool = False  # a batch call waits (within the deadline) for a quota instead of rate_limited
    if_match: str | None = None  # the expected state of If-Match (proxy/state_guard.py), single calls only
    flow_as: tuple[str, str] | None = None  # (agent, subject) whose flow labels the decision reads, not the
                                            # caller's: a related read runs under its requester's (never from a
                                            # request)
    key_subject: str | None = None  # the subject an Idempotency-Key's operation is scoped to when it is not the
                                    # caller's: a compensation's is its original's (one per original, whoever
                                    # asks), never set from a request


@dataclass(frozen=True)
class ToolCallRequest:
    call_id: str
    tool: str
    version: str | None
    arguments: Any  # untrusted: a JSON object or a JSON-encoded string
    meta: RequestMeta
    channel: CallChannel = NO_CHANNEL  # the front's relays to its client and the caller's withdrawal signal


@dataclass(frozen=True)
class CallResult:
    envelope: Envelope  # turned into JSON by the front that answers (``Envelope.to_json``)
    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
