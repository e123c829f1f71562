"""The index of operations whose outcome is unknown, kept in Redis.

Owns: the two numbers read at scrape time (how many unknown outcomes are
open, how old the oldest is), from two sources: operations with an
idempotency record (UNKNOWN or NEEDS_TAKEOVER; indexed atomically by the
record's own Lua transitions in ``proxy/operations.py``) and calls without a
record that ended ``unknown`` (one sorted set, ``<prefix>:unknowns:{index}``,
score: when they became unknown). Because both live in Redis, the
``toolproxy_open_unknowns`` gauge stays right across restarts and is the same
from every replica. Must never: decide an outcome or touch another stage's
records; it is an index, read by metrics.

Who writes the sorted set: the commit stage ``open``s an entry for a call
without an operation record whose envelope says ``unknown``; whoever settles
it by hand ``close``s it with the same ``ref``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as redis_async

from .operations import OperationStore
from .store import key


@dataclass(frozen=True)
class UnknownStats:
    open: int
    oldest_age_s: float


class UnknownIndex:
    def __init__(self, redis: redis_async.Redis, prefix: str, operations: OperationStore | None = None) -> None:
        self._redis = redis
        self._operations = operations
        self.key = key(prefix, "unknowns", "index")

    @staticmethod
    def ref(*, tenant: str, idempotency_key: str | None, request_id: str, call_id: str) -> str:
        """The member naming one operation: its idempotency key when it has one."""
        if idempotency_key:
            return f"op:{tenant}:{idempotency_key}"
        return f"call:{request_id}:{call_id}"

    async def open(self, ref: str, since: float | None = None) -> None:
        # NX: an operation that stays unknown across retries keeps its first timestamp.
        await self._redis.zadd(self.key, {ref: since if since is not None else time.time()}, nx=True)

    async def close(self, ref: str) -> bool:
        return bool(await self._redis.zrem(self.key, ref))

    async def stats(self, now: float | None = None) -> UnknownStats:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self.key)
            pipe.zrange(self.key, 0, 0, withscores=True)
            count, oldest = await pipe.execute()
        since = [float(oldest[0][1])] if oldest else []
        if self._operations is not None:
            records, oldest_ms = await self._operations.open_stats()
            count += records
            since += [oldest_ms / 1000.0] if oldest_ms is not None else []
        now = time.time() if now is None else now
        age = max(0.0, now - min(since)) if since else 0.0
        return UnknownStats(open=int(count), oldest_age_s=age)
