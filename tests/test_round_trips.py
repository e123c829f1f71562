"""Round trips on the hot path, counted at the real Redis and the real OPA (deterministic, never timed).

Each scenario makes one warm-up call, then the measured call, and states the exact top-level Redis
commands it sends (MONITOR; scripts by name), how many network round trips they take (a pipeline
counts once), and that it asks OPA exactly once. Stages that add Redis work add a row here; a stage
that must cost nothing when it does not apply keeps the existing rows as they are.

The speed of all this lives in bench/floor.py; this file only keeps the counts from regressing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.deadline import Deadline
from proxy.normalize import ResourceRef
from tests.support.redis_traffic import RedisTraffic
from tests.support.stack import running_stack

# Nothing in the background while a call is counted: no reconciler sweep, no lock renewal.
QUIET = {"reconcile.scan_interval_ms": 3_600_000, "locks.lease_ms": 60_000, "locks.renew_interval_ms": 30_000}
_ids = itertools.count()


@dataclass(frozen=True)
class Scenario:
    name: str
    tool: str
    arguments: dict[str, Any]
    commands: list[str]   # top-level Redis commands of the measured call, in order
    round_trips: int
    same_key: bool = False  # the measured call repeats the warm-up's Idempotency-Key (a replay)
    headers: dict[str, str] = field(default_factory=dict)


SCENARIOS = [
    Scenario("read without a record", "get_order", {"order_id": "ord_1001"}, [], 0),
    # reserve and lock in one script (the lock only once the key is reserved), then the outcome record and the
    # lock release in one script (the release only once the record holds the outcome)
    Scenario("locked write with an Idempotency-Key", "adjust_counter", {"counter": "ctr_rt", "delta": 1},
             ["operations.begin+locks.acquire", "operations.commit+locks.release"], 2),
    # the same script call: it finds the outcome and takes no lock (test_a_replay_takes_no_lock)
    Scenario("replayed write", "adjust_counter", {"counter": "ctr_rt", "delta": 1},
             ["operations.begin+locks.acquire"], 1, same_key=True),
]


def opa_decisions(opa) -> float:
    status, body = opa.request("GET", "/metrics", timeout=10)
    assert status == 200
    text = body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("http_request_duration_seconds_count") and 'handler="v1/data"' in line
               and 'method="post"' in line)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
async def test_one_call_makes_its_round_trips_and_one_opa_query(scenario, proxy_deps, opa_server):
    async with running_stack({**proxy_deps, **QUIET}) as stack:
        key = f"rt-{next(_ids)}"
        for measured in (False, True):
            headers = dict(scenario.headers)
            if stack.runtime.registry.resolve(scenario.tool).is_write:
                headers["Idempotency-Key"] = key if scenario.same_key or not measured else key + "-measured"
            if measured:
                decisions = opa_decisions(opa_server)
                async with RedisTraffic(proxy_deps["redis.url"]) as traffic:
                    status, env = await stack.call(scenario.tool, scenario.arguments, headers=headers)
                    seen = await traffic.since_start()
                assert opa_decisions(opa_server) - decisions == 1
            else:
                status, env = await stack.call(scenario.tool, scenario.arguments, headers=headers)
            assert env["outcome"] == "succeeded", env
        assert env.get("replayed", False) is scenario.same_key
        assert seen.commands == scenario.commands
        assert seen.round_trips == scenario.round_trips


async def test_a_replay_takes_no_lock_and_a_busy_set_is_waited_for(proxy_deps):
    """The lock attempt that rides with the reservation runs only once the key is reserved: a replay leaves
    the fencing counter and the lock hash as they were. A set held by another is waited for (the lock
    stage), then taken with a newer fencing token."""
    async with running_stack({**proxy_deps, **QUIET}) as stack:
        locks = stack.runtime.pipeline._locks
        redis = stack.runtime.redis
        fence, hash_key = locks.fence_key("acme"), locks.resource_key("acme", "counter:ctr_once")
        headers = {"Idempotency-Key": f"rt-{next(_ids)}"}
        _, first = await stack.call("adjust_counter", {"counter": "ctr_once", "delta": 1}, headers=headers)
        assert first["outcome"] == "succeeded"
        token = await redis.get(fence)
        _, again = await stack.call("adjust_counter", {"counter": "ctr_once", "delta": 1}, headers=headers)
        assert again.get("replayed") is True and again["data"] == first["data"]
        assert await redis.get(fence) == token and not await redis.hgetall(hash_key)
        # another holder: the write waits for it (lock stage) and then takes the next fencing token
        held = await locks.acquire(
            [ResourceRef(id="counter:ctr_once", access="exclusive")], tenant="acme", tool="other", is_write=True,
            deadline=Deadline(time.monotonic() + 5))
        call = asyncio.ensure_future(stack.call("adjust_counter", {"counter": "ctr_once", "delta": 1},
                                                headers={"Idempotency-Key": f"rt-{next(_ids)}"}))
        await asyncio.sleep(0.3)
        assert not call.done()
        await held.release()
        async with asyncio.timeout(10):
            _, waited = await call
        assert waited["outcome"] == "succeeded" and waited["timing"]["stages_ms"]["lock"] >= 200
        assert int(await redis.get(fence)) > int(token)


async def test_a_reconciler_sweep_is_one_round_trip_whatever_the_bucket_count(proxy_deps):
    async with running_stack({**proxy_deps, **QUIET}) as stack:
        async with RedisTraffic(proxy_deps["redis.url"]) as traffic:
            counts = await stack.runtime.reconciler.scan_once()
            seen = await traffic.since_start()
    assert counts == {}
    # 16 buckets x (leases, due), each read by the bucket master's own clock (operations.passed), pipelined
    assert seen.commands == ["operations.passed"] * 32
    assert seen.round_trips == 1
