"""MCP legacy sessions: the ``Mcp-Session-Id`` handed out by ``initialize``.

Owns: minting unguessable session ids, binding each session to the caller
that created it and to its negotiated protocol version, the log level its
client set (``logging/setLevel``), idle expiry, the caps
on open sessions (all of them, and one owner's: one caller cannot fill the
table), and ending sessions (``DELETE``). Sessions live in this
process only: after a restart a client gets 404 and initializes again, which
the MCP spec requires clients to handle. Must never: let a session stand for
identity (every request is still authenticated), or be used as an
idempotency key or call id.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from typing import Callable

from ...identity import Caller


@dataclass(frozen=True)
class Session:
    id: str
    protocol_version: str
    owner: tuple[str, str, str]  # subject, tenant, agent of the caller that initialized it
    # What the client declared it can answer (``mcp_relay.declared``), e.g. {"sampling", "elicitation.form"}.
    client_capabilities: frozenset[str] = frozenset()
    # The lowest level of upstream log messages the client asked for; None: it never asked (none relayed).
    log_level: str | None = None


class SessionsFull(Exception):
    """No room for another session even after expiring idle ones: ``reason`` is ``too_many_sessions``
    (mcp.max_sessions) or ``too_many_owner_sessions`` (mcp.max_sessions_per_owner)."""

    def __init__(self, reason: str = "too_many_sessions") -> None:
        super().__init__(reason)
        self.reason = reason


def owner_of(caller: Caller) -> tuple[str, str, str]:
    return (caller.subject, caller.tenant, caller.agent)


class SessionTable:
    """Open sessions of one process, with idle expiry on a monotonic clock."""

    def __init__(self, *, max_sessions: int, idle_s: float, max_per_owner: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_sessions
        self._max_per_owner = max_sessions if max_per_owner is None else max_per_owner
        self._idle_s = idle_s
        self._clock = clock
        self._sessions: dict[str, tuple[Session, float]] = {}
        self._owned: dict[tuple[str, str, str], int] = {}  # open sessions per owner (no entry at zero)

    def __len__(self) -> int:
        return len(self._sessions)

    def owned(self, caller: Caller) -> int:
        return self._owned.get(owner_of(caller), 0)

    def create(self, caller: Caller, protocol_version: str,
               client_capabilities: frozenset[str] = frozenset()) -> Session:
        owner = owner_of(caller)
        if len(self._sessions) >= self._max or self._owned.get(owner, 0) >= self._max_per_owner:
            self._expire()
            if self._owned.get(owner, 0) >= self._max_per_owner:
                raise SessionsFull("too_many_owner_sessions")
            if len(self._sessions) >= self._max:
                raise SessionsFull("too_many_sessions")
        session = Session(id=secrets.token_urlsafe(32), protocol_version=protocol_version, owner=owner,
                          client_capabilities=client_capabilities)
        self._sessions[session.id] = (session, self._clock())
        self._owned[owner] = self._owned.get(owner, 0) + 1
        return session

    def _drop(self, session_id: str) -> None:
        session, _ = self._sessions.pop(session_id)
        left = self._owned.get(session.owner, 0) - 1
        if left > 0:
            self._owned[session.owner] = left
        else:
            self._owned.pop(session.owner, None)

    def get(self, session_id: str, caller: Caller) -> Session | None:
        """The live session with this id owned by this caller, touched; None otherwise.

        A session created by another caller reads as absent (404), so ids
        cannot be probed across identities.
        """
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        session, last_seen = entry
        now = self._clock()
        if now - last_seen > self._idle_s:
            self._drop(session_id)
            return None
        if session.owner != owner_of(caller):
            return None
        self._sessions[session_id] = (session, now)
        return session

    def set_log_level(self, session_id: str, caller: Caller, level: str) -> Session | None:
        """Store the client's ``logging/setLevel`` on its session (for the calls that follow)."""
        session = self.get(session_id, caller)
        if session is None:
            return None
        session = replace(session, log_level=level)
        self._sessions[session_id] = (session, self._clock())
        return session

    def end(self, session_id: str, caller: Caller) -> bool:
        if self.get(session_id, caller) is None:
            return False
        self._drop(session_id)
        return True

    def _expire(self) -> None:
        now = self._clock()
        for session_id in [k for k, (_, seen) in self._sessions.items() if now - seen > self._idle_s]:
            self._drop(session_id)
