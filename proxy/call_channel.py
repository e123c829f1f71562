"""The call's channel: what the front that made a call hands down with it, beside its deadline.

Owns: the ``CallChannel`` value and the types of what it carries: where an adapter relays the backend's
progress (``ProgressRelay``), its log messages (``LogRelay``) and its requests for input (``InputRelay``:
sampling, elicitation) to the caller's client, and the signal by which the caller withdraws the call
(``withdrawn``, with who can: ``withdrawn_by``). A front builds one per call (the MCP front, for a client that
can receive them; the batch scheduler, for a batch that can be cancelled) and puts it on the call's
``ToolCallRequest``; the pipeline hands it on explicitly, to cancellation and, on the ``BackendCall``, to the
adapter. The seam between a front and an adapter is this one typed value, as opa-envoy-plugin passes its
``EvalContext``: no context variable joins them.
Must never: hold behaviour of its own, or import anything above plain value types (every layer reads it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from .deadline import Deadline

# Where an adapter reports the backend's progress on the call: called with (progress, total). Only numbers
# pass: a backend's progress text is untrusted.
ProgressRelay = Callable[[float, "float | None"], Awaitable[None]]


@dataclass(frozen=True)
class LogRelay:
    """Where an MCP adapter hands the log messages (``notifications/message`` params) its upstream sends during
    the call, and the lowest level the call's client asked for.

    Set by the MCP front only when that client asked for log messages and can receive them; unset, an
    upstream's log messages are dropped. The messages are the upstream's untrusted data."""

    level: str
    deliver: Callable[[Mapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class InputRefused:
    """A relayed request's error answer (JSON-RPC ``code`` and ``message``) for the upstream that asked."""

    code: int
    message: str


# Where an MCP adapter hands a request its upstream sent back during the call (``sampling/createMessage``,
# ``elicitation/create``) to the client that made the call (``proxy/fronts/mcp/relay.py``): called with (method,
# params, the call's deadline), it returns the client's result object or an ``InputRefused``. Unset: refused.
InputRelay = Callable[[str, Mapping[str, Any], Deadline], Awaitable["Mapping[str, Any] | InputRefused"]]


@dataclass(frozen=True)
class CallChannel:
    """The call's way back to its client and the caller's way to withdraw it (each None: the front has none)."""

    progress: ProgressRelay | None = None
    log: LogRelay | None = None
    input: InputRelay | None = None
    withdrawn: asyncio.Event | None = None  # set: the caller withdrew the call (cancelled if not sent yet)
    withdrawn_by: str = "mcp"               # who withdraws through ``withdrawn``, for the evidence: mcp, batch


NO_CHANNEL = CallChannel()  # a call whose front relays nothing and cannot withdraw it (/v1, OpenAI)
