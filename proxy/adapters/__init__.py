"""Execute stage: adapters that carry one decoded call to its backend.

Owns: the ``BackendCall``/``BackendResult`` contract shared by every adapter
and choosing the adapter for a contract. Must never: retry a call on its own,
or decide authorization, idempotency or locking.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from ..registry import ToolContract


@dataclass(frozen=True)
class BackendCall:
    tool: ToolContract
    canonical_arguments: bytes
    arguments: Mapping[str, Any]
    call_id: str
    request_id: str
    budget_s: float
    traceparent: str
    subject: str
    tenant: str
    agent: str
    idempotency_key: str | None = None
    fencing_token: int | None = None


@dataclass(frozen=True)
class BackendResult:
    data: Any
    status: int
    backend_request_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


class Adapter(Protocol):
    async def call(self, call: BackendCall) -> BackendResult:
        """Execute the call; raise ProxyError (with attempted/committed set) on failure."""


_CODE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def safe_value(value: Any) -> str | None:
    """A backend-supplied identifier, only if it is short and cannot carry text into logs or envelopes."""
    return value if isinstance(value, str) and _SAFE_VALUE.match(value) else None


def safe_error_fields(document: Any) -> dict[str, Any]:
    """A backend's structured ``{"error": {code, field, applied}}`` reduced to safe machine-readable
    fields. Its message is never kept: it may name hosts, queries or other tenants' data."""
    error = document.get("error") if isinstance(document, dict) else None
    if not isinstance(error, dict):
        return {}
    safe: dict[str, Any] = {}
    if isinstance(error.get("code"), str) and _CODE.match(error["code"]):
        safe["code"] = error["code"]
    if safe_value(error.get("field")):
        safe["field"] = error["field"]
    if isinstance(error.get("applied"), bool):
        safe["applied"] = error["applied"]
    return safe
