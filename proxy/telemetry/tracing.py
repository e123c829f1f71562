"""Trace and request identifiers (W3C Trace Context).

Owns: accepting a caller's ``traceparent`` (only if well-formed), making the
child ``traceparent`` forwarded to backends, and request ids. Must never:
forward a malformed trace header, or trust a request id that could inject
text into logs.
"""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True)
class TraceContext:
    trace_id: str
    parent_id: str
    flags: str = "01"

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags}"

    def child(self) -> "TraceContext":
        """A new span under this trace: what a backend call carries."""
        return TraceContext(self.trace_id, secrets.token_hex(8), self.flags)


def accept_traceparent(header: str | None) -> TraceContext:
    if header:
        match = _TRACEPARENT.match(header.strip().lower())
        if match and match.group(1) != "0" * 32 and match.group(2) != "0" * 16:
            return TraceContext(match.group(1), match.group(2), match.group(3))
    return TraceContext(secrets.token_hex(16), secrets.token_hex(8))


def safe_id(value: str | None) -> str | None:
    """Return a caller-supplied identifier only if it is short and log-safe."""
    if value is not None and _SAFE_ID.match(value):
        return value
    return None


def new_request_id() -> str:
    return uuid.uuid4().hex
