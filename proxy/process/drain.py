"""Draining on SIGTERM: stop taking calls, let the calls in flight finish within a budget, cut the rest.

Owns: the draining flag (readiness reads it: a draining process is not ready), the agent listener's
middleware that refuses a request arriving while draining (``shutting_down``: retryable with the same key,
at another replica or after the restart) and counts the requests in flight, and the drain itself: wait for
those requests for ``shutdown.drain_timeout_ms``, then have the pipeline cut the calls still running (each
is answered and its outcome recorded: ``Pipeline.cut_running``) and wait for their answers, bounded again.
Must never: cut a call in its commit stage, end a request without an answer, or wait without a bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web

from ..config import ShutdownConfig
from ..errors import ProxyError

log = logging.getLogger("toolproxy.drain")

# After the cut: how long the cut calls get to commit (their outcome records, lock releases and audit
# records are a few Redis round trips, each bounded by redis.timeout_ms).
CUT_ANSWER_S = 10.0


class Drain:
    def __init__(self, config: ShutdownConfig) -> None:
        self._budget_s = config.drain_timeout_ms / 1000.0
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if self.draining:
            raise ProxyError("shutting_down", "The proxy is shutting down and takes no new calls; retry with the "
                             "same key.", phase="request")
        if request.method == "GET":  # reads of state, and MCP's event streams, which end with the listener
            return await handler(request)
        self._in_flight += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def run(self, cut: Callable[[], int]) -> None:
        """Refuse new calls, wait for the ones in flight (the budget), then ``cut`` the rest and wait for their
        answers (bounded). Logs what happened."""
        self.draining = True
        started = time.monotonic()
        waiting = self._in_flight
        log.info("draining: %d request(s) in flight, up to %.1f s", waiting, self._budget_s)
        if await self._wait_idle(self._budget_s):
            log.info("drained: every request in flight finished in %.2f s", time.monotonic() - started)
            return
        count = cut()
        log.warning("drain budget spent: %d call(s) cut (each answered; a write whose request left is "
                    "shutdown_unknown, reconciled)", count)
        if not await self._wait_idle(CUT_ANSWER_S):
            log.error("%d request(s) still unanswered after the cut; the listeners close now", self._in_flight)

    async def _wait_idle(self, bound_s: float) -> bool:
        try:
            async with asyncio.timeout(bound_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False
