"""SIGTERM drains a real ``toolproxy run``: 50 writes in flight against a slow backend, then SIGTERM.

On SIGTERM the process takes no new call (``shutting_down``, retryable with the same key; readiness fails at
once), lets the calls in flight finish for ``shutdown.drain_timeout_ms``, then cuts the rest: each is still
answered with an envelope, and its outcome recorded (``shutdown_unknown`` and an UNKNOWN record for a write
whose request had left). It releases every lock it holds (an unknown write leaves its freeze mark: the
resource waits for reconciliation, not for a holder) and exits 0. Afterwards Redis holds no record in
IN_PROGRESS and no lock holder.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp
import redis.asyncio as redis_async

from proxy.operations import record_keys
from tests.support.proxyproc import ProxyProcess
from tests.support.records import read_fields
from tests.support.stack import UNLOCKED_COUNTER, extra_tools
from tests.support.waits import wait_until

CALLS = 50
# adjust_counter's backend behind a write contract that locks its counter and whose timeout outlives the test's
# slow backend.
DRAIN_COUNTER = UNLOCKED_COUNTER.replace("name: bump_counter", "name: drain_counter").replace(
    "    timeout_ms: 3000", '    resources: [{template: "counter:{counter}", access: exclusive}]\n    timeout_ms: 60000')
assert "drain_counter" in DRAIN_COUNTER and "timeout_ms: 60000" in DRAIN_COUNTER


async def write(session: aiohttp.ClientSession, proxy: ProxyProcess, n: int) -> tuple[int, dict[str, Any]]:
    body = {"call_id": f"drain-{n}", "tool": "drain_counter", "arguments": {"counter": f"ctr_drain_{n}", "delta": 1}}
    async with session.post(proxy.url + "/v1/tool-calls", json=body,
                            headers={"Idempotency-Key": f"drain-{n}"}) as answer:
        return answer.status, await answer.json()


async def readiness(session: aiohttp.ClientSession, proxy: ProxyProcess) -> int:
    try:
        async with session.get(f"http://127.0.0.1:{proxy.ops_port}/readyz") as answer:
            return answer.status
    except aiohttp.ClientError:
        return 0


async def test_sigterm_answers_and_records_every_call_in_flight_releases_its_locks_and_exits_0(
        demo_backend, proxy_deps, tmp_path):
    backend_url, state = demo_backend
    state.aliases["drain_counter"] = "adjust_counter"
    state.latency_ms = (1500, 6000)  # some finish within the budget, the rest are cut
    proxy = ProxyProcess({**proxy_deps, **extra_tools(tmp_path, DRAIN_COUNTER), "backends.services": {"demo": backend_url},
                          "reconcile.enabled": False, "opa.timeout_ms": 5000, "shutdown.drain_timeout_ms": 3000})
    proxy.stop_grace_s = 60.0
    proxy.start()
    try:
        await proxy.ready()
        async with aiohttp.ClientSession() as session:
            calls = [asyncio.create_task(write(session, proxy, n)) for n in range(CALLS)]
            await wait_until(lambda: len(state.requests) == CALLS, 60, "every write at the backend")
            assert proxy.proc is not None
            proxy.proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: readiness(session, proxy), 10, "readiness answered")
            await wait_until(lambda: _is(readiness(session, proxy), 503), 10, "readiness failing")
            refused_status, refused = await write(session, proxy, CALLS)  # a new call while draining
            answers = await asyncio.gather(*calls)
        exit_code = await asyncio.to_thread(proxy.proc.wait, 60)
    finally:
        proxy.stop()
    log = proxy.log(limit=200_000)
    assert exit_code == 0, log
    assert refused_status == 503 and refused["error"]["code"] == "shutting_down", refused
    assert refused["error"]["retryable"] is True and refused["error"]["resolution"] == "retry_same_key"

    outcomes: dict[str, int] = {}
    client = redis_async.from_url(proxy_deps["redis.url"])
    try:
        for status, envelope in answers:  # every call answered with an envelope, recorded as its answer says
            code = (envelope.get("error") or {}).get("code", "succeeded")
            outcomes[code] = outcomes.get(code, 0) + 1
            name = record_keys("toolproxy", envelope["idempotency_key"])[0]
            stored = await client.get(name)
            recorded = (await read_fields(client, name))["state"] if stored is not None else None
            expected = {"succeeded": "SUCCEEDED", "shutdown_unknown": "UNKNOWN", "shutting_down": None}[code]
            assert recorded == expected, (code, recorded, envelope)
            if code == "shutdown_unknown":
                assert envelope["outcome"] == "unknown" and envelope["side_effect"]["committed"] is None
                assert envelope["error"]["resolution"] == "reconcile"
        states = [(await read_fields(client, key))["state"] async for key in client.scan_iter("toolproxy:op:*")
                  if await client.type(key) == b"string"]
        holders = freezes = 0
        async for key in client.scan_iter("toolproxy:lock:*"):
            fields = [f.decode() for f in await client.hkeys(key)]
            holders += sum(not f.startswith("u:") for f in fields)
            freezes += sum(f.startswith("u:") for f in fields)
    finally:
        await client.aclose()
    print(f"\ndrain figures: {CALLS} writes in flight at SIGTERM; answered {sum(outcomes.values())} "
          f"({outcomes}); records {len(states)} ({ {s: states.count(s) for s in set(states)} }); "
          f"lock holders left {holders}; freeze marks {freezes}; exit code {exit_code}")
    assert sum(outcomes.values()) == CALLS and set(outcomes) <= {"succeeded", "shutdown_unknown", "shutting_down"}
    assert "IN_PROGRESS" not in states
    assert holders == 0
    assert freezes == outcomes.get("shutdown_unknown", 0)  # an unknown write's resource waits for reconciliation


async def _is(status: Any, expected: int) -> bool:
    return await status == expected
