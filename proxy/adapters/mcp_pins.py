"""Pinned MCP upstreams, watched: each upstream's live tools/list compared with the registry's pins.

Owns: one watch per upstream URL whose contracts carry a ``backend.pin``,
each with an SDK session of its own (never the adapter's: the call path's
sessions stay untouched, and this one asks for nothing but the tool list); a
check at start-up (awaited by the runtime, bounded), on the upstream's
``notifications/tools/list_changed`` (a legacy session's message handler, or
the 2026-07-28 ``subscriptions/listen`` stream), every
``mcp_pins.check_interval_ms``, after a registry reload, and when a call
needs its pins fresher than the last check (``recheck``, ``nudge``: the
freshness bound of ``drift.Quarantine.fresh``); handing each
check's verdicts (``drift.compare``) to the ``Quarantine``, counting each new
drift (``toolproxy_contract_drift_total``) and logging it with its diff. A
check that fails (unreachable, too slow, too many tools, an answer too large)
leaves the upstream's contracts unverified and is retried with a backoff.

Every answer is bounded: time (``check_timeout_ms``: the session and every
page), tools (``max_tools``), pages (``MAX_PAGES``), bytes per answer
(``max_answer_bytes``), and checks (at most one per ``min_gap_ms``, however
many notifications arrive). The ``mcp`` SDK is imported only when a watch
starts: a registry without pins never loads it.

Must never: decide anything about a call but quarantine (execution metadata
stays the registry's), read an upstream's descriptions into anything the
model sees, or call a tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from ..config import McpPinsConfig
from ..drift import KINDS, Quarantine, UpstreamTool, compare
from ..registry import Registry, ToolContract
from ..telemetry.metrics import Metrics

log = logging.getLogger("toolproxy.mcp_pins")

MAX_PAGES = 100  # of one tools/list walk
_MAX_BACKOFF_S = 30.0


class CheckFailed(Exception):
    """An upstream's tool list could not be read within the bounds; the message says which."""


async def read_tools(client: Any, *, max_tools: int) -> list[UpstreamTool]:
    """Every tool an SDK ``Client`` lists, all pages: at most ``max_tools`` tools and ``MAX_PAGES`` pages."""
    tools: list[UpstreamTool] = []
    cursor = None
    for _ in range(MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        for tool in page.tools:
            tools.append(UpstreamTool.from_sdk(tool))
        if len(tools) > max_tools:
            raise CheckFailed(f"the upstream lists more than {max_tools} tools")
        cursor = page.next_cursor
        if cursor is None:
            return tools
    raise CheckFailed(f"the upstream's tools/list has more than {MAX_PAGES} pages")


def pinned_upstreams(registry: Registry, services: Mapping[str, str]) -> dict[str, list[ToolContract]]:
    """The callable contracts that carry a pin, by the upstream URL they resolve to."""
    found: dict[str, list[ToolContract]] = {}
    for tool in registry.all():
        if tool.callable and tool.backend.type == "mcp" and tool.backend.pin is not None:
            url = tool.backend.resolve(services)
            if url is not None:
                found.setdefault(url, []).append(tool)
    return found


def capped_http_client(max_bytes: int, connect_timeout_s: float, auth: Any = None,
                       headers: Sequence[tuple[str, str]] | None = None) -> Any:
    """An ``httpx2`` client whose every answer is cut (a read error) past ``max_bytes``, and never decoded
    (``bounded_answers``: an encoded answer is refused, whatever it would inflate to); with ``auth``, an
    upstream's access token on each request; with ``headers``, a static secret's header on each request."""
    import httpx2

    from .bounded_answers import BoundedTransport

    return httpx2.AsyncClient(transport=BoundedTransport(httpx2.AsyncHTTPTransport(retries=0), max_bytes),
                              follow_redirects=False, auth=auth, headers=dict(headers or ()),
                              timeout=httpx2.Timeout(None, connect=connect_timeout_s))


class PinWatcher:
    """The watches of every pinned upstream of the live registry, and what they found."""

    def __init__(self, registry: Registry, quarantine: Quarantine, *, services: Mapping[str, str],
                 config: McpPinsConfig, mode: str, metrics: Metrics, connect_timeout_s: float,
                 auth_for: Callable[[str, Sequence[ToolContract]], Any] | None = None,
                 headers_for: Callable[[str | None], Sequence[tuple[str, str]] | None] | None = None) -> None:
        self.registry = registry
        # An upstream behind OAuth: the httpx2 auth of its pinned tools' credential (None: it asks for none)
        self.auth_for = auth_for
        # An upstream behind a static secret: its header, by the pinned tools' credential name (None: not one)
        self.headers_for = headers_for
        self.quarantine = quarantine
        self.config = config
        self.mode = mode
        self._services = dict(services)
        self._metrics = metrics
        self.connect_timeout_s = connect_timeout_s
        self._watches: dict[str, _Watch] = {}
        self._http: Any = None
        quarantine.checker = self  # the call path's freshness bound asks for checks here (drift.Quarantine.fresh)

    async def recheck(self, upstream: str) -> None:
        watch = self._watches.get(upstream)
        if watch is not None:
            await watch.recheck()

    def nudge(self, upstream: str) -> None:
        watch = self._watches.get(upstream)
        if watch is not None and not watch.failing:
            watch.wake.set()

    @property
    def http(self) -> Any:
        if self._http is None:
            self._http = capped_http_client(self.config.max_answer_bytes, self.connect_timeout_s)
        return self._http

    async def start(self) -> None:
        """Watch every pinned upstream and wait (bounded) for each one's first check."""
        self.sync(self.registry)
        watches = list(self._watches.values())
        if watches:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.check_timeout_ms / 1000.0 + 1.0):
                    await asyncio.gather(*(w.first.wait() for w in watches))

    def sync(self, registry: Registry) -> None:
        """The registry changed (start, reload): watch its pinned upstreams, check each again now."""
        self.registry = registry
        groups = pinned_upstreams(registry, self._services)
        for url in [url for url in self._watches if url not in groups]:
            self._watches.pop(url).stop()
        for contract in (c for contracts in groups.values() for c in contracts):
            for kind in KINDS:  # every series exists at 0: a first drift is an increase (the alert rule)
                self._metrics.child(self._metrics.contract_drift, contract.name, kind)
        for url, contracts in groups.items():
            watch = self._watches.get(url)
            if watch is None:
                watch = self._watches[url] = _Watch(url, self)
                watch.start()
            watch.contracts = contracts
            watch.wake.set()
        self.quarantine.retain(groups)
        self._gauge()

    async def stop(self) -> None:
        watches = list(self._watches.values())
        self._watches.clear()
        for watch in watches:
            watch.stop()
        await asyncio.gather(*(w.stopped() for w in watches))
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def rows(self) -> list[dict[str, Any]]:
        """Every pinned contract with its state (the admin API's ``GET /v1/pins`` and the console)."""
        return self.quarantine.view(self.registry.all())

    def checked(self, watch: "_Watch", listed: list[UpstreamTool], started: float) -> None:
        verdicts = compare(watch.contracts, listed, watch.baseline)
        fresh, returned = self.quarantine.record(watch.url, verdicts, started=started)
        watch.failing = False
        if all(verdict is None for _, verdict in verdicts):
            watch.baseline = listed
        for contract, drift in fresh:
            self._metrics.child(self._metrics.contract_drift, contract.name, drift.kind).inc()
            log.warning("contract drift: %s %s is quarantined (contract_drift): %s; re-pin after review with "
                        "`toolproxy mcp repin %s`\n%s", contract.name, contract.version, drift.summary(),
                        contract.source, drift.diff,
                        extra={"tool": contract.name, "drift": drift.kind, "backend": contract.backend_name})
        for contract in returned:
            log.warning("contract drift: %s %s matches its pins again but stays quarantined until an operator "
                        "acknowledges it (POST /v1/pins/acknowledge on the admin listener) or re-pins it",
                        contract.name, contract.version, extra={"tool": contract.name})
        self._gauge()

    def failed(self, watch: "_Watch", why: str) -> None:
        self.quarantine.unverified(watch.url)
        if watch.failing:
            log.debug("pinned MCP upstream check failed again (%s)", why)
        else:
            watch.failing = True
            log.warning("pinned MCP upstream of %s could not be checked (%s): its pinned tools are %s until a "
                        "check succeeds", ", ".join(sorted({c.name for c in watch.contracts})), why,
                        "refused" if self.config.unverified == "refuse" else "served unverified",
                        extra={"backend": watch.contracts[0].backend_name if watch.contracts else None})
        self._gauge()

    def _gauge(self) -> None:
        for state, count in self.quarantine.counts(self.registry.all()).items():
            self._metrics.child(self._metrics.pinned_tools, state).set(count)


class _Watch:
    """One upstream: a session owned by one task, checked on start, on notice, on a timer."""

    def __init__(self, url: str, owner: PinWatcher) -> None:
        self.url = url
        self.owner = owner
        self.contracts: list[ToolContract] = []
        self.baseline: list[UpstreamTool] | None = None  # the list as last seen matching every pin
        self.wake = asyncio.Event()
        self.first = asyncio.Event()  # the first check ended (either way)
        self._task: asyncio.Task[None] | None = None
        self._last = 0.0
        self.failing = False  # the latest check failed (logged once per run of failures)
        self._started = 0  # checks started so far
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []  # (the check it waits for, its end)

    async def recheck(self) -> None:
        """Until a check that starts after now has ended; at once while checks fail (they keep their backoff:
        calls must not turn a failing upstream's retries into a flood)."""
        if self.failing:
            return
        done = asyncio.get_running_loop().create_future()
        self._waiters.append((self._started + 1, done))
        self.wake.set()
        await done

    def _ended(self, number: int) -> None:
        """Check ``number`` ended (either way): every waiter for it, or for an earlier one, goes on."""
        waiting = []
        for wanted, done in self._waiters:
            if wanted <= number or self.failing:
                if not done.done():
                    done.set_result(None)
            elif not done.done():
                waiting.append((wanted, done))
        self._waiters = waiting

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"mcp-pins {self.url}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.failing = True  # nothing more will be checked here: every waiter goes on (and finds it unverified)
        self._ended(self._started)

    async def stopped(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure of a check: the upstream is unverified, try again later
                failures += 1
                self.owner.failed(self, _why(exc))
                self._ended(self._started)
                self.first.set()
                self.wake.clear()  # a reload during the pause still wakes it
                await self._pause(min(_MAX_BACKOFF_S, 0.25 * 2 ** min(failures, 8)))
                continue
            failures = 0

    async def _session(self) -> None:
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client
        import mcp_types

        async def on_message(message: Any) -> None:
            if isinstance(message, mcp_types.ToolListChangedNotification):  # a legacy session's notice
                self.wake.set()

        config = self.owner.config
        timeout_s = config.check_timeout_ms / 1000.0
        async with contextlib.AsyncExitStack() as stack:
            http = self.owner.http
            auth = self.owner.auth_for(self.url, self.contracts) if self.owner.auth_for is not None else None
            fixed = None
            if auth is None and self.owner.headers_for is not None:
                fixed = next(filter(None, (self.owner.headers_for(c.backend.auth) for c in self.contracts)), None)
            if auth is not None or fixed:  # a client of its own, carrying the upstream's access token or secret
                http = capped_http_client(config.max_answer_bytes, self.owner.connect_timeout_s, auth=auth,
                                          headers=fixed)
                stack.push_async_callback(http.aclose)
            client = Client(streamable_http_client(self.url, http_client=http), mode=self.owner.mode,
                            cache=None, message_handler=on_message)
            async with asyncio.timeout(timeout_s):
                await stack.enter_async_context(client)
            listener = asyncio.create_task(self._listen(client), name=f"mcp-pins listen {self.url}")
            stack.push_async_callback(_cancelled, listener)
            while True:
                self.wake.clear()
                self._last = time.monotonic()
                self._started += 1
                async with asyncio.timeout(timeout_s):
                    listed = await read_tools(client, max_tools=config.max_tools)
                self.owner.checked(self, listed, self._last)  # verified as of when the list was asked for
                self._ended(self._started)
                self.first.set()
                await self._next()

    async def _listen(self, client: Any) -> None:
        """2026-07-28: the upstream's change events on a ``subscriptions/listen`` stream (legacy sessions get
        theirs through the message handler). A stream that ends is opened again, after a check."""
        from mcp_types.version import MODERN_PROTOCOL_VERSIONS

        if client.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return
        pause = 1.0
        while True:
            try:
                async with client.listen(tools_list_changed=True) as events:
                    pause = 1.0
                    async for _ in events:
                        self.wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not offered, refused, or lost: the timer still checks
                log.debug("MCP upstream listen stream ended", extra={"upstream_error": type(exc).__name__})
            self.wake.set()  # no replay: what changed while the stream was down is checked now
            await asyncio.sleep(pause)
            pause = min(_MAX_BACKOFF_S, pause * 2)

    async def _next(self) -> None:
        """Until the next check: a notice or a reload (``wake``) or the interval, then at least ``min_gap_ms``
        after the last check."""
        interval_ms = self.owner.config.check_interval_ms
        await self._pause(interval_ms / 1000.0 if interval_ms else None)
        gap = self.owner.config.min_gap_ms / 1000.0 - (time.monotonic() - self._last)
        if gap > 0:
            await asyncio.sleep(gap)

    async def _pause(self, seconds: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.wake.wait()


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _why(exc: BaseException) -> str:
    """A failure in one safe phrase: its kind, never its text (hostnames, upstream words)."""
    if isinstance(exc, CheckFailed):
        return str(exc)
    from .bounded_answers import AnswerRefused  # loaded with the watch's client already
    if isinstance(exc, AnswerRefused):
        return "an answer above mcp_pins.max_answer_bytes" if exc.what == "body" else \
            "an encoded answer (Content-Encoding): never decoded"
    if isinstance(exc, TimeoutError):
        return "no complete answer within mcp_pins.check_timeout_ms"
    if isinstance(exc, BaseExceptionGroup):
        return _why(exc.exceptions[0]) if exc.exceptions else "session failed"
    return type(exc).__name__

