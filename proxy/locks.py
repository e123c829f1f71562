"""Lock stage: per-resource shared/exclusive leases in Redis, with fencing tokens.

Owns: acquiring ALL of a call's lockable resources (``NormalizedCall.resources``
whose access is ``shared`` or ``exclusive``; ``none`` is never locked) in one
atomic Lua step, all-or-nothing, in sorted order; waiting for busy resources
within the caller's deadline (``resource_busy``); renewing the lease while the
call runs; noticing a lost lease (``lock_lost``); issuing fencing tokens; and
releasing on every path, cancellation included. Must never: hold a lock while
waiting for another (a call's set is taken in one step, so calls cannot
deadlock each other), decide authorization or idempotency, or let a Redis
exception escape as a stack trace.

Redis layout (all keys of one lock domain share a Cluster hash tag, so the
multi-key scripts run in one slot):

* ``<prefix>:lock:{<domain>}:<resource id>`` — a hash per resource. Field
  ``h:<owner>`` = ``<s|x>:<expires ms>:<token>`` for each holder; field
  ``w:<owner>`` = ``w:<expires ms>`` for an exclusive waiter. A waiting writer
  keeps new shared holders out (writer preference: a stream of readers cannot
  starve a write); writers still compete with each other. Expiry is judged on
  Redis's clock (``TIME``), never a replica's.
* ``<prefix>:fence:{<domain>}`` — the domain's fencing counter. It never
  expires. Each exclusive acquisition sets it to ``max(counter + 1, now ms)``
  and that value is the call's fencing token. One counter per domain (rather
  than one per resource) makes a single ``X-Fencing-Token`` valid for every
  resource of the call: the token is strictly greater than every token issued
  earlier for any resource of the domain, so per resource the tokens a backend
  sees increase monotonically. (With per-resource counters and "forward the
  max", a later writer of only one resource could get a smaller number than one
  already recorded there and be refused as stale.) The ``now ms`` floor keeps
  tokens increasing even if Redis loses the counter (failover without
  persistence): new tokens restart from the clock, not from 1.

Domains (``locks.scope``): ``tenant`` (default) — the hash tag is the tenant,
so one tenant's locks live in one Cluster slot and different tenants never
exclude each other (resource ids are tenant-relative; the trade-off is that a
busy tenant is one hot slot, and a backend resource shared by several tenants
is not protected across them). ``global`` — every lock in one slot: tenants
exclude each other, all lock traffic goes to one shard.

A call that holds any exclusive resource gets one new token for its whole
set. A call holding only shared resources (a read that declares a resource)
gets the domain's current counter — the newest token issued so far — and it
is forwarded too (``X-Fencing-Token``): no write with a newer token can start
on its resources while the read holds them, so a read-modify-write backend
may refuse a read whose token is older than a write it already saw on that
resource (a reader whose lease lapsed), exactly as it refuses a stale write.
A read taken while the counter is missing sets it from the clock first, so
the next write still gets a larger token.

Who holds what is visible to operators (``GET /v1/locks`` on the admin
listener, ``LockManager.held``): each holder's field name carries its tenant,
tool, operation key and request id, so listing needs no extra bookkeeping
and taking a lock no extra round trip. A proxy that crashed holding locks
stops renewing them; they free themselves when their lease
(``locks.lease_ms``) runs out, and the listing shows how long that is.

Losing the lock: the lease is renewed every ``renew_interval_ms``. If a
renewal finds the lease gone (expired or taken) or Redis cannot confirm it
before the last confirmed lease runs out, the call has lost its lock: the
execution still in flight is abandoned and the call ends with ``lock_lost``.
For a write that is an unknown outcome (``committed: null``, resolution
``reconcile``): the request may already be at the backend, where the fencing
token decides — a newer holder's token makes the backend refuse the stale
write. For a read it is a retryable failure with nothing applied. A backend that
refuses the token (error code ``stale_fencing_token``) proves nothing was
applied: ``lock_lost`` with ``committed: false``, retry with the same key.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, TypeVar
from urllib.parse import quote, unquote


from . import store
from .config import LocksConfig
from .deadline import Deadline
from .errors import ProxyError
from .interrupts import TaskInterrupt
from .telemetry.metrics import Metrics
from .normalize import ResourceRef

log = logging.getLogger("toolproxy.locks")

T = TypeVar("T")
LOCKABLE = ("shared", "exclusive")
STALE_FENCING_CODE = "stale_fencing_token"  # a backend's 409 error code for a token older than one it saw
GLOBAL_TAG = "*"  # never a percent-encoded tenant, so it cannot collide with one

# KEYS[1] fencing counter, KEYS[2..] resource hashes (sorted).
# ARGV[1] owner, ARGV[2] lease ms, ARGV[3] waiter-intent ms, ARGV[4] the call's operation key ('' for none),
# ARGV[5] '1' if the call writes, ARGV[4+i] mode ('s'|'x') of KEYS[i].
# Reply: {1, token|-1, lease ms} when every resource was taken; {0, i, ...} (1-based
# indexes into the resource list of the busy ones) when nothing was taken; {2, operation key, i} when a
# write meets the freeze mark of another operation whose outcome is not settled (nothing taken).
_ACQUIRE = store.lua("locks.acquire", """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner, lease, intent = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local writes = ARGV[5] == '1'
local me_h, me_w, me_u = 'h:' .. owner, 'w:' .. owner, 'u:' .. ARGV[4]
local function marked(key)  -- a freeze mark keeps the hash (no expiry) until it is thawed
  for _, f in ipairs(redis.call('HKEYS', key)) do
    if string.sub(f, 1, 2) == 'u:' then return true end
  end
  return false
end
local function extend(key, ms)
  local ttl = redis.call('PTTL', key)
  if ttl == -1 and marked(key) then return end
  if ttl < ms then redis.call('PEXPIRE', key, ms) end
end
local blocked, exclusive = {}, false
for i = 2, #KEYS do
  local key, mode = KEYS[i], ARGV[i + 4]
  if mode == 'x' then exclusive = true end
  local fields = redis.call('HGETALL', key)
  local busy = false
  for j = 1, #fields, 2 do
    local f, v = fields[j], fields[j + 1]
    if string.sub(f, 1, 2) == 'u:' then
      -- A freeze mark: an operation on this resource has an unknown outcome. A write of another operation
      -- is refused (the caller looks the operation up); reads go on.
      if writes and f ~= me_u then return {2, string.sub(f, 3), i - 1} end
    else
      local kind, expiry = string.match(v, '^(%a):(%d+)')
      if expiry == nil or tonumber(expiry) <= now then
        redis.call('HDEL', key, f)
      elseif f ~= me_h and f ~= me_w then
        if kind == 'x' or (mode == 'x' and kind == 's') or (mode == 's' and kind == 'w') then
          busy = true
        end
      end
    end
  end
  if busy then blocked[#blocked + 1] = i - 1 end
end
if #blocked > 0 then
  for i = 2, #KEYS do
    if ARGV[i + 4] == 'x' then
      redis.call('HSET', KEYS[i], me_w, 'w:' .. string.format('%d', now + intent))
      extend(KEYS[i], intent)
    end
  end
  table.insert(blocked, 1, 0)
  return blocked
end
local token
if exclusive then
  local last = tonumber(redis.call('GET', KEYS[1]) or '0')
  token = math.max(last + 1, now)
  redis.call('SET', KEYS[1], string.format('%d', token))
else
  local last = redis.call('GET', KEYS[1])
  if not last then
    last = string.format('%d', now)
    redis.call('SET', KEYS[1], last)
  end
  token = tonumber(last)
end
local value_tail = ':' .. string.format('%d', now + lease) .. ':' .. string.format('%d', math.max(token, 0))
for i = 2, #KEYS do
  redis.call('HDEL', KEYS[i], me_w)
  redis.call('HSET', KEYS[i], me_h, ARGV[i + 4] .. value_tail)
  extend(KEYS[i], lease)
end
return {1, token, lease}
""")

# KEYS resource hashes; ARGV[1] owner, ARGV[2] lease ms. 1 = extended, 0 = lost (nothing changed).
_RENEW = store.lua("locks.renew", """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me_h, lease = 'h:' .. ARGV[1], tonumber(ARGV[2])
local values = {}
for i = 1, #KEYS do
  local v = redis.call('HGET', KEYS[i], me_h)
  if not v then return 0 end
  local mode, expiry, token = string.match(v, '^(%a):(%d+):(%d+)$')
  if expiry == nil or tonumber(expiry) <= now then return 0 end
  values[i] = mode .. ':' .. string.format('%d', now + lease) .. ':' .. token
end
local function marked(key)
  for _, f in ipairs(redis.call('HKEYS', key)) do
    if string.sub(f, 1, 2) == 'u:' then return true end
  end
  return false
end
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], me_h, values[i])
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl < lease and not (ttl == -1 and marked(KEYS[i])) then redis.call('PEXPIRE', KEYS[i], lease) end
end
return 1
""")

# KEYS resource hashes; ARGV[1] owner, ARGV[2] operation key to freeze resources for ('' for none: the
# outcome is known), ARGV[3] now ms, ARGV[3+i] '1' to freeze KEYS[i] (the call's exclusive resources).
# Drops the owner's holder and waiter fields; sets the operation's freeze mark (``u:<key>``, no expiry: the
# hash stays until the mark is thawed) on the resources to freeze.
_RELEASE = store.lua("locks.release", """
local removed = 0
for i = 1, #KEYS do
  removed = removed + redis.call('HDEL', KEYS[i], 'h:' .. ARGV[1], 'w:' .. ARGV[1])
  if ARGV[2] ~= '' and ARGV[3 + i] == '1' then
    redis.call('HSET', KEYS[i], 'u:' .. ARGV[2], ARGV[3])
    redis.call('PERSIST', KEYS[i])
  elseif redis.call('HLEN', KEYS[i]) == 0 then
    redis.call('DEL', KEYS[i])
  end
end
return removed
""")

# KEYS resource hashes; ARGV[1] operation key, ARGV[2] lease ms. Thaws: drops that operation's freeze mark
# (its outcome settled); a hash left without marks expires again like any lock. Returns the marks dropped.
_THAW = store.lua("locks.thaw", """
local removed = 0
for i = 1, #KEYS do
  removed = removed + redis.call('HDEL', KEYS[i], 'u:' .. ARGV[1])
  if redis.call('HLEN', KEYS[i]) == 0 then
    redis.call('DEL', KEYS[i])
  elseif redis.call('PTTL', KEYS[i]) == -1 then
    local marked = false
    for _, f in ipairs(redis.call('HKEYS', KEYS[i])) do
      if string.sub(f, 1, 2) == 'u:' then marked = true break end
    end
    if not marked then redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[2])) end
  end
end
return removed
""")


class Frozen(ProxyError):
    """A write met the freeze mark of another operation whose outcome was not settled when it was last seen
    (``operation``, on ``resource``). The pipeline checks that operation's record: still open, the call is
    refused (``operation_unknown``); settled, the mark is thawed and the lock taken again."""

    def __init__(self, operation: str, resource: str) -> None:
        super().__init__("operation_unknown",
                         "A resource this write needs is frozen: an earlier operation on it has an unknown "
                         "outcome. Nothing was sent; no other write runs there until it is reconciled or an "
                         "operator resolves it.",
                         details={"blocking_operation": operation, "resource": resource,
                                  "status": f"/v1/operations/{operation}"},
                         phase="lock", attempted=False, committed=False)
        self.operation = operation
        self.resource = resource


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, encoded in its Redis field name (``h:<owner>``): a random id plus the facts an
    operator needs, so the listing reads them without any bookkeeping beside the lock itself."""

    tenant: str
    tool: str
    operation: str | None = None
    request_id: str | None = None

    def owner(self) -> str:
        return "|".join((uuid.uuid4().hex, quote(self.tenant, safe=""), quote(self.tool, safe=""),
                         quote(self.operation or "", safe=""), quote(self.request_id or "", safe="")))

    @staticmethod
    def parse(owner: str) -> "Holder | None":
        parts = owner.split("|")
        if len(parts) != 5:
            return None
        _, tenant, tool, operation, request_id = (unquote(p) for p in parts)
        return Holder(tenant=tenant, tool=tool, operation=operation or None, request_id=request_id or None)


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def lockable(resources: Iterable[ResourceRef]) -> tuple[ResourceRef, ...]:
    """The resources a call locks, in the fixed (sorted by id) order."""
    return tuple(sorted((r for r in resources if r.access in LOCKABLE), key=lambda r: r.id))


def domain(scope: str, tenant: str) -> str:
    """The lock domain (hash tag) of a tenant's locks."""
    return GLOBAL_TAG if scope == "global" else quote(tenant, safe="-_.@:")


def lock_keys(prefix: str, scope: str, tenant: str, resource_ids: Sequence[str]) -> list[str]:
    """KEYS of the acquire script: the domain's fencing counter, then the resource hashes (renew and
    release take the resource hashes alone)."""
    tag = domain(scope, tenant)
    return [store.key(prefix, "fence", tag)] + [store.key(prefix, "lock", tag, rid) for rid in resource_ids]


def script_key_sets(prefix: str, scope: str) -> dict[str, list[list[str]]]:
    """Sample key sets of the lock scripts (start-up check: each in one Cluster slot)."""
    samples = [lock_keys(prefix, scope, tenant, ["orders/42", "customer:{7}", "x"])
               for tenant in ("acme", "tenant{b}", "a:b c")]
    return {"locks.acquire": samples, "locks.renew/release": [keys[1:] for keys in samples]}


@dataclass(frozen=True)
class LockPlan:
    """The lock set one call takes: its resources in lock order, its owner id, the acquire script's keys
    and arguments, and whether any of it is exclusive."""

    wanted: tuple[ResourceRef, ...]
    owner: str
    keys: list[str]
    args: list[Any]
    mode: str  # "exclusive" | "shared" (the lock-wait metric's label)
    tool: str
    is_write: bool
    operation: str | None = None  # the call's operation key: its freeze mark on the exclusive resources


class LockManager:
    """One per process; hands out ``Lease`` objects for lock sets."""

    def __init__(self, redis: store.Client, config: LocksConfig, *, key_prefix: str, metrics: Metrics) -> None:
        self._redis = redis
        self._config = config
        self._prefix = key_prefix
        self._metrics = metrics
        self._acquire = store.script(redis, _ACQUIRE)
        self._renew = store.script(redis, _RENEW)
        self._release = store.script(redis, _RELEASE)
        self._thaw = store.script(redis, _THAW)

    def domain(self, tenant: str) -> str:
        return domain(self._config.scope, tenant)

    def resource_key(self, tenant: str, resource_id: str) -> str:
        return lock_keys(self._prefix, self._config.scope, tenant, [resource_id])[1]

    def fence_key(self, tenant: str) -> str:
        return lock_keys(self._prefix, self._config.scope, tenant, [])[0]

    def plan(self, resources: Sequence[ResourceRef], *, tenant: str, tool: str, is_write: bool,
             operation: str | None = None, request_id: str | None = None) -> "LockPlan | None":
        """What a call will lock (owner, keys, modes), or None if nothing it names is lockable."""
        wanted = lockable(resources)
        if not wanted:
            return None
        config = self._config
        owner = Holder(tenant=tenant, tool=tool, operation=operation, request_id=request_id).owner()
        keys = lock_keys(self._prefix, config.scope, tenant, [r.id for r in wanted])
        args: list[Any] = [owner, config.lease_ms, 3 * config.poll_max_ms, operation or "", int(is_write)] + \
            ["x" if r.access == "exclusive" else "s" for r in wanted]
        mode = "exclusive" if any(r.access == "exclusive" for r in wanted) else "shared"
        return LockPlan(wanted=wanted, owner=owner, keys=keys, args=args, mode=mode, tool=tool, is_write=is_write,
                        operation=operation)

    def attempt(self, plan: "LockPlan") -> store.Then:
        """One try at taking the plan's whole set, for another stage's round trip (``granted`` reads its reply)."""
        return store.Then(self._acquire, plan.keys, plan.args)

    def granted(self, plan: "LockPlan", reply: Any, *, sent: float, started: float) -> "Lease | None":
        """The running lease if ``reply`` (of ``attempt``, sent at ``sent``) took the set, else None."""
        if int(reply[0]) != 1:
            return None
        self._metrics.child(self._metrics.lock_wait, plan.mode).observe(time.monotonic() - started)
        lease = Lease(self, owner=plan.owner, keys=plan.keys[1:], resources=plan.wanted, tool=plan.tool,
                      is_write=plan.is_write, fencing_token=int(reply[1]), valid_until=sent + self._safe_lease_s(),
                      operation=plan.operation)
        lease.start()
        return lease

    async def forget(self, plan: "LockPlan") -> None:
        """Drop whatever the plan's owner may hold or wait for, its freeze mark included (its attempt's reply
        was lost or not used: nothing was sent under it)."""
        await self._forget(plan.keys[1:], plan.owner, None)

    async def thaw_settled(self, operation: str, meta: Mapping[str, Any]) -> None:
        """Thaw what a settled operation froze (its record's ``marks``, in its tenant's domain). Errors are only
        logged: a write that meets a mark left behind checks the operation and thaws it then."""
        marks, tenant = meta.get("marks"), meta.get("tenant")
        if not marks or not isinstance(tenant, str):
            return
        with store.logged_on_fault(log, "could not thaw the resources of settled operation %s; the next write "
                                   "there will", operation):
            await self.thaw(tenant, [str(m) for m in marks], operation)

    async def freeze_unknown(self, operation: str, meta: Mapping[str, Any]) -> None:
        """Freeze what an operation whose outcome became unknown without its proxy wrote (its record's
        ``marks``). Errors are logged: the reconciler's answer stands; a write there then runs unfrozen."""
        marks, tenant = meta.get("marks"), meta.get("tenant")
        if not marks or not isinstance(tenant, str):
            return
        with store.logged_on_fault(log, "could not freeze the resources of unknown operation %s", operation):
            await self.freeze(tenant, [str(m) for m in marks], operation)

    async def freeze(self, tenant: str, resource_ids: Sequence[str], operation: str) -> None:
        """Mark an operation's resources frozen (its outcome became unknown without its proxy: a lease that ran
        out). Idempotent."""
        if resource_ids:
            keys = lock_keys(self._prefix, self._config.scope, tenant, sorted(set(resource_ids)))[1:]
            await store.redis_call(self._release(keys=keys, args=["", operation, _now_ms(), *("1" * len(keys))]))

    async def thaw(self, tenant: str, resource_ids: Sequence[str], operation: str) -> int:
        """Drop an operation's freeze marks (its outcome settled: reconciled, resolved by an operator, or found
        settled by a write it blocked). Idempotent; marks already gone count 0."""
        if not resource_ids:
            return 0
        keys = lock_keys(self._prefix, self._config.scope, tenant, sorted(set(resource_ids)))[1:]
        return int(await store.redis_call(self._thaw(keys=keys, args=[operation, self._config.lease_ms])))

    async def acquire(self, resources: Sequence[ResourceRef], *, tenant: str, tool: str, is_write: bool,
                      deadline: Deadline, while_waiting: Callable[[], Awaitable[None]] | None = None,
                      keepalive_s: float = 1.0, operation: str | None = None,
                      request_id: str | None = None) -> "Lease | None":
        """Take every lockable resource at once, waiting within the deadline; None if nothing to lock."""
        plan = self.plan(resources, tenant=tenant, tool=tool, is_write=is_write, operation=operation,
                         request_id=request_id)
        return await self.acquire_planned(plan, deadline=deadline, while_waiting=while_waiting,
                                          keepalive_s=keepalive_s)

    async def acquire_planned(self, plan: "LockPlan | None", *, deadline: Deadline,
                              while_waiting: Callable[[], Awaitable[None]] | None = None,
                              keepalive_s: float = 1.0) -> "Lease | None":
        """Take the plan's resources at once, waiting within the deadline; None if there is no plan.

        ``while_waiting`` is awaited about every ``keepalive_s`` of waiting (the pipeline keeps the
        call's idempotency reservation alive with it); an error it raises ends the wait.
        """
        if plan is None:
            return None
        config = self._config
        tool = plan.tool
        started = time.monotonic()
        wait = deadline.or_after(config.max_wait_ms / 1000.0)
        pause = config.poll_min_ms / 1000.0
        kept_alive = started
        try:
            while True:
                sent = time.monotonic()
                reply = await store.redis_call(self._acquire(keys=plan.keys, args=plan.args))
                lease = self.granted(plan, reply, sent=sent, started=started)
                if lease is not None:
                    return lease
                if int(reply[0]) == 2:
                    operation = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
                    raise Frozen(operation, plan.wanted[int(reply[2]) - 1].id)
                now = time.monotonic()
                if wait.expired:
                    busy = [plan.wanted[int(i) - 1].id for i in reply[1:]]
                    self._metrics.lock_wait.labels(plan.mode).observe(now - started)
                    self._metrics.lock_timeouts.labels(tool).inc()
                    raise ProxyError("resource_busy", "A resource this call needs is in use; the deadline ran out "
                                     "while waiting for it.",
                                     details={"resources": busy, "waited_ms": int((now - started) * 1000)},
                                     phase="lock", attempted=False, committed=False)
                await asyncio.sleep(min(wait.budget(), pause * random.uniform(0.5, 1.0)))
                pause = min(pause * 2, config.poll_max_ms / 1000.0)
                if while_waiting is not None and time.monotonic() - kept_alive >= keepalive_s:
                    await while_waiting()
                    kept_alive = time.monotonic()
        except ProxyError:
            await self.forget(plan)
            raise
        except store.StoreError as exc:  # policy: fail closed, once what this owner may hold is dropped
            log.warning("lock store unavailable while acquiring for tool %s (%s)", tool, type(exc).__name__)
            # The script may have run before the reply was lost: drop whatever this owner may hold.
            await self.forget(plan)
            raise store.unavailable("The lock store is unavailable.", phase="lock") from None
        except BaseException:  # cancelled mid-wait: the script may have taken the set already
            await self.forget(plan)
            raise

    async def _lock_hashes(self, tenant: str | None, *, clock: bool = True
                           ) -> tuple[int, list[tuple[str, str, dict[bytes, bytes]]]]:
        """Redis's clock in ms (with ``clock``, read before the scan, apart from the pipeline: a Cluster
        pipeline refuses TIME; else this process's) and every lock hash as (domain, resource id, fields):
        one tenant's (or every tenant's for ``None``), read in one pipeline after a SCAN."""
        if tenant is not None and self._config.scope == "tenant":
            pattern = _glob_escape(self.resource_key(tenant, "")) + "*"
        else:
            pattern = _glob_escape(f"{self._prefix}:lock:") + "*"
        if clock:  # before the scan: a lease that ends meanwhile shows with a little time left, never negative
            seconds, micros = await store.redis_call(self._redis.time())
            now_ms = int(seconds) * 1000 + int(micros) // 1000
        else:
            now_ms = _now_ms()
        keys: list[bytes] = []
        async for found in self._redis.scan_iter(match=pattern, count=200):
            keys.append(found)
        async with self._redis.pipeline(transaction=False) as pipe:
            for found in keys:
                pipe.hgetall(found)
            hashes = await store.redis_call(pipe.execute()) if len(pipe) else []
        rows = []
        for found, fields in zip(keys, hashes):
            tagged, _, resource = found.decode().partition("}:")
            rows.append((unquote(tagged.rpartition("{")[2]), resource, fields))
        return now_ms, rows

    async def frozen(self, *, tenant: str | None, limit: int = 500) -> dict[str, Any]:
        """``GET /v1/freezes`` and the freeze gauges: every freeze mark, oldest first (one tenant's, or every
        tenant's for ``None``): the resource, the operation whose unknown outcome froze it and since when.
        ``count`` and ``oldest_age_s`` cover all of them, ``freezes`` the first ``limit``. Ages are judged on
        this process's clock, the one a mark's time was written with."""
        now_ms, rows = await self._lock_hashes(tenant, clock=False)
        marks: list[dict[str, Any]] = []
        for tag, resource, fields in rows:
            for name, value in fields.items():
                name = name.decode()
                if not name.startswith("u:"):
                    continue
                since = int(value) if value.isdigit() else now_ms
                marks.append({"resource": resource, "operation": name[2:],
                              "tenant": tag if self._config.scope == "tenant" else None,
                              "since_ms": since, "age_s": max(0, now_ms - since) / 1000.0})
        marks.sort(key=lambda mark: (mark["since_ms"], mark["resource"], mark["operation"]))
        resources = len({(m["tenant"], m["resource"]) for m in marks})
        return {"freezes": marks[:limit], "truncated": len(marks) > limit, "frozen_resources": resources,
                "oldest_age_s": marks[0]["age_s"] if marks else 0.0}

    async def held(self, *, tenant: str | None, limit: int = 500) -> dict[str, Any]:
        """``GET /v1/locks``: the locks held now, one tenant's (or every tenant's for ``None``), resource
        order. Lease time is judged on Redis's clock, as the locks themselves are."""
        now_ms, rows = await self._lock_hashes(tenant)
        locks: list[dict[str, Any]] = []
        for _, resource, fields in rows:
            for name, value in fields.items():
                name, value = name.decode(), value.decode()
                holder = Holder.parse(name[2:]) if name.startswith("h:") else None
                mode, _, rest = value.partition(":")
                expiry, _, token = rest.partition(":")
                if holder is None or not expiry.isdigit() or int(expiry) <= now_ms:
                    continue  # a waiter, an expired holder, or a holder of an older version
                if tenant is not None and holder.tenant != tenant:
                    continue
                locks.append({"resource": resource, "tenant": holder.tenant,
                              "mode": "exclusive" if mode == "x" else "shared", "tool": holder.tool,
                              "operation": holder.operation, "request_id": holder.request_id,
                              "fencing_token": int(token) if token.isdigit() else None,
                              "lease_remaining_ms": int(expiry) - now_ms})
        locks.sort(key=lambda lock: (lock["tenant"], lock["resource"], lock["mode"]))
        return {"locks": locks[:limit], "truncated": len(locks) > limit, "scope": self._config.scope,
                "lease_ms": self._config.lease_ms}

    def _safe_lease_s(self) -> float:
        """How long a lease confirmed now is trusted locally: the lease minus a clock-rate margin."""
        lease = self._config.lease_ms / 1000.0
        return lease - max(0.005, lease * 0.02)

    async def _forget(self, keys: list[str], owner: str, freeze: str | None,
                      marks: Sequence[str] | None = None) -> None:
        """Release (or withdraw a waiter) shielded from cancellation; errors only logged (the lease expires).
        ``freeze``: the operation whose outcome is unknown, marked on every resource (None: known)."""
        with store.logged_on_fault(log, "could not release locks of owner %s; they expire with their lease", owner,
                                   faults=store.STORE_OR_SOCKET_FAULTS):
            await asyncio.shield(store.translated(self._release(keys=keys, args=[owner, freeze or "", _now_ms(),
                                                                                 *(marks or ())])))


class Lease:
    """A held lock set: renewed by a timer until released or lost."""

    def __init__(self, manager: LockManager, *, owner: str, keys: list[str], resources: tuple[ResourceRef, ...],
                 tool: str, is_write: bool, fencing_token: int | None, valid_until: float,
                 operation: str | None = None) -> None:
        self._manager = manager
        self.operation = operation
        self.owner = owner
        self.keys = keys
        self.resources = resources
        self.tool = tool
        self.is_write = is_write
        self.fencing_token = fencing_token
        self._valid_until = valid_until
        self._lost = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None      # the next renewal
        self._renewer: asyncio.Task[None] | None = None     # a renewal on its way to Redis
        self._on_lost: Callable[[], None] | None = None     # set while ``guard`` awaits an execution
        self._released = False  # also tells the renewer to stop if a Redis call swallowed its cancellation

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def released(self) -> bool:
        return self._released

    def start(self) -> None:
        """Renew every ``renew_interval_ms`` from now on. A timer, not a task per lease: a call that ends
        before its first renewal (most calls) never starts one; a task runs only while a renewal is on
        its way to Redis."""
        self._loop = asyncio.get_running_loop()
        self._schedule(self._manager._config.renew_interval_ms / 1000.0)

    def _schedule(self, delay: float) -> None:
        if self._released or self._lost.is_set():
            return
        self._timer = self._loop.call_later(max(0.0, min(delay, self._valid_until - time.monotonic())),
                                            self._renew_due)

    def _renew_due(self) -> None:
        self._timer = None
        if self._released:
            return
        if self._valid_until - time.monotonic() <= 0:
            return self._mark_lost("lease could not be renewed before it ran out")
        self._renewer = self._loop.create_task(self._renew(), name=f"lock-renew-{self.owner}")

    async def _renew(self) -> None:
        """One renewal; schedules the next (sooner after a failed one: the lease may still be valid)."""
        manager = self._manager
        config = manager._config
        interval = config.renew_interval_ms / 1000.0
        left = self._valid_until - time.monotonic()
        sent = time.monotonic()
        try:
            async with asyncio.timeout(left):
                renewed = await store.redis_call(manager._renew(keys=self.keys, args=[self.owner, config.lease_ms]))
        except (store.StoreError, OSError, TimeoutError):  # policy: retry: renew again sooner; the lease still holds
            return self._schedule(interval / 4)
        if self._released:
            return
        if int(renewed) != 1:
            return self._mark_lost("lease expired or was taken")
        self._valid_until = sent + manager._safe_lease_s()
        self._schedule(interval)

    def _mark_lost(self, why: str) -> None:
        if not self._lost.is_set():
            self._lost.set()
            if self._on_lost is not None:
                self._on_lost()
            self._manager._metrics.lock_lost.labels(self.tool).inc()
            log.warning("lock lost for tool %s (%s): %s", self.tool, why,
                        ", ".join(r.id for r in self.resources))

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await the execution; if the lock is lost first, abandon it and raise ``lock_lost``.

        The execution runs in the caller's task (no task of its own per call): losing the lease cancels
        that task, and the cancel this guard made is taken back (``uncancel``) and becomes ``lock_lost``;
        a cancel from anyone else stays a cancel. An answer already returned when the lease is found lost
        stands (the guard no longer listens)."""
        if self._lost.is_set():
            _abandon(awaitable)
            raise self.lost_error()
        lost = TaskInterrupt()
        self._on_lost = lost.interrupt
        try:
            return await awaitable
        except asyncio.CancelledError:
            self._on_lost = None
            if lost.take_back():  # only this guard's cancel: the lease went
                raise self.lost_error() from None
            raise  # someone else cancelled (too): a cancel it stays
        except ProxyError as error:
            self._on_lost = None
            if error.details.get("backend_code") == STALE_FENCING_CODE:
                self._mark_lost("the backend refused the fencing token as stale")
                raise self.stale_error() from None
            raise
        finally:
            self._on_lost = None
            lost.take_back()  # the execution ended before the cancel reached it: its own ending stands

    def lost_error(self) -> ProxyError:
        details = {"resources": [r.id for r in self.resources], "fencing_token": self.fencing_token}
        if self.is_write:
            return ProxyError("lock_lost", "The call lost its resource lock while the write was in flight; "
                              "whether it was applied is unknown.", details=details, phase="lock",
                              attempted=True, committed=None)
        return ProxyError("lock_lost", "The call lost its resource lock while the read ran; the read was abandoned.",
                          details=details, phase="lock", attempted=True, committed=False,
                          retryable=True, resolution="retry")

    def stale_error(self) -> ProxyError:
        return ProxyError("lock_lost", "The backend refused the call's fencing token: a newer lock holder came "
                          "first. Nothing was applied.",
                          details={"resources": [r.id for r in self.resources], "fencing_token": self.fencing_token,
                                   "backend_code": STALE_FENCING_CODE},
                          phase="lock", attempted=True, committed=False, retryable=True, resolution="retry_same_key")

    async def release(self, *, unknown: bool = False) -> None:
        """Stop renewing and drop the locks; safe to call twice and under cancellation. ``unknown``: the
        call's outcome is unknown, so its freeze marks stay (no other write runs on its resources until the
        operation settles)."""
        if self._released:
            return
        self.stop_renewing()
        await self._manager._forget(self.keys, self.owner, self._frozen_by(unknown), self._marks())
        await self.renewer_stopped()

    def release_in(self, trip: store.RoundTrip, *, unknown: bool = False) -> None:
        """``release`` as one step of the commit stage's round trip; errors only logged (the lease expires).
        Await ``renewer_stopped`` after the trip is sent."""
        if self._released:
            return
        self.stop_renewing()
        self.add_release(trip, unknown=unknown)

    def add_release(self, trip: store.RoundTrip, *, unknown: bool) -> None:
        """The release as one step of ``trip``, once ``stop_renewing`` was called (by ``release_in``, or by the
        commit stage, whose chained release did not run)."""
        step = self.release_step(unknown=unknown)

        def released(reply: Any) -> None:
            if isinstance(reply, BaseException):
                log.warning("could not release locks of owner %s (%s); they expire with their lease", self.owner,
                            type(reply).__name__)

        trip.add(step.script, step.keys, step.args, released)

    def release_step(self, *, unknown: bool = False) -> store.Then:
        """The release as a script call (the commit stage chains it after the outcome record). Call
        ``stop_renewing`` before sending it: a renewal after it would find the lease gone."""
        return store.Then(self._manager._release, self.keys,
                          [self.owner, self._frozen_by(unknown) or "", _now_ms(), *self._marks()])

    def _marks(self) -> list[str]:
        """Per key of the lease, "1" where a freeze would mark it (the exclusive resources)."""
        return ["1" if r.access == "exclusive" else "0" for r in self.resources]

    def _frozen_by(self, unknown: bool) -> str | None:
        """The operation a release freezes the exclusive resources for: a write's, when its outcome is unknown."""
        return self.operation if unknown and self.is_write and self.operation else None

    def stop_renewing(self) -> None:
        """No more renewals: the lease is being released (``released`` is True from here on)."""
        self._released = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._renewer is not None:
            self._renewer.cancel()

    async def renewer_stopped(self) -> None:
        if self._renewer is not None and not self._renewer.done():
            await asyncio.gather(self._renewer, return_exceptions=True)


def _now_ms() -> int:
    """When a freeze mark was set (informational: the mark never expires)."""
    return int(time.time() * 1000)


def _abandon(awaitable: Awaitable[Any]) -> None:
    """An execution that will never be awaited: cancel a future, close a coroutine."""
    if asyncio.isfuture(awaitable):
        awaitable.cancel()
    elif asyncio.iscoroutine(awaitable):
        awaitable.close()
