"""Identify stage: who is calling, from trusted context only.

Owns: turning the transport's trusted context into a frozen ``Caller``
(subject, tenant, roles, scopes, agent). Must never: read identity, tenant,
roles or approval from tool arguments, or accept a header-borne identity
unless the operator configured that mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .config import IdentityConfig
from .errors import ProxyError


@dataclass(frozen=True)
class Caller:
    subject: str
    tenant: str
    roles: tuple[str, ...]
    scopes: tuple[str, ...]
    agent: str
    source: str  # static | jwt | headers

    def to_json(self) -> dict[str, Any]:
        return {"subject": self.subject, "tenant": self.tenant, "roles": list(self.roles),
                "scopes": list(self.scopes), "agent": self.agent, "source": self.source}


@dataclass(frozen=True)
class AdminPrincipal:
    """An approver/operator on the admin listener: never the agent's credential."""

    subject: str
    roles: tuple[str, ...]


class Authenticator:
    def __init__(self, config: IdentityConfig) -> None:
        if config.mode != "static":
            raise ValueError(f"identity mode {config.mode!r} is not supported")
        self._config = config

    async def authenticate(self, headers: Mapping[str, str]) -> Caller:
        config = self._config
        if not config.static_subject or not config.static_tenant:
            raise ProxyError("unauthorized", "No trusted identity is configured.", phase="identity")
        return Caller(subject=config.static_subject, tenant=config.static_tenant,
                      roles=tuple(config.static_roles), scopes=tuple(config.static_scopes),
                      agent=config.agent_id, source="static")

    async def authenticate_admin(self, headers: Mapping[str, str], *, role: str) -> AdminPrincipal:
        """The admin listener's principal. Static mode has none: admin calls need a real credential."""
        raise ProxyError("unauthorized", "The admin API requires an approver or operator credential.",
                         phase="identity")
