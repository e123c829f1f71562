"""Backend back-pressure: pauses a backend asked for, and a circuit breaker per backend service.

Owns: the state of every backend service as the fleet sees it — ``closed``
(calls go through), ``paused`` (the backend answered 429 or 503 with
``Retry-After``: no new call until then; refused as ``rate_limited`` resp.
``dependency_unavailable`` at once) and ``open`` (its breaker tripped: refused
as ``dependency_unavailable`` until ``open_s`` passed, then exactly one probe
call goes through fleet-wide; its success closes the breaker, its failure opens
it again) — the failure-ratio window that trips a breaker, and sharing every
transition with the other replicas through Redis.

How the fleet shares it without a round trip per call: a transition is one Lua
step that records it in the hash ``<prefix>:bp:{bp}`` (field = backend,
``<state>:<until ms>:<code>``) and PUBLISHes it on ``<prefix>:bp-events``. Each
process mirrors the hash in memory (loaded on (re)subscribe, then kept current
by the channel), so a call to a healthy backend costs no Redis command; only a
half-open breaker's probe claim (``SET NX``) and the transitions do. Durations
travel as "milliseconds from now" and are applied to the receiver's monotonic
clock, so clock skew between hosts cannot shorten a pause.

Each process counts the failure ratio of its own calls (a window per backend);
the first process whose window crosses the threshold opens the breaker for
everyone. Failures are what says the service is unwell: the backend
unreachable, timing out, 5xx (``dependency_unavailable``, ``upstream_error*``,
``timeout*`` from the execute phase). A business refusal (4xx) is an answer,
not a failure.

Must never: change the outcome of a call already sent (a write that timed out
stays ``unknown``; only the *next* calls are refused), add a Redis command to a
call whose backend is closed, or expose a backend's address (backends are
named by registry service name).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Mapping


from . import store
from .config import QuotasConfig
from .errors import ProxyError
from .telemetry.metrics import Metrics
from .registry import Registry

log = logging.getLogger("toolproxy.backpressure")

FAILURE_CODES = frozenset({"dependency_unavailable", "upstream_error", "upstream_error_unknown", "timeout",
                           "timeout_unknown"})
PROBE_BUSY_RETRY_S = 1.0

# KEYS[1] state hash, KEYS[2] probe claim. ARGV[1] backend, ARGV[2] closed|paused|open, ARGV[3] ms from now,
# ARGV[4] code, ARGV[5] channel. A pause never shortens a longer one already recorded. Reply: ms from now.
_TRANSITION = store.lua("backpressure.transition", """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local name, state, ms, code = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if state == 'closed' then
  redis.call('HDEL', KEYS[1], name)
  ms = 0
else
  local untl = now + ms
  local current = redis.call('HGET', KEYS[1], name)
  if current and state == 'paused' then
    local cstate, cuntil = string.match(current, '^(%a+):(%d+)')
    if cstate == 'paused' and tonumber(cuntil) > untl then untl = tonumber(cuntil) end
  end
  redis.call('HSET', KEYS[1], name, state .. ':' .. string.format('%d', untl) .. ':' .. code)
  ms = untl - now
end
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[5], name .. ' ' .. state .. ' ' .. string.format('%d', ms) .. ' ' .. code)
return ms
""")

# KEYS[1] state hash. Reply: {now ms, field, value, field, value, ...}; paused entries that ran out are dropped.
_SNAPSHOT = store.lua("backpressure.snapshot", """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local state, untl = string.match(fields[i + 1], '^(%a+):(%d+)')
  if state == 'paused' and tonumber(untl) <= now then
    redis.call('HDEL', KEYS[1], fields[i])
  else
    out[#out + 1] = fields[i]
    out[#out + 1] = fields[i + 1]
  end
end
return out
""")


@dataclass(frozen=True)
class BreakerSettings:
    enabled: bool
    failure_ratio: float
    min_calls: int
    window_s: float
    open_s: float


@dataclass
class _Backend:
    state: str = "closed"          # closed | paused | open (open past `until` = half-open)
    until: float = 0.0             # time.monotonic() when the pause / open period ends
    code: str = ""                 # paused: the code refused calls get
    outcomes: collections.deque = field(default_factory=collections.deque)  # (monotonic, failed) of own calls
    failures: int = 0              # how many of `outcomes` failed (kept with it: no window walk per call)

    def forget(self) -> None:
        self.outcomes.clear()
        self.failures = 0


class BackendGuard:
    """One per process: refuses calls to paused or open backends, learns from every sent call's outcome."""

    def __init__(self, redis: store.Client, config: QuotasConfig, registry: Registry, *, key_prefix: str,
                 metrics: Metrics) -> None:
        self._redis = redis
        self._config = config
        self._registry = registry
        self._metrics = metrics
        self._hash = store.key(key_prefix, "bp", "bp")
        self._prefix = key_prefix
        self._channel = f"{key_prefix}:bp-events"
        self._transition = store.script(redis, _TRANSITION)
        self._snapshot = store.script(redis, _SNAPSHOT)
        self._backends: dict[str, _Backend] = {}
        self._listener = store.ChannelListener(redis, self._channel, self._apply_event,
                                               on_subscribed=self._subscribed, what="back-pressure channel", log=log)
        self.synced = asyncio.Event()  # set once the first snapshot is loaded (tests wait for it)

    def settings(self, backend: str) -> BreakerSettings:
        c = self._config
        own: Mapping[str, Any] = {}
        service = self._registry.services.get(backend)
        if service is not None:
            own = service.breaker
        return BreakerSettings(enabled=own.get("enabled", c.breaker_enabled),
                               failure_ratio=own.get("failure_ratio", c.breaker_failure_ratio),
                               min_calls=own.get("min_calls", c.breaker_min_calls),
                               window_s=own.get("window_s", c.breaker_window_s),
                               open_s=own.get("open_s", c.breaker_open_s))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._listener.start()

    async def stop(self) -> None:
        await self._listener.stop()

    async def _subscribed(self) -> None:
        await self._load()  # after subscribing: no transition falls between the two
        self.synced.set()

    async def _load(self) -> None:
        reply = await store.redis_call(self._snapshot(keys=[self._hash]))
        now_ms = int(reply[0])
        seen = set()
        for name_raw, value_raw in zip(reply[1::2], reply[2::2]):
            name = _text(name_raw)
            state, until_ms, code = _text(value_raw).split(":", 2)
            self._set(name, state, max(0, int(until_ms) - now_ms), code)
            seen.add(name)
        for name, backend in self._backends.items():
            if name not in seen and backend.state != "closed":
                self._set(name, "closed", 0, "")

    def _apply_event(self, raw: Any) -> None:
        try:
            name, state, ms, code = (_text(raw).split(" ") + [""])[:4]
            self._set(name, state, int(ms), code)
        except ValueError:
            log.warning("ignored a malformed back-pressure event")

    def _set(self, name: str, state: str, ms: int, code: str) -> None:
        backend = self._backends.setdefault(name, _Backend())
        if state not in ("closed", "paused", "open"):
            return
        if state == "paused" and backend.state == "open":
            return  # an open breaker stays open (it ends by a probe, not a timer)
        backend.state, backend.code = state, code
        backend.until = time.monotonic() + ms / 1000.0
        if state != "paused":
            backend.forget()  # a new period starts with a fresh window
        self._metrics.breaker_open.labels(name).set(1 if state == "open" else 0)
        self._metrics.backend_paused.labels(name).set(1 if state == "paused" else 0)

    # ------------------------------------------------------------------ per call

    async def admit(self, backend: str) -> bool:
        """Raise if the backend takes no new call now; True if this call is the half-open breaker's probe.
        No Redis command unless the breaker is half-open."""
        state = self._backends.get(backend)
        if state is None or state.state == "closed":
            return False
        left = state.until - time.monotonic()
        if state.state == "paused":
            if left > 0:
                raise self._refusal(backend, state.code or "rate_limited", "backend_retry_after", left)
            state.state = "closed"
            self._metrics.backend_paused.labels(backend).set(0)
            return False
        if left > 0:
            raise self._refusal(backend, "dependency_unavailable", "breaker_open", left)
        if await self._claim_probe(backend):
            self._metrics.backpressure_events.labels(backend, "probe").inc()
            return True
        raise self._refusal(backend, "dependency_unavailable", "breaker_open", PROBE_BUSY_RETRY_S)

    async def _claim_probe(self, backend: str) -> bool:
        settings = self.settings(backend)
        claimed = await store.degrade_on_fault(store.redis_call(self._redis.set(
            self._probe_key(backend), secrets.token_hex(8), nx=True, px=int(settings.open_s * 1000))),
            lambda _: False)  # cannot coordinate one probe: keep refusing (open is the safe state)
        return bool(claimed)

    async def abandon_probe(self, backend: str) -> None:
        """The probe call never reached the backend (refused later, cancelled): let another call probe."""
        # best effort: the claim runs out with its own expiry (a cleanup must not hide the call's outcome)
        with store.logged_on_fault(log, "could not free the probe of backend %s", backend, level=logging.DEBUG,
                                   faults=store.STORE_OR_SOCKET_FAULTS):
            await asyncio.shield(store.translated(self._redis.delete(self._probe_key(backend))))

    def _probe_key(self, backend: str) -> str:
        return store.key(self._prefix, "bp", "bp", "probe", backend)

    def _refusal(self, backend: str, code: str, reason: str, left_s: float) -> ProxyError:
        self._metrics.backpressure_events.labels(backend, "refused").inc()
        retry_after = max(0.001, round(left_s, 3))
        message = ("The tool's backend asked for fewer calls; retry later." if reason == "backend_retry_after"
                   else "The tool's backend is failing; calls to it are paused.")
        return ProxyError(code, message, phase="quota", attempted=False, committed=False,
                          details={"limit": f"backend:{backend}", "reason": reason, "retry_after_s": retry_after},
                          retryable=True, resolution="retry")

    async def observe(self, backend: str, *, sent: bool, error: ProxyError | None, probe: bool) -> None:
        """Learn from one finished call: a Retry-After pauses the backend, the ratio may open its breaker,
        a probe's outcome closes or re-opens it. The call's own outcome is never changed here."""
        if not sent:
            if probe:
                await self.abandon_probe(backend)
            return
        from_backend = error if error is not None and error.phase == "execute" else None
        failed = from_backend is not None and from_backend.code in FAILURE_CODES
        if from_backend is not None:
            await self._pause_if_asked(backend, from_backend)
        settings = self.settings(backend)
        if probe:
            opened = "opened" if failed else "closed"
            self._metrics.backpressure_events.labels(backend, opened).inc()
            await self._record(backend, *(("open", settings.open_s, "dependency_unavailable") if failed
                                          else ("closed", 0, "")))
            return
        if settings.enabled:
            await self._count_outcome(backend, settings, failed)

    async def _pause_if_asked(self, backend: str, error: ProxyError) -> None:
        """A 429, or a 503 with Retry-After, pauses the backend fleet-wide (capped at max_pause_s)."""
        retry_after = error.details.get("retry_after_s")
        if not (isinstance(retry_after, (int, float)) and retry_after > 0):
            return
        if error.code != "rate_limited" and error.details.get("backend_status") != 503:
            return
        code = "rate_limited" if error.code == "rate_limited" else "dependency_unavailable"
        self._metrics.backpressure_events.labels(backend, "paused").inc()
        await self._record(backend, "paused", min(float(retry_after), self._config.max_pause_s), code)

    async def _count_outcome(self, backend: str, settings: BreakerSettings, failed: bool) -> None:
        """The breaker's window: opens it when enough calls failed within it."""
        state = self._backends.setdefault(backend, _Backend())
        now = time.monotonic()
        state.outcomes.append((now, failed))
        state.failures += failed
        while state.outcomes and state.outcomes[0][0] < now - settings.window_s:
            state.failures -= state.outcomes.popleft()[1]
        calls, failures = len(state.outcomes), state.failures
        if state.state != "open" and calls >= settings.min_calls and failures / calls >= settings.failure_ratio:
            log.warning("circuit breaker of backend %s opened (%d of %d calls failed)", backend, failures, calls)
            self._metrics.backpressure_events.labels(backend, "opened").inc()
            await self._record(backend, "open", settings.open_s, "dependency_unavailable")

    async def _record(self, backend: str, state: str, seconds: float, code: str) -> None:
        """Apply locally at once, then share: one script records it and tells every replica."""
        ms = int(math.ceil(seconds * 1000))
        self._set(backend, state, ms, code)
        with store.logged_on_fault(log, "could not share the %s state of backend %s; this replica applies it alone",
                                   state, backend):
            shared_ms = await asyncio.shield(self._transition(
                keys=[self._hash, self._probe_key(backend)], args=[backend, state, ms, code, self._channel]))
            if state == "paused":
                self._set(backend, state, int(shared_ms), code)  # a longer pause another replica recorded

    def describe(self) -> list[dict[str, Any]]:
        """Every backend service this process knows: its state, how long it lasts, its window and settings."""
        names = set(self._backends) | set(self._registry.services) | \
            {tool.backend_name for tool in self._registry.all()}
        now = time.monotonic()
        out = []
        for name in sorted(names):
            state = self._backends.get(name, _Backend())
            settings = self.settings(name)
            left = max(0.0, state.until - now)
            shown = "half_open" if state.state == "open" and left == 0 else \
                "closed" if state.state == "paused" and left == 0 else state.state
            out.append({"backend": name, "state": shown,
                        "retry_after_s": round(left, 3) if shown in ("open", "paused") else None,
                        "code": state.code if shown == "paused" else None,
                        "window": {"calls": len(state.outcomes),
                                   "failures": state.failures},
                        "breaker": {"enabled": settings.enabled, "failure_ratio": settings.failure_ratio,
                                    "min_calls": settings.min_calls, "window_s": settings.window_s,
                                    "open_s": settings.open_s}})
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

