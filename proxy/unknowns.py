"""The index of operations whose outcome is unknown, kept in Redis.

Owns: one sorted set (``<prefix>:unknowns:{index}``) whose members are the
operations that ended ``unknown`` (score: when they became unknown) and that
nobody has resolved yet, and the two numbers read from it at scrape time
(how many are open, how old the oldest is). Because it lives in Redis, the
``toolproxy_open_unknowns`` gauge stays right across restarts and is the same
from every replica. Must never: decide an outcome or touch another stage's
records; it is an index, written after the fact and read by metrics.

Who writes it: the commit stage ``open``s an entry for every call whose
envelope says ``unknown``; whoever resolves the operation (the reconciler, an
operator closing a takeover) ``close``s it with the same ``ref``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as redis_async

from .store import key


@dataclass(frozen=True)
class UnknownStats:
    open: int
    oldest_age_s: float


class UnknownIndex:
    def __init__(self, redis: redis_async.Redis, prefix: str) -> None:
        self._redis = redis
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
        now = time.time() if now is None else now
        age = max(0.0, now - float(oldest[0][1])) if oldest else 0.0
        return UnknownStats(open=int(count), oldest_age_s=age)
