"""Credentials: what the proxy attaches to a backend request, per call, after the decision.

Owns: the named credentials of the config (``credentials``), built once at start-up (their secret files are
read then, and only then), the one question an adapter asks for each request it sends (``attach``: the headers
one credential adds for one call) and the TLS context a credential's backend is reached with (``tls``), refusing
a registry that names a credential the config does not have (at start-up and on every reload), and the one
error a credential that cannot be had gives (``credential_unavailable``: nothing was sent, retry with the same
key). Must never: put a secret, a token, a token endpoint's answer or a subject token into a log line, span
attribute, audit or decision record, metric label, error envelope or message; send a credential anywhere but
the backend (or token endpoint) it is configured for; be asked before the call was allowed.

The agent holds none of these: a direct call from its container reaches the backend without the credential
and without a call token, and is refused there (docs/security.md).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from ..errors import ProxyError

Headers = tuple[tuple[str, str], ...]
STATIC_SECRET_KINDS = ("header", "bearer", "basic")  # a secret read at start-up, the same header on every request


@dataclass(frozen=True)
class OnBehalfOf:
    """Who a call runs for: the verified caller, and (identity.mode jwt) the token that proved it, which a
    ``token_exchange`` credential sends to its authorization server as the subject token."""

    subject: str
    tenant: str
    token: str = field(default="", repr=False)


class Credential(Protocol):
    name: str
    kind: str
    tls: ssl.SSLContext | None  # a client certificate and/or a CA bundle for its backend (None: the system's CAs)

    async def headers(self, audience: str, caller: OnBehalfOf, wait_s: float) -> Headers:
        """The headers this credential adds to one request (raises ``ProxyError`` credential_unavailable)."""


def unavailable(name: str, reason: str, **details: object) -> ProxyError:
    """A credential that could not be had for this call: nothing was sent to the backend. ``reason`` is one of a
    fixed set (``timeout``, ``unreachable``, ``refused``, ``invalid_answer``, ``answer_too_large``,
    ``no_subject_token``); the token endpoint's own words never appear."""
    return ProxyError("credential_unavailable", "The credential the tool's backend needs could not be obtained.",
                      details={"credential": name, "reason": reason, **details}, phase="execute",
                      attempted=False, committed=False)


class Credentials:
    """The process's credentials by name; adapters ask ``attach`` per request and ``tls`` per connection."""

    def __init__(self, entries: Mapping[str, Credential] | None = None) -> None:
        self._entries = dict(entries or {})

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._entries)

    def kind(self, name: str) -> str | None:
        """A loaded credential's kind; None for a name this object does not hold (the ``mcp_*`` kinds live in
        the MCP OAuth sources, not here)."""
        entry = self._entries.get(name)
        return entry.kind if entry is not None else None

    def tls(self, name: str | None) -> ssl.SSLContext | None:
        """The TLS context of a credential's backend (None: the wire's default, the system's CAs)."""
        return self._entries[name].tls if name is not None else None

    def fixed_headers(self, name: str | None) -> Headers | None:
        """The headers of a static secret credential (kinds header, bearer, basic): the same on every request, so
        an MCP upstream's client can carry them; None for no credential or any other kind."""
        entry = self._entries.get(name) if name is not None else None
        if entry is None or entry.kind not in STATIC_SECRET_KINDS:
            return None
        fixed: Headers = getattr(entry, "fixed")  # a StaticCredential (credentials.static)
        return fixed

    async def attach(self, name: str, *, audience: str, caller: OnBehalfOf, wait_s: float) -> Headers:
        """The headers credential ``name`` adds to one request of ``caller`` to ``audience`` (the backend service),
        waiting at most ``wait_s`` for a token endpoint."""
        return await self._entries[name].headers(audience, caller, wait_s)

    async def aclose(self) -> None:
        for entry in self._entries.values():
            close: Callable[[], object] | None = getattr(entry, "aclose", None)
            if close is not None:
                await close()  # type: ignore[misc]


__all__ = ["STATIC_SECRET_KINDS", "Credential", "Credentials", "Headers", "OnBehalfOf", "unavailable"]
