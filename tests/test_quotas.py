"""Quota stage in one process: the envelope of a refusal (JSON, MCP), round trips counted on the test's own
Redis, OPA quota classes, batches waiting for a slot, Redis loss, a backend's Retry-After and the admin view.
Real OPA, real Redis, the demo backend. (Two proxy processes: tests/test_quotas_fleet.py.)"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis as redis_sync
from mcp import Client

from tests.support.stack import UNLOCKED_COUNTER, extra_tools, mcp_envelope, passthrough_read, running_stack
from tests.support.tokens import jwt_overrides
from tests.support.waits import wait_until

ORDER = {"order_id": "ord_1001"}

# Two demo-backend tools under contracts with their own quotas.
LIMITED_TOOLS = "tools:" + passthrough_read("counted_order", "/tools/get_order", "order_id",
                                            "quotas: {rate: 1000, per_s: 1, burst: 1000}") \
    + passthrough_read("single_file_inventory", "/tools/get_inventory", "sku", "quotas: {concurrency: 1}")


class RoundTrips:
    """Commands clients send to the test's own Redis, from MONITOR: what a script runs inside itself
    (client type ``lua``) is not a round trip, nor PING (the pool's health check, the pub/sub keepalive)."""

    def __init__(self, url: str) -> None:
        self._url = url

    async def during(self, scenario: Any) -> list[str]:
        marker = uuid.uuid4().hex
        seen: list[dict[str, Any]] = []
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()

        def watch() -> None:
            client = redis_sync.Redis.from_url(self._url)
            with client.monitor() as monitor:
                loop.call_soon_threadsafe(ready.set)
                for command in monitor.listen():
                    if marker in command["command"]:
                        break
                    seen.append(command)
            client.close()

        watcher = asyncio.ensure_future(asyncio.to_thread(watch))
        await ready.wait()
        poke = redis_sync.Redis.from_url(self._url)
        poke.echo("warm")  # the poking client's own connection handshake happens outside the scenario
        await asyncio.sleep(0.05)
        seen.clear()
        try:
            await scenario
        finally:
            poke.echo(marker)
            await asyncio.wait_for(watcher, 10)
            poke.close()
        return [c["command"].split()[0].lower() for c in seen
                if c.get("client_type") != "lua" and not c["command"].upper().startswith(("PING", "ECHO"))]


def sample(registry: Any, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def synced(stack) -> None:
    await asyncio.wait_for(stack.runtime.quotas.guard.synced.wait(), 10)


async def test_a_limited_call_adds_one_round_trip_and_an_unlimited_call_none(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, LIMITED_TOOLS),
                              "reconcile.enabled": False}) as stack:
        await synced(stack)
        for tool in ("get_order", "counted_order"):  # warm up: connections made, script loaded
            assert (await stack.call(tool, ORDER))[0] == 200
        trips = RoundTrips(proxy_deps["redis.url"])
        assert await trips.during(stack.call("get_order", ORDER)) == []
        assert await trips.during(stack.call("counted_order", ORDER)) == ["evalsha"]


async def test_over_the_limit_is_rate_limited_with_a_usable_retry_after_on_json_and_mcp(proxy_deps):
    async with running_stack({**proxy_deps, "quotas.subject": "rate=2/1s burst=1"}) as stack:
        assert (await stack.call("get_order", ORDER))[0] == 200
        sent = len(stack.backend.requests)
        async with stack.session.post(stack.proxy_url + "/v1/tool-calls", json={
                "call_id": "c2", "tool": "get_order", "arguments": ORDER}) as response:
            status, env, retry_after = response.status, await response.json(), response.headers.get("Retry-After")
        assert status == 429 and retry_after == "1"
        error = env["error"]
        assert error["code"] == "rate_limited" and error["phase"] == "quota" and error["retryable"] is True
        assert set(error["details"]) == {"limit", "retry_after_s"}  # the limit's name, no figures
        assert error["details"]["limit"] == "subject"
        assert 0 < error["details"]["retry_after_s"] <= 0.5  # one emission interval of 2/s at most
        assert env["side_effect"] == {"attempted": False, "committed": False}
        assert len(stack.backend.requests) == sent

        async with Client(stack.proxy_url + "/mcp", mode="auto") as mcp:
            result = await mcp.call_tool("get_order", ORDER)
        assert result.is_error is True
        mcp_error = mcp_envelope(result)["error"]
        assert mcp_error["code"] == "rate_limited" and mcp_error["details"]["limit"] == "subject"
        assert mcp_error["details"]["retry_after_s"] > 0
        assert "Retry after" in result.content[0].text
        assert len(stack.backend.requests) == sent

        await asyncio.sleep(mcp_error["details"]["retry_after_s"])  # the limiter's own answer
        assert (await stack.call("get_order", ORDER))[0] == 200
        assert sample(stack.runtime.metrics.registry, "toolproxy_quota_decisions_total",
                      limit="subject", result="limited") == 2


async def test_a_batch_waits_for_a_concurrency_slot_instead_of_failing(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, LIMITED_TOOLS)}) as stack:
        stack.backend.latency_ms = (40, 40)
        calls = [{"call_id": f"i{n}", "tool": "single_file_inventory", "arguments": {"sku": "sku_widget"}}
                 for n in range(4)]
        status, body = await stack.batch(calls, headers={"Request-Timeout": "30"})
        assert status == 200 and body["status"] == "succeeded", body
        spans = sorted((i.start, i.end) for i in stack.backend.intervals if i.tool == "get_inventory")
        assert len(spans) == 4
        assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))  # never two at once
        assert sample(stack.runtime.metrics.registry, "toolproxy_quota_decisions_total",
                      limit="tool:single_file_inventory", result="waited") > 0
        assert sample(stack.runtime.metrics.registry, "toolproxy_quota_in_flight",
                      limit="tool:single_file_inventory") == 0


async def test_single_calls_over_a_concurrency_quota_are_refused_and_slots_are_released(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **extra_tools(tmp_path, LIMITED_TOOLS)}) as stack:
        await stack.fault("get_inventory", "slow", delay_ms=300, count=1)
        first = asyncio.ensure_future(stack.call("single_file_inventory", {"sku": "sku_widget"}))
        await wait_until(lambda: len(stack.backend.requests) == 1, what="the first call at the backend")
        status, env = await stack.call("single_file_inventory", {"sku": "sku_widget"})
        assert status == 429 and env["error"]["details"]["limit"] == "tool:single_file_inventory"
        assert (await first)[0] == 200
        assert (await stack.call("single_file_inventory", {"sku": "sku_widget"}))[0] == 200  # slot came back
        assert len(stack.backend.requests) == 2


async def test_redis_loss_fails_closed_for_writes_and_open_for_reads_by_default(proxy_deps, tmp_path):
    dead = {**proxy_deps, "redis.url": "redis://127.0.0.1:9/0", "redis.timeout_ms": 200,
            "quotas.tenant": "rate=100/1s", "reconcile.enabled": False}
    counter = extra_tools(tmp_path, UNLOCKED_COUNTER)  # a write that reaches the quota stage alone
    async with running_stack({**dead, **counter}) as stack:
        status, env = await stack.call("get_order", ORDER)
        assert status == 200, env  # read: auto = open, counted as skipped
        status, env = await stack.call("bump_counter", {"counter": "ctr_demo", "delta": 1})
        assert status == 503 and env["error"]["code"] == "dependency_unavailable"
        assert env["error"]["phase"] == "quota" and env["error"]["details"]["dependency"] == "state_store"
        assert [r["tool"] for r in stack.backend.requests] == ["get_order"]
        registry = stack.runtime.metrics.registry
        assert sample(registry, "toolproxy_quota_decisions_total", limit="tenant", result="skipped") == 1
        assert sample(registry, "toolproxy_quota_decisions_total", limit="tenant", result="unavailable") == 1
    # on_redis_error=open lets the write past the quota stage, but a write is never sent without its
    # operation record, so the idempotency stage refuses it: fail-open quotas never weaken that rule.
    async with running_stack({**dead, **counter, "quotas.tenant": "rate=100/1s on_redis_error=open"}) as stack:
        status, env = await stack.call("bump_counter", {"counter": "ctr_demo", "delta": 1})
        assert status == 503 and env["error"]["code"] == "dependency_unavailable"
        assert env["error"]["phase"] != "quota" and stack.backend.requests == []
        registry = stack.runtime.metrics.registry
        assert sample(registry, "toolproxy_quota_decisions_total", limit="tenant", result="skipped") == 1


@pytest.fixture
async def jwt_stack(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin),
                              "quotas.classes": {"reduced": "rate=1/1m burst=1"}}) as s:
        yield s


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_an_opa_quota_class_lowers_only_that_subjects_limit(jwt_stack, issuers, opa_server):
    agent, _ = issuers
    noisy, calm = f"noisy-{uuid.uuid4().hex[:6]}", f"calm-{uuid.uuid4().hex[:6]}"
    opa_server.put_data("toolproxy/quota_classes", {"subjects": {"acme": {noisy: "reduced"}}})
    try:
        results = {who: [(await jwt_stack.call("get_order", ORDER, headers=bearer(agent.token(who))))[1]
                         for _ in range(4)] for who in (noisy, calm)}
    finally:
        opa_server.put_data("toolproxy/quota_classes", {})
    assert [env["outcome"] for env in results[calm]] == ["succeeded"] * 4
    assert [env["outcome"] for env in results[noisy]] == ["succeeded"] + ["failed"] * 3
    assert {env["error"]["details"]["limit"] for env in results[noisy][1:]} == {"class:reduced"}


async def test_a_class_the_proxy_does_not_define_fails_closed(jwt_stack, issuers, opa_server):
    agent, _ = issuers
    who = f"odd-{uuid.uuid4().hex[:6]}"
    opa_server.put_data("toolproxy/quota_classes", {"subjects": {"acme": {who: "platinum"}}})
    try:
        status, env = await jwt_stack.call("get_order", ORDER, headers=bearer(agent.token(who)))
    finally:
        opa_server.put_data("toolproxy/quota_classes", {})
    assert status == 403 and env["error"]["code"] == "forbidden"
    assert env["error"]["details"] == {"reason": "policy_error"}
    assert jwt_stack.backend.requests == []


async def test_a_quota_refusal_does_not_spend_an_approval(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin),
                              "quotas.subject": "rate=1/1m burst=1"}) as stack:
        headers = bearer(agent.token("alice"))
        approver = admin.token("bob", audience="toolproxy-admin", roles=["approver"], scope="")
        refund = {"order_id": "ord_1001", "amount": 9000, "reason": "damaged"}  # above acme's threshold
        _, env = await stack.call("refund_order", refund, headers={**headers, "Idempotency-Key": "r1"})
        approval_id = env["error"]["details"]["approval_id"]
        assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
        assert (await stack.call("get_order", ORDER, headers=headers))[0] == 200  # spends the budget
        with_approval = {**headers, "Idempotency-Key": "r1", "X-Approval-Id": approval_id}
        status, env = await stack.call("refund_order", refund, headers=with_approval)
        assert status == 429 and env["error"]["code"] == "rate_limited"
        _, view = await stack.admin("GET", f"/v1/approvals/{approval_id}", approver)
        assert view["status"] == "approved"  # still usable once the budget allows
        assert [r["tool"] for r in stack.backend.requests] == ["get_order"]


async def test_a_backend_retry_after_pauses_it_and_the_admin_view_shows_it(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin),
                              "quotas.tenant": "rate=100/1s concurrency=10"}) as stack:
        headers = bearer(agent.token("alice"))
        operator = admin.token("olga", audience="toolproxy-admin", roles=["operator"], scope="")
        await synced(stack)
        await stack.fault("get_order", "http_429", retry_after_s=2, count=1)
        status, env = await stack.call("get_order", ORDER, headers=headers)
        assert status == 429 and env["error"]["phase"] == "execute"  # the backend's own answer, unchanged
        status, env = await stack.call("get_order", ORDER, headers=headers)
        assert status == 429 and env["error"]["phase"] == "quota"
        assert env["error"]["details"]["limit"] == "backend:demo"
        assert env["error"]["details"]["reason"] == "backend_retry_after"
        assert 0 < env["error"]["details"]["retry_after_s"] <= 2
        assert len(stack.backend.requests) == 1

        status, view = await stack.admin("GET", "/v1/quotas", operator)
        assert status == 200
        assert view["limits"]["tenant"] == {"rate": 100, "period_ms": 1000, "burst": 100, "concurrency": 10,
                                            "on_redis_error": "auto"}
        assert view["limits"]["tools"]["get_orders"]["rate"] == 20  # the demo registry's example
        demo = next(b for b in view["backends"] if b["backend"] == "demo")
        assert demo["state"] == "paused" and demo["code"] == "rate_limited" and 0 < demo["retry_after_s"] <= 2
        assert demo["breaker"]["min_calls"] == 20
        assert (await stack.admin("GET", "/v1/quotas", agent.token("alice")))[0] == 401

        async def goes_through() -> bool:
            return (await stack.call("get_order", ORDER, headers=headers))[0] == 200
        await wait_until(goes_through, timeout=10, interval=0.1, what="the pause to end")
        assert len(stack.backend.requests) == 2  # nothing was sent while it lasted
