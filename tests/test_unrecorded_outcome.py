"""No answer without a record: a write whose outcome record cannot be written at commit is answered
``unknown`` (``outcome_unrecorded``), never with its result, and its key stays in progress, so a retry cannot
run it again, and its resources stay frozen, so no other write runs on them before the outcome is known.
Redis refuses the commit for real: its ACL takes the proxy's user's script permission away, or only its write
permission on the operation records, while the backend holds the call (a Redis of this test's own, run with
the documented least-privilege ACL)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.servers import RedisServer
from tests.support.stack import running_stack
from tests.support.waits import wait_until
from tests.test_redis_acl import PASSWORD, documented_acl

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}
# ACL rules (refuse, then allow again): every key but the operation records (toolproxy:op*) stays writable
RECORDS_READ_ONLY = (["resetkeys", "~toolproxy:[^o]*", "%R~toolproxy:o*"], ["resetkeys", "~toolproxy:*"])


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


def acl_stack(acl_redis, opa_server, **settings):
    return running_stack({**opa_server.settings, "redis.url": acl_redis.url, "redis.username": "toolproxy",
                          "redis.password": PASSWORD, "reconcile.enabled": False,
                          "locks.renew_interval_ms": 4500,  # no lock renewal while the backend holds the call
                          **settings})


@pytest.fixture
async def stack(acl_redis, opa_server):
    async with acl_stack(acl_redis, opa_server) as s:
        yield s


async def refund_while_refused(stack, acl_redis, key: str, refuse: list[str], allow: list[str],
                               headers: dict[str, str] | None = None):
    """A refund whose commit meets the ACL rule ``refuse`` (set while the backend holds the call, taken back
    with ``allow`` once it has answered): its status and envelope."""
    await stack.fault("refund_order", "slow", delay_ms=1000, count=1)
    call = asyncio.ensure_future(stack.call("refund_order", REFUND, headers={"Idempotency-Key": key,
                                                                             **(headers or {})}))
    admin = acl_redis.client()
    try:
        await wait_until(lambda: refund_requests(stack) == 1, timeout=10, what="the refund at the backend")
        admin.execute_command("ACL", "SETUSER", "toolproxy", *refuse)
        return await asyncio.wait_for(call, 30)
    finally:
        admin.execute_command("ACL", "SETUSER", "toolproxy", *allow)
        admin.close()


async def test_a_write_whose_outcome_cannot_be_recorded_is_answered_unknown(stack, acl_redis):
    key = {"Idempotency-Key": "refund-unrecorded-1"}
    # the commit's scripts are refused
    status, env = await refund_while_refused(stack, acl_redis, key["Idempotency-Key"], ["-evalsha"], ["+evalsha"])
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


async def test_a_write_whose_record_alone_cannot_be_written_keeps_its_resources_frozen(stack, acl_redis):
    """Only the outcome record's write fails (the ACL makes the operation records read-only; the locks stay
    writable): the resources are not let go. The release freezes them for the operation, whose key stays in
    progress: the same key sends nothing again, and another key's write on the same order is refused."""
    key = {"Idempotency-Key": "refund-unrecorded-2"}
    status, env = await refund_while_refused(stack, acl_redis, key["Idempotency-Key"], *RECORDS_READ_ONLY)
    admin = acl_redis.client()
    try:
        denied = [entry for entry in admin.acl_log() if str(entry.get("reason")) == "key"]
        fields = sorted(admin.hgetall(stack.runtime.pipeline._locks.resource_key("acme", "order:ord_1001")))
    finally:
        admin.close()
    assert denied, "the record's write was not refused by the ACL"  # (by key: the scripts still ran)
    assert status == 503 and env["outcome"] == "unknown", env
    assert env["error"]["code"] == "outcome_unrecorded" and env["data"] is None
    assert stack.backend.effect_counts().get("refund_order") == 1

    # Nothing half-written: the record is as the reservation left it, and the order's lock hash holds the
    # operation's freeze mark and no holder.
    record = await stack.runtime.operations.get(env["idempotency_key"])
    assert record.state == "IN_PROGRESS" and record.outcome is None and record.evidence is None, record
    assert fields == [f"u:{env['idempotency_key']}".encode()], fields

    status, again = await stack.call("refund_order", REFUND, headers=key)
    assert again["error"]["code"] in ("operation_in_progress", "operation_unknown"), again
    status, other = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "refund-unrecorded-3"})
    assert other["error"]["code"] == "operation_unknown", other
    assert other["error"]["details"]["blocking_operation"] == env["idempotency_key"], other
    assert other["side_effect"] == {"attempted": False, "committed": False}
    assert refund_requests(stack) == 1 and stack.backend.effect_counts()["refund_order"] == 1



async def test_the_freeze_of_an_unrecorded_write_lifts_when_it_is_reconciled(acl_redis, opa_server):
    """The resources of a write whose record could not be written stay frozen only until its outcome is known:
    its lease runs out, the reconciler asks the backend's status endpoint (committed), the record settles
    SUCCEEDED and the freeze is thawed; another key's write then runs."""
    fast = {"reconcile.enabled": True, "reconcile.scan_interval_ms": 200, "reconcile.backoff_initial_ms": 100,
            "idempotency.lease_grace_ms": 500}
    async with acl_stack(acl_redis, opa_server, **fast) as stack:
        status, env = await refund_while_refused(stack, acl_redis, "refund-reconciled-1", *RECORDS_READ_ONLY,
                                                 headers={"Request-Timeout": "3"})  # a lease of 3.5 s
        assert env["error"]["code"] == "outcome_unrecorded", env
        key = env["idempotency_key"]

        async def settled() -> bool:
            record = await stack.runtime.operations.get(key)
            return record is not None and record.state == "SUCCEEDED"
        await wait_until(settled, timeout=30, what="the reconciler to settle the unrecorded write", interval=0.1)
        _, replay = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "refund-reconciled-1"})
        assert replay["outcome"] == "succeeded" and replay.get("replayed") is True, replay
        admin = acl_redis.client()
        try:
            fields = admin.hgetall(stack.runtime.pipeline._locks.resource_key("acme", "order:ord_1001"))
        finally:
            admin.close()
        assert not [f for f in fields if f.startswith(b"u:")], fields  # thawed
        _, other = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "refund-reconciled-2"})
        assert other["outcome"] == "succeeded", other
        assert stack.backend.effect_counts()["refund_order"] == 2  # the first once, the new key once
