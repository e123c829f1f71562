"""MCP front: the Streamable HTTP endpoint ``/mcp`` on the agent listener.

Owns: JSON-RPC framing over HTTP (POST for messages, DELETE to end a session,
GET refused with 405 because the proxy never pushes server-initiated
messages), refusing requests whose ``Host`` or ``Origin`` is not allowed
(DNS rebinding: 403 on every method), choosing the protocol era per request
and checking it, and translating ``tools/list`` / ``tools/call`` into the
shared listing and the one ``Pipeline.execute``:

* legacy era (2024-11-05 .. 2025-11-25): ``initialize`` negotiates a version
  and opens a session (``Mcp-Session-Id``); later requests must carry it and
  may carry any supported ``MCP-Protocol-Version`` (as the reference SDK
  servers do). Sessions negotiated at 2025-03-26 also accept JSON-RPC batches,
  which that revision requires and later ones removed.
* modern era (2026-07-28): every request is self-contained — ``_meta``
  envelope plus ``MCP-Protocol-Version`` / ``Mcp-Method`` / ``Mcp-Name``
  headers that must agree with the body (checked with the SDK's own
  validation ladder, ``mcp.shared.inbound``); ``server/discover`` advertises
  the versions.

Every peer of this edge is bounded: a JSON-RPC batch holds at most
``mcp.batch_max_members`` members (and ``scheduler.max_calls`` calls), refused
whole above, and its calls run as one plan on the batch scheduler (its ordering
check and limits); one caller holds at most ``mcp.max_sessions_per_owner``
sessions; a call's SSE stream queues at most ``mcp.sse_queue_max``
notifications (the excess dropped and counted); bodies are read within
``listen.max_body_bytes`` (``ingress``).

Protocol problems are JSON-RPC errors (malformed
request ``-32600``/``-32700``, unsupported version ``-32022``, header mismatch
``-32020``, a method a tools gateway does not offer ``-32601``, an unknown or
retired tool ``-32602`` as each revision's tools page says); everything else the
pipeline says about a call is a ``CallToolResult`` (``isError`` with the
envelope in ``_meta``, see ``mcp_tools.call_result``). A call still running after
``mcp.sse_after_ms`` is answered as an SSE stream with keepalive pings. A
request the call's upstream sends back (sampling, elicitation) reaches a
session client that declared it on the call's SSE stream, and the client's
response POSTed here goes back to that call (``proxy/fronts/mcp/relay.py``); so do
the upstream's log messages of the call, at or above the level the client asked
for (``logging/setLevel`` on a session, stored on it; on 2026-07-28, which
removed that method, the request's ``_meta`` log level).

A client's operation identity: the ``X-Run-Id`` header (the business request:
run, task or conversation; a client sets it once on its transport), else
``params._meta["io.toolproxy/run-id"]``; or a key, the ``Idempotency-Key``
header, else ``params._meta["io.toolproxy/idempotency-key"]`` (writes require
one of them by default).

Must never: use the session id or the JSON-RPC id as a call id or an
idempotency key (a client re-issues a broken request with a new id), decide
anything a pipeline stage decides, or run a call outside ``Pipeline.execute``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web
from mcp.shared.inbound import (
    ERROR_CODE_HTTP_STATUS,
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PROTOCOL_VERSION_HEADER,
    NAME_BEARING_METHODS,
    InboundLadderRejection,
    classify_inbound_request,
    decode_header_value,
    find_duplicated_routing_header,
)
from mcp_types import LOG_LEVEL_META_KEY, SERVER_INFO_META_KEY
from mcp_types import methods as mcp_methods
from mcp_types.jsonrpc import (
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION, MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from ... import __version__
from .. import ingress
from ..rebinding import HostGuard
from . import relay as mcp_relay, tools as mcp_tools
from ...envelope import Envelope, dumps as json_bytes
from ...call_channel import CallChannel, LogRelay
from ...audit import Auditor
from ...config import Config
from ...errors import ProxyError
from ...idempotency import MCP_KEY_META, MCP_RUN_META
from ...policy.approvals import MCP_APPROVAL_META
from ...requests import RequestMeta
from ...telemetry import spans, tracing
from ...telemetry.tracing import safe_id
from ...identity import Authenticator, Caller
from ...policy.listing import visible_tools
from .sessions import Session, SessionsFull, SessionTable
from ...telemetry.metrics import Metrics
from ...batch.plan import BatchPlan, PlannedCall
from ...batch.scheduler import Scheduler
from ...pipeline import Pipeline, ToolCallRequest
from ...policy.client import PolicyClient
from ...registry import Registry

log = logging.getLogger("toolproxy.mcp")

SESSION_HEADER = "Mcp-Session-Id"
SUPPORTED_VERSIONS = (*HANDSHAKE_PROTOCOL_VERSIONS, *MODERN_PROTOCOL_VERSIONS)
SERVER_INFO = {"name": "toolproxy", "version": __version__}
# logging: the upstreams' log messages of a call, relayed to its client (``mcp_relay.Channel.log``).
CAPABILITIES = {"tools": {"listChanged": False}, "logging": {}}
INSTRUCTIONS = ("Tool calls pass through toolproxy: failures come back as isError results whose text says "
                f"what to do next; the proxy's result envelope is in _meta[{mcp_tools.ENVELOPE_META_KEY!r}].")
BATCH_VERSION = "2025-03-26"  # the one negotiated revision with JSON-RPC batches
FORBIDDEN = -32000  # implementation-defined server error, as the reference SDKs answer a bad Host/Origin
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache, no-transform",
                "X-Accel-Buffering": "no"}
# Ingress failures -> (HTTP status, JSON-RPC code).
_INGRESS = {"invalid_json": (400, PARSE_ERROR), "payload_too_large": (413, INVALID_REQUEST),
            "unsupported_media_type": (415, INVALID_REQUEST), "invalid_request": (400, INVALID_REQUEST),
            "unauthorized": (401, INVALID_REQUEST)}


class RpcError(Exception):
    """A JSON-RPC error answer, with the HTTP status it travels with (None: the era's default)."""

    def __init__(self, code: int, message: str, data: Any = None, *, status: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data, self.status = code, message, data, status

    def body(self, rpc_id: Any) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return {"jsonrpc": "2.0", "id": rpc_id, "error": error}


@dataclass(frozen=True)
class Message:
    """One decoded JSON-RPC message (request if ``has_id``)."""

    method: str | None
    params: Mapping[str, Any] | None
    rpc_id: Any
    has_id: bool
    raw: Mapping[str, Any] = field(repr=False)


@dataclass(frozen=True)
class Exchange:
    """The negotiated facts one request is served under."""

    modern: bool
    version: str
    caller: Caller
    session: Session | None = None


class McpFront:
    """The /mcp endpoint of one agent listener; holds that listener's legacy sessions."""

    def __init__(self, *, config: Config, authenticator: Authenticator, registry: Registry, policy: PolicyClient,
                 pipeline: Pipeline, scheduler: Scheduler, metrics: Metrics, audit: Auditor) -> None:
        self._config = config  # the whole of it: ingress reads its limits and header rules
        self._authenticator = authenticator
        self._registry = registry
        self._policy = policy
        self._pipeline = pipeline
        self._scheduler = scheduler  # a JSON-RPC batch's tools/call members run within its limits
        self._metrics = metrics
        mcp = config.mcp
        self._page_size = mcp.page_size
        self._batch_max = mcp.batch_max_members
        self._queue_max = mcp.sse_queue_max
        self._sessions = SessionTable(max_sessions=mcp.max_sessions, idle_s=mcp.session_idle_s,
                                      max_per_owner=mcp.max_sessions_per_owner)
        self._sse_after_s = mcp.sse_after_ms / 1000.0
        self._ping_s = max(0.05, mcp.sse_ping_ms / 1000.0)
        self._hosts = HostGuard(mcp)  # the agent listener's Host/Origin check, answered here in JSON-RPC shape
        # In-flight tools/call per (session id, JSON-RPC id): the signal notifications/cancelled sets.
        self._inflight: dict[tuple[str, Any], asyncio.Event] = {}
        self._relays = mcp_relay.Desk(mcp, metrics, audit, pipeline.flow)  # relayed requests waiting for their client's response

    def install(self, app: web.Application) -> None:
        app.router.add_post("/mcp", self._guarded(self.post))
        app.router.add_get("/mcp", self._guarded(self.get))
        app.router.add_delete("/mcp", self._guarded(self.delete))

    def _guarded(self, handler: Any) -> Any:
        """``handler`` behind the Host/Origin check (DNS rebinding protection, every method)."""
        async def guarded(request: web.Request) -> web.StreamResponse:
            refusal = self._hosts.refusal(request)
            if refusal is not None:
                return _json(RpcError(FORBIDDEN, refusal, {"code": "origin_not_allowed"}).body(None), 403)
            return await handler(request)
        return guarded

    # -- HTTP verbs ---------------------------------------------------------

    async def get(self, request: web.Request) -> web.Response:
        # No server-initiated messages exist: a registry reload is not announced
        # (tools.listChanged is false; clients see it on their next tools/list),
        # so no standalone SSE stream is offered.
        return web.Response(status=405, headers={"Allow": "POST, DELETE"})

    async def delete(self, request: web.Request) -> web.Response:
        try:
            caller = await self._authenticate(request)
        except RpcError as error:
            return _json(error.body(None), error.status or 400)
        session_id = request.headers.get(SESSION_HEADER)
        if not session_id:
            return _json(RpcError(INVALID_REQUEST, "Missing Mcp-Session-Id").body(None), 400)
        if not self._sessions.end(session_id, caller):
            return _json(RpcError(INVALID_REQUEST, "Session not found").body(None), 404)
        return web.Response(status=200)

    async def post(self, request: web.Request) -> web.StreamResponse:
        seen = _Seen()
        headers: dict[str, str] = {}
        try:
            return await self._post(request, seen, headers)
        except RpcError as error:
            status = error.status or (ERROR_CODE_HTTP_STATUS.get(error.code, 200) if seen.modern else 200)
            return _json(error.body(seen.rpc_id()), status, headers)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("MCP request failed", extra={"request_id": ingress.request_id_of(request)})
            return _json(RpcError(INTERNAL_ERROR, "Internal error").body(seen.rpc_id()), 500, headers)

    async def _post(self, request: web.Request, seen: "_Seen", headers: dict[str, str]) -> web.StreamResponse:
        has_json, has_sse = _accepts(request)
        if not has_json:
            return _json(RpcError(INVALID_REQUEST, "Not Acceptable: the client must accept application/json")
                         .body(None), 406)
        # Identity first: an unauthenticated body is never read (the README's promise, as on every endpoint).
        caller = await self._authenticate(request)
        body = await self._read(request)
        if isinstance(body, list):
            return await self._batch(request, body, headers)
        if _is_response(body):
            return self._relay_response(request, body, caller)
        message = seen.message = _message(body)
        duplicated = find_duplicated_routing_header(request.headers.items())
        if duplicated is not None:
            raise RpcError(HEADER_MISMATCH, f"{duplicated} header appears more than once", status=400)
        seen.modern = _is_modern(request, message)
        exchange = (self._modern(request, body, message, caller) if seen.modern
                    else self._legacy(request, message, caller, headers))
        if not message.has_id:
            if message.method == "notifications/cancelled" and exchange.session is not None:
                self._withdraw(exchange.session, (message.params or {}).get("requestId"))
            return web.Response(status=202, headers=headers)
        if message.method == "tools/call":
            return await self._answer_call(request, message, headers, has_sse, exchange)
        return _json(_ok(message.rpc_id, await self._dispatch(request, message, exchange, headers)), 200, headers)

    # -- reading and era checks ---------------------------------------------

    async def _read(self, request: web.Request) -> Any:
        try:
            return await ingress.read_json(request, self._config)
        except ProxyError as error:
            status, code = _INGRESS.get(error.code, (400, INVALID_REQUEST))
            text = "Parse error" if code == PARSE_ERROR else error.message
            raise RpcError(code, text, status=status) from None

    async def _authenticate(self, request: web.Request) -> Caller:
        try:
            return await self._authenticator.authenticate(request.headers, request.remote)
        except ProxyError as error:
            status, code = _INGRESS.get(error.code, (401, INVALID_REQUEST))
            raise RpcError(code, error.message, {"code": error.code}, status=status) from None

    def _modern(self, request: web.Request, body: Any, message: Message, caller: Caller) -> Exchange:
        requested = request.headers.get(MCP_PROTOCOL_VERSION_HEADER, "")
        if not message.has_id:
            if requested not in MODERN_PROTOCOL_VERSIONS:
                raise _unsupported(requested)
            return Exchange(modern=True, version=requested, caller=caller)
        lowered = {k.lower(): v for k, v in request.headers.items()}
        verdict = classify_inbound_request(body, headers=lowered, supported_modern_versions=MODERN_PROTOCOL_VERSIONS)
        if isinstance(verdict, InboundLadderRejection):
            if verdict.code == UNSUPPORTED_PROTOCOL_VERSION:
                raise _unsupported(requested)
            raise RpcError(verdict.code, verdict.message, verdict.data)
        _check_params(message, verdict.protocol_version)
        return Exchange(modern=True, version=verdict.protocol_version, caller=caller)

    def _legacy(self, request: web.Request, message: Message, caller: Caller,
                headers: dict[str, str]) -> Exchange:
        if message.method == "initialize" and message.has_id:
            requested = (message.params or {}).get("protocolVersion")
            version = requested if requested in HANDSHAKE_PROTOCOL_VERSIONS else LATEST_HANDSHAKE_VERSION
            _check_params(message, version)
            try:
                session = self._sessions.create(
                    caller, version, mcp_relay.declared((message.params or {}).get("capabilities")))
            except SessionsFull as full:
                self._metrics.child(self._metrics.mcp_refusals, full.reason).inc()
                raise RpcError(INVALID_REQUEST, "Too many open sessions; end one (DELETE) or try again later",
                               {"code": full.reason}, status=503) from None
            headers[SESSION_HEADER] = session.id
            return Exchange(modern=False, version=version, caller=caller, session=session)
        session_id = request.headers.get(SESSION_HEADER)
        if not session_id:
            raise RpcError(INVALID_REQUEST, "Bad Request: missing Mcp-Session-Id (initialize first)", status=400)
        session = self._sessions.get(session_id, caller)
        if session is None:
            raise RpcError(INVALID_REQUEST, "Not Found: session expired or unknown; initialize again", status=404)
        headers[SESSION_HEADER] = session.id
        requested = request.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        # Like the reference SDK servers: any supported revision is accepted on a session
        # (a client's parallel streams may say an older one); the session's stays in force.
        if requested is not None and requested not in HANDSHAKE_PROTOCOL_VERSIONS:
            raise RpcError(INVALID_REQUEST, "Bad Request: unsupported MCP-Protocol-Version",
                           {"supported": list(HANDSHAKE_PROTOCOL_VERSIONS), "requested": requested[:64]}, status=400)
        _check_routing_headers(request, message)
        if message.has_id:
            _check_params(message, session.protocol_version)
        return Exchange(modern=False, version=session.protocol_version, caller=caller, session=session)

    async def _batch(self, request: web.Request, bodies: list[Any], headers: dict[str, str]) -> web.Response:
        """A JSON-RPC batch: accepted only on a session negotiated at 2025-03-26.

        At most ``mcp.batch_max_members`` members, of which at most
        ``scheduler.max_calls`` ``tools/call``; a larger batch is refused whole
        (``-32600``, data ``batch_too_large``) before anything runs. Each member is
        checked and answered on its own (one failing member does not fail the
        others); initialize may not be batched. The batch's calls are one plan on
        the batch scheduler (``_run_plan``), as a ``POST /v1/tool-calls:batch``:
        reads in parallel, calls on one resource one at a time, within the
        scheduler's limits and one batch deadline (the request's, else
        ``scheduler.default_timeout_ms``); two writes on one resource are refused
        (``invalid_plan``, nothing of the batch's calls runs), since a JSON-RPC batch
        states no order. The answers come back as one JSON array, or 202 when the
        batch held only notifications.
        """
        caller, session = await self._batch_session(request, bodies)
        answers: list[Any] = [None] * len(bodies)
        planned, others = self._sort_members(request, bodies, caller, headers, answers)
        for (index, rpc_id, _), outcome in zip(others, await asyncio.gather(*(call for _, _, call in others),
                                                                             return_exceptions=True)):
            answers[index] = _member_answer(rpc_id, outcome)
        if planned:
            for index, answer in zip((i for i, _ in planned), await self._run_plan(request, planned, caller, session)):
                answers[index] = answer
        present = [a for a in answers if a is not None]
        if not present:
            return web.Response(status=202, headers=headers)
        return _json(present, 200, headers)

    async def _batch_session(self, request: web.Request, bodies: list[Any]) -> tuple[Caller, Session]:
        """The batch's caller and session, once the batch may run at all (not empty, a 2025-03-26 session,
        within the member and call limits)."""
        if not bodies:
            raise RpcError(INVALID_REQUEST, "Empty batch", status=400)
        caller = await self._authenticate(request)
        session = self._sessions.get(request.headers.get(SESSION_HEADER) or "", caller)
        if session is None or session.protocol_version != BATCH_VERSION:
            raise RpcError(INVALID_REQUEST, f"Batches are accepted only on sessions negotiated at {BATCH_VERSION}",
                           status=400)
        calls = sum(1 for b in bodies if isinstance(b, dict) and b.get("method") == "tools/call")
        if len(bodies) > self._batch_max or calls > self._scheduler.max_calls:
            self._metrics.child(self._metrics.mcp_refusals, "batch_too_large").inc()
            raise RpcError(INVALID_REQUEST, "Batch too large; nothing was run",
                           {"code": "batch_too_large", "members": len(bodies), "max_members": self._batch_max,
                            "calls": calls, "max_calls": self._scheduler.max_calls}, status=413)
        return caller, session

    def _sort_members(self, request: web.Request, bodies: list[Any], caller: Caller, headers: dict[str, str],
                      answers: list[Any]) -> tuple[list[tuple[int, Message]], list[tuple[int, Any, Awaitable[Any]]]]:
        """The batch's tools/call members (for one plan) and its other requests (each dispatched now); a member
        refused on its own gets its answer in ``answers`` (notifications get none)."""
        planned: list[tuple[int, Message]] = []
        others: list[tuple[int, Any, Awaitable[Any]]] = []
        for index, body in enumerate(bodies):
            message: Message | None = None
            try:
                message = _message(body)
                if message.method == "initialize":
                    raise RpcError(INVALID_REQUEST, "initialize must not be part of a batch")
                exchange = self._legacy(request, message, caller, headers)
                if not message.has_id:
                    continue
                if message.method == "tools/call":
                    planned.append((index, message))
                else:
                    others.append((index, message.rpc_id, self._dispatch(request, message, exchange, headers)))
            except RpcError as error:
                if message is None or message.has_id:
                    answers[index] = error.body(message.rpc_id if message is not None else None)
        return planned, others

    async def _run_plan(self, request: web.Request, members: list[tuple[int, Message]], caller: Caller,
                        session: Session) -> list[dict[str, Any]]:
        """The batch's tools/call members as one plan on the batch scheduler; their answers, in member order.
        Each call's ``_meta`` identity (key, business request id, approval) applies to it alone; a header wins."""
        try:
            meta = self._batch_meta(request)
        except RpcError as refusal:
            return [refusal.body(message.rpc_id) for _, message in members]
        calls, problems = _planned_calls(meta, members)
        runnable = [c for c, problem in zip(calls, problems) if problem is None]
        rpc_ids = {c.call_id: m.rpc_id for c, (_, m) in zip(calls, members)}
        envelopes = await self._run_calls(runnable, meta, caller, rpc_ids) if runnable else {}
        answers = []
        for call, problem, (_, message) in zip(calls, problems, members):
            if problem is not None:
                answers.append(problem.body(message.rpc_id))
                continue
            try:
                answers.append(_ok(message.rpc_id, self._call_answer(envelopes[call.call_id], call.tool,
                                                                     modern=False)))
            except RpcError as error:
                answers.append(error.body(message.rpc_id))
        return answers

    def _batch_meta(self, request: web.Request) -> RequestMeta:
        """The batch request's headers as request metadata; an RpcError refuses every call of the batch."""
        try:
            meta = ingress.request_meta(request, self._config)
        except ProxyError as error:
            raise RpcError(INVALID_REQUEST, error.message, {"code": error.code, **error.details}) from None
        if meta.approval_id is not None:  # one approval binds one call's arguments
            raise RpcError(INVALID_REQUEST, "A batch carries approvals per call, in each call's "
                           f"_meta[{MCP_APPROVAL_META!r}], not in the X-Approval-Id header.",
                           {"code": "invalid_request", "header": "X-Approval-Id"})
        return meta

    async def _run_calls(self, runnable: list[PlannedCall], meta: RequestMeta, caller: Caller,
                         rpc_ids: dict[str, Any]) -> dict[str, Envelope]:
        """The runnable calls' envelopes by call id, run as one plan; each refused alike if the plan was."""
        try:
            result = await self._scheduler.run(BatchPlan(calls=tuple(runnable), meta=meta), caller)
            return {env.call_id: env for env in result.results if env.call_id is not None}
        except ProxyError as error:  # the plan was refused: none of its calls ran
            refused = _plan_refusal(error, rpc_ids)
            return {c.call_id: Envelope.of(call_id=c.call_id, request_id=meta.request_id, tool=c.tool,
                                           tool_version=None, error=refused) for c in runnable}

    def _relay_response(self, request: web.Request, body: dict[str, Any], caller: Caller) -> web.Response:
        """A client's response to a relayed request: 202 if it answers one waiting on its session."""
        session = self._sessions.get(request.headers.get(SESSION_HEADER) or "", caller)
        if body.get("jsonrpc") != "2.0" or session is None or not self._relays.answer(session, body):
            raise RpcError(INVALID_REQUEST, "Bad Request: no relayed request with this id is waiting on this session",
                           status=400)
        return web.Response(status=202, headers={SESSION_HEADER: session.id})

    # -- methods --------------------------------------------------------------

    def _dispatch(self, request: web.Request, message: Message, exchange: Exchange,
                  headers: dict[str, str]) -> Awaitable[dict[str, Any]]:
        method = message.method
        params = message.params or {}
        if method == "initialize":
            return _done({"protocolVersion": exchange.version, "capabilities": CAPABILITIES,
                          "serverInfo": SERVER_INFO, "instructions": INSTRUCTIONS})
        if method == "ping":
            return _done({})
        if method == "logging/setLevel" and exchange.session is not None:  # 2026-07-28 has no such method
            self._sessions.set_log_level(exchange.session.id, exchange.caller, params["level"])
            return _done({})
        if method == "server/discover":
            return _done({"supportedVersions": list(SUPPORTED_VERSIONS), "capabilities": CAPABILITIES,
                          "instructions": INSTRUCTIONS, "resultType": "complete", "ttlMs": 0,
                          "cacheScope": "public", "_meta": {SERVER_INFO_META_KEY: SERVER_INFO}})
        if method == "tools/list":
            return self._list(params, exchange)
        raise RpcError(METHOD_NOT_FOUND, f"Method not found: {str(method)[:64]}")

    async def _list(self, params: Mapping[str, Any], exchange: Exchange) -> dict[str, Any]:
        try:
            tools = await visible_tools(self._registry, self._policy, exchange.caller,
                                        quarantine=self._pipeline.quarantine)
        except ProxyError as error:  # OPA could not decide: the listing fails closed
            raise RpcError(INTERNAL_ERROR, error.message, {"code": error.code, "retryable": error.retryable},
                           status=error.spec.http_status) from None
        try:
            chunk, next_cursor = mcp_tools.page(tools, params.get("cursor"), self._page_size)
        except mcp_tools.BadCursor as error:
            raise RpcError(INVALID_PARAMS, str(error)) from None
        result: dict[str, Any] = {"tools": [mcp_tools.tool_definition(t, modern=exchange.modern) for t in chunk]}
        if next_cursor is not None:
            result["nextCursor"] = next_cursor
        if exchange.modern:
            # The listing depends on who asks: never shared across callers, never cached stale.
            result.update(resultType="complete", ttlMs=0, cacheScope="private")
        return result

    async def _call(self, request: web.Request, params: Mapping[str, Any], exchange: Exchange,
                    channel: CallChannel) -> dict[str, Any]:
        """One tools/call through ``Pipeline.execute``, with its ``channel`` back to the client."""
        try:
            meta = ingress.request_meta(request, self._config)
        except ProxyError as error:
            raise RpcError(INVALID_REQUEST, error.message, {"code": error.code, **error.details},
                           status=400) from None
        meta = _with_meta_key(meta, params, trace=tracing.from_meta(meta.trace, params.get("_meta")))  # MCP semconv
        name = params["name"]
        call = ToolCallRequest(call_id=f"mcp-{secrets.token_hex(16)}", tool=name, version=None,
                               arguments=params.get("arguments") or {}, meta=meta, channel=channel)
        relay = channel.input
        if isinstance(relay, mcp_relay.Channel):  # its audit records name the call; its flow, the contract's
            relay.call_id, relay.tool, relay.run_id = call.call_id, name, meta.run_id
            contract = self._pipeline.registry.default(name) if isinstance(name, str) else None
            relay.sink = contract.flow_sink if contract is not None else "external"
        async with contextlib.AsyncExitStack() as held:
            traced = spans.mcp_request(meta.trace, exchange.version, exchange.session.id if exchange.session else None)
            if traced is not None:  # the MCP conventions' server span, parent of the call's execute_tool span
                held.enter_context(traced)
            env = (await self._pipeline.execute(call, exchange.caller)).envelope
            if traced is not None:
                traced.settle(env.tool if env.tool_version else None, env.error_code)
        return self._call_answer(env, name, modern=exchange.modern)

    def _call_answer(self, env: Envelope, name: Any, *, modern: bool) -> dict[str, Any]:
        """The CallToolResult of one call's envelope; an unknown tool is the protocol error ``-32602``."""
        if env.error_code == "tool_not_found":
            # A protocol error, as the tools page of every supported revision (2024-11-05 .. 2026-07-28)
            # says: "Unknown tool" is a JSON-RPC error -32602, not a tool result.
            # The pipeline ran it (audit record, metrics); the envelope's facts travel in ``data``.
            error = env.error
            hint = error.details.get("did_you_mean") if error is not None else None
            raise RpcError(INVALID_PARAMS, f"Unknown tool: {str(name)[:128]}"
                           + (f'. Did you mean "{hint}"?' if isinstance(hint, str) else ""),
                           {"code": "tool_not_found", **(dict(error.details) if error is not None else {}),
                            mcp_tools.ENVELOPE_META_KEY: env.to_json()})
        try:
            tool = self._registry.resolve(env.tool, env.tool_version)
        except ProxyError:
            tool = None
        return mcp_tools.call_result(env, tool, modern=modern)

    def _withdraw(self, session: Session, request_id: Any) -> None:
        signal = self._inflight.get((session.id, request_id)) if isinstance(request_id, (str, int)) else None
        if signal is not None:
            signal.set()

    async def _answer_call(self, request: web.Request, message: Message, headers: dict[str, str], has_sse: bool,
                           exchange: Exchange) -> web.StreamResponse:
        """JSON if the call finishes within ``sse_after``; otherwise an SSE stream with pings.

        A call whose ``_meta.progressToken`` asks for progress (and whose client
        accepts SSE) streams at once: the backend's progress numbers arrive as
        ``notifications/progress`` before the result. A session's
        ``notifications/cancelled`` for the call withdraws it if nothing was
        sent yet (outcome ``cancelled``); once sent, it runs on. The call runs
        to completion either way: a client that goes away does not cancel a
        call whose outcome must still be recorded.
        """
        loop = asyncio.get_running_loop()
        updates = _Updates(loop, self._queue_max,
                           lambda kind: self._metrics.child(self._metrics.mcp_sse_dropped, kind).inc())
        channel, streams_now = self._call_channel(message, exchange, updates if has_sse else None)
        task = loop.create_task(self._call(request, message.params or {}, exchange, channel))
        self._forget_when_done(task, exchange, message)
        if has_sse and not streams_now:  # JSON unless it runs long or an update must go out first
            await updates.decided_within(task, self._sse_after_s)
        if not has_sse or (task.done() and not streams_now and not updates.pending()):
            body = await _settle(task, message.rpc_id)
            code = body["error"]["code"] if "error" in body else None
            status = ERROR_CODE_HTTP_STATUS.get(code, 200) if exchange.modern and code is not None else 200
            return _json(body, status, headers)
        return await self._stream(request, task, updates.stream(), message, headers)

    def _call_channel(self, message: Message, exchange: Exchange,
                      updates: "_Updates | None") -> tuple[CallChannel, bool]:
        """What the call (down to its adapter) is handed: the withdrawal signal of a session's call, the relay
        of requests and log messages to the client, and progress when the client asked for it and can
        receive it (then the answer streams at once: the second value)."""
        signal = None
        if exchange.session is not None:
            signal = asyncio.Event()
            self._inflight[(exchange.session.id, message.rpc_id)] = signal
        request_meta = (message.params or {}).get("_meta") or {}
        log_level = request_meta.get(LOG_LEVEL_META_KEY) if exchange.modern else \
            (exchange.session.log_level if exchange.session is not None else None)
        relay = self._relays.channel(exchange.session, exchange.caller,
                                     updates.push if updates is not None else None, log_level)
        logs = LogRelay(relay.log_level, relay.log) if relay.log_level is not None else None
        channel = CallChannel(log=logs, input=relay, withdrawn=signal)
        token = request_meta.get("progressToken")
        if updates is None or not isinstance(token, (str, int)) or isinstance(token, bool):
            return channel, False

        async def progress(value: float, total: float | None) -> None:
            params: dict[str, Any] = {"progressToken": token, "progress": value}
            if total is not None:
                params["total"] = total
            updates.push({"jsonrpc": "2.0", "method": "notifications/progress", "params": params})

        return replace(channel, progress=progress), True

    def _forget_when_done(self, task: "asyncio.Task[Any]", exchange: Exchange, message: Message) -> None:
        if exchange.session is None:
            return
        key = (exchange.session.id, message.rpc_id)
        signal = self._inflight.get(key)
        task.add_done_callback(lambda _: self._inflight.pop(key, None) if self._inflight.get(key) is signal
                               else None)

    async def _stream(self, request: web.Request, task: "asyncio.Task[Any]", queue: "asyncio.Queue[dict[str, Any]]",
                      message: Message, headers: dict[str, str]) -> web.StreamResponse:
        """The SSE answer: updates as they come, a ping every ``ping_s``, then the result. A client that went
        away stops the writes, never the call."""
        response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **headers})
        await response.prepare(request)
        connected = True
        while not task.done():
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({task, getter}, timeout=self._ping_s, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
            elif connected:
                connected = await _write(response, _event(getter.result()))
            if not done and connected:
                connected = await _write(response, b": ping\n\n")
        while not queue.empty() and connected:
            connected = await _write(response, _event(queue.get_nowait()))
        body = await _settle(task, message.rpc_id)
        if connected and await _write(response, _event(body)):
            await response.write_eof()
        return response


@dataclass
class _Seen:
    """What an error answer needs of a request read so far: its message (for the id) and its era."""

    message: Message | None = None
    modern: bool = False

    def rpc_id(self) -> Any:
        return self.message.rpc_id if self.message is not None and self.message.has_id else None


class _Updates:
    """What a call's SSE stream carries before its result (progress, relayed requests, log messages), and the
    moment the answer's form is decided (the call ended, an update must go out, or ``sse_after`` passed).
    The queue is made on the first update or when the answer streams: most calls answer JSON without one."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue_max: int, dropped: Callable[[str], None]) -> None:
        self._queue: asyncio.Queue[dict[str, Any]] | None = None
        self._decided = loop.create_future()
        self._loop, self._max, self._dropped = loop, queue_max, dropped

    def decide(self, _: Any = None) -> None:
        if not self._decided.done():
            self._decided.set_result(None)

    def push(self, update: dict[str, Any]) -> None:
        queue = self.stream()
        if "id" not in update and queue.qsize() >= self._max:
            # A notification past mcp.sse_queue_max: dropped and counted. Relayed requests (with an id)
            # always go out: a call has at most mcp_relay.MAX_OUTSTANDING of them, and one waits for its answer.
            self._dropped("progress" if update.get("method") == "notifications/progress" else "log")
            return
        queue.put_nowait(update)
        self.decide()  # the response must stream from now on

    async def decided_within(self, task: "asyncio.Task[Any]", seconds: float) -> None:
        task.add_done_callback(self.decide)  # (callbacks, not a waiter task per call)
        timer = self._loop.call_later(seconds, self.decide)
        try:
            await self._decided
        finally:
            timer.cancel()

    def pending(self) -> bool:
        return self._queue is not None and not self._queue.empty()

    def stream(self) -> "asyncio.Queue[dict[str, Any]]":
        if self._queue is None:
            self._queue = asyncio.Queue()
        return self._queue


# -- helpers ----------------------------------------------------------------------


def _accepts(request: web.Request) -> tuple[bool, bool]:
    """(JSON accepted, SSE accepted) by the request's ``Accept``."""
    return _accepted(request.headers.get("Accept"))


@functools.lru_cache(maxsize=256)  # a client sends the same Accept on every request
def _accepted(raw: str | None) -> tuple[bool, bool]:
    if raw is None:
        return True, False
    types = {part.split(";")[0].strip().lower() for part in raw.split(",")}
    wildcard = "*/*" in types
    return (wildcard or bool(types & {"application/json", "application/*"}),
            wildcard or bool(types & {"text/event-stream", "text/*"}))


def _message(body: Any) -> Message:
    if not isinstance(body, dict):
        raise RpcError(INVALID_REQUEST, "Body must be one JSON-RPC request or notification object", status=400)
    has_id = "id" in body
    rpc_id = body.get("id")
    if body.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "jsonrpc must be \"2.0\"", status=400)
    if has_id and (isinstance(rpc_id, bool) or not isinstance(rpc_id, (str, int))):
        raise RpcError(INVALID_REQUEST, "id must be a string or an integer", status=400)
    method = body.get("method")
    if method is None and ("result" in body or "error" in body):
        # Responses answer relayed requests one per POST (``_relay_response``), never inside a batch.
        raise RpcError(INVALID_REQUEST, "Responses are accepted only one per request", status=400)
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, "method must be a non-empty string", status=400)
    params = body.get("params")
    if params is not None and not isinstance(params, dict):
        raise RpcError(INVALID_REQUEST, "params must be an object", status=400)
    return Message(method=method, params=params, rpc_id=rpc_id, has_id=has_id, raw=body)


def _is_response(body: Any) -> bool:
    return isinstance(body, dict) and "method" not in body and ("result" in body or "error" in body)


def _is_modern(request: web.Request, message: Message) -> bool:
    requested = request.headers.get(MCP_PROTOCOL_VERSION_HEADER)
    return (requested is not None and requested not in HANDSHAKE_PROTOCOL_VERSIONS) \
        or message.method == "server/discover"


def _unsupported(requested: str) -> RpcError:
    return RpcError(UNSUPPORTED_PROTOCOL_VERSION, "Unsupported protocol version",
                    {"supported": list(SUPPORTED_VERSIONS), "requested": requested[:64]})


def _check_params(message: Message, version: str) -> None:
    """The params of ``message`` against the SDK's wire types of ``version``."""
    try:
        mcp_methods.validate_client_request(message.method or "", version, message.params)
    except KeyError:
        raise RpcError(METHOD_NOT_FOUND, f"Method not found: {(message.method or '')[:64]}") from None
    except ValidationError as exc:
        problems = [{"path": ".".join(map(str, e["loc"])), "message": e["msg"]} for e in exc.errors()[:10]]
        raise RpcError(INVALID_PARAMS, "Invalid params", {"violations": problems}) from None


def _check_routing_headers(request: web.Request, message: Message) -> None:
    """Mcp-Method / Mcp-Name, when a client sends them in the legacy era too, must match the body."""
    method_header = request.headers.get(MCP_METHOD_HEADER)
    if method_header is not None and method_header != message.method:
        raise RpcError(HEADER_MISMATCH, "Mcp-Method header does not match the request body's method", status=400)
    name_key = NAME_BEARING_METHODS.get(message.method or "")
    name_header = request.headers.get(MCP_NAME_HEADER)
    if name_key and name_header is not None and \
            decode_header_value(name_header) != (message.params or {}).get(name_key):
        raise RpcError(HEADER_MISMATCH, f"Mcp-Name header does not match the request body's {name_key!r}",
                       status=400)


def _with_meta_key(meta: RequestMeta, params: Mapping[str, Any], *, trace: Any) -> RequestMeta:
    """``meta`` with ``trace``, and what an MCP client that cannot set headers per call sends in the call's
    ``params._meta`` (same rules as the headers; a header wins): its key (``io.toolproxy/idempotency-key``,
    as ``Idempotency-Key``), its business request id (``io.toolproxy/run-id``, as ``X-Run-Id``) and the
    approval it re-sends the call with (``io.toolproxy/approval-id``, as ``X-Approval-Id``), in one
    ``replace`` of the frozen meta (each costs a few microseconds of every call)."""
    request_meta = params.get("_meta")
    if not isinstance(request_meta, Mapping):
        return replace(meta, trace=trace)
    key = _meta_id(request_meta, MCP_KEY_META) if meta.idempotency_key is None else None
    run = _meta_id(request_meta, MCP_RUN_META) if meta.run_id is None else None
    approval = _meta_id(request_meta, MCP_APPROVAL_META) if meta.approval_id is None else None
    if key is None and run is None and approval is None:
        return replace(meta, trace=trace)
    return replace(meta, trace=trace, idempotency_key=key or meta.idempotency_key, run_id=run or meta.run_id,
                   approval_id=approval or meta.approval_id)


def _meta_id(request_meta: Mapping[str, Any], name: str) -> str | None:
    """The id a client put in ``_meta[name]`` (None when absent); ``-32602`` when it is not a valid one."""
    raw = request_meta.get(name)
    if raw is None:
        return None
    value = safe_id(raw) if isinstance(raw, str) else None
    if value is None:
        raise RpcError(INVALID_PARAMS, f"_meta[{name!r}] must be 1-128 characters of [A-Za-z0-9._:-].",
                       {"code": "invalid_request", "field": f"_meta.{name}"})
    return value


def _member_answer(rpc_id: Any, outcome: Any) -> dict[str, Any]:
    """A batch member's answer from its dispatched request's outcome (a result, an RpcError, or a failure)."""
    if isinstance(outcome, RpcError):
        return outcome.body(rpc_id)
    if isinstance(outcome, BaseException):
        return RpcError(INTERNAL_ERROR, "Internal error").body(rpc_id)
    return _ok(rpc_id, outcome)


def _planned_calls(meta: RequestMeta, members: list[tuple[int, Message]]
                   ) -> tuple[list[PlannedCall], list[RpcError | None]]:
    """The batch's tools/call members as planned calls, each with its own ``_meta`` identity; beside each, the
    problem that refuses it alone (None when it may run)."""
    calls: list[PlannedCall] = []
    problems: list[RpcError | None] = []
    for _, message in members:
        params = message.params or {}
        try:
            own = _with_meta_key(meta, params, trace=meta.trace)
        except RpcError as error:
            problems.append(error)
            own = meta
        else:
            problems.append(None)
        calls.append(PlannedCall(call_id=f"mcp-{secrets.token_hex(16)}", tool=params["name"],
                                 arguments=params.get("arguments") or {}, approval_id=own.approval_id,
                                 idempotency_key=own.idempotency_key, run_id=own.run_id))
    return calls, problems


def _plan_refusal(error: ProxyError, rpc_ids: Mapping[str, Any]) -> ProxyError:
    """The answer of each call of a batch whose plan was refused (nothing ran), naming the members by their
    JSON-RPC ids: a JSON-RPC batch has no ``depends_on`` or ``order``, so the way out is to send the calls
    one at a time, in the order meant."""
    problems = [{**problem, "calls": [rpc_ids.get(c, c) for c in problem["calls"]]} if "calls" in problem
                else problem for problem in error.details.get("problems", [])]
    if any(p.get("problem") == "unordered_writes" for p in problems):
        pairs = "; ".join(" and ".join(map(str, p["calls"])) + " on " + ", ".join(p["resources"])
                          for p in problems[:5] if p.get("problem") == "unordered_writes")
        message = (f"Two writes on one resource in this batch have no stated order (requests {pairs}); none of "
                   "the batch's calls was started. Send them one at a time, in the order you mean.")
    else:
        message = error.message
    return ProxyError(error.code, message[:400], details={**error.details, "problems": problems}, phase=error.phase)


async def _done(value: dict[str, Any]) -> dict[str, Any]:
    return value


def _ok(rpc_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "result": result}


async def _settle(task: "asyncio.Future[dict[str, Any]]", rpc_id: Any) -> dict[str, Any]:
    try:
        return _ok(rpc_id, await task)
    except RpcError as error:
        return error.body(rpc_id)
    except Exception:
        log.exception("MCP tools/call failed outside the pipeline")
        return RpcError(INTERNAL_ERROR, "Internal error").body(rpc_id)


def _event(message: Mapping[str, Any]) -> bytes:
    return b"event: message\ndata: " + json_bytes(message) + b"\n\n"


async def _write(response: web.StreamResponse, chunk: bytes) -> bool:
    try:
        await response.write(chunk)
        return True
    except (ConnectionError, RuntimeError):
        return False


def _json(body: Any, status: int, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=json_bytes(body), status=status, content_type="application/json",
                        headers=dict(headers or {}))
