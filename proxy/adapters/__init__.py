"""Execute stage: adapters that carry one decoded call to its backend.

Owns: the ``BackendCall``/``BackendResult`` contract shared by every adapter
and choosing the adapter for a contract. Must never: retry a call on its own,
or decide authorization, idempotency or locking.
"""

from __future__ import annotations

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
