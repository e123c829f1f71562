"""The MCP session table without servers: ownership, idle expiry, the cap (proxy/fronts/mcp/sessions.py)."""

from __future__ import annotations

import pytest

from proxy.identity import Caller
from proxy.fronts.mcp.sessions import SessionsFull, SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def caller(subject: str = "alice", tenant: str = "t1") -> Caller:
    return Caller(subject=subject, tenant=tenant, roles=(), scopes=(), agent="agent-1", source="static")


def test_a_session_belongs_to_its_creator_and_reads_absent_to_anyone_else():
    table = SessionTable(max_sessions=4, idle_s=60, clock=Clock())
    session = table.create(caller(), "2025-06-18")
    assert table.get(session.id, caller()) == session and session.protocol_version == "2025-06-18"
    assert table.get(session.id, caller("bob")) is None
    assert table.get(session.id, caller(tenant="t2")) is None
    assert table.end(session.id, caller("bob")) is False and len(table) == 1
    assert table.end(session.id, caller()) is True and table.get(session.id, caller()) is None


def test_ids_are_unguessable_and_distinct():
    table = SessionTable(max_sessions=4, idle_s=60, clock=Clock())
    ids = {table.create(caller(), "v").id for _ in range(4)}
    assert len(ids) == 4 and all(len(i) >= 40 for i in ids)


def test_an_idle_session_expires_and_use_keeps_it_alive():
    clock = Clock()
    table = SessionTable(max_sessions=4, idle_s=10, clock=clock)
    kept, idle = table.create(caller(), "v"), table.create(caller(), "v")
    clock.now += 8
    assert table.get(kept.id, caller()) is not None
    clock.now += 8
    assert table.get(kept.id, caller()) is not None
    assert table.get(idle.id, caller()) is None and len(table) == 1


def test_the_cap_expires_idle_sessions_first_and_refuses_when_all_are_live():
    clock = Clock()
    table = SessionTable(max_sessions=2, idle_s=10, clock=clock)
    table.create(caller(), "v")
    table.create(caller(), "v")
    with pytest.raises(SessionsFull):
        table.create(caller(), "v")
    clock.now += 11
    table.create(caller(), "v")
    assert len(table) == 1


def test_one_owner_cannot_fill_the_table():
    clock = Clock()
    table = SessionTable(max_sessions=10, idle_s=10, max_per_owner=3, clock=clock)
    mine = [table.create(caller(), "v") for _ in range(3)]
    with pytest.raises(SessionsFull) as refused:
        table.create(caller(), "v")
    assert refused.value.reason == "too_many_owner_sessions" and table.owned(caller()) == 3
    # Others still get sessions; the owner gets one back when one of its own ends or idles out.
    assert table.create(caller("bob"), "v") and table.create(caller(tenant="t2"), "v")
    assert table.end(mine[0].id, caller()) and table.create(caller(), "v")
    clock.now += 11
    assert table.create(caller(), "v") and table.owned(caller()) == 1 and table.owned(caller("bob")) == 0


def test_the_global_cap_still_refuses_with_its_own_reason():
    table = SessionTable(max_sessions=2, idle_s=10, max_per_owner=2, clock=Clock())
    table.create(caller(), "v")
    table.create(caller("bob"), "v")
    with pytest.raises(SessionsFull) as refused:
        table.create(caller("carol"), "v")
    assert refused.value.reason == "too_many_sessions"
