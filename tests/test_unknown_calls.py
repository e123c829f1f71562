"""Unknown outcomes of writes the caller sent without a key, and call-level unknown entries.

A write without an idempotency key gets a per-request operation record (issue
#12): its unknown outcome is counted in ``toolproxy_open_unknowns`` through
that record and settled like any operation (status endpoint, or an operator's
resolve). Call-level entries (``/v1/unknown-calls``), which earlier versions
wrote for such calls, are still listed and settled with evidence.
"""

from __future__ import annotations

import pytest

from tests.support.audit import audit_records
from tests.support.metrics import sample, samples, scrape_text

COUNTER = {"counter": "ctr_demo", "delta": 5}


@pytest.fixture
def stack(jwt_stack):
    return jwt_stack


def operator(issuers, tenant=None) -> str:
    cross = ["cross-tenant"] if tenant is None else []  # a tenant-less admin token needs the cross-tenant role
    return issuers[1].token("olga", audience="toolproxy-admin", roles=["operator", *cross], tenant=tenant, scope="")


async def settle(stack, token: str, body: object) -> tuple[int, dict]:
    async with stack.session.post(stack.admin_url + "/v1/unknown-calls/settle", json=body,
                                  headers={"Authorization": f"Bearer {token}"}) as response:
        return response.status, await response.json()


async def test_a_keyless_unknown_write_has_an_operation_record_an_operator_resolves(stack, issuers):
    await stack.fault("adjust_counter", "drop_after_commit", count=1)
    _, env = await stack.call("adjust_counter", COUNTER, call_id="call_ctr")
    assert env["error"]["code"] == "timeout_unknown" and env["idempotency_key"].startswith("ik_")
    values = samples(await scrape_text(stack))
    assert values[sample("toolproxy_open_unknowns")] == 1
    token = operator(issuers)
    status, view = await stack.admin("GET", f"/v1/operations/{env['idempotency_key']}", token)
    assert status == 200 and view["state"] == "UNKNOWN"
    async with stack.session.post(f"{stack.admin_url}/v1/operations/{env['idempotency_key']}/resolve",
                                  json={"outcome": "committed", "evidence": "counters table shows 5"},
                                  headers={"Authorization": f"Bearer {token}"}) as response:
        assert response.status == 200, await response.text()
    values = samples(await scrape_text(stack))
    assert values[sample("toolproxy_open_unknowns")] == 0


async def test_operator_settles_a_call_level_unknown_and_the_gauge_comes_down(stack, issuers, capsys):
    # A call-level entry as earlier versions wrote one for a keyless write that ended unknown.
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, call_id="call_ctr")
    assert status == 200
    ref = stack.runtime.unknowns.ref(tenant="acme", tool="adjust_counter", request_id=env["request_id"],
                                     call_id="call_ctr")
    await stack.runtime.unknowns.open(ref, 1.0)
    values = samples(await scrape_text(stack))
    assert values[sample("toolproxy_open_unknowns")] == 1
    assert values[sample("toolproxy_oldest_open_unknown_age_seconds")] > 0

    token = operator(issuers)
    status, listing = await stack.admin("GET", "/v1/unknown-calls", token)
    assert status == 200
    [entry] = listing["unknown_calls"]
    assert (entry["tenant"], entry["tool"], entry["request_id"], entry["call_id"]) == \
        ("acme", "adjust_counter", env["request_id"], "call_ctr")
    status, other = await stack.admin("GET", "/v1/unknown-calls", operator(issuers, tenant="globex"))
    assert other["unknown_calls"] == []

    body = {"request_id": env["request_id"], "call_id": "call_ctr", "outcome": "committed",
            "evidence": "counters table shows ctr_demo = 5"}
    status, answer = await settle(stack, operator(issuers, tenant="globex"), body)
    assert status == 404 and answer["error"]["code"] == "operation_not_found"
    for bad in ({**body, "outcome": "maybe"}, {**body, "evidence": " "}, {**body, "extra": 1}, [body]):
        status, answer = await settle(stack, token, bad)
        assert status == 400 and answer["error"]["code"] == "invalid_request"
    approver = issuers[1].token("bob", audience="toolproxy-admin", roles=["approver", "cross-tenant"], tenant=None, scope="")
    status, answer = await settle(stack, approver, body)
    assert status == 403 and answer["error"]["code"] == "forbidden"  # a valid admin token without the role

    status, answer = await settle(stack, token, body)
    assert (status, answer) == (200, {"request_id": env["request_id"], "call_id": "call_ctr",
                                      "settled": "committed"})
    values = samples(await scrape_text(stack))
    assert values[sample("toolproxy_open_unknowns")] == 0
    assert values[sample("toolproxy_oldest_open_unknown_age_seconds")] == 0
    assert values[sample("toolproxy_reconciliations_total", result="operator")] == 1
    status, answer = await settle(stack, token, body)
    assert status == 404  # settled once

    [record] = [r for r in audit_records(capsys.readouterr().out) if r["kind"] == "reconciliation"]
    assert record["request_id"] == env["request_id"] and record["call_id"] == "call_ctr"
    assert record["side_effect_committed"] is True and record["outcome"] == "succeeded"
    assert record["details"] == {"from": "unknown", "to": "committed", "requested_by": "operator",
                                 "operator": "olga", "evidence": "counters table shows ctr_demo = 5"}


async def test_settling_finds_the_entry_by_its_ids_without_reading_the_index(stack, issuers):
    """The settle endpoint looks the call up by (request id, call id); only an entry an earlier version
    wrote (no per-call set) is searched for, by a ZSCAN filtered in Redis."""
    from tests.support.redis_traffic import RedisTraffic

    unknowns = stack.runtime.unknowns
    for n in range(200):
        await unknowns.open(unknowns.ref(tenant="acme", tool="adjust_counter", request_id=f"req_{n}",
                                         call_id="c"), 1.0 + n)
    legacy = unknowns.ref(tenant="acme", tool="adjust_counter", request_id="req_old", call_id="c")
    await stack.runtime.redis.zadd(unknowns.key, {legacy: 0.5})  # as an earlier version wrote it: no set
    token = operator(issuers)
    async with RedisTraffic(stack.runtime.config.redis.url) as traffic:
        status, answer = await settle(stack, token, {"request_id": "req_150", "call_id": "c",
                                                     "outcome": "not_applied", "evidence": "no row"})
        assert (status, answer["settled"]) == (200, "not_applied"), answer
        indexed = await traffic.since_start()
        status, answer = await settle(stack, token, {"request_id": "req_old", "call_id": "c",
                                                     "outcome": "committed", "evidence": "row present"})
        assert (status, answer["settled"]) == (200, "committed"), answer
        fallback = await traffic.since_start()
    assert "smembers" in indexed.commands and "zscore" in indexed.commands
    assert not {"zrange", "zscan"} & set(indexed.commands), indexed.commands
    assert "zscan" in fallback.commands and "zrange" not in fallback.commands
    status, listing = await stack.admin("GET", "/v1/unknown-calls", token)
    assert len(listing["unknown_calls"]) == 199
    assert not {e["request_id"] for e in listing["unknown_calls"]} & {"req_150", "req_old"}
