"""The index of unknown outcomes, kept in Redis, and settling the ones nobody else can.

Owns: the two numbers read at scrape time (how many unknown outcomes are
open, how old the oldest is), from two sources: operations with an
idempotency record (UNKNOWN or NEEDS_TAKEOVER; indexed atomically by the
record's own Lua transitions in ``proxy/operations.py``) and calls without a
record that ended ``unknown`` (one sorted set, ``<prefix>:unknowns:{index}``,
score: when they started). Because both live in Redis, the
``toolproxy_open_unknowns`` gauge stays right across restarts and is the same
from every replica. Also owns the operator's view of the call-level entries
and settling one from evidence (a call without a key has no status to query:
only a person can say what happened, and until then it stays open and the
"unknowns open too long" alert keeps firing).

Must never: decide an outcome by itself, touch another stage's records, or
settle an entry unaudited (the audit record comes first; audit_unavailable
stops the settlement).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.asyncio as redis_async

from .errors import ProxyError
from .operations import OperationStore
from .store import key, translated

if TYPE_CHECKING:  # pragma: no cover
    from .audit import Auditor
    from .identity import AdminPrincipal
    from .metrics import Metrics

log = logging.getLogger("toolproxy.unknowns")

MAX_EVIDENCE_CHARS = 2000
_SETTLEMENTS = {"committed": True, "not_applied": False}


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
    def ref(*, tenant: str, tool: str, request_id: str, call_id: str) -> str:
        """The member naming one call: JSON, so no separator inside an id can forge another."""
        return json.dumps(["call", tenant, tool, request_id, call_id], separators=(",", ":"))

    async def open(self, ref: str, since: float | None = None) -> None:
        # NX: an entry keeps its first timestamp.
        await translated(self._redis.zadd(self.key, {ref: since if since is not None else time.time()}, nx=True))

    async def close(self, ref: str) -> bool:
        return bool(await translated(self._redis.zrem(self.key, ref)))

    async def stats(self, now: float | None = None) -> UnknownStats:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self.key)
            pipe.zrange(self.key, 0, 0, withscores=True)
            count, oldest = await translated(pipe.execute())
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
        for member, score in await translated(self._redis.zrange(self.key, 0, -1, withscores=True)):
            entry = _entry(member, score)
            if entry is not None and (tenant is None or entry["tenant"] == tenant):
                out.append(entry)
                if len(out) >= limit:
                    break
        return out

    async def settle(self, audit: "Auditor", metrics: "Metrics", principal: "AdminPrincipal",
                     body: Any) -> dict[str, Any]:
        """An operator settles one call-level unknown from evidence.

        Body: ``{"request_id": ..., "call_id": ..., "outcome": "committed" | "not_applied",
        "evidence": "<what was checked>"}``.
        """
        if not isinstance(body, dict) or set(body) != {"request_id", "call_id", "outcome", "evidence"} \
                or not all(isinstance(body[k], str) for k in body) or body["outcome"] not in _SETTLEMENTS \
                or not 0 < len(body["evidence"].strip()) <= MAX_EVIDENCE_CHARS:
            raise ProxyError("invalid_request", "Send {request_id, call_id, outcome: committed|not_applied, "
                             "evidence: text}.", phase="request")
        found = next((e for e in await self.open_calls(tenant=principal.tenant, limit=100000)
                      if e["request_id"] == body["request_id"] and e["call_id"] == body["call_id"]), None)
        if found is None:
            raise ProxyError("operation_not_found", "No such open unknown call.", phase="request")
        committed = _SETTLEMENTS[body["outcome"]]
        await audit.record(
            "reconciliation", critical=True, request_id=found["request_id"], call_id=found["call_id"],
            tool=found["tool"], tenant=found["tenant"], outcome="succeeded" if committed else "failed",
            error_code=None if committed else "dependency_unavailable", side_effect_committed=committed,
            details={"from": "unknown", "to": body["outcome"], "requested_by": "operator",
                     "operator": principal.subject, "evidence": body["evidence"].strip()})
        if not await self.close(found["ref"]):
            raise ProxyError("operation_not_open", "This call was settled meanwhile.", phase="request")
        metrics.reconciliations.labels("operator").inc()
        log.warning("unknown call %s/%s settled by operator %s as %s", found["request_id"], found["call_id"],
                    principal.subject, body["outcome"])
        return {"request_id": found["request_id"], "call_id": found["call_id"], "settled": body["outcome"]}


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
