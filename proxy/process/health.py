"""Health: liveness, readiness and the gauges refreshed when Prometheus scrapes.

Owns: the readiness checks (not draining after SIGTERM; OPA answers ``/health``, asked through ``opa_control``; every Redis
master answers ``PING``: the standalone server, Sentinel's current master, each Cluster master;
every master's ``maxmemory-policy`` is ``noeviction`` unless ``redis.accept_eviction``, proxy/eviction.py;
the registry holds at least one tool), each bounded by its dependency's own
timeout and run concurrently; the ``toolproxy_dependency_up`` gauge they set;
and refreshing the gauges that are read from Redis (open unknowns) right
before an exposition. Results are cached for ``CACHE_S`` so frequent probes
and scrapes cost at most one check per dependency per interval.
Must never: block longer than the configured dependency timeouts, raise to a
probe handler, or put hostnames or exception text into a probe answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

from .. import store
from ..config import Config
from ..eviction import EvictionWatch
from ..telemetry.metrics import Metrics
from ..policy.opa_control import OpaControl, read_token
from ..registry import Registry
from ..transactions.unknowns import UnknownIndex
from ..wire.http import HttpWire

log = logging.getLogger("toolproxy.health")

CACHE_S = 1.0


@dataclass(frozen=True)
class Readiness:
    ready: bool
    checks: Mapping[str, bool] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"status": "ready" if self.ready else "not_ready", "checks": dict(self.checks)}


class Health:
    def __init__(self, *, config: Config, registry: Registry,
                 redis: store.Client, metrics: Metrics, unknowns: UnknownIndex, eviction: EvictionWatch,
                 opa_wire: HttpWire, accepting: Callable[[], bool] = lambda: True,
                 gauge_refreshers: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        self._config = config
        self._registry = registry
        # One attempt per probe, bounded by OPA's timeout (the probe itself is the retry).
        self._opa = OpaControl(config.opa.http_base, opa_wire, timeout_s=config.opa.timeout_ms / 1000.0,
                               token=read_token(config.opa.token_file))
        self._redis = redis
        self._accepting = accepting  # False while the process drains (SIGTERM): not ready, whatever else holds
        self._metrics = metrics
        self._unknowns = unknowns
        self._eviction = eviction
        self._refreshers = tuple(gauge_refreshers)  # other stages' Redis-backed gauges (pending approvals)
        self._cached: tuple[float, Readiness] | None = None
        self._lock = asyncio.Lock()

    async def readiness(self, *, use_cache: bool = True) -> Readiness:
        if not self._accepting():  # draining: not ready at once, whatever the dependencies say
            return Readiness(ready=False, checks={"accepting_calls": False})
        async with self._lock:  # concurrent probes share one check
            now = time.monotonic()
            if use_cache and self._cached is not None and now - self._cached[0] < CACHE_S:
                return self._cached[1]
            opa_ok, redis_ok, policy_ok = await asyncio.gather(self._check_opa(), self._check_redis(),
                                                               self._check_eviction())
            self._metrics.dependency_up.labels("opa").set(1 if opa_ok else 0)
            self._metrics.dependency_up.labels("redis").set(1 if redis_ok else 0)
            checks = {"opa": opa_ok, "redis": redis_ok, "redis_policy": policy_ok,
                      "registry": len(self._registry) > 0}
            result = Readiness(ready=all(checks.values()), checks=checks)
            self._cached = (time.monotonic(), result)
            return result

    async def before_scrape(self) -> None:
        """Bring Redis-backed gauges and dependency health up to date (bounded, never raises)."""
        readiness = await self.readiness()
        if not readiness.checks.get("redis"):
            return  # keep the last known values; dependency_up{redis} already says why
        # the gauges keep their values until the next scrape
        with store.logged_on_fault(log, "could not refresh the Redis-backed gauges",
                                   faults=store.STORE_OR_SOCKET_FAULTS):
            async with asyncio.timeout(self._config.redis.timeout_ms / 1000.0):
                stats = await self._unknowns.stats()
                for refresh in self._refreshers:
                    await refresh()
            self._metrics.open_unknowns.set(stats.open)
            self._metrics.oldest_open_unknown_age.set(stats.oldest_age_s)

    async def _check_opa(self) -> bool:
        return await self._opa.healthy()

    async def _check_redis(self) -> bool:
        """Not ready while a master does not answer (within the store's timeout)."""
        return await store.degrade_on_fault(self._bounded(store.masters_reachable(self._redis)), lambda _: False,
                                            faults=store.STORE_OR_SOCKET_FAULTS)

    async def _check_eviction(self) -> bool:
        """Every master's maxmemory-policy keeps the proxy's records (or the risk is accepted); also counts
        the evictions since the last check. False while a master cannot be read."""
        return await store.degrade_on_fault(self._bounded(self._eviction.check()), lambda _: False,
                                            faults=store.STORE_OR_SOCKET_FAULTS)

    async def _bounded(self, check: Awaitable[bool]) -> bool:
        async with asyncio.timeout(self._config.redis.timeout_ms / 1000.0):
            return await check
