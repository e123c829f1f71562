"""Issue 4 acceptance across real processes: two ``toolproxy run`` sharing one Redis, and a proxy SIGKILLed
mid-call. Real OPA, real Redis, the demo backend in this process counting its side effects.

(The single-process acceptance cases — commit-then-drop, never received, conflicting arguments, no status
endpoint — are in tests/test_idempotency.py.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from proxy.idempotency import derive_key
from proxy.normalize import canonical_json, sha256_hex
from tests.support.proxyproc import ProxyProcess
from tests.support.stack import DEMO_REGISTRY, assert_envelope
from tests.support.waits import wait_until as wait_for
from tests.support.modes import all_redis_modes

REFUND = {"order_id": "ord_1002", "amount": 700, "reason": "charged twice"}


def proxy_settings(backend_url: str, proxy_deps: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**proxy_deps,
            "backends.services": {"demo": backend_url}, "registry.paths": [str(DEMO_REGISTRY)],
            "reconcile.scan_interval_ms": 100, "reconcile.backoff_initial_ms": 50,
            "reconcile.backoff_max_ms": 200, "idempotency.lease_grace_ms": 300,
            "opa.timeout_ms": 5000,  # fifty calls at once on two loaded cores: the decisions queue
            **extra}


async def call(session: aiohttp.ClientSession, proxy: ProxyProcess, headers: dict[str, str],
               arguments: dict[str, Any] = REFUND, call_id: str = "c") -> tuple[int, dict[str, Any]]:
    async with session.post(proxy.url + "/v1/tool-calls", headers=headers,
                            json={"call_id": call_id, "tool": "refund_order", "arguments": arguments}) as response:
        body = await response.json()
    assert_envelope(body)
    return response.status, body


def operation_key(header_key: str, arguments: dict[str, Any] = REFUND) -> str:
    return derive_key(tenant="acme", subject="dev-user", tool="refund_order", tool_version="1.0.0",
                      args_hash=sha256_hex(canonical_json(arguments)), idempotency_key=header_key, run_id=None).key


async def operation(session, proxy: ProxyProcess, key: str) -> tuple[int, dict[str, Any]]:
    async with session.get(f"{proxy.url}/v1/operations/{key}") as response:
        return response.status, await response.json()


@all_redis_modes
async def test_fifty_concurrent_duplicates_through_two_proxies_make_one_effect(demo_backend, http_session, proxy_deps):
    backend_url, state = demo_backend
    session = http_session
    proxies = [ProxyProcess(proxy_settings(backend_url, proxy_deps)).start() for _ in range(2)]
    try:
        await asyncio.gather(*(p.ready() for p in proxies))
        async with session.post(backend_url + "/_control/faults",
                                json={"tool": "refund_order", "mode": "slow", "delay_ms": 300, "count": 1}) as r:
            assert r.status == 200
        key = {"Idempotency-Key": "refund-ord_1002-once"}
        # Half of the callers ask to wait for a running duplicate (Prefer: wait), half poll.
        results = await asyncio.gather(*(
            call(session, proxies[i % 2], {**key, **({"Prefer": "wait=10"} if i % 4 < 2 else {})}, call_id=f"c{i}")
            for i in range(50)))
        succeeded = [env for status, env in results if status == 200]
        busy = [env for status, env in results if status == 409]
        assert len(succeeded) + len(busy) == 50, [(status, env["error"]) for status, env in results
                                                  if status not in (200, 409)]
        assert {env["error"]["code"] for env in busy} <= {"operation_in_progress"}
        assert len({env["data"]["refund_id"] for env in succeeded}) == 1
        assert sum(1 for env in succeeded if not env.get("replayed")) == 1  # exactly one caller ran it
        assert len(succeeded) >= 25  # every waiting caller got the result
        assert state.effect_counts()["refund_order"] == 1
        assert [r["tool"] for r in state.requests] == ["refund_order"]
        status, again = await call(session, proxies[1], key)
        assert status == 200 and again["replayed"] is True and again["data"] == succeeded[0]["data"]
        assert state.effect_counts()["refund_order"] == 1
    finally:
        for proxy in proxies:
            proxy.stop()


@pytest.mark.parametrize("fault, settles_as", [
    ("stall", "FAILED_RETRYABLE"),  # the backend never applied it: the same key runs again, once
    ("slow", "SUCCEEDED"),          # the backend committed after the proxy died: the original result
])
async def test_proxy_killed_mid_call_becomes_unknown_and_is_reconciled(demo_backend, http_session, proxy_deps, fault,
                                                                       settles_as):
    backend_url, state = demo_backend
    session = http_session
    settings = proxy_settings(backend_url, proxy_deps)
    async with session.post(backend_url + "/_control/faults",
                            json={"tool": "refund_order", "mode": fault, "delay_ms": 1500, "count": 1}) as r:
        assert r.status == 200
    header = f"refund-killed-{fault}"
    key = operation_key(header)
    first = ProxyProcess(settings).start()
    try:
        await first.ready()
        in_flight = asyncio.create_task(call(session, first, {"Idempotency-Key": header, "Request-Timeout": "1"}))
        await wait_for(lambda: state.requests, 10, "the call to reach the backend")
        first.kill()  # SIGKILL mid-call: nothing recorded, the record stays IN_PROGRESS with its lease
        with pytest.raises(aiohttp.ClientError):
            await in_flight
    finally:
        first.kill()

    restarted = ProxyProcess(settings).start()
    try:
        await restarted.ready()
        deadline = time.monotonic() + 15
        record: dict[str, Any] = {"state": "IN_PROGRESS"}
        retried_early = None  # a duplicate that arrived just after the reconciler settled the record
        while record["state"] != settles_as:
            assert time.monotonic() < deadline, f"still {record} after 15s\n{restarted.log()}"
            status, record = await operation(session, restarted, key)
            assert status == 200, record
            if record["state"] == "UNKNOWN":
                # Never re-executed while UNKNOWN: a duplicate is told to reconcile. The reconciler
                # may settle the record between our read and the duplicate; then the duplicate
                # gets what the settled state allows (a replay, or one same-key retry).
                status, env = await call(session, restarted, {"Idempotency-Key": header})
                if env["error"] is None:
                    status, record = await operation(session, restarted, key)
                    if settles_as == "FAILED_RETRYABLE":
                        retried_early = env
                        break
                    assert env["replayed"] is True, env
                else:
                    assert env["error"]["code"] in ("operation_unknown", "operation_in_progress"), env
            await asyncio.sleep(0.02)
        assert record["reconciliation"]["unknown_since"] is not None  # it went through UNKNOWN
        if retried_early is None:
            assert record["evidence"]["source"] == "status_endpoint"
            assert [r["tool"] for r in state.requests] == ["refund_order"]  # nothing re-sent by the proxy
            status, env = await call(session, restarted, {"Idempotency-Key": header})
        else:
            status, env = 200, retried_early
        assert status == 200, env
        if settles_as == "SUCCEEDED":
            assert env["replayed"] is True
            assert env["data"] == record["result"]
            assert env["data"]["refund_id"] == state.idempotency[("refund_order", key)]["body"]["refund_id"]
        else:
            assert "replayed" not in env and len(state.requests) == 2
        assert state.effect_counts()["refund_order"] == 1  # zero duplicates
    finally:
        restarted.stop()
