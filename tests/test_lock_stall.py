"""A lock holder that stalls past its lease: a real ``toolproxy run`` process frozen with SIGSTOP.

The frozen proxy cannot renew its lease, so the next writer (another proxy on
the same Redis) gets the lock with a newer fencing token and writes; when the
stalled writer's request finally reaches the backend's commit point, its older
token is refused (409 ``stale_fencing_token``, nothing applied).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.support.proxyproc import ProxyProcess
from tests.support.stack import DEMO_REGISTRY, assert_envelope, running_stack
from tests.support.waits import wait_until

LEASE = {"locks.lease_ms": 500, "locks.renew_interval_ms": 100}


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack({**proxy_deps, **LEASE}) as s:
        yield s


@pytest.fixture
async def proxy_process(stack, proxy_deps):
    """A second proxy as a separate OS process (`toolproxy run`), same Redis, same backend."""
    process = ProxyProcess({**proxy_deps, **LEASE, "backends.services": {"demo": stack.backend_url},
                            "registry.paths": [str(DEMO_REGISTRY)], "reconcile.enabled": False}).start()
    try:
        await process.ready()
        yield process
    finally:
        if process.proc is not None and process.proc.poll() is None:
            process.proc.send_signal(signal.SIGCONT)
        process.stop()


def backend_requests(stack, call_id: str) -> list[dict]:
    return [r for r in stack.backend.requests if r["headers"].get("X-Call-Id") == call_id]


async def test_stalled_holder_is_overtaken_and_its_late_write_is_refused(stack, proxy_process):
    process = proxy_process
    # The stalled writer's request sits in the backend before its commit point for 2 s.
    await stack.fault("adjust_counter", "slow", delay_ms=2000, count=1)
    body = {"call_id": "stale", "tool": "adjust_counter", "arguments": {"counter": "ctr_race", "delta": 10}}
    stale_call = asyncio.create_task(stack.session.post(process.url + "/v1/tool-calls", json=body,
                                                        headers={"Request-Timeout": "15",
                                                                 "Idempotency-Key": "stale-write"}))

    async def arrived():
        return bool(backend_requests(stack, "stale"))

    await wait_until(arrived, what="the stalled writer's request to reach the backend")
    stale_token = int(backend_requests(stack, "stale")[0]["headers"]["X-Fencing-Token"])
    process.proc.send_signal(signal.SIGSTOP)  # the holder freezes: no more lease renewals
    try:
        started = time.monotonic()
        status, env = await stack.call("adjust_counter", {"counter": "ctr_race", "delta": 20}, call_id="fresh",
                                       headers={"Request-Timeout": "5"})
        waited = time.monotonic() - started
        assert env["outcome"] == "succeeded", env
        fresh_token = int(backend_requests(stack, "fresh")[0]["headers"]["X-Fencing-Token"])
        assert fresh_token > stale_token
        # The next writer went ahead while the stalled one was still in flight at the backend...
        assert not [iv for iv in stack.backend.intervals if iv.call_id == "stale"]
        assert waited >= 0.2  # ...after the stalled holder's lease ran out, not before
        assert stack.backend.counters["ctr_race"] == 20

        async def stale_finished():
            return any(iv.call_id == "stale" for iv in stack.backend.intervals)

        await wait_until(stale_finished, what="the stalled write to reach its commit point")
        # Refused by its fencing token: nothing applied.
        assert stack.backend.counters["ctr_race"] == 20
        assert [e["call_id"] for e in stack.backend.effects] == ["fresh"]
        assert stack.backend.fencing["counter:ctr_race"] == fresh_token
    finally:
        process.proc.send_signal(signal.SIGCONT)
    response = await asyncio.wait_for(stale_call, 10)
    stale_env = await response.json()
    assert_envelope(stale_env)
    # Whichever the woken proxy sees first — the backend's refusal of its token or its own lost
    # lease — it reports a lost lock and never claims the stale write happened.
    assert stale_env["error"]["code"] == "lock_lost"
    assert stale_env["side_effect"]["committed"] in (False, None)
    if stale_env["side_effect"]["committed"] is False:  # the refusal arrived first: proven not applied
        assert stale_env["error"]["details"]["backend_code"] == "stale_fencing_token"
        assert stale_env["error"]["retryable"] is True
