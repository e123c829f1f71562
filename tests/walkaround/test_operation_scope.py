"""Walk-around: another subject's operations, batches and a tenant-less admin token (issue 28, section 7).

An operation key derived from an ``Idempotency-Key`` names the tenant's
operation, whoever started it. Another subject of the same tenant who guesses
the key must not read, cancel or compensate it: the operation does not exist
for them (``operation_not_found``) unless OPA grants their role
``operate_others`` (the example data's ``shift_lead``). Real proxy, OPA, Redis,
demo backend and JWTs.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.support.stack import running_stack
from tests.support.tokens import jwt_overrides
from tests.support.waits import wait_until

REPORT = {"title": "quarterly", "duration_ms": 8000}
RESERVE = {"sku": "sku_widget", "quantity": 3, "order_id": "ord_1001"}


@pytest.fixture
async def stack(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False,
                              "cancellation.grace_ms": 1500}) as s:
        s.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        yield s


def as_(issuers, subject: str, roles: list[str] | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {issuers[0].token(subject, roles=roles)}"}


async def test_another_subject_cannot_read_cancel_or_compensate_an_operation(stack, issuers):
    status, env = await stack.call("reserve_inventory", RESERVE, headers={"Idempotency-Key": "rsv-1"})
    assert status == 200 and env["outcome"] == "succeeded", env
    key = env["idempotency_key"]
    bob = as_(issuers, "bob")
    for path in (f"/v1/operations/{key}", "/v1/operations/rsv-1?tool=reserve_inventory"):
        status, body = await stack.get(path, headers=bob)
        assert status == 404 and body["error"]["code"] == "operation_not_found", body
    for path in (f"/v1/operations/{key}:cancel", "/v1/operations/rsv-1:cancel?tool=reserve_inventory",
                 f"/v1/operations/{key}:compensate", "/v1/operations/rsv-1:compensate?tool=reserve_inventory"):
        status, body = await stack.post(path, {}, headers=bob)
        assert status == 404 and body["error"]["code"] == "operation_not_found", (path, body)
    assert stack.backend.effect_counts().get("release_reservation", 0) == 0
    # The operation's own subject sees it; nothing bob tried left a mark on it.
    status, view = await stack.get(f"/v1/operations/{key}")
    assert status == 200 and view["compensation"] is None and view["cancellation"] is None
    # A shift lead (operate_others in the policy data) may read another subject's operation.
    status, view = await stack.get(f"/v1/operations/{key}", headers=as_(issuers, "dora", ["agent", "shift_lead"]))
    assert status == 200 and view["idempotency_key"] == key


async def test_another_subject_cannot_cancel_a_running_call_but_its_own_subject_can(stack, issuers):
    call = asyncio.create_task(stack.call("generate_report", REPORT, headers={"Idempotency-Key": "rep-1"}))
    await wait_until(lambda: any(r["tool"] == "generate_report" for r in stack.backend.requests),
                     what="the report at the backend")
    status, body = await stack.post("/v1/operations/rep-1:cancel?tool=generate_report", {},
                                    headers=as_(issuers, "bob"))
    assert status == 404 and body["error"]["code"] == "operation_not_found", body
    assert stack.backend.cancel_requests == []
    status, view = await stack.post("/v1/operations/rep-1:cancel?tool=generate_report", {})
    assert status == 200 and view["state"] == "CANCELLED", view
    assert view["cancellation"]["requested_by"] == "alice"
    _, env = await call
    assert env["outcome"] == "cancelled"


async def test_a_batch_id_names_only_its_own_callers_batch(stack, issuers):
    plan = {"calls": [{"call_id": "r1", "tool": "generate_report", "arguments": REPORT}]}
    batch = asyncio.create_task(stack.post("/v1/tool-calls:batch", plan,
                                           headers={"X-Request-Id": "batch-1", "Idempotency-Key": "b-1"}))
    await wait_until(lambda: any(r["tool"] == "generate_report" for r in stack.backend.requests),
                     what="the batch's call at the backend")
    status, body = await stack.post("/v1/batches/batch-1:cancel", {}, headers=as_(issuers, "bob"))
    assert status == 404 and body["error"]["code"] == "batch_not_found", body
    status, body = await stack.post("/v1/batches/batch-1:cancel", {})
    assert status == 200 and body["status"] in ("cancelled", "cancelling"), body
    await batch


async def test_another_subject_can_neither_probe_nor_take_an_idempotency_key(stack, issuers):
    """The header key is scoped to the subject: bob sending alice's key learns nothing (no
    ``idempotency_conflict`` telling him she used it) and cannot take a predictable key before her."""
    bob = as_(issuers, "bob")
    status, hers = await stack.call("reserve_inventory", RESERVE, headers={"Idempotency-Key": "rsv-9"})
    assert status == 200 and hers["outcome"] == "succeeded", hers
    status, probe = await stack.call("reserve_inventory", {**RESERVE, "quantity": 1},
                                     headers={"Idempotency-Key": "rsv-9", **bob})
    assert status == 200 and probe["outcome"] == "succeeded", probe  # his own operation: nothing told on her
    assert probe["idempotency_key"] != hers["idempotency_key"]
    # bob takes a predictable key first: alice's own call under it is still hers, and runs.
    status, taken = await stack.call("reserve_inventory", {**RESERVE, "quantity": 2},
                                     headers={"Idempotency-Key": "rsv-10", **bob})
    assert status == 200, taken
    status, mine = await stack.call("reserve_inventory", RESERVE, headers={"Idempotency-Key": "rsv-10"})
    assert status == 200 and mine["outcome"] == "succeeded", mine
    assert stack.backend.effect_counts()["reserve_inventory"] == 4
