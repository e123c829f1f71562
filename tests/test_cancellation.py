"""A cancelled call stops, whatever Redis call it is in, and leaves no reservation or lock behind.

redis-py on Python 3.11 can swallow a cancellation that lands just as a
command's reply arrives (CPython gh-86296); ``proxy.store.redis_call`` puts it
back. The cancels below land at spread-out points of a call that is inside the
idempotency stage's Redis calls, often enough that the race window is hit.
Real proxy, real Redis, real demo backend.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.deadline import Deadline
from proxy.pipeline import RequestMeta, ToolCallRequest
from proxy.telemetry.tracing import accept_traceparent
from tests.support.stack import running_stack
from tests.support.waits import wait_until

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}
ROUNDS = 40


@pytest.fixture
async def stack(proxy_deps):
    # Waiting duplicates re-read the record every millisecond: most of their time is spent in a Redis call.
    async with running_stack({**proxy_deps, "reconcile.enabled": False, "idempotency.wait_poll_ms": 1}) as s:
        yield s


async def start_refund(stack, key: str, *, wait_s: float | None = None) -> asyncio.Task:
    caller = await stack.runtime.authenticator.authenticate({})
    meta = RequestMeta(request_id=f"r-{key}", trace=accept_traceparent(None), idempotency_key=key,
                       deadline=Deadline(time.monotonic() + 10), wait_s=wait_s)
    request = ToolCallRequest(call_id=f"c-{key}", tool="refund_order", version=None, arguments=REFUND, meta=meta)
    return asyncio.create_task(stack.runtime.pipeline.execute(request, caller))


async def cancel_and_expect_it_stops(task: asyncio.Task) -> None:
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert done and task.cancelled(), "a cancelled call kept going (its cancellation was swallowed)"


async def operation_records(stack) -> list[bytes]:
    return [k async for k in stack.redis.scan_iter(match="toolproxy:op:*")]


async def holding_refund(stack) -> asyncio.Task:
    """A refund that reached the backend and stays there: it holds its key and the order's lock."""
    await stack.fault("refund_order", "slow", delay_ms=8000, count=1)
    holder = await start_refund(stack, "holder")
    await wait_until(lambda: stack.backend.requests, what="the holder to reach the backend")
    return holder


async def test_a_cancelled_duplicate_stops_waiting_for_the_running_call(stack):
    holder = await holding_refund(stack)
    for i in range(ROUNDS):
        waiter = await start_refund(stack, "holder", wait_s=5)
        await asyncio.sleep(0.005 + 0.025 * i / ROUNDS)  # the cancel point, spread over the polling loop
        await cancel_and_expect_it_stops(waiter)
    assert len(await operation_records(stack)) == 1  # the holder's; a waiter never reserves
    assert len(stack.backend.requests) == 1
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)


async def test_a_call_cancelled_around_its_reservation_leaves_nothing_behind(stack):
    holder = await holding_refund(stack)  # every other refund of the order waits for its lock, unsent
    before = await operation_records(stack)
    for i in range(ROUNDS):
        call = await start_refund(stack, f"cancelled-{i}")
        await asyncio.sleep(0.030 * i / ROUNDS)  # the cancel point: authorize, reserve, lock wait
        await cancel_and_expect_it_stops(call)
        assert await operation_records(stack) == before, f"round {i} left a reservation behind"
    locks = [k async for k in stack.redis.scan_iter(match="toolproxy:lock:*")]
    fields = [f for k in locks for f in await stack.redis.hkeys(k)]
    assert len(fields) == 1 and fields[0].startswith(b"h:"), fields  # only the holder's; no waiter mark left
    assert len(stack.backend.requests) == 1
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)


async def test_a_write_at_the_backend_runs_in_its_callers_task_alone(stack):
    # The cancellation guard, the lock guard and the lease renewal start no task per call: while a
    # cancellable, locked write waits for its backend, no task of the pipeline's runs beside the call's own.
    before = asyncio.all_tasks()
    holder = await holding_refund(stack)
    ours = ("Pipeline", "Cancellations", "Lease", "HttpAdapter", "Event.wait")
    extra = [t.get_coro().__qualname__ for t in asyncio.all_tasks() - before - {holder}
             if any(name in t.get_coro().__qualname__ for name in ours)]
    assert extra == []
    await cancel_and_expect_it_stops(holder)
