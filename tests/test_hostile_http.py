"""Hostile and overloaded peers against a real ``toolproxy run``: the sidecar stays up, every call ends.

Real parts throughout: OPA and Redis from the session fixtures, a proxy process (tests/support/proxyproc.py)
and slow or misbehaving backends on loopback in this event loop. Every wait is bounded; the assertions
count calls, answers, probes and bytes, never durations.

* The wedge of issue 30: five times the pool's size of slow calls, with the process's stdout and stderr
  merged into one pipe that nobody reads (a log collector that stalls). Every call answers with an
  envelope and a catalogued code, ``/readyz`` answers throughout, and the backlog drains.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.proxyproc import ProxyProcess
from tests.support.stack import DEMO_REGISTRY, assert_envelope, passthrough_read

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
POOL = 4


class SlowBackend:
    """An aiohttp backend whose ``/slow`` answers after ``delay_s``; counts what arrived and what it answered."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.arrived = 0
        self.answered = 0
        self.in_flight = 0  # requests whose connection is still open (a closed one cancels its handler)
        self.peak = 0
        self.runner: web.AppRunner | None = None

    async def _slow(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrived += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        self.answered += 1
        return web.json_response({"ok": True})

    async def __aenter__(self) -> "SlowBackend":
        app = web.Application()
        app.router.add_post("/slow", self._slow)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        assert self.runner is not None
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"


def _registry(tmp_path: Path, timeout_ms: int) -> list[str]:
    path = tmp_path / "slow-tools.yaml"
    path.write_text("tools:\n" + passthrough_read("slow_read", "/slow", "q", extra=f"timeout_ms: {timeout_ms}",
                                                  service="slow"))
    return [str(DEMO_REGISTRY), str(path)]


async def _call(session: aiohttp.ClientSession, proxy: ProxyProcess, tool: str, arguments: dict[str, Any],
                bound_s: float) -> dict[str, Any] | None:
    """The envelope, or None when no answer came within ``bound_s`` (well past the call's deadline)."""
    try:
        async with asyncio.timeout(bound_s):
            async with session.post(proxy.url + "/v1/tool-calls",
                                    json={"call_id": "c", "tool": tool, "arguments": arguments}) as response:
                envelope = await response.json(content_type=None)
    except TimeoutError:
        return None
    assert_envelope(envelope)
    return envelope


async def _probe(session: aiohttp.ClientSession, proxy: ProxyProcess, bound_s: float) -> int | None:
    try:
        async with asyncio.timeout(bound_s):
            async with session.get(f"http://127.0.0.1:{proxy.ops_port}/readyz") as response:
                return response.status
    except (TimeoutError, aiohttp.ClientError):
        return None


async def test_five_times_the_pool_of_slow_calls_with_an_unread_output_pipe_never_wedge_the_sidecar(
        proxy_deps, tmp_path):
    async with SlowBackend(delay_s=1.0) as backend:
        proxy = ProxyProcess({**proxy_deps, "backends.services": {"slow": backend.url},
                              "registry.paths": _registry(tmp_path, timeout_ms=2500),
                              "backends.pool_size": POOL, "reconcile.enabled": False, "log.level": "info",
                              "audit.stdout_queue_records": 5},
                             stdout_pipe=True, merge_stderr=True).start()
        try:
            assert proxy.proc is not None and proxy.proc.stdout is not None
            fcntl.fcntl(proxy.proc.stdout.fileno(), F_SETPIPE_SZ, 4096)  # nobody reads it: full at once
            await proxy.ready()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                burst = asyncio.gather(*(_call(session, proxy, "slow_read", {"q": str(i)}, bound_s=20)
                                         for i in range(5 * POOL)))
                probes: list[int | None] = []
                while not burst.done():  # the probe answers throughout the burst
                    probes.append(await _probe(session, proxy, bound_s=10))
                    await asyncio.sleep(0.1)
                envelopes = await burst

                assert None not in envelopes, "a call got no answer"
                outcomes = collections.Counter(
                    (e["outcome"], e["error"]["code"] if e["error"] else None) for e in envelopes)
                assert outcomes[("succeeded", None)] >= POOL, outcomes
                assert {code for _, code in outcomes} <= {None, "timeout_not_started", "timeout"}, outcomes
                assert probes and probes.count(200) == len(probes), probes
                assert 0 < backend.peak <= POOL  # never more in flight than the pool

                # The backlog drains: the next calls are served, each within its deadline.
                later = await asyncio.gather(*(_call(session, proxy, "slow_read", {"q": f"later-{i}"}, bound_s=20)
                                               for i in range(POOL)))
                assert [e and e["outcome"] for e in later] == ["succeeded"] * POOL, later
                assert await _probe(session, proxy, bound_s=10) == 200
        finally:
            proxy.stop()
