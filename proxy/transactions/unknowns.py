"""The index of unknown outcomes, kept in Redis, and settling the ones nobody else can.

Owns: the two numbers read at scrape time (how many unknown outcomes are
open, how old the oldest is), from two sources: operations with an
idempotency record (UNKNOWN or NEEDS_TAKEOVER; indexed atomically by the
record's own Lua transitions in ``proxy/operations.py``) and calls without a
record that ended ``unknown`` (one sorted set, ``<prefix>:unknowns:{index}``,
score: when they started). Because both live in Redis, the
``toolproxy_open_unknowns`` gauge stays right across restarts and is the same
from every replica. Also owns reading the call-level entries: the list, and
finding one by (request id, call id) through a small per-call set written
beside each entry (a call without a key has no status to query: only a
person can say what happened — ``proxy/fronts/admin_api.py`` settles it — and until
then it stays open and the "unknowns open too long" alert keeps firing).

Must never: decide an outcome by itself, or touch another stage's records.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any


from ..normalize import sha256_hex
from ..operations import OperationStore
from ..store import Client, key, redis_call

log = logging.getLogger("toolproxy.unknowns")



@dataclass(frozen=True)
class UnknownStats:
    open: int
    oldest_age_s: float


class UnknownIndex:
    def __init__(self, redis: Client, prefix: str, operations: OperationStore | None = None) -> None:
        self._redis = redis
        self._operations = operations
        self.key = key(prefix, "unknowns", "index")
        self._prefix = prefix

    @staticmethod
    def ref(*, tenant: str, tool: str, request_id: str, call_id: str) -> str:
        """The member naming one call: JSON, so no separator inside an id can forge another."""
        return json.dumps(["call", tenant, tool, request_id, call_id], separators=(",", ":"))

    def _by_call(self, request_id: str, call_id: str) -> str:
        """The set of entries naming this (request id, call id): one per tenant and tool that used them.
        Same hash tag as the index, so both live in one slot."""
        digest = sha256_hex(json.dumps([request_id, call_id], separators=(",", ":")).encode())
        return key(self._prefix, "unknowns", "index", "call", digest)

    async def open(self, ref: str, since: float | None = None) -> None:
        _, _, _, request_id, call_id = json.loads(ref)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(self.key, {ref: since if since is not None else time.time()}, nx=True)  # NX: keeps its first time
            pipe.sadd(self._by_call(request_id, call_id), ref)
            await redis_call(pipe.execute())

    async def close(self, ref: str) -> bool:
        entry = _entry(ref, 0.0)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.key, ref)
            if entry is not None:
                pipe.srem(self._by_call(entry["request_id"], entry["call_id"]), ref)
            removed, *_ = await redis_call(pipe.execute())
        return bool(removed)

    async def stats(self, now: float | None = None) -> UnknownStats:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self.key)
            pipe.zrange(self.key, 0, 0, withscores=True)
            count, oldest = await redis_call(pipe.execute())
        since = [float(oldest[0][1])] if oldest else []
        if self._operations is not None:
            records, oldest_ms = await self._operations.open_stats()
            count += records
            since += [oldest_ms / 1000.0] if oldest_ms is not None else []
        now = time.time() if now is None else now
        age = max(0.0, now - min(since)) if since else 0.0
        return UnknownStats(open=int(count), oldest_age_s=age)

    async def open_calls(self, *, tenant: str | None, limit: int = 500) -> list[dict[str, Any]]:
        """Open call-level unknowns, oldest first (one tenant's, unless ``tenant`` is None)."""
        out = []
        for member, score in await redis_call(self._redis.zrange(self.key, 0, -1, withscores=True)):
            entry = _entry(member, score)
            if entry is not None and (tenant is None or entry["tenant"] == tenant):
                out.append(entry)
                if len(out) >= limit:
                    break
        return out

    async def find(self, request_id: str, call_id: str, *, tenant: str | None) -> dict[str, Any] | None:
        """The open call-level entry of this call (one tenant's, unless ``tenant`` is None), or None.

        Read from its per-call set and checked against the index (a closed
        entry is gone from both); an entry opened by an earlier version has no
        set, so a miss falls back to a ZSCAN of the index matching this call's
        ids (filtered in Redis: only matching entries come back).
        """
        return (await self._find_by_call(request_id, call_id, tenant)
                or await self._scan_index(request_id, call_id, tenant))

    async def _find_by_call(self, request_id: str, call_id: str, tenant: str | None) -> dict[str, Any] | None:
        refs = sorted(m.decode() if isinstance(m, bytes) else m
                      for m in await redis_call(self._redis.smembers(self._by_call(request_id, call_id))))
        for ref in refs:
            entry = _entry(ref, 0.0)
            if entry is None or (tenant is not None and entry["tenant"] != tenant):
                continue
            score = await redis_call(self._redis.zscore(self.key, ref))
            if score is not None:
                return _entry(ref, score)
        return None

    async def _scan_index(self, request_id: str, call_id: str, tenant: str | None) -> dict[str, Any] | None:
        pattern = "*," + _glob_literal(json.dumps(request_id)) + "," + _glob_literal(json.dumps(call_id)) + "]"
        cursor: int | None = None
        while cursor != 0:
            cursor, page = await redis_call(self._redis.zscan(self.key, cursor or 0, match=pattern, count=1000))
            for member, score in page:
                entry = _entry(member, score)
                if entry is not None and entry["request_id"] == request_id and entry["call_id"] == call_id \
                        and (tenant is None or entry["tenant"] == tenant):
                    return entry
        return None


def _entry(member: bytes | str, score: float) -> dict[str, Any] | None:
    ref = member.decode() if isinstance(member, bytes) else member
    try:
        kind, tenant, tool, request_id, call_id = json.loads(ref)
    except (ValueError, TypeError):
        return None  # not written by this version: left alone, still counted
    if kind != "call":
        return None
    return {"ref": ref, "tenant": tenant, "tool": tool, "request_id": request_id, "call_id": call_id,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(score))}


def _glob_literal(text: str) -> str:
    """``text`` as a Redis MATCH pattern that matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
