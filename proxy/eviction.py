"""Eviction: whether Redis may drop the proxy's records, and the evictions it did.

Owns: the rule that only ``maxmemory-policy noeviction`` keeps the proxy's state (every other policy may
evict an operation record, an approval or a lock; the ``volatile-*`` ones too, since those records carry
a TTL; an evicted operation record lets a same-key retry run a write a second time), reading each
master's policy (``INFO memory``) and eviction count (``INFO stats``): the standalone server, Sentinel's
current master, every Cluster master; the start-up refusal (one line naming the master and its policy)
and the readiness verdict, both waived only by ``redis.accept_eviction``; counting the evictions seen
between two reads (``toolproxy_redis_evicted_keys_total``) and the masters that may evict
(``toolproxy_redis_evicting_masters``).
Must never: change the store's configuration (the policy is the operator's, and managed Redis often
disables CONFIG), or put a master's address into a probe answer (only into the operator's log line).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

from . import store
from .config import ConfigError, RedisConfig
from .telemetry.metrics import Metrics

log = logging.getLogger("toolproxy.eviction")

SAFE_POLICY = "noeviction"
GROWTH_LOG_INTERVAL_S = 60.0


def may_evict(policy: str) -> bool:
    """Whether a ``maxmemory-policy`` may remove the proxy's keys: every policy but ``noeviction``
    (``volatile-*`` included: records, approvals and locks all carry a TTL). An unknown policy ("")
    may evict too."""
    return policy != SAFE_POLICY


@dataclass(frozen=True)
class MasterMemory:
    """One master as INFO described it: its name (``host:port``), ``maxmemory_policy`` ("" when INFO
    did not say or was refused) and ``evicted_keys`` (None when unknown)."""

    node: str
    policy: str
    evicted_keys: int | None


@dataclass(frozen=True)
class Verdict:
    masters: tuple[MasterMemory, ...]
    accepted: bool  # redis.accept_eviction

    @property
    def evicting(self) -> tuple[MasterMemory, ...]:
        return tuple(master for master in self.masters if may_evict(master.policy))

    @property
    def ok(self) -> bool:
        return self.accepted or not self.evicting

    def describe(self) -> str:
        """``allkeys-lru on 10.0.0.5:6379, volatile-lru on 10.0.0.6:6379`` (the masters that may evict)."""
        return ", ".join(f"{master.policy or 'an unreadable maxmemory-policy'} on {master.node}"
                         for master in self.evicting)

    def refusal(self) -> str:
        """The one start-up line."""
        return (f"redis: maxmemory-policy {self.describe()} may evict the proxy's records (an evicted operation "
                f"record lets a same-key retry run a write twice); set maxmemory-policy noeviction on every "
                f"master, or set redis.accept_eviction: true (TOOLPROXY_REDIS_ACCEPT_EVICTION) to accept that risk")


async def read_masters(client: store.Client) -> tuple[MasterMemory, ...]:
    """Every master's policy and eviction count (a master that refuses INFO has an unknown policy, "");
    an unreachable one raises ``StoreError``."""
    memory = await store.masters_info(client, "memory")
    stats = dict(await store.masters_info(client, "stats"))
    return tuple(MasterMemory(node, str((fields or {}).get("maxmemory_policy", "")),
                              _count((stats.get(node) or {}).get("evicted_keys")))
                 for node, fields in memory)


def _count(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class EvictionWatch:
    """Checks the masters' policy at start-up (``at_startup``) and at each readiness check (``check``),
    counting the evictions seen between two reads."""

    def __init__(self, config: RedisConfig, redis: store.Client, metrics: Metrics) -> None:
        self._accept = config.accept_eviction
        self._timeout_s = config.timeout_ms / 1000.0
        self._address = config.address
        self._redis = redis
        self._metrics = metrics
        self._last: dict[str, int] = {}  # evicted_keys per master at the last read
        self._refused: str | None = None  # the last refusal logged (logged again only when it changes)
        self._growth_logged_at = float("-inf")
        self._startup_warnings: list[str] = []  # logged by log_startup_warnings once start-up succeeded

    async def at_startup(self) -> None:
        """Raise ``ConfigError`` (one line) if a master may evict and the operator has not accepted it.
        An unreachable Redis is not refused here: readiness checks the policy once it answers. The warnings
        this check has (an unreadable policy, an accepted risk) wait for ``log_startup_warnings``: a later
        refusal of the start-up stays one line."""
        verdict = await store.degrade_on_fault(self._read_bounded(), self._unanswered_at_startup,
                                               faults=store.STORE_OR_SOCKET_FAULTS)
        if verdict is None:
            return
        if not verdict.ok:
            raise ConfigError(verdict.refusal())
        if verdict.evicting:
            self._startup_warnings.append(
                f"redis: maxmemory-policy {verdict.describe()} may evict the proxy's records; accepted by "
                f"redis.accept_eviction (an evicted operation record lets a same-key retry run a write twice; "
                f"evictions are counted in toolproxy_redis_evicted_keys_total)")

    async def _read_bounded(self) -> Verdict:
        async with asyncio.timeout(self._timeout_s):
            return await self._read()

    def _unanswered_at_startup(self, fault: Exception) -> None:
        self._startup_warnings.append(
            f"redis: {self._address} does not answer at start-up ({type(fault).__name__}): calls that need it "
            f"fail with dependency_unavailable and /readyz stays not ready until every master answers (and "
            f"with noeviction); check the address and that Redis runs")

    def log_startup_warnings(self) -> None:
        """Log what ``at_startup`` found worth a warning, once the whole runtime has opened."""
        for line in self._startup_warnings:
            log.warning("%s", line)
        self._startup_warnings.clear()

    async def check(self) -> bool:
        """The readiness verdict: every master answers with ``noeviction`` (or eviction is accepted).
        Raises ``StoreError`` / ``TimeoutError`` / ``OSError`` when a master cannot be read."""
        verdict = await self._read()
        if not verdict.ok:
            line = verdict.refusal()
            if line != self._refused:
                log.error("not ready: %s", line)
            self._refused = line
        elif self._refused is not None:
            log.info("redis: every master's maxmemory-policy is noeviction again; ready")
            self._refused = None
        return verdict.ok

    async def _read(self) -> Verdict:
        masters = await read_masters(self._redis)
        self._observe(masters)
        return Verdict(masters, self._accept)

    def _observe(self, masters: tuple[MasterMemory, ...]) -> None:
        """Count the growth of each master's ``evicted_keys`` since the last read (a lower value means the
        server restarted or reset its stats: all of it is new); the first read of a master is its baseline."""
        self._metrics.redis_evicting_masters.set(sum(1 for master in masters if may_evict(master.policy)))
        grown: dict[str, int] = {}
        for master in masters:
            if master.evicted_keys is None:
                continue
            last = self._last.get(master.node)
            if last is not None and master.evicted_keys != last:
                grown[master.node] = master.evicted_keys - last if master.evicted_keys > last \
                    else master.evicted_keys
            self._last[master.node] = master.evicted_keys
        total = sum(grown.values())
        if total <= 0:
            return
        self._metrics.redis_evicted_keys.inc(total)
        now = time.monotonic()
        if now - self._growth_logged_at >= GROWTH_LOG_INTERVAL_S:
            self._growth_logged_at = now
            log.error("redis evicted %d key(s) since the last check (%s): operation records may be lost, and a "
                      "same-key retry of a lost one runs again", total, _per_master(grown))


def _per_master(grown: Mapping[str, int]) -> str:
    return ", ".join(f"{count} on {node}" for node, count in sorted(grown.items()))
