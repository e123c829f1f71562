"""The least-privilege Redis ACL of docs/scale.md, as written there, against a real redis-server.

The ACL rule is read from docs/scale.md (the fenced block after "least-privilege ACL"), so the page and
the test cannot drift. A proxy authenticated as that user runs the whole flow: writes, replays, locks,
approvals (create, decide, spend), quotas and back-pressure, a cancel, a reconciled unknown outcome, the
audit stream. Redis's ACL LOG must stay empty (no command the proxy sends was refused), and a command
outside the ACL is refused.
"""

from __future__ import annotations

import asyncio
import re
import secrets

import pytest
import redis

from tests.support.servers import RedisServer
from tests.support.stack import REPO, running_stack
from tests.support.tokens import jwt_overrides
from tests.support.waits import wait_until

PASSWORD = secrets.token_urlsafe(24)


def documented_acl() -> str:
    """The ``ACL SETUSER`` line of docs/scale.md, with the password placeholder filled in."""
    text = (REPO / "docs" / "scale.md").read_text(encoding="utf-8")
    block = re.search(r"least-privilege ACL.*?```\n(ACL SETUSER toolproxy .*?)\n```", text, re.S)
    assert block, "docs/scale.md has no least-privilege ACL block"
    rule = " ".join(block.group(1).replace("\\\n", " ").split())
    assert "<password>" in rule
    return rule.removeprefix("ACL SETUSER ").replace("<password>", PASSWORD)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis-acl"), password=secrets.token_urlsafe(24),
                         users=[documented_acl()])
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def stack(acl_redis, opa_server, issuers):
    admin = acl_redis.client()
    admin.flushall()
    admin.execute_command("ACL", "LOG", "RESET")
    admin.close()
    settings = {**opa_server.settings, **jwt_overrides(*issuers), "redis.url": acl_redis.url,
                "redis.username": "toolproxy", "redis.password": PASSWORD, "audit.sinks": ["stdout", "redis"],
                "quotas.tenant": "rate=100/1s burst=100 concurrency=10", "reconcile.enabled": False,
                "reconcile.backoff_initial_ms": 0, "cancellation.grace_ms": 1500}
    async with running_stack(settings) as s:
        s.headers["Authorization"] = f"Bearer {issuers[0].token('alice')}"
        yield s


def refused_commands(server: RedisServer) -> list[str]:
    """What Redis's ACL LOG recorded as refused: "<reason> <command or key>" per entry."""
    admin = server.client(decode_responses=True)
    try:
        return [f"{entry.get('reason')} {entry.get('object')}" for entry in admin.acl_log()]
    finally:
        admin.close()


async def test_the_whole_flow_runs_under_the_documented_acl(stack, acl_redis, issuers):
    # writes, a replay, locks
    status, env = await stack.call("refund_order", {"order_id": "ord_1001", "amount": 100, "reason": "dup"},
                                   headers={"Idempotency-Key": "acl-1"})
    assert status == 200, (env, refused_commands(acl_redis))
    status, replay = await stack.call("refund_order", {"order_id": "ord_1001", "amount": 100, "reason": "dup"},
                                      headers={"Idempotency-Key": "acl-1"})
    assert status == 200 and replay["replayed"] is True, replay
    assert (await stack.call("get_order", {"order_id": "ord_1001"}))[0] == 200
    # an approval: created, listed, decided, spent
    big = {"order_id": "ord_1001", "amount": 6000, "reason": "big"}
    _, env = await stack.call("refund_order", big, headers={"Idempotency-Key": "acl-2"})
    approval_id = env["error"]["details"]["approval_id"]
    approver = issuers[1].token("bob", audience="toolproxy-admin", roles=["approver"], tenant="acme", scope="")
    assert (await stack.admin("GET", "/v1/approvals", approver))[0] == 200
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    status, env = await stack.call("refund_order", big, headers={"Idempotency-Key": "acl-2", "X-Approval-Id": approval_id})
    assert status == 200, env
    # a cancel
    call = asyncio.create_task(stack.call("generate_report", {"title": "q", "duration_ms": 8000},
                                          headers={"Idempotency-Key": "acl-3"}))
    await wait_until(lambda: any(r["tool"] == "generate_report" for r in stack.backend.requests),
                     what="the report at the backend")
    status, view = await stack.post("/v1/operations/acl-3:cancel?tool=generate_report", {})
    assert status == 200 and view["state"] == "CANCELLED", view
    await call
    # an unknown outcome, reconciled
    await stack.fault("refund_order", "drop_after_commit", count=1)
    _, env = await stack.call("refund_order", {"order_id": "ord_1002", "amount": 100, "reason": "dup"},
                              headers={"Idempotency-Key": "acl-4"})
    assert env["error"]["code"] == "timeout_unknown", env
    await stack.runtime.reconciler.scan_once()
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "SUCCEEDED", record
    # flow labels: recorded by the reads, read for the send (which then waits for a person)
    for tool, arguments in (("get_user_preferences", {"user_ref": "usr_alice"}),
                            ("fetch_page", {"url": "https://shop.example/help"})):
        assert (await stack.call(tool, arguments))[0] == 200, refused_commands(acl_redis)
    _, held = await stack.call("send_email", {"to": "a@b.example", "subject": "s", "body": "b"},
                               headers={"Idempotency-Key": "acl-5"})
    assert held["error"]["code"] == "approval_required", (held, refused_commands(acl_redis))
    # a denial (the denials log), then what the console reads: approvals decided, denials, locks, unknowns
    assert (await stack.call("get_order", {"order_id": "ord_2001"}))[0] == 403
    operator = issuers[1].token("olga", audience="toolproxy-admin", roles=["approver", "operator", "cross-tenant"],
                                tenant=None, scope="")
    for path in ("/v1/approvals/decided", "/v1/denials", "/v1/locks", "/v1/unknown-calls",
                 "/v1/unknown-operations", "/v1/takeovers", "/v1/quotas", f"/v1/operations/{env['idempotency_key']}"):
        status, body = await stack.admin("GET", path, operator)
        assert status == 200, (path, body)
    # readiness and metrics read Redis too
    async with stack.session.get(stack.ops_url + "/readyz") as response:
        assert response.status == 200, await response.text()
    async with stack.session.get(stack.ops_url + "/metrics") as response:
        assert response.status == 200
    assert refused_commands(acl_redis) == []


def test_a_command_outside_the_acl_is_refused(acl_redis):
    client = redis.Redis.from_url(acl_redis.url, username="toolproxy", password=PASSWORD)
    try:
        assert client.ping()
        client.set("toolproxy:x", "1")  # inside its key prefix, a command it has
        for command in (("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"),
                        ("ACL", "SETUSER", "toolproxy", "+@all"), ("MONITOR",), ("SCRIPT", "FLUSH"),
                        ("EVAL", "return redis.call('FLUSHALL')", "0")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        with pytest.raises(redis.exceptions.NoPermissionError):  # a key outside its prefix
            client.set("other:x", "1")
        # A script it may load and run still cannot reach outside the ACL: Redis checks each call inside it.
        with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
            client.execute_command("EVALSHA", client.script_load("return redis.call('FLUSHALL')"), "0")
        refused = refused_commands(acl_redis)
        assert any(entry.endswith("flushall") for entry in refused) and "key other:x" in refused, refused
    finally:
        client.close()
