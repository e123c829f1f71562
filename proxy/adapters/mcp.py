"""MCP backend adapter: execute a registry tool on an upstream MCP server.

Owns: one reusable session per upstream URL (opened with the ``mcp`` SDK
client over Streamable HTTP — the 2026-07-28 stateless revision when the
upstream offers it, else the initialize handshake — and reopened when it
drops), sending ``tools/call`` for the contract's ``backend.tool`` (through the
SDK session, or — the first round of a call with nothing to relay, on a
stateless session — as one POST over the hot path's wire:
``adapters.mcp_wire``) within
the call's deadline (``BackendCall.deadline``) (with a progress token when the caller's front relays
progress: the call's ``CallChannel.progress``, and with the log level the caller's client asked for:
``CallChannel.log``) with the trusted headers and the signed ``Txn-Token`` the HTTP adapter forwards (on every POST of the call),
handing the upstream's log messages (``notifications/message``) of that call to the caller's
front (dropped when no call in this context asked for them),
carrying the requests the upstream sends back during the call (``sampling/createMessage``,
``elicitation/create``: mid-call requests on a legacy session, or the 2026-07-28
``InputRequiredResult`` rounds) to the caller's front (``CallChannel.input``;
refused as the SDK client refuses what it cannot answer when the front has no
client to ask), within the call's deadline, and
classifying every outcome honestly: whether the request left the proxy and
whether the effect is known to have happened (mirrors ``adapters/http.py``).
An upstream behind OAuth (its tools' ``backend.auth`` names an ``mcp_*`` credential) gets its access token on
every request of the call and of its session (``credentials.mcp_oauth``: the proxy's own client's, or the
calling user's grant, with a session per user), obtained before anything is sent (``credential_unavailable``
or ``user_grant_required`` when it cannot be had) and renewed once when the upstream challenges it: a
challenged request did not run, so it is sent once more with the new token. An upstream behind a static secret
(kind header, bearer or basic) gets its header on every request of the call and of its session. An upstream
reached on behalf of the caller (kind ``token_exchange``: the caller's verified token exchanged for one to the
upstream, kept per tenant, subject and audience by ``credentials``) gets the caller's exchanged token on every
request of the call and of a session of that caller's own, obtained before anything is sent.

Must never: retry a call that may have reached the upstream (the one resend
it makes is after a definite "not processed" answer: HTTP 404 for an expired
legacy session, a header mismatch, or a 401 or 403 challenge of its access token), read the upstream's tool list,
descriptions or annotations to decide anything (the trusted registry is the
only source of execution metadata; upstream output is checked by the verify
stage against the registry's outputSchema), or pass upstream error text,
hostnames or exception messages to the caller.

Results: with a declared outputSchema the data is the upstream's
``structuredContent`` (or its one JSON text block), verified later; without
one, every content block passes through as the upstream gave it (text, image,
audio, resource_link, embedded resource): the data is
``{"content": [...], "structuredContent"?: ...}`` (see
``mcp_tools.passes_content``), bounded by ``max_response_bytes``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import (
    CONNECTION_CLOSED,
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    MISSING_REQUIRED_CLIENT_CAPABILITY,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
    UNSUPPORTED_PROTOCOL_VERSION,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import ValidationError

from ..credentials import Credentials, Headers, OnBehalfOf
from ..credentials.mcp_oauth import TokenSource, UpstreamBearer, is_challenge
from ..decode import check_depth, strict_loads
from ..errors import ProxyError
from ..wire.http import HttpWire
from ..call_channel import InputRefused, ProgressRelay
from . import BackendCall, BackendResult, deadline_passed, safe_error_fields, unanswered, failed_answer
from .bounded_answers import AnswerRefused, BoundedTransport
from .call_tokens import CallTokens
from .http import forwarded_headers
from ..wire import mcp as mcp_wire

log = logging.getLogger("toolproxy.adapters.mcp")

# JSON-RPC errors that mean "refused before the tool ran".
_REFUSED = frozenset({PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, HEADER_MISMATCH,
                      MISSING_REQUIRED_CLIENT_CAPABILITY, UNSUPPORTED_PROTOCOL_VERSION})
# Transport-synthesized: the request went out and no answer came back.
_NO_ANSWER = frozenset({CONNECTION_CLOSED, REQUEST_TIMEOUT})
_CONNECT_ERRORS = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
# Sessions held to upstreams that take an access token per user (one per user and upstream), at most.
MAX_USER_SESSIONS = 1000
# 2026-07-28 InputRequiredResult rounds one call may take (the SDK client's default cap).
MAX_INPUT_ROUNDS = 10
# How the SDK's own client refuses a server request it has no callback for.
_NOT_SUPPORTED = {"sampling/createMessage": "Sampling not supported", "elicitation/create": "Elicitation not supported"}


@dataclass
class _Progress:
    """How far the tools/call POST of one call got (filled in by ``_ObservedTransport``)."""

    headers: Mapping[str, str]
    mint: Callable[[], str]  # a new Txn-Token: each POST carries its own (a backend takes a token once)
    observed: bool = False
    headers_sent: bool = False
    connect_failed: bool = False
    status: int | None = None
    refused: AnswerRefused | None = None  # an answer of the call cut by ``bounded_answers``
    auth_failure: ProxyError | None = None  # the upstream's access token could not be had during the call

    @property
    def sent(self) -> bool:
        return self.headers_sent and not self.connect_failed


class _ConnectFailed(Exception):
    """The session to the upstream could not be opened; no call was sent."""


class _ObservedTransport(httpx2.AsyncBaseTransport):
    """Adds the call's forwarded headers to its tools/call POST and records how far it got.

    The SDK runs each POST in the context of the task that sent the message,
    so the per-call ``_Progress`` in a context variable reaches this layer.
    Every POST of the call carries the headers (a 2026-07-28 retry with input
    responses is the same call), each with a token of its own; only the first is observed (later ones, such
    as a cancellation notice, must not overwrite what happened to the call).
    """

    def __init__(self, inner: httpx2.AsyncBaseTransport, progress: contextvars.ContextVar[_Progress | None]) -> None:
        self._inner = inner
        self._progress = progress

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        progress = self._progress.get()
        if progress is None or request.method != "POST":
            return await self._inner.handle_async_request(request)
        request.headers.update(progress.headers)
        if progress.observed:  # a later POST of the call (an input round, a cancellation): a token of its own
            request.headers["Txn-Token"] = progress.mint()
            return await self._inner.handle_async_request(request)
        progress.observed = True

        async def trace(name: str, info: Mapping[str, Any]) -> None:
            if name.endswith("send_request_headers.started"):
                progress.headers_sent = True

        request.extensions = {**request.extensions, "trace": trace}
        try:
            response = await self._inner.handle_async_request(request)
        except _CONNECT_ERRORS:
            progress.connect_failed = True
            raise
        if "authorization" in request.headers and is_challenge(response):
            # The upstream refused the access token without running the request: the retry with a renewed
            # token (``UpstreamBearer``) is the call's first POST.
            progress.observed = progress.headers_sent = False
            return response
        progress.status = response.status_code
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _SharedTransport(httpx2.AsyncBaseTransport):
    """The adapter's transport as used by one upstream's own client: closing that client leaves it open."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        pass


class _Upstream:
    """One upstream MCP server: a session owned by a background task, reopened on demand.

    The SDK client holds task groups that must be entered and exited by the
    same task, so a dedicated owner task keeps it open while calls from any
    task use it; when the session breaks the owner ends and the next call
    opens a new one.
    """

    def __init__(self, url: str, http: httpx2.AsyncClient, handshake_timeout_s: float, mode: str,
                 callbacks: Mapping[str, Any], source: TokenSource | None = None) -> None:
        self.url = url
        self.source = source  # the upstream's access tokens (OAuth), None when it asks for none
        self.fixed_headers: Mapping[str, str] = {}  # a static secret's header, on every request (its own client)
        self.caller: OnBehalfOf | None = None  # whom a per-caller session runs for (its latest verified token)
        self.caller_credential: tuple[str, str] = ("", "")  # a per-caller session's credential name and audience
        self.per_principal = False  # a session of one user's or caller's own (bounded: MAX_USER_SESSIONS)
        self.owns_http = False  # a client of its own (over the adapter's shared transport), closed with it
        self.auth_failure: ProxyError | None = None  # why the last session could not be opened, when it was that
        self._callbacks = callbacks
        self._mode = mode
        self.http = http
        self._handshake_timeout_s = handshake_timeout_s
        self._ready: asyncio.Future[Client] | None = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self._owners: set[asyncio.Task[None]] = set()  # current and still-closing sessions
        self.streams = False  # answered a tools/call with SSE once: later calls go through the SDK (it resumes)

    async def session(self) -> Client:
        if self._owner is None or self._owner.done():
            loop = asyncio.get_running_loop()
            self._ready, self._stop = loop.create_future(), asyncio.Event()
            # A context of its own: the session (and its standalone stream, where requests outside
            # any call arrive) must not inherit the call that happened to open it.
            self._owner = loop.create_task(self._own(self._ready, self._stop), name=f"mcp-upstream {self.url}",
                                           context=contextvars.Context())
            self._owners.add(self._owner)
            self._owner.add_done_callback(self._owners.discard)
        assert self._ready is not None
        # Shielded: one caller's deadline must not cancel the handshake others wait on.
        return await asyncio.shield(self._ready)

    def drop(self) -> None:
        """Stop using the current session (the owner closes it in the background)."""
        if self._stop is not None:
            self._stop.set()
        self._owner = None

    async def aclose(self, timeout_s: float = 5.0) -> None:
        self.drop()
        owners = list(self._owners)
        if owners:
            _, pending = await asyncio.wait(owners, timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self.owns_http:
            await self.http.aclose()

    async def _own(self, ready: "asyncio.Future[Client]", stop: asyncio.Event) -> None:
        self.auth_failure = None
        try:
            client = Client(streamable_http_client(self.url, http_client=self.http), mode=self._mode, cache=None,
                            **self._callbacks)
            async with contextlib.AsyncExitStack() as stack:
                async with asyncio.timeout(self._handshake_timeout_s):
                    await stack.enter_async_context(client)
                ready.set_result(client)
                await stop.wait()
        except BaseException as exc:  # the owner must end quietly; callers get a classified error
            if not ready.done():
                ready.set_exception(_ConnectFailed())
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.info("MCP upstream session ended", extra={"upstream_error": type(exc).__name__})
        finally:
            if not ready.done():
                ready.set_exception(_ConnectFailed())


class McpAdapter:
    # Cancelling a sent call closes its request: the MCP session then sends notifications/cancelled upstream
    # (the SDK's courtesy cancel for an abandoned request), which is this adapter's cancel (proxy/transactions/cancellation.py).
    cancel_by_closing = True

    def __init__(self, services: Mapping[str, str], *, tokens: CallTokens, max_response_bytes: int,
                 max_json_depth: int, connect_timeout_s: float, handshake_timeout_s: float, mode: str = "auto",
                 wire: HttpWire | None = None, answer_limits: mcp_wire.Limits = mcp_wire.Limits(),
                 oauth: Callable[[BackendCall, str], TokenSource | None] | None = None,
                 fixed_headers: Callable[[str | None], Headers | None] | None = None,
                 backend_credentials: Credentials | None = None) -> None:
        self._tokens = tokens
        self._credentials = backend_credentials  # a per-caller credential's tokens (token_exchange), by name
        self._fixed_headers = fixed_headers  # a static secret credential's headers, by credential name
        self._oauth = oauth  # the access tokens of a call's upstream (one source per upstream and principal)
        self._max_json_depth = max_json_depth
        self._answer_limits = answer_limits  # of a stateless call's answer read over the wire (``mcp_wire``)
        self._wire = wire  # the hot path's: stateless tools/call POSTs go over it (``mcp_wire``)
        self._mode = mode
        self._services = dict(services)
        self._max_response_bytes = max_response_bytes
        self._handshake_timeout_s = handshake_timeout_s
        self._progress: contextvars.ContextVar[_Progress | None] = contextvars.ContextVar(
            f"toolproxy_mcp_progress_{id(self)}", default=None)
        # The call running in this context (its deadline and its channel to the client): the SDK runs a
        # server request's callback in the context of the POST it arrived on, so it reaches the callbacks.
        self._running: contextvars.ContextVar[BackendCall | None] = contextvars.ContextVar(
            f"toolproxy_mcp_call_{id(self)}", default=None)
        self._callbacks = {"sampling_callback": self._on_sampling, "elicitation_callback": self._on_elicitation,
                           "logging_callback": self._on_log}
        # Per running call (by id): the log deliveries still on their way to its client. The SDK runs each
        # notification's callback as a task of its own, so a message the upstream sent before its result
        # could reach the client after it (a relay awaits the flow record before it pushes): the result
        # waits for them.
        self._log_deliveries: dict[int, set[asyncio.Task[Any]]] = {}
        # Every answer of every upstream bounded, the SDK's sessions included (never decoded: bounded_answers).
        self._transport = _ObservedTransport(BoundedTransport(httpx2.AsyncHTTPTransport(retries=0),
                                                              answer_limits.max_bytes, self._answer_refused),
                                             self._progress)
        # No read timeout here: every call is bounded by its own budget.
        self._timeout = httpx2.Timeout(None, connect=connect_timeout_s)
        self._http = httpx2.AsyncClient(transport=self._transport, follow_redirects=False, timeout=self._timeout)
        # By URL and token source: an upstream that takes each user's own grant gets a session per user (its
        # sessions may be bound to the user), the least recently used of them closed past MAX_USER_SESSIONS.
        # A static secret's upstream is keyed by its credential's name too (a client of its own carries it), a
        # per-caller credential's by its name, tenant and subject (a session per caller, bounded the same way).
        self._upstreams: collections.OrderedDict[
            tuple[str, TokenSource | None, str | tuple[str, ...] | None], _Upstream] = collections.OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def _answer_refused(self, error: AnswerRefused) -> None:
        """An answer cut by the bounded transport: the call in this context learns why (the SDK sees a read
        error, which alone would read as a lost connection)."""
        progress = self._progress.get()
        if progress is not None and progress.refused is None:
            progress.refused = error

    async def aclose(self) -> None:
        await asyncio.gather(*(u.aclose() for u in self._upstreams.values()), *self._closing)
        self._upstreams.clear()
        await self._http.aclose()

    async def call(self, call: BackendCall) -> BackendResult:
        url = self._callable_url(call)
        source = self._oauth(call, url) if self._oauth is not None else None
        fixed = self._fixed_headers(call.tool.backend.auth) if self._fixed_headers is not None else None
        caller = self._on_behalf_of(call)
        upstream = self._session_upstream(call, url, source, fixed, caller)
        progress = _Progress(headers={k: v for k, v in forwarded_headers(call, self._tokens.for_call(call)).items()
                                      if k not in ('Content-Type', 'Accept')},
                             mint=lambda: self._tokens.for_call(call))
        started = time.monotonic()
        running = self._running.set(call)
        try:
            async with call.deadline.timeout():
                if source is not None and source.current() is None:
                    await source.token()  # before anything is sent (raises credential_unavailable)
                if caller is not None:  # before anything is sent (raises credential_unavailable)
                    progress.headers = {**progress.headers, **dict(await self._caller_headers(call, caller))}
                result = await self._send(call, upstream, progress)
                await self._logs_delivered(call)
                return self._classify(call, result)
        except (TimeoutError, _ConnectFailed, MCPError, mcp_wire.AnswerTooLarge, ValidationError,
                httpx2.HTTPError, ConnectionError, OSError) as exc:
            raise self._call_failure(call, upstream, progress, exc, time.monotonic() - started) from None
        finally:
            self._running.reset(running)
            self._log_deliveries.pop(id(call), None)

    async def _logs_delivered(self, call: BackendCall) -> None:
        """Wait (within the call's deadline, which bounds the caller) for the call's log messages still being
        delivered, so none reaches the client after the result."""
        pending = self._log_deliveries.get(id(call))
        if pending:
            await asyncio.wait(set(pending))

    def _callable_url(self, call: BackendCall) -> str:
        """The tool's MCP server address, once the call may start at all (configured backend, time left)."""
        tool = call.tool
        url = tool.backend.resolve(self._services)
        if url is None or not tool.backend.tool:
            raise ProxyError("dependency_unavailable", "The tool's backend is not configured.",
                             details={"tool": tool.name}, phase="execute")
        if call.deadline.expired:
            raise ProxyError("timeout_not_started", "No time budget was left to start the call.",
                             phase="execute", attempted=False, committed=False)
        return url

    def _on_behalf_of(self, call: BackendCall) -> OnBehalfOf | None:
        """The caller whose token is exchanged for the upstream's, when the tool's credential is a token exchange."""
        auth = call.tool.backend.auth
        if auth is not None and self._credentials is not None and self._credentials.kind(auth) == "token_exchange":
            return OnBehalfOf(call.subject, call.tenant, call.caller_token)
        return None

    def _session_upstream(self, call: BackendCall, url: str, source: TokenSource | None, fixed: Headers | None,
                          caller: OnBehalfOf | None) -> _Upstream:
        """The upstream session the call goes over: shared per URL and credential, or one per principal."""
        tool = call.tool
        principal = (tool.backend.auth, call.tenant, call.subject) if caller is not None else None
        key = (url, source, tool.backend.auth if fixed else principal)
        upstream = self._upstreams.get(key)
        if upstream is None:
            upstream = self._upstreams[key] = self._upstream(url, source, fixed, caller is not None)
            self._bound_sessions()
        elif upstream.per_principal:
            self._upstreams.move_to_end(key)
        if caller is not None:
            upstream.caller = caller  # the session's later requests are exchanged from the newest token
            upstream.caller_credential = (tool.backend.auth or "", tool.backend_name)
        return upstream

    def _call_failure(self, call: BackendCall, upstream: _Upstream, progress: _Progress, exc: BaseException,
                      elapsed_s: float) -> ProxyError:
        """The call's error for what ended it (checked in this order: a timeout is also an OSError)."""
        if isinstance(exc, TimeoutError):
            return self._cut(call, progress) or self._timed_out(call, progress, elapsed_s)
        if isinstance(exc, _ConnectFailed):
            if upstream.auth_failure is not None:
                return upstream.auth_failure
            return ProxyError("dependency_unavailable", "The tool's MCP server could not be reached.",
                              details={"tool": call.tool.name}, phase="execute", attempted=False, committed=False)
        if isinstance(exc, MCPError):
            if progress.auth_failure is not None:
                return progress.auth_failure
            return self._cut(call, progress) or self._rpc_failure(call, progress, exc.error.code)
        if isinstance(exc, mcp_wire.AnswerTooLarge):
            return self._unreadable(call, {"limit": exc.what, "limit_value": exc.limit})
        if isinstance(exc, ValidationError):  # the SDK's or the wire's check of the result against the revision's types
            return self._unreadable(call, {"answer": "invalid_result"})
        return self._cut(call, progress) or self._rpc_failure(call, progress, CONNECTION_CLOSED)

    def _cut(self, call: BackendCall, progress: _Progress) -> ProxyError | None:
        """The call's error when the bounded transport cut one of its answers (whatever the SDK made of it)."""
        if progress.refused is None:
            return None
        return self._unreadable(call, {"limit": progress.refused.what, "limit_value": progress.refused.limit})

    def _caller_headers(self, call: BackendCall, caller: OnBehalfOf) -> Any:
        """The caller's exchanged token for the call's upstream (cached per tenant, subject and audience)."""
        assert self._credentials is not None and call.tool.backend.auth is not None
        return self._credentials.attach(call.tool.backend.auth, audience=call.tool.backend_name, caller=caller,
                                        wait_s=call.deadline.budget())

    def _upstream(self, url: str, source: TokenSource | None, fixed: Headers | None = None,
                  per_caller: bool = False) -> _Upstream:
        upstream = _Upstream(url, self._http, self._handshake_timeout_s, self._mode, self._callbacks, source)
        upstream.per_principal = per_caller or (source is not None and source.per_user)
        upstream.owns_http = bool(fixed) or per_caller or source is not None
        if per_caller:  # a client of its own: every request of the caller's session carries their token
            upstream.http = httpx2.AsyncClient(transport=_SharedTransport(self._transport),
                                               auth=_CallerBearer(self, upstream), follow_redirects=False,
                                               timeout=self._timeout)
        if fixed:  # a client of its own: every request of its session carries the static secret's header
            upstream.fixed_headers = dict(fixed)
            upstream.http = httpx2.AsyncClient(transport=_SharedTransport(self._transport),
                                               headers=upstream.fixed_headers, follow_redirects=False,
                                               timeout=self._timeout)
        if source is not None:  # a client of its own: every request of its session carries the access token
            bearer = UpstreamBearer(source, lambda failure: self._auth_failed(upstream, failure))
            upstream.http = httpx2.AsyncClient(transport=_SharedTransport(self._transport), auth=bearer,
                                               follow_redirects=False, timeout=self._timeout)
        return upstream

    def _bound_sessions(self) -> None:
        """Past ``MAX_USER_SESSIONS`` sessions of per-user sources, the least recently used closes (a call still
        running on it ends as a lost connection: honest, and rare with the bound well above the users at once)."""
        per_user = [key for key, upstream in self._upstreams.items() if upstream.per_principal]
        for key in per_user[:max(0, len(per_user) - MAX_USER_SESSIONS)]:
            task = asyncio.get_running_loop().create_task(self._upstreams.pop(key).aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _auth_failed(self, upstream: _Upstream, failure: ProxyError) -> None:
        """A renewal of the upstream's access token failed: the call that needed it (or, while a session was
        being opened, its callers) report why instead of the upstream's refusal."""
        progress = self._progress.get()
        if progress is not None:
            progress.auth_failure = failure
        else:
            upstream.auth_failure = failure

    async def _send(self, call: BackendCall, upstream: _Upstream, progress: _Progress) -> types.CallToolResult:
        for attempt in (1, 2):
            if attempt == 2:  # the one resend: a token of its own
                progress.headers = {**progress.headers, "Txn-Token": progress.mint()}
            client = await upstream.session()
            progress.observed = progress.headers_sent = progress.connect_failed = False
            progress.status = None
            token = self._progress.set(progress)
            try:
                return await self._call_once(call, upstream, client, progress, plain_post_allowed=attempt == 1)
            except MCPError as exc:
                if attempt == 2 or progress.connect_failed or not await _nothing_ran(upstream, client, progress, exc):
                    raise
            finally:
                self._progress.reset(token)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call_once(self, call: BackendCall, upstream: _Upstream, client: Client, progress: _Progress,
                         plain_post_allowed: bool = True) -> types.CallToolResult:
        """One attempt: a plain POST (mcp_wire) when nothing is to be relayed, else the SDK's session, then the
        2026-07-28 input rounds (answered requests go back with a retry of the same call)."""
        name, arguments = call.tool.backend.tool or "", dict(call.arguments)
        relayed = _progress_callback(call.channel.progress)
        logs = call.channel.log
        # 2026-07-28 upstreams send log messages only to a request that opts in; legacy ones send every level.
        meta = {types.LOG_LEVEL_META_KEY: logs.level} if logs is not None else None
        ask = functools.partial(client.session.call_tool, name, arguments, progress_callback=relayed,
                                allow_input_required=True, meta=meta)
        headers = _plain_post_headers(upstream, progress) if relayed is None and meta is None else None
        if headers is not None and plain_post_allowed and self._wire is not None and not upstream.streams \
                and mcp_wire.stateless(client):  # nothing to relay: one plain POST (mcp_wire)
            answer = await mcp_wire.call_tool(self._wire, upstream.url, client, name, arguments,
                                              headers, progress, self._answer_limits)
            upstream.streams = answer.streamed
            result = answer.result
        else:
            result = await ask()
        return await self._input_rounds(call, client, ask, result)

    async def _input_rounds(self, call: BackendCall, client: Client, ask: Callable[..., Awaitable[Any]],
                            result: Any) -> types.CallToolResult:
        """The 2026-07-28 input rounds of an answer that asks for input: each answered request goes back with a
        retry of the same call (``ask``), at most ``MAX_INPUT_ROUNDS`` of them."""
        for _ in range(MAX_INPUT_ROUNDS):
            if not isinstance(result, types.InputRequiredResult):
                break
            result = await ask(input_responses=await self._input_responses(call, client, result),
                               request_state=result.request_state)
        if not isinstance(result, types.CallToolResult):
            raise _input_not_given(call, "kept asking for input")
        return result

    async def _input_responses(self, call: BackendCall, client: Client,
                               asked: types.InputRequiredResult) -> types.InputResponses:
        """Answers to a 2026-07-28 ``InputRequiredResult`` through the same callbacks.

        A request the caller's client cannot answer ends the call: the upstream
        answered (it did not finish without the input), so nothing was committed.
        """
        responses: dict[str, Any] = {}
        for key, request in (asked.input_requests or {}).items():
            context = ClientRequestContext(session=client.session, request_id=key,
                                           meta=request.params.meta if request.params else None)
            answer = await client.session.dispatch_input_request(context, request)
            if isinstance(answer, types.ErrorData):
                raise _input_not_given(call, "needs input from the client (sampling or elicitation) that the "
                                       "client could not give")
            responses[key] = answer
        return responses

    async def _on_sampling(self, context: ClientRequestContext, params: types.CreateMessageRequestParams) -> Any:
        answer = await self._relay("sampling/createMessage", params)
        if isinstance(answer, types.ErrorData):
            return answer
        adapter = types.CreateMessageResultWithTools if params.tools else types.CreateMessageResult
        return _parsed(adapter, answer)

    async def _on_elicitation(self, context: ClientRequestContext, params: types.ElicitRequestParams) -> Any:
        answer = await self._relay("elicitation/create", params)
        return answer if isinstance(answer, types.ErrorData) else _parsed(types.ElicitResult, answer)

    async def _on_log(self, params: types.LoggingMessageNotificationParams) -> None:
        """An upstream's log message: to the call it arrived during (the SDK runs this in that call's context)."""
        call = self._running.get()
        relay = call.channel.log if call is not None else None
        if call is None or relay is None:  # no call here, or its client did not ask: never anyone else's
            log.debug("MCP upstream log message dropped: no call in this context asked for log messages")
            return
        delivery = asyncio.current_task()
        pending = self._log_deliveries.setdefault(id(call), set())
        if delivery is not None:
            pending.add(delivery)
        try:
            await relay.deliver(params.model_dump(mode="json", by_alias=True))
        finally:
            pending.discard(delivery)  # type: ignore[arg-type]

    async def _relay(self, method: str, params: Any) -> Mapping[str, Any] | types.ErrorData:
        """An upstream's request during a call, to the caller's client (or refused, as the SDK refuses it)."""
        call = self._running.get()
        relay = call.channel.input if call is not None else None
        if call is None or relay is None:  # a front with no MCP client behind it (/v1, OpenAI)
            log.info("MCP upstream's %s refused: no MCP client behind this call to ask", method)
            return types.ErrorData(code=INVALID_REQUEST, message=_NOT_SUPPORTED[method])
        answer = await relay(method, params.model_dump(mode="json", by_alias=True, exclude_none=True),
                             call.deadline)
        if isinstance(answer, InputRefused):
            return types.ErrorData(code=answer.code, message=answer.message)
        return answer

    def _classify(self, call: BackendCall, result: types.CallToolResult) -> BackendResult:
        tool = call.tool
        if result.is_error:
            raise _tool_error(call, result)
        committed = True if tool.is_write else False
        if not tool.declares_output:
            data = {"content": [block.model_dump(mode="json", by_alias=True, exclude_none=True)
                                for block in result.content]}
            if result.structured_content is not None:
                data["structuredContent"] = result.structured_content
        else:
            data = self._declared_output(call, result, committed)
        size = len(json.dumps(data, separators=(",", ":")).encode())
        if size > self._max_response_bytes:
            raise ProxyError("output_invalid", "The tool returned more data than allowed.",
                             details={"limit_bytes": self._max_response_bytes}, phase="verify",
                             attempted=True, committed=committed)
        return BackendResult(data=data, status=200)

    def _unreadable(self, call: BackendCall, why: Mapping[str, Any]) -> ProxyError:
        """The upstream answered, but no result could be read from it: past a limit (``mcp.upstream_max_*``,
        ``why`` names it) or not a valid ``tools/call`` result. A write's effect is then unknown (reconcile);
        a read failed with nothing committed."""
        tool = call.tool
        details: dict[str, Any] = {"tool": tool.name, **why}
        if tool.is_write:  # the honest-outcome rule of every adapter (``adapters.failed_answer``)
            return failed_answer(call, backend="MCP server", details=details)
        return ProxyError("output_invalid", "The MCP server's answer could not be read as a result.",
                          details=details, phase="verify", attempted=True, committed=False)

    def _declared_output(self, call: BackendCall, result: types.CallToolResult, committed: bool) -> Any:
        """The JSON result of a tool that declares an output: its structured content, or the one text block
        that holds it."""
        tool = call.tool
        if result.structured_content is not None:
            data = result.structured_content
            try:  # parsed by the SDK: the same nesting limit as JSON the proxy parses itself
                check_depth(data, self._max_json_depth, what="backend output", phase="verify")
            except ProxyError:
                raise ProxyError("output_invalid", "The MCP tool returned data nested too deeply.",
                                 details={"tool": tool.name}, phase="verify", attempted=True,
                                 committed=committed) from None
            return data
        texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
        if len(texts) != 1 or len(result.content) != 1:
            raise ProxyError("output_invalid", "The MCP tool returned no structured JSON result.",
                             details={"tool": tool.name}, phase="verify", attempted=True, committed=committed)
        try:
            return strict_loads(texts[0], what="backend output", phase="verify", max_depth=self._max_json_depth)
        except ProxyError:
            raise ProxyError("output_invalid", "The MCP tool returned data that is not valid JSON.",
                             details={"tool": tool.name}, phase="verify", attempted=True,
                             committed=committed) from None

    def _timed_out(self, call: BackendCall, progress: _Progress, elapsed: float) -> ProxyError:
        return deadline_passed(call, sent=progress.sent, elapsed_s=elapsed, backend="MCP server")

    def _rpc_failure(self, call: BackendCall, progress: _Progress, code: int) -> ProxyError:
        tool = call.tool
        details: dict[str, Any] = {"tool": tool.name, "upstream_code": code}
        if progress.status is not None:
            details["backend_status"] = progress.status
        if progress.sent and (code in _REFUSED or progress.status == 404):
            return ProxyError("upstream_error", "The MCP server refused the call before running it.",
                              details=details, phase="execute", attempted=True, committed=False,
                              retryable=False, resolution="inspect")
        if not progress.sent or code in _NO_ANSWER:
            return unanswered(call, sent=progress.sent, why="connection_lost", backend="MCP server", details=details)
        return failed_answer(call, backend="MCP server", details=details)


class _CallerBearer(httpx2.Auth):
    """Attaches the session's caller's exchanged token to every request of a per-caller session (the session's
    own requests: its handshake, its stream, its close). A token that cannot be had is handed to the adapter's
    ``_auth_failed`` and the request goes without one (the upstream refuses it)."""

    def __init__(self, adapter: McpAdapter, upstream: _Upstream) -> None:
        self._adapter = adapter
        self._upstream = upstream

    async def async_auth_flow(self, request: httpx2.Request) -> Any:
        credentials, caller = self._adapter._credentials, self._upstream.caller
        name, audience = self._upstream.caller_credential
        if credentials is not None and caller is not None and "authorization" not in request.headers:
            try:
                request.headers.update(dict(await credentials.attach(
                    name, audience=audience, caller=caller, wait_s=self._adapter._handshake_timeout_s)))
            except ProxyError as exc:
                self._adapter._auth_failed(self._upstream, exc)
        yield request


def _progress_callback(relay: ProgressRelay | None) -> Callable[..., Awaitable[None]] | None:
    """The SDK's progress callback for a call whose front relays progress (None: nobody asked)."""
    if relay is None:
        return None

    async def relayed(value: float, total: float | None, message: str | None) -> None:
        await relay(value, total)  # the upstream's progress text is not passed on
    return relayed


def _plain_post_headers(upstream: _Upstream, progress: _Progress) -> Mapping[str, str] | None:
    """What a plain POST (mcp_wire) of the call carries: the call's headers with the upstream's static secret, or
    its access token as the session's client has it; None when that token is not at hand (the SDK's way)."""
    if upstream.source is None:
        return {**progress.headers, **upstream.fixed_headers}
    bearer = upstream.source.current()
    return {**progress.headers, "Authorization": f"Bearer {bearer}"} if bearer is not None else None


def _tool_error(call: BackendCall, result: types.CallToolResult) -> ProxyError:
    """An isError result is the tool's own answer, but only an explicit ``"applied": false`` proves a write
    did not happen."""
    details: dict[str, Any] = {"tool": call.tool.name, **_safe_error(result.structured_content)}
    applied = details.pop("applied", None)
    if call.tool.is_write and applied is not False:
        return ProxyError("upstream_error_unknown", "The MCP tool reported an error; whether the write was "
                          "applied is unknown.", details={**details, "idempotency_key": call.idempotency_key},
                          phase="execute", attempted=True, committed=None)
    reason = f": {details['backend_code']}" if "backend_code" in details else ""
    return ProxyError("business_rejected", f"The MCP tool reported an error{reason}.", details=details,
                      phase="execute", attempted=True, committed=False)


async def _nothing_ran(upstream: _Upstream, client: Client, progress: _Progress, exc: MCPError) -> bool:
    """Whether a failed first attempt provably ran nothing and may be sent once more: the upstream forgot our
    session (404 on a session revision: a new one is opened), or refused our Mcp-Param headers (learnt now)."""
    if progress.status == 404 and client.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS:
        upstream.drop()
        return True
    if upstream.source is not None and progress.status in (401, 403):
        # A plain POST (mcp_wire) the upstream refused without running it: its token was refused (renewed
        # now) or its scope was short (the session's client steps up); the SDK's way sends it once more.
        if progress.status == 401:
            upstream.source.invalidate(upstream.source.current())
        return True
    if exc.error.code == HEADER_MISMATCH:
        await client.session.list_tools()
        return True
    return False


def _input_not_given(call: BackendCall, why: str) -> ProxyError:
    """A 2026-07-28 call that ended in input rounds: the upstream answered each round without finishing."""
    return ProxyError("upstream_error", f"The MCP tool {why}; it did not finish.", details={"tool": call.tool.name},
                      phase="execute", attempted=True, committed=False, retryable=False, resolution="inspect")


def _parsed(model: Any, answer: Mapping[str, Any]) -> Any:
    """The client's result as the SDK type the upstream expects; a malformed one is refused."""
    try:
        return model.model_validate(dict(answer), by_name=False)
    except ValueError:
        return types.ErrorData(code=INVALID_PARAMS, message="The client's result is not valid")


def _safe_error(structured: Any) -> dict[str, Any]:
    """An upstream tool error reduced to safe machine-readable fields (never its text)."""
    safe = safe_error_fields(structured)
    if "code" in safe:
        safe["backend_code"] = safe.pop("code")
    return safe