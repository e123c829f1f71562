"""Issue 17 acceptance across real processes: two ``toolproxy run`` sharing one Redis and one OPA, the demo
backend in this process counting and timing what reaches it. Expectations come from the limiter's own math
(GCRA: at most ``burst + elapsed * rate`` admissions, elapsed on Redis's clock), with the issue's ±1.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp
import pytest
import redis as redis_sync

from tests.support.mesh import mesh_headers, mesh_settings
from tests.support.proxyproc import ProxyProcess
from tests.support.calltokens import session_keys
from tests.support.stack import DEMO_REGISTRY, passthrough_read
from tests.support.waits import wait_until

FLEET_TOOLS = """
services:
  flaky:
    breaker: {failure_ratio: 0.5, min_calls: 6, window_s: 120, open_s: 1}
tools:""" + passthrough_read("pooled_inventory", "/tools/get_inventory", "sku", "quotas: {concurrency: 2}") \
    + passthrough_read("flaky_inventory", "/tools/get_inventory", "sku", service="flaky")

# A rate the 2-core machine saturates even when other work runs; a burst of 3 keeps a late request (the
# load's own jitter) from costing allowance, so the lower bound holds too.
RATE, BURST, LOAD_S = 2, 3, 5.0
IDENTITY = {"acme": ("alice", {"order_id": "ord_1001"}), "globex": ("gina", {"order_id": "ord_2001"})}


@pytest.fixture
async def fleet(demo_backend, proxy_deps, tmp_path):
    url, state = demo_backend
    extra = tmp_path / "fleet-tools.yaml"
    extra.write_text(FLEET_TOOLS)
    state.aliases.update({"pooled_inventory": "get_inventory", "flaky_inventory": "get_inventory"})
    settings = {"redis.url": proxy_deps["redis.url"], "opa.url": proxy_deps["opa.url"], "opa.token_file": proxy_deps["opa.token_file"],
                **session_keys().settings(), "call_tokens.audiences": {"flaky": "demo"},  # one backend, two names
                "backends.services": {"demo": url, "flaky": url}, "registry.paths": [str(DEMO_REGISTRY), str(extra)],
                "reconcile.enabled": False, **mesh_settings(tmp_path),
                "opa.timeout_ms": 5000,  # 2 loaded cores
                "quotas.tenants": {"acme": f"rate={RATE}/1s burst={BURST}"}}
    proxies = [ProxyProcess(settings).start() for _ in range(2)]
    try:
        await asyncio.gather(*(p.ready() for p in proxies))
        async with aiohttp.ClientSession() as session:
            yield proxies, session, state, proxy_deps["redis.url"]
    finally:
        for p in proxies:
            p.stop()


async def call(session: aiohttp.ClientSession, proxy: ProxyProcess, tool: str, arguments: dict[str, Any],
               tenant: str = "acme") -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = mesh_headers(IDENTITY[tenant][0], tenant)
    async with session.post(proxy.url + "/v1/tool-calls", headers=headers,
                            json={"call_id": f"{tenant}-call", "tool": tool, "arguments": arguments}) as response:
        return response.status, await response.json(), dict(response.headers)


def redis_now(url: str) -> float:
    client = redis_sync.Redis.from_url(url)
    try:
        seconds, micros = client.time()
    finally:
        client.close()
    return seconds + micros / 1e6


async def test_a_tenant_rate_limit_holds_across_two_proxies_and_spares_other_tenants(fleet):
    proxies, session, state, redis_url = fleet
    refusals: list[tuple[dict[str, Any], dict[str, str]]] = []
    globex_sent = acme_sent = 0

    async def load(proxy: ProxyProcess, tenant: str, until: float) -> None:
        nonlocal globex_sent, acme_sent
        while time.monotonic() < until:
            status, env, headers = await call(session, proxy, "get_order", IDENTITY[tenant][1], tenant)
            if tenant == "globex":
                globex_sent += 1
                assert status == 200, env["error"]
            else:
                acme_sent += 1
                if status != 200:
                    refusals.append((env, headers))

    async def load_ends(until: float) -> float:
        await asyncio.sleep(until - time.monotonic())
        return redis_now(redis_url)

    started, started_mono = redis_now(redis_url), time.monotonic()
    until = time.monotonic() + LOAD_S
    stopped, *_ = await asyncio.gather(load_ends(until), *(load(p, "acme", until) for p in proxies for _ in range(6)),
                                       *(load(p, "globex", until) for p in proxies))
    finished = redis_now(redis_url)  # the last calls sent before `until` may be admitted up to here

    acme_at_backend = [i.start for i in state.intervals if i.call_id == "acme-call"]
    admitted = len(acme_at_backend)
    # GCRA admits at most burst + rate * elapsed over a window, and — the load never pausing — at least that
    # many from the first admission to the end of the load (the limiter's clock, Redis TIME; the first
    # admission is placed no earlier than its arrival at the backend, which only lowers the bound).
    first_admitted = started + (min(acme_at_backend) - started_mono)
    at_most = BURST + math.floor((finished - started) * RATE)
    at_least = BURST + math.floor((stopped - first_admitted) * RATE)
    assert at_least - 1 <= admitted <= at_most + 1, (admitted, at_least, at_most, acme_sent)
    assert refusals, "the load never exceeded the limit"
    for env, headers in refusals:
        assert env["error"]["code"] == "rate_limited" and env["error"]["details"]["limit"] == "tenant"
        assert 0 < env["error"]["details"]["retry_after_s"] <= 1 / RATE + 0.001
        assert headers["Retry-After"] == "1"
    globex_seen = sum(1 for r in state.requests if r["headers"].get("X-Toolproxy-Tenant") == "globex")
    assert globex_seen == globex_sent > 0


async def test_a_tool_concurrency_quota_holds_across_two_proxies(fleet):
    proxies, session, state, _ = fleet
    state.latency_ms = (20, 60)
    outcomes: list[int] = []

    async def load(proxy: ProxyProcess) -> None:
        for _ in range(6):
            status, env, _ = await call(session, proxy, "pooled_inventory", {"sku": "sku_widget"}, "globex")
            assert status in (200, 429), env
            outcomes.append(status)

    await asyncio.gather(*(load(p) for p in proxies for _ in range(4)))
    spans = [(i.start, i.end) for i in state.intervals if i.tool == "get_inventory"]
    assert len(spans) == outcomes.count(200) > 0
    assert outcomes.count(429) > 0  # the load did contend for the two slots
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])  # ends sort first
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak <= 2


async def test_a_backend_retry_after_stops_both_proxies_for_that_long(fleet):
    proxies, session, state, _ = fleet
    state.faults.clear()
    from examples.demo_backend import Fault
    state.faults.append(Fault(tool="get_order", mode="http_429", count=1, retry_after_s=2))
    first, second = proxies
    status, env, _ = await call(session, first, "get_order", IDENTITY["globex"][1], "globex")
    assert status == 429 and env["error"]["phase"] == "execute"
    answered_429 = state.intervals[-1].end

    async def refused_by_both() -> None:
        for proxy in (second, first):
            status, env, headers = await call(session, proxy, "get_order", IDENTITY["globex"][1], "globex")
            if status == 200:
                return
            assert status == 429 and env["error"]["details"]["limit"] == "backend:demo", env
            assert env["error"]["phase"] == "quota" and int(headers["Retry-After"]) <= 2

    async def served() -> bool:
        await refused_by_both()
        return len(state.requests) > 1

    await wait_until(served, timeout=15, interval=0.05, what="the backend's pause to end")
    later = [i.start for i in state.intervals if i.start > answered_429]
    assert later and min(later) >= answered_429 + 2.0  # nothing reached it for the 2 s it asked for


async def test_a_half_failing_backend_trips_the_breaker_and_a_probe_closes_it(fleet):
    proxies, session, state, _ = fleet
    from examples.demo_backend import Fault
    state.faults.append(Fault(tool="get_inventory", mode="http_500", every=2))  # every other call fails
    first, second = proxies
    codes = []
    for _ in range(6):  # min_calls 6, ratio 0.5: the sixth outcome opens the breaker
        status, env, _ = await call(session, first, "flaky_inventory", {"sku": "sku_widget"}, "globex")
        codes.append(env["error"]["code"] if env["error"] else "ok")
    assert codes == ["ok", "upstream_error"] * 3
    for proxy in (first, second):
        status, env, headers = await call(session, proxy, "flaky_inventory", {"sku": "sku_widget"}, "globex")
        assert status == 503 and env["error"]["code"] == "dependency_unavailable", env
        assert env["error"]["details"]["reason"] == "breaker_open" and env["error"]["phase"] == "quota"
        assert env["error"]["details"]["limit"] == "backend:flaky" and "Retry-After" in headers
    assert len(state.requests) == 6

    state.faults.clear()  # the backend recovers

    async def closed_on(proxy: ProxyProcess) -> bool:
        status, env, _ = await call(session, proxy, "flaky_inventory", {"sku": "sku_widget"}, "globex")
        assert status in (200, 503), env
        return status == 200

    await wait_until(lambda: closed_on(second), timeout=15, interval=0.05, what="a probe to close the breaker")
    assert len(state.requests) == 7  # exactly one probe reached the backend
    await wait_until(lambda: closed_on(first), timeout=5, interval=0.02, what="the other proxy to see it closed")
    assert len(state.requests) == 8
