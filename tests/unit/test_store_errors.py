"""The store wrapper without a server: one error vocabulary, one envelope, the swallowed-cancel guard
(proxy/store.py: redis_call, translated, unavailable)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ResponseError, SlotNotCoveredError

from proxy import store


async def failing(exc: BaseException):
    raise exc


@pytest.mark.parametrize("raised", [SlotNotCoveredError("slot 7"), ConnectionResetError("peer"), TimeoutError()])
async def test_cluster_and_socket_failures_arrive_as_store_errors(raised):
    with pytest.raises(store.StoreError) as caught:
        await store.redis_call(failing(raised))
    assert isinstance(caught.value, store.StoreUnavailable)
    assert str(caught.value) == type(raised).__name__  # the class, never the text (it may name a host)


async def test_redis_errors_pass_unchanged():
    with pytest.raises(ResponseError):
        await store.translated(failing(ResponseError("NOSCRIPT")))


async def test_a_cancel_the_client_swallowed_still_cancels_the_caller():
    """redis-py can return the reply of a command whose caller was cancelled meanwhile (CPython gh-86296)."""
    started = asyncio.Event()

    async def swallowing_command():
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "reply"  # what asyncio.wait_for does when the reply wins the race

    task = asyncio.create_task(store.redis_call(swallowing_command()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_unavailable_names_the_state_store_and_applies_nothing():
    error = store.unavailable("The lock store is unavailable.", phase="lock", limit="tenant")
    assert (error.code, error.phase, error.attempted, error.committed) == ("dependency_unavailable", "lock",
                                                                           False, False)
    assert error.details == {"dependency": "state_store", "limit": "tenant"}
