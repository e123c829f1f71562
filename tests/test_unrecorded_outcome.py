"""No answer without a record: a write whose outcome record cannot be written at commit is answered
``unknown`` (``outcome_unrecorded``), never with its result, and its key stays in progress, so a retry cannot
run it again. Redis refuses the commit for real: its ACL takes the proxy's user's script permission away
while the backend holds the call (a Redis of this test's own, run with the documented least-privilege ACL)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.servers import RedisServer
from tests.support.stack import running_stack
from tests.support.waits import wait_until
from tests.test_redis_acl import PASSWORD, documented_acl

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}


@pytest.fixture
def acl_redis(tmp_path):
    server = RedisServer(data_dir=tmp_path / "redis", password="admin-" + PASSWORD, users=[documented_acl()])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def refund_requests(stack) -> int:
    return sum(1 for r in stack.backend.requests if r["tool"] == "refund_order")


async def test_a_write_whose_outcome_cannot_be_recorded_is_answered_unknown(acl_redis, opa_server):
    settings = {**opa_server.settings, "redis.url": acl_redis.url, "redis.username": "toolproxy",
                "redis.password": PASSWORD, "reconcile.enabled": False,
                "locks.renew_interval_ms": 4500}  # no lock renewal while the backend holds the call
    async with running_stack(settings) as stack:
        key = {"Idempotency-Key": "refund-unrecorded-1"}
        await stack.fault("refund_order", "slow", delay_ms=1000, count=1)
        call = asyncio.ensure_future(stack.call("refund_order", REFUND, headers=key))
        admin = acl_redis.client()
        try:
            await wait_until(lambda: refund_requests(stack) == 1, timeout=10, what="the refund at the backend")
            admin.execute_command("ACL", "SETUSER", "toolproxy", "-evalsha")  # the commit's script is refused
            status, env = await asyncio.wait_for(call, 30)
        finally:
            admin.execute_command("ACL", "SETUSER", "toolproxy", "+evalsha")
            admin.close()
        assert stack.backend.effect_counts().get("refund_order") == 1  # the backend did refund
        assert status == 503 and env["outcome"] == "unknown", env
        assert env["error"]["code"] == "outcome_unrecorded" and env["error"]["resolution"] == "reconcile"
        assert env["error"]["details"]["observed"] == "succeeded"
        assert env["data"] is None and env["side_effect"] == {"attempted": True, "committed": None}
        # The key stays in progress: a retry with it learns that and sends nothing.
        _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
        assert record["state"] == "IN_PROGRESS", record
        status, again = await stack.call("refund_order", REFUND, headers=key)
        assert again["error"]["code"] in ("operation_in_progress", "operation_unknown"), again
        assert refund_requests(stack) == 1 and stack.backend.effect_counts()["refund_order"] == 1
