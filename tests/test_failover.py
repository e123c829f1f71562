"""Failover with zero duplicate effects: Sentinel and Redis Cluster, a master SIGKILLed mid-load.

Two real ``toolproxy run`` processes share one topology (tests/support/topologies.py) and one demo
backend. 200 writes with unique operation keys across four tenants, plus same-key duplicates sent
through the other proxy at the same time, run as an agent would: a failure that says "retry"
(``retryable``) is retried with the same Idempotency-Key. When a third of them are done, the master
holding the most operation records is SIGKILLed; a replica is promoted (Sentinel or Cluster
failover) while the load goes on. Afterwards:

* no operation key has more than one effect at the backend, nor was it sent more than once;
* every call ended ``succeeded``, ``failed`` with a catalogued code (never ``internal_error``), or
  ``unknown`` that converges (SUCCEEDED / FAILED_* / NEEDS_TAKEOVER) within the reconcile window;
  every record agrees with the backend (SUCCEEDED <=> one effect);
* no lock outlives its lease (every lock key is gone within ``locks.lease_ms``);
* per tenant, every fencing token issued after the promotion is greater than all issued before the kill.

The counts are printed (``-s``) for the issue's closing note.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

import aiohttp
import pytest

from examples.demo_backend import start_demo_backend
from tests.support.calltokens import session_keys
from proxy.idempotency import derive_key
from proxy.normalize import canonical_json, sha256_hex
from proxy.operations import record_keys
from tests.support.mesh import mesh_headers, mesh_settings
from tests.support.proxyproc import ProxyProcess
from tests.support.stack import UNLOCKED_COUNTER, assert_envelope, extra_tools
from tests.support.waits import wait_until

OPERATIONS = 200
DUPLICATE_EVERY = 4       # every 4th operation is also sent, at the same time, through the other proxy
CONCURRENCY = 12
LOCK_LEASE_MS = 2000
RECONCILE_WINDOW_MS = 20000
RETRY_FOR_S = 40.0        # how long the "agent" keeps retrying a retryable failure with the same key
SETTLED = {"SUCCEEDED", "FAILED_RETRYABLE", "FAILED_FINAL", "NEEDS_TAKEOVER"}
TOOL = "fleet_counter"
# adjust_counter's backend (locked per counter, fenced) with a status endpoint, so an unknown outcome is
# reconciled from the backend's own record rather than handed to a human.
FLEET_COUNTER = UNLOCKED_COUNTER.replace("name: bump_counter", "name: fleet_counter").replace(
    "without resource locks (tests of stages that run before the lock)", "locked, fenced, with a status endpoint"
) + """    resources: [{template: "counter:{counter}", access: exclusive}]
    status_endpoint: {service: demo, path: /status/adjust_counter}
"""


def tenants_spread(group) -> list[str]:
    """Four tenants whose lock domains (hash tag = tenant) cover every master, so whichever master is
    killed holds some tenant's fencing counter."""
    if group.mode != "cluster":
        return ["tenanta", "tenantb", "tenantc", "tenantd"]
    owners: dict[int, list[str]] = collections.defaultdict(list)
    for n in range(200):
        name = f"tenant{n}"
        owners[group.master_of(f"{{{name}}}").port].append(name)
        if len(owners) == group.masters and sum(min(len(v), 2) for v in owners.values()) >= 4:
            break
    picked = [names[0] for names in owners.values()]
    extra = [name for names in owners.values() for name in names[1:]]
    return (picked + extra)[:4]


def operation_key(tenant: str, n: int, arguments: dict[str, Any]) -> str:
    return derive_key(tenant=tenant, subject="agent-1", tool=TOOL, tool_version="1.0.0",
                      args_hash=sha256_hex(canonical_json(arguments)), idempotency_key=f"op-{n}", run_id=None).key


def headers(tenant: str, n: int) -> dict[str, str]:
    return mesh_headers("agent-1", tenant, **{"Idempotency-Key": f"op-{n}", "Prefer": "wait=5"})


async def call_until_settled(session: aiohttp.ClientSession, proxy: ProxyProcess, tenant: str, n: int,
                             arguments: dict[str, Any], log: list[dict[str, Any]]) -> dict[str, Any]:
    """One agent's call: retried with the same key while the answer says retry (bounded)."""
    until = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            async with session.post(proxy.url + "/v1/tool-calls", headers=headers(tenant, n),
                                    json={"call_id": f"c{n}", "tool": TOOL, "arguments": arguments},
                                    timeout=aiohttp.ClientTimeout(total=30)) as response:
                status, env = response.status, await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status, env = 0, None
        if env is not None:
            assert_envelope(env)
            log.append({"n": n, "status": status, "outcome": env["outcome"],
                        "code": (env["error"] or {}).get("code")})
            error = env["error"] or {}
            if not error.get("retryable") or time.monotonic() >= until:
                return env
        await asyncio.sleep(0.1)


async def final_state(session: aiohttp.ClientSession, proxy: ProxyProcess, tenant: str, key: str) -> str:
    async with session.get(f"{proxy.url}/v1/operations/{key}", headers=headers(tenant, 0)) as response:
        body = await response.json()
    if response.status == 404:
        return "ABSENT"
    return body["state"] if response.status == 200 else f"http_{response.status}"


@pytest.fixture(params=["sentinel", "cluster"])
def topology(request):
    group = request.getfixturevalue("redis_cluster" if request.param == "cluster" else "redis_sentinel")
    group.restore()
    group.flushall()
    yield group
    group.restore()


async def test_master_killed_mid_load_leaves_no_duplicate_effect(topology, opa_server, tmp_path):
    if not opa_server.running:
        opa_server.start()
    group = topology
    runner, backend_url, backend = await start_demo_backend(keys=session_keys().jwks)
    backend.aliases["fleet_counter"] = "adjust_counter"  # its call tokens name the contract, on that route
    backend.latency_ms = (5, 30)  # keeps calls in flight when the master dies
    settings = {**group.overrides(), **opa_server.settings, **mesh_settings(tmp_path),
                "backends.services": {"demo": backend_url}, **extra_tools(tmp_path, FLEET_COUNTER), **session_keys().settings(),
                "redis.timeout_ms": 1000, "opa.timeout_ms": 5000,
                "locks.lease_ms": LOCK_LEASE_MS, "locks.renew_interval_ms": 500,
                "idempotency.lease_grace_ms": 1000, "reconcile.scan_interval_ms": 200,
                "reconcile.backoff_initial_ms": 100, "reconcile.backoff_max_ms": 500,
                "reconcile.window_ms": RECONCILE_WINDOW_MS, "log.level": "warning"}
    proxies = [ProxyProcess(settings).start() for _ in range(2)]
    try:
        await asyncio.gather(*(p.ready() for p in proxies))
        tenants = tenants_spread(group)
        ops = []
        for n in range(OPERATIONS):
            tenant = tenants[n % len(tenants)]
            arguments = {"counter": f"ctr_{tenant}_{n % 5}", "delta": 1}
            ops.append((n, tenant, arguments, operation_key(tenant, n, arguments)))
        # The master holding the most operation records (Sentinel: the one master).
        by_master = collections.Counter(group.master_of(record_keys("toolproxy", key)[0]).port
                                        for *_, key in ops)
        victim_port = by_master.most_common(1)[0][0]
        victim = next(node for node in group.nodes if node.port == victim_port)

        log: list[dict[str, Any]] = []
        done = 0
        killed_at = promoted_at = 0.0
        gate = asyncio.Semaphore(CONCURRENCY)
        async with aiohttp.ClientSession() as session:
            async def one(n, tenant, arguments, proxy):
                nonlocal done
                async with gate:
                    env = await call_until_settled(session, proxy, tenant, n, arguments, log)
                done += 1
                return env

            async def killer():
                nonlocal killed_at, promoted_at
                await wait_until(lambda: done >= OPERATIONS // 3, timeout=120, what="a third of the load")
                killed_at = time.time()
                group.kill_master(victim)
                await asyncio.to_thread(group.wait_promoted)
                promoted_at = time.time()

            calls = []
            for n, tenant, arguments, _ in ops:
                calls.append(one(n, tenant, arguments, proxies[n % 2]))
                if n % DUPLICATE_EVERY == 0:
                    calls.append(one(n, tenant, arguments, proxies[(n + 1) % 2]))
            results, _ = await asyncio.gather(asyncio.gather(*calls), killer())

            # Every record settles within the reconcile window (unknowns converge or become takeovers).
            states: dict[str, str] = {}

            async def settled() -> bool:
                for n, tenant, _, key in ops:
                    if states.get(key) not in SETTLED:
                        states[key] = await final_state(session, proxies[0], tenant, key)
                return all(state in SETTLED or state == "ABSENT" for state in states.values())
            await wait_until(settled, timeout=RECONCILE_WINDOW_MS / 1000 + 15, what="every record settled",
                             interval=0.2)
            async with session.get(f"http://127.0.0.1:{proxies[0].ops_port}/readyz") as response:
                assert response.status == 200  # ready again: the promoted master answers

        # Zero duplicate effects, and no operation sent twice.
        effects = collections.Counter(e["idempotency_key"] for e in backend.effects)
        sends = collections.Counter(r["headers"].get("Idempotency-Key") for r in backend.requests
                                    if r["tool"] == "adjust_counter")
        assert max(effects.values()) == 1, [k for k, c in effects.items() if c > 1]
        # Outcomes: succeeded, failed with a catalogued code, or unknown (converged above).
        outcomes = collections.Counter(env["outcome"] for env in results)
        codes = collections.Counter((env["error"] or {}).get("code") for env in results if env["error"])
        assert "internal_error" not in codes and set(outcomes) <= {"succeeded", "failed", "unknown"}
        # Records agree with the backend.
        final = collections.Counter(states.values())
        for n, tenant, _, key in ops:
            assert (states[key] == "SUCCEEDED") == (effects[key] == 1), (n, key, states[key], effects[key])
        # No lock outlives its lease.
        def no_locks() -> bool:
            return all(not node.client().keys("toolproxy:lock:*") for node in group.nodes
                       if node.running and node.client().info("replication")["role"] == "master")
        await wait_until(no_locks, timeout=LOCK_LEASE_MS / 1000 + 5, what="every lock expired or released")
        # Fencing tokens after the promotion exceed every token issued before the kill, per tenant domain.
        before: dict[str, int] = {}
        after: dict[str, int] = {}
        for effect in backend.effects:
            tenant = effect["args"]["counter"].split("_")[1]
            token = int(effect["fencing_token"])
            if effect["time"] < killed_at:
                before[tenant] = max(before.get(tenant, 0), token)
            elif effect["time"] > promoted_at:
                after[tenant] = min(after.get(tenant, token), token)
        compared = [t for t in after if t in before]
        assert compared, (before, after)
        assert all(after[t] > before[t] for t in compared), (before, after)
        report = {"mode": group.mode, "operations": OPERATIONS, "requests": len(calls),
                  "attempts": len(log), "outcomes": dict(outcomes), "codes": dict(codes),
                  "attempt_codes": dict(collections.Counter(entry["code"] or "none" for entry in log)),
                  "final_states": dict(final), "effects": sum(effects.values()),
                  "max_effects_per_key": max(effects.values()), "max_sends_per_key": max(sends.values()),
                  "keys_sent_twice": sum(1 for c in sends.values() if c > 1),
                  "killed_master_records": by_master[victim_port], "tenants_fenced": len(compared),
                  "failover_s": round(promoted_at - killed_at, 2)}
        print("FAILOVER REPORT " + json.dumps(report, sort_keys=True))
        assert max(sends.values()) == 1, report
    finally:
        for proxy in proxies:
            proxy.stop()
        await runner.cleanup()
