"""Unknown outcomes of calls without an operation record: counted, listed to operators, settled with evidence.

A write without an idempotency key has no status to query, so nothing can
reconcile it automatically; it stays in ``toolproxy_open_unknowns`` (and
keeps ``ToolproxyUnknownsOpenTooLong`` firing) until an operator settles it.
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
    return issuers[1].token("olga", audience="toolproxy-admin", roles=["operator"], tenant=tenant, scope="")


async def settle(stack, token: str, body: object) -> tuple[int, dict]:
    async with stack.session.post(stack.admin_url + "/v1/unknown-calls/settle", json=body,
                                  headers={"Authorization": f"Bearer {token}"}) as response:
        return response.status, await response.json()


async def test_operator_settles_a_keyless_unknown_and_the_gauge_comes_down(stack, issuers, capsys):
    await stack.fault("adjust_counter", "drop_after_commit", count=1)
    _, env = await stack.call("adjust_counter", COUNTER, call_id="call_ctr")
    assert env["error"]["code"] == "timeout_unknown" and env["idempotency_key"] is None
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
    approver = issuers[1].token("bob", audience="toolproxy-admin", roles=["approver"], tenant=None, scope="")
    status, answer = await settle(stack, approver, body)
    assert status == 401

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
