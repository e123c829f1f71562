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


class _Inner:
    """Stands for redis-py's client class under the boundary."""

    fault: BaseException = AttributeError("'NoneType' object has no attribute 'write'")

    async def execute_command(self, *args, **options):
        raise self.fault


class _Bounded(store._ClientFaults, _Inner):
    pass


@pytest.mark.parametrize("fault", [AttributeError("writer"), RuntimeError("closed handle"), KeyError(7),
                                   TypeError("half-torn")])
async def test_a_fault_inside_the_client_arrives_as_the_store_being_away(fault):
    client = _Bounded()
    client.fault = fault
    with pytest.raises(store.StoreUnavailable) as caught:
        await store.redis_call(client.execute_command("GET", "k"))
    assert str(caught.value) == f"redis client fault ({type(fault).__name__})"


async def test_the_proxys_own_fault_is_not_taken_for_the_stores():
    """No traceback is read: a fault outside redis-py's entry points (here, a plain coroutine) stays itself."""
    with pytest.raises(AttributeError):
        await store.redis_call(failing(AttributeError("the proxy's own bug")))


async def test_pipelines_and_pubsub_reads_are_bounded_too():
    class Pipe:
        async def execute(self):
            raise RuntimeError("closed handle")

    class PubSub:
        async def subscribe(self, *channels):
            raise AttributeError("writer")

        async def unsubscribe(self, *channels):
            return None

        async def get_message(self, timeout=None):
            raise KeyError("slot")

    class Client:
        def pipeline(self, *args, **kwargs):
            return Pipe()

        def pubsub(self, **kwargs):
            return PubSub()

    class BoundedClient(store._ClientFaults, Client):
        pass

    client = BoundedClient()
    with pytest.raises(store.StoreUnavailable):
        await client.pipeline().execute()
    pubsub = client.pubsub()
    with pytest.raises(store.StoreUnavailable):
        await pubsub.subscribe("c")
    with pytest.raises(store.StoreUnavailable):
        await pubsub.get_message(timeout=1)


def test_every_client_the_store_makes_has_the_boundary():
    assert issubclass(store.WiredRedis, store._ClientFaults)
    assert issubclass(store._BlockingCluster, store._ClientFaults)
    assert issubclass(store._Redis, store._ClientFaults)
