"""Quota stage: rate limits and concurrency quotas shared by the fleet, and backend back-pressure.

Runs once per call, after the OPA decision (which may name a quota class) and
before anything is reserved or sent (no approval spent, no idempotency record,
no lock, no backend request). Every limit that applies to the call
(``proxy/quota_rules.py``) is checked and counted in ONE Lua step — one Redis
round trip — and a call no limit applies to costs none.

* Rate limits are GCRA (the "virtual scheduling" form of a token bucket): one
  key per limit holds the theoretical arrival time; a call is admitted when it
  is no more than ``(burst - 1)`` emission intervals early. Over ``W`` seconds a
  limit admits at most ``burst + W * rate / period`` calls, and a refusal knows
  exactly when the next call fits (``Retry-After``).
* Concurrency quotas are slots: a sorted set per limit whose members are the
  calls in flight, scored by their lease expiry (Redis's clock). The lease is
  the call's longest possible life plus ``quotas.slot_grace_ms``, so a proxy
  that crashes mid-call leaks its slots only until then; a finished call
  releases its slots at once (one more round trip, only for concurrency quotas).
* All or nothing: when any limit refuses, nothing is counted.

Over a limit -> ``rate_limited`` (429, ``Retry-After``; ``details.limit`` names
the limit — ``tenant``, ``subject``, ``class:<c>``, ``tool:<t>``,
``backend:<b>`` or ``fleet`` — never another tenant's figures;
``details.retry_after_s``). A batch call (``RequestMeta.wait_for_quota``, set by
``BatchPlan.request``) waits for the limit within the batch deadline instead.

Redis unreachable: each limit's ``on_redis_error`` decides — ``closed``
refuses (``dependency_unavailable``, ``details.dependency: state_store``), ``open``
lets the call go uncounted, ``auto`` (the default) is closed for write tools
and open for reads: the idempotency stage's rule (a write cannot run without
its record anyway; a read proceeds). One closed limit closes the call.

Owns: the admission script, slot release, the quota metrics, and calling the
back-pressure guard (``proxy/backpressure.py``) before and after the call.
Must never: count a call twice, hold a slot past the call, change the outcome of
a call that was sent, or let a Redis exception escape as a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
from dataclasses import dataclass
from typing import Any


from . import store
from .backpressure import BackendGuard
from .config import Config
from .deadline import Deadline
from .errors import ProxyError
from .identity import Caller
from .telemetry.metrics import Metrics
from .quota_rules import AppliedLimit, LimitSpec, QuotaRules, parse_spec
from .registry import Registry, ToolContract

log = logging.getLogger("toolproxy.quotas")

QUOTA_TAG = "q"  # every quota key shares one Cluster hash tag: all of a call's limits in one script, one slot
CONCURRENCY_RETRY_CAP_MS = 1000  # a full concurrency quota cannot know when a slot frees: hint at most this

# KEYS one per counter. ARGV[1] member (the call's slot id), ARGV[2] slot lease ms, then per KEYS[i]:
# ARGV[3i] 'r' (rate) or 'c' (concurrency), ARGV[3i+1] emission ms | slots, ARGV[3i+2] burst | unused.
# Reply: {1} admitted (every counter counted), or {0, i, retry ms}: KEYS[i] refused, nothing changed.
_ADMIT = store.lua("quotas.admit", """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local member, lease = ARGV[1], tonumber(ARGV[2])
local worst, worst_ms = 0, -1
local tats = {}
for i = 1, #KEYS do
  local kind, a, b = ARGV[3 * i], tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
  local wait = 0
  if kind == 'r' then
    local tat = math.max(tonumber(redis.call('GET', KEYS[i]) or '0'), now)
    wait = tat - now - (b - 1) * a
    tats[i] = tat + a
  else
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    if redis.call('ZCARD', KEYS[i]) >= a then
      local first = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
      wait = math.max(1, math.min(tonumber(first[2]) - now, tonumber(ARGV[3 * i + 2])))
    end
  end
  if wait > 0 and wait > worst_ms then worst, worst_ms = i, wait end
end
if worst > 0 then return {0, worst, math.ceil(worst_ms)} end
for i = 1, #KEYS do
  if ARGV[3 * i] == 'r' then
    redis.call('SET', KEYS[i], string.format('%.3f', tats[i]), 'PX', math.ceil(tats[i] - now) + 1)
  else
    redis.call('ZADD', KEYS[i], now + lease, member)
    if redis.call('PTTL', KEYS[i]) < lease then redis.call('PEXPIRE', KEYS[i], math.ceil(lease) + 1000) end
  end
end
return {1}
""")

# KEYS slot sets; ARGV[1] member.
_RELEASE = store.lua("quotas.release", """
for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
return 1
""")


@dataclass(frozen=True)
class Ticket:
    """What a call holds from the quota stage until it finishes."""

    backend: str | None = None
    member: str = ""
    slot_keys: tuple[str, ...] = ()
    slot_limits: tuple[str, ...] = ()  # names of the concurrency limits it holds (in-flight gauge)
    probe: bool = False               # this call is the half-open breaker's probe


NO_TICKET = Ticket()


def build_rules(config: Config, registry: Registry) -> QuotaRules:
    """The rules from the registry and the configuration (the config checked every text already)."""
    q = config.quotas

    def spec(text: str) -> LimitSpec | None:
        return parse_spec(text) if text.strip() else None

    return QuotaRules(
        tools={tool.name: tool.quota for tool in registry.all() if tool.quota is not None},
        backends={name: s.quota for name, s in registry.services.items() if s.quota is not None},
        tenant=spec(q.tenant), tenants={k: parse_spec(v) for k, v in q.tenants.items()},
        subject=spec(q.subject), fleet=spec(q.fleet), classes={k: parse_spec(v) for k, v in q.classes.items()})


class QuotaStage:
    def __init__(self, redis: store.Client, config: Config, registry: Registry, metrics: Metrics,
                 guard: BackendGuard) -> None:
        self._redis = redis
        self._enabled = config.quotas.enabled
        self._config = config.quotas
        self._prefix = config.redis.key_prefix
        self._metrics = metrics
        # Without a deadline a call lives at most: lock wait + duplicate wait + the tool's timeout.
        self._undeadlined_s = (config.locks.max_wait_ms + config.idempotency.max_wait_ms) / 1000.0
        self.rules = build_rules(config, registry)
        self.guard = guard
        self._admit = store.script(redis, _ADMIT)
        self._release = store.script(redis, _RELEASE)

    async def admit(self, caller: Caller, tool: ToolContract, quota_class: str | None, deadline: Deadline, *,
                    wait: bool) -> Ticket:
        """Admit the call or raise ``rate_limited`` / ``dependency_unavailable`` (nothing counted then)."""
        if not self._enabled:
            return NO_TICKET
        backend = tool.backend_name
        probe = await self.guard.admit(backend)
        try:
            try:
                limits = self.rules.applicable(tenant=caller.tenant, subject=caller.subject, tool=tool.name,
                                               backend=backend, quota_class=quota_class)
            except KeyError:
                log.warning("the policy named quota class %r, which quotas.classes does not define", quota_class)
                raise ProxyError("forbidden", "The call is not permitted.", details={"reason": "policy_error"},
                                 phase="quota") from None
            if not limits:
                return Ticket(backend=backend, probe=probe)
            # The store away: per quotas' ``unreachable`` setting (fail closed by default)
            return await store.degrade_on_fault(self._count(limits, tool, deadline, wait, backend, probe),
                                                lambda fault: self._unreachable(limits, tool, backend, probe, fault))
        except BaseException:
            if probe:
                await self.guard.abandon_probe(backend)
            raise

    async def _count(self, limits: tuple[AppliedLimit, ...], tool: ToolContract, deadline: Deadline, wait: bool,
                     backend: str, probe: bool) -> Ticket:
        member = secrets.token_hex(8)
        counters = self._counters(limits)
        args: list[Any] = [member, self._lease_ms(tool, deadline)]
        for limit, kind, _ in counters:
            args += ([kind, f"{limit.spec.emission_ms:.6f}", limit.spec.bucket] if kind == "r"
                     else [kind, limit.spec.concurrency, CONCURRENCY_RETRY_CAP_MS])
        keys = [key for _, _, key in counters]
        poll_s = 0.005
        while True:
            reply = await store.redis_call(self._admit(keys=keys, args=args))
            if int(reply[0]) == 1:
                return self._admitted(limits, counters, backend, member, probe)
            limit, kind, _ = counters[int(reply[1]) - 1]
            retry_s = int(reply[2]) / 1000.0
            # A batch call waits: exactly until the rate allows it, or polling (with jitter) for a slot.
            pause = retry_s if kind == "r" else min(retry_s, poll_s * random.uniform(0.5, 1.0))
            if not wait or deadline.budget() <= pause:
                self._metrics.quota_decisions.labels(limit.name, "limited").inc()
                raise ProxyError("rate_limited", "Too many calls: a quota is exhausted; retry after the given time.",
                                 details={"limit": limit.name, "retry_after_s": round(max(retry_s, 0.001), 3)},
                                 phase="quota", attempted=False, committed=False)
            self._metrics.quota_decisions.labels(limit.name, "waited").inc()
            await asyncio.sleep(pause)
            poll_s = min(poll_s * 2, self._config.wait_poll_max_ms / 1000.0)

    def _counters(self, limits: tuple[AppliedLimit, ...]) -> list[tuple[AppliedLimit, str, str]]:
        """(limit, kind, key) of every counter the limits keep: ``r`` a rate's bucket, ``c`` concurrency slots."""
        counters: list[tuple[AppliedLimit, str, str]] = []
        for limit in limits:
            base = store.key(self._prefix, "quota", QUOTA_TAG, limit.key_suffix())
            if limit.spec.rate:
                counters.append((limit, "r", base + ":rate"))
            if limit.spec.concurrency:
                counters.append((limit, "c", base + ":slots"))
        return counters

    def _admitted(self, limits: tuple[AppliedLimit, ...], counters: list[tuple[AppliedLimit, str, str]],
                  backend: str, member: str, probe: bool) -> Ticket:
        held = tuple((limit.name, key) for limit, kind, key in counters if kind == "c")
        for limit in limits:
            self._metrics.quota_decisions.labels(limit.name, "allowed").inc()
        for name, _ in held:
            self._metrics.quota_in_flight.labels(name).inc()
        return Ticket(backend=backend, member=member, slot_keys=tuple(k for _, k in held),
                      slot_limits=tuple(n for n, _ in held), probe=probe)

    def _lease_ms(self, tool: ToolContract, deadline: Deadline) -> int:
        remaining = deadline.remaining()
        life_s = remaining if remaining is not None else self._undeadlined_s + tool.timeout_ms / 1000.0
        return int(max(life_s, 0) * 1000) + self._config.slot_grace_ms

    def _unreachable(self, limits: tuple[AppliedLimit, ...], tool: ToolContract, backend: str, probe: bool,
                     exc: Exception) -> Ticket:
        closed = [limit.name for limit in limits if limit.spec.fails_closed(tool.is_write)]
        log.warning("quota store unreachable (%s): %s", type(exc).__name__,
                    "refusing the call" if closed else "admitting the call uncounted")
        for limit in limits:
            self._metrics.quota_decisions.labels(limit.name, "unavailable" if closed else "skipped").inc()
        if closed:
            raise store.unavailable("The quota store is unreachable; nothing was done.", phase="quota",
                                    limit=closed[0])
        return Ticket(backend=backend, probe=probe)

    async def finish(self, ticket: Ticket, *, sent: bool, error: ProxyError | None) -> None:
        """The call is over: free its slots (shielded: this runs after a cancel too) and tell the guard."""
        if ticket.slot_keys:
            for name in ticket.slot_limits:
                self._metrics.quota_in_flight.labels(name).dec()
            with store.logged_on_fault(log, "could not release quota slots; their lease will"):
                await asyncio.shield(self._release(keys=list(ticket.slot_keys), args=[ticket.member]))
        if ticket.backend is not None:
            # the call's outcome stands; the breaker learns from the next one
            with store.logged_on_fault(log, "back-pressure could not learn from a call to backend %s", ticket.backend):
                await self.guard.observe(ticket.backend, sent=sent, error=error, probe=ticket.probe)


def retry_after_header(error: ProxyError | None) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) for an envelope whose error says when to retry."""
    if error is None:
        return {}
    seconds = error.details.get("retry_after_s")
    if error.code in ("rate_limited", "dependency_unavailable") and isinstance(seconds, (int, float)):
        return {"Retry-After": str(max(1, math.ceil(seconds)))}
    return {}
