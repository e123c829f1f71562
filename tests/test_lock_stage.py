"""The lock stage inside the pipeline: real proxies, real Redis, real demo backend over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp
import pytest

from proxy.deadline import Deadline
from proxy.normalize import normalize
from proxy.pipeline import RequestMeta, ToolCallRequest
from proxy.telemetry.tracing import accept_traceparent
from tests.support.calltokens import session_keys
from tests.support.stack import extra_tools, running_stack
from tests.support.waits import wait_until
from tests.support.modes import all_redis_modes

FAST_LEASE = {"locks.lease_ms": 400, "locks.renew_interval_ms": 100}


def refs(stack, tool: str, arguments: dict):
    return normalize(stack.runtime.registry.resolve(tool), arguments).resources


def requests_for(stack, call_id: str) -> list[dict]:
    return [r for r in stack.backend.requests if r["headers"].get("X-Call-Id") == call_id]


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack(proxy_deps) as s:
        yield s


@pytest.fixture
def redis(state_client):
    return state_client


@all_redis_modes
async def test_write_forwards_increasing_fencing_tokens_and_leaves_no_lock(stack, redis):
    for n in (1, 2):
        status, env = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1}, call_id=f"w{n}")
        assert env["outcome"] == "succeeded", env
        assert "lock" in env["timing"]["stages_ms"]
    tokens = [int(requests_for(stack, f"w{n}")[0]["headers"]["X-Fencing-Token"]) for n in (1, 2)]
    assert tokens[0] < tokens[1]
    assert stack.backend.fencing["counter:ctr_demo"] == tokens[1]
    assert await redis.keys("toolproxy:lock:*") == []  # released after the call


async def test_a_read_that_declares_a_resource_forwards_the_newest_token(stack):
    """Read-modify-write backends fence their reads: a shared holder gets the newest token issued so
    far (no newer write can start while it holds the resource); a read without a lock gets none."""
    await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1}, call_id="w1")
    await stack.call("get_inventory", {"sku": "sku_widget"}, call_id="shared_read")  # access: shared
    await stack.call("get_order", {"order_id": "ord_1001"}, call_id="unlocked_read")  # access: none
    await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1}, call_id="w2")
    token = {call_id: int(requests_for(stack, call_id)[0]["headers"]["X-Fencing-Token"])
             for call_id in ("w1", "shared_read", "w2")}
    assert token["w1"] <= token["shared_read"] < token["w2"]
    assert "X-Fencing-Token" not in requests_for(stack, "unlocked_read")[0]["headers"]


@all_redis_modes
async def test_busy_resource_is_resource_busy_within_the_deadline_and_nothing_is_sent(stack):
    locks = stack.runtime.pipeline._locks  # another holder (as another replica would be)
    held = await locks.acquire(refs(stack, "adjust_counter", {"counter": "ctr_demo", "delta": 1}),
                               tenant="acme", tool="adjust_counter", is_write=True,
                               deadline=Deadline(time.monotonic() + 1))
    try:
        started = time.monotonic()
        status, env = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1}, call_id="busy",
                                       headers={"Request-Timeout": "0.3"})
        waited = time.monotonic() - started
    finally:
        await held.release()
    assert status == 409
    assert env["outcome"] == "failed" and env["error"]["code"] == "resource_busy"
    assert env["error"]["retryable"] is True and env["error"]["phase"] == "lock"
    assert env["error"]["details"]["resources"] == ["counter:ctr_demo"]
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert 0.2 <= waited < 2.0
    assert requests_for(stack, "busy") == []
    sample = stack.runtime.metrics.registry.get_sample_value("toolproxy_lock_timeouts_total",
                                                             {"tool": "adjust_counter"})
    assert sample == 1


async def test_lock_lost_mid_write_is_unknown_with_reconcile(proxy_deps, redis):
    async with running_stack({**proxy_deps, **FAST_LEASE}) as stack:
        await stack.fault("adjust_counter", "slow", delay_ms=1500, count=1)
        call = asyncio.create_task(stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 5},
                                              call_id="loser", headers={"Request-Timeout": "5"}))
        await wait_until(lambda: requests_for(stack, "loser"), what="the write to reach the backend")
        # The lease disappears under the holder (as when it expired during a stall and was taken over).
        await redis.delete("toolproxy:lock:{acme}:counter:ctr_demo")
        status, env = await asyncio.wait_for(call, 5)
    assert env["outcome"] == "unknown", env
    assert env["error"]["code"] == "lock_lost"
    assert env["error"]["resolution"] == "reconcile" and env["error"]["retryable"] is False
    assert env["side_effect"] == {"attempted": True, "committed": None}
    assert env["error"]["details"]["resources"] == ["counter:ctr_demo"]
    lost = stack.runtime.metrics.registry.get_sample_value("toolproxy_lock_lost_total", {"tool": "adjust_counter"})
    assert lost == 1


async def test_cancelled_call_releases_its_lock(stack, redis):
    await stack.fault("adjust_counter", "slow", delay_ms=3000, count=1)
    meta = RequestMeta(request_id="r1", trace=accept_traceparent(None), deadline=Deadline(time.monotonic() + 10),
                       idempotency_key=f"cancel-{uuid.uuid4().hex}")
    caller = await stack.runtime.authenticator.authenticate({})
    task = asyncio.create_task(stack.runtime.pipeline.execute(
        ToolCallRequest(call_id="cancelme", tool="adjust_counter", version=None,
                        arguments={"counter": "ctr_demo", "delta": 1}, meta=meta), caller))
    await wait_until(lambda: requests_for(stack, "cancelme"), what="the call to reach the backend")
    assert await redis.exists("toolproxy:lock:{acme}:counter:ctr_demo") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The lock is released; the sent write's outcome is unknown, so its freeze mark stays (seed 004 §5).
    fields = await redis.hkeys("toolproxy:lock:{acme}:counter:ctr_demo")
    assert [f for f in fields if f.startswith(b"h:") or f.startswith(b"w:")] == []
    assert len(fields) == 1 and fields[0].startswith(b"u:ik_")


async def test_redis_down_fails_a_locked_write_before_sending(redis_server, proxy_deps):
    async with running_stack(proxy_deps) as stack:
        redis_server.stop()
        try:
            status, env = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1}, call_id="nored")
        finally:
            redis_server.start()
    assert status == 503
    # Every write has an operation record now (issue #12): the record, taken before the lock, fails first.
    assert env["error"]["code"] == "dependency_unavailable" and env["error"]["details"] == {"dependency": "state_store"}
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert requests_for(stack, "nored") == []


async def test_unprotected_read_modify_write_loses_updates(stack):
    """Control for the next test: the demo backend really races when nothing serializes it."""
    async with aiohttp.ClientSession() as session:
        async def bump(delta):  # signed as the proxy would: the backend admits nothing else
            body = json.dumps({"counter": "ctr_race", "delta": delta}).encode()
            headers = session_keys().headers_for("POST", "/tools/adjust_counter", body,
                                                 {"Content-Type": "application/json"})
            async with session.post(stack.backend_url + "/tools/adjust_counter", data=body,
                                    headers=headers) as response:
                assert response.status == 200
        await asyncio.gather(*(bump(d) for d in [10] * 20 + [20] * 20))
    assert stack.backend.counters["ctr_race"] != 600


async def test_two_proxies_apply_every_update_exactly(proxy_deps):
    """Lost update (seed 001 section 5.1): x += 10 and x += 20, 100 times each, through two proxies
    (two runtimes with their own Redis pools and HTTP sessions) sharing one Redis and one backend."""
    # 200 calls at once on a shared 2-core machine: generous dependency timeouts and lease, so the
    # test measures exactness, not how fast a loaded machine answers.
    settings = {**proxy_deps, "opa.timeout_ms": 10000, "redis.timeout_ms": 5000, "locks.lease_ms": 20000,
                "locks.renew_interval_ms": 2000}
    async with running_stack(settings) as a, running_stack(settings, share=a) as b:
        calls = [a.call("adjust_counter", {"counter": "ctr_race", "delta": 10}, call_id=f"a{i}",
                        headers={"Request-Timeout": "60"}) for i in range(100)]
        calls += [b.call("adjust_counter", {"counter": "ctr_race", "delta": 20}, call_id=f"b{i}",
                         headers={"Request-Timeout": "60"}) for i in range(100)]
        results = await asyncio.gather(*calls)
        failures = [env for _, env in results if env["outcome"] != "succeeded"]
        assert not failures, [(e["call_id"], e["error"]) for e in failures[:3]]
        assert a.backend.counters["ctr_race"] == 100 * 10 + 100 * 20
        intervals = sorted((iv.start, iv.end) for iv in a.backend.intervals if iv.tool == "adjust_counter")
        assert len(intervals) == 200
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(intervals, intervals[1:]))  # never overlapped
        tokens = [e["fencing_token"] for e in a.backend.effects]
        assert tokens == sorted(tokens) and len(set(tokens)) == 200  # applied in token order


async def test_backend_refusing_a_stale_token_is_lock_lost_not_applied(stack):
    stack.backend.fencing["counter:ctr_demo"] = 10**15  # a newer holder already wrote (token from the future)
    status, env = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1}, call_id="stale")
    assert env["outcome"] == "failed" and env["error"]["code"] == "lock_lost"
    assert env["side_effect"] == {"attempted": True, "committed": False}
    assert env["error"]["retryable"] is True and env["error"]["resolution"] == "retry_same_key"
    assert env["error"]["details"]["backend_code"] == "stale_fencing_token"
    assert stack.backend.counters["ctr_demo"] == 0


# reserve_inventory behind a 300 ms timeout: its idempotency reservation (timeout + grace) is short.
FAST_RESERVE = """
tools:
  - name: reserve_fast
    version: "1.0.0"
    description: reserve_inventory with a short timeout (lock waits longer than its reservation lease).
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [sku, quantity, order_id]
      properties:
        sku: {type: string, pattern: "^sku_[A-Za-z0-9]+$"}
        quantity: {type: integer, minimum: 1, maximum: 1000}
        order_id: {type: string, pattern: "^ord_[A-Za-z0-9]+$"}
    outputSchema: {type: object}
    resources: [{template: "inventory:{sku}", access: exclusive}]
    idempotency: {required: true}
    timeout_ms: 300
    strict: true
    backend: {type: http, service: demo, path: /tools/reserve_inventory}
"""


async def test_a_long_lock_wait_keeps_the_idempotency_reservation_alive(proxy_deps, tmp_path):
    settings = {**proxy_deps, **extra_tools(tmp_path, FAST_RESERVE), "idempotency.lease_grace_ms": 200,
                "reconcile.scan_interval_ms": 100}  # an expired reservation is found at once
    async with running_stack(settings) as stack:
        arguments = {"sku": "sku_widget", "quantity": 1, "order_id": "ord_1001"}
        held = await stack.runtime.pipeline._locks.acquire(
            refs(stack, "reserve_fast", arguments), tenant="acme", tool="reserve_fast", is_write=True,
            deadline=Deadline(time.monotonic() + 1))
        call = asyncio.create_task(stack.call("reserve_fast", arguments, call_id="patient",
                                              headers={"Idempotency-Key": "k-patient", "Request-Timeout": "10"}))
        await asyncio.sleep(1.5)  # the other holder works for three reservation leases (0.5 s each)
        await held.release()
        status, env = await asyncio.wait_for(call, 10)
    assert env["outcome"] == "succeeded", env["error"]
    assert env["timing"]["stages_ms"]["lock"] >= 1400
    assert stack.backend.inventory["sku_widget"]["reserved"] == 1
