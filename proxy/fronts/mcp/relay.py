"""MCP relay: requests an upstream MCP server sends back during a call, carried to the client.

Owns: which client capabilities a session declared (``declared``), and for one
``tools/call`` the ``Channel`` the MCP adapter hands an upstream's
``sampling/createMessage`` / ``elicitation/create`` to (its ``CallChannel.input``):
checking it (a relayed method, a capability the client declared, at most
``mcp.relay_max_bytes``, a few outstanding per call), pushing it onto the call's
SSE stream under a proxy-assigned JSON-RPC id, and waiting (until the call's
deadline, which the adapter passes) for the client's response
POSTed to ``/mcp``, which the ``Desk`` matches by session and that id. Every relayed request is
counted (``toolproxy_mcp_relayed_requests_total``) and audited (``mcp_relay``).
The upstream's log messages (``notifications/message``) of that call go onto the
same stream when the client asked for them (``logging/setLevel`` on its session,
or the 2026-07-28 request's ``_meta`` log level), at or above that level and at
most ``mcp.log_message_max_bytes``; each is counted
(``toolproxy_mcp_log_messages_total``), its content never logged.

Data flow, decided per direction (``flow``): what the upstream sends the client
(a relayed request: the upstream asking the model to act; a log message) is
untrusted input, so the first of a call records the ``untrusted`` label for the
caller (principal and run scope, as a call's output would); what the client
answers goes to the upstream, so a call whose contract is an external sink
(``flow.sink: external``) relays no request while the caller's context holds
``private`` or ``secret`` data (refused to the upstream as the client's error,
``flow_refused``): an upstream must not get the model to read private data out
to it.

Must never: give a relayed request any authority (it is the untrusted upstream's
text, shown to the client as the upstream's; nothing in the proxy acts on it),
deliver a client's answer to anything but the call that asked, or an upstream's
log message to any client but the one whose call it arrived during (ids are
unguessable and bound to the session and its owner), relay a capability the
client did not declare, or leave a waiter behind when a call ends.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from mcp_types.jsonrpc import INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, REQUEST_TIMEOUT

from ...call_channel import InputRefused
from ...audit import Auditor
from ...config import McpConfig
from ...deadline import Deadline
from ...envelope import dumps as json_bytes
from ...errors import ProxyError
from ...flow import FlowLedger
from ...identity import Caller
from .sessions import Session
from ...telemetry.metrics import Metrics

# Relayed method -> the capability names (``declared``) a client must have for it.
_SAMPLING, _ELICITATION = "sampling/createMessage", "elicitation/create"
METHODS = (_SAMPLING, _ELICITATION)
# As the SDK's own client answers a request it has no callback for.
_NOT_SUPPORTED = {_SAMPLING: "Sampling not supported", _ELICITATION: "Elicitation not supported"}
MAX_OUTSTANDING = 4  # per call: an upstream cannot park more questions than this on a client
OUT_OF_BOUNDS = frozenset({"private", "secret"})  # labels an external sink's upstream never gets an answer under
_MESSAGE_CHARS = 200  # of a client's error message passed back to the upstream
# MCP log levels, least severe first (RFC 5424 severities); a client gets its level and above.
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


def declared(capabilities: Any) -> frozenset[str]:
    """The relay-relevant names in a client's ``initialize`` capabilities.

    ``sampling``, ``sampling.tools``, ``elicitation.form``, ``elicitation.url``
    (an empty ``elicitation: {}`` means form, as the spec says for older clients).
    """
    if not isinstance(capabilities, Mapping):
        return frozenset()
    names: set[str] = set()
    sampling = capabilities.get("sampling")
    if isinstance(sampling, Mapping):
        names.add("sampling")
        if isinstance(sampling.get("tools"), Mapping):
            names.add("sampling.tools")
    elicitation = capabilities.get("elicitation")
    if isinstance(elicitation, Mapping):
        modes = {m for m in ("form", "url") if isinstance(elicitation.get(m), Mapping)}
        names.update(f"elicitation.{m}" for m in (modes or {"form"}))
    return frozenset(names)


def required(method: str, params: Mapping[str, Any]) -> str | None:
    """The capability name ``method`` with these ``params`` needs; None: never relayed."""
    if method == _SAMPLING:
        return "sampling.tools" if params.get("tools") else "sampling"
    if method == _ELICITATION:
        return "elicitation.url" if params.get("mode") == "url" else "elicitation.form"
    return None


class Desk:
    """The relayed requests of one MCP front still waiting for their client's answer, and their accounting."""

    def __init__(self, config: McpConfig, metrics: Metrics, audit: Auditor, flow: FlowLedger | None = None) -> None:
        self._config = config
        self._metrics = metrics
        self._audit = audit
        self.flow = flow  # None: no flow labels (then nothing is recorded or refused for them)
        self._waiting: dict[str, tuple[str, "asyncio.Future[Mapping[str, Any]]"]] = {}  # id -> (session id, answer)

    @property
    def max_bytes(self) -> int:
        return int(self._config.relay_max_bytes)

    @property
    def log_max_bytes(self) -> int:
        return int(self._config.log_message_max_bytes)

    def channel(self, session: Session | None, caller: Caller,
                push: Callable[[dict[str, Any]], None] | None, log_level: str | None = None) -> "Channel":
        """The channel of one ``/mcp`` call: it asks the client only on a legacy ``session`` whose
        response streams (``push``); otherwise every request is refused (and still counted). Log
        messages at or above ``log_level`` go to a client whose response streams."""
        return Channel(self, session if push is not None else None, caller, push,
                       log_level=log_level if push is not None and log_level in LOG_LEVELS else None)

    def expect(self, session: Session) -> tuple[str, "asyncio.Future[Mapping[str, Any]]"]:
        """A fresh unguessable id, and the future its answer on ``session`` will complete."""
        rpc_id = f"toolproxy-relay-{secrets.token_urlsafe(18)}"
        answer: asyncio.Future[Mapping[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rpc_id] = (session.id, answer)
        return rpc_id, answer

    def forget(self, rpc_id: str) -> None:
        self._waiting.pop(rpc_id, None)

    def answer(self, session: Session, body: Mapping[str, Any]) -> bool:
        """A client's JSON-RPC response: True if it answers a request waiting on this session."""
        rpc_id = body.get("id")
        waiting = self._waiting.get(rpc_id) if isinstance(rpc_id, str) else None
        if waiting is None or waiting[0] != session.id or waiting[1].done():
            return False
        waiting[1].set_result(body)
        return True

    def count_log(self, result: str) -> None:
        self._metrics.child(self._metrics.mcp_log_messages, result).inc()

    async def account(self, channel: "Channel", method: str, result: str, size: int | None,
                      flow: Mapping[str, Any] | None = None) -> None:
        """Count and audit one request an upstream sent during ``channel``'s call (never its content; ``flow``:
        the labels it recorded or the ones that refused it)."""
        metrics, caller = self._metrics, channel.caller
        label = method if method in METHODS else "other"
        metrics.child(metrics.mcp_relayed, label, result).inc()
        details: dict[str, Any] = {"method": label, "result": result, "bytes": size}
        if flow:
            details["flow"] = dict(flow)
        await self._audit.record("mcp_relay", call_id=channel.call_id, tool=channel.tool,
                                         tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
                                         details=details)


@dataclass
class Channel:
    """Carries the upstream's requests (``call_channel.InputRelay``) and log messages (``log``) of one call to its client."""

    desk: Desk
    session: Session | None  # None: nobody to ask (2026-07-28, or a response that cannot stream)
    caller: Caller
    push: Callable[[dict[str, Any]], None] | None
    call_id: str | None = None
    tool: str | None = None
    log_level: str | None = None  # None: the client did not ask for log messages, or cannot receive them
    run_id: str | None = None     # the call's X-Run-Id (its flow labels' run scope)
    sink: str = "internal"        # the call's contract's flow.sink: where the client's answers end up
    _outstanding: int = 0
    _labelled: bool = False       # the untrusted label of this call's relayed messages is recorded
    # One at a time through the label's first recording, first come first served: log messages keep their order.
    _flow_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def _flow_in(self, content: Any) -> None:
        """The upstream's words reach the client: the caller has seen untrusted data (the label once per call),
        and the values in them count as seen in untrusted output (argument provenance: one command per
        message that holds any)."""
        flow = self.desk.flow
        if flow is None:
            return
        await flow.note(self.caller, self.run_id, () if self._labelled else ("untrusted",),
                        self.tool or "mcp_relay", now_ms=int(time.time() * 1000), content=content,
                        call_id=self.call_id or "")
        self._labelled = True

    async def _flow_out(self) -> list[str]:
        """The labels that forbid answering this upstream (empty: it may be answered)."""
        flow = self.desk.flow
        if flow is None or self.sink != "external":
            return []
        state = await flow.read(self.caller, self.run_id, now_ms=int(time.time() * 1000))
        return sorted(OUT_OF_BOUNDS & set(state.policy_input()["labels"]))

    async def __call__(self, method: str, params: Mapping[str, Any],
                       deadline: Deadline) -> Mapping[str, Any] | InputRefused:
        refusal, size = self._admission(method, params)
        if refusal is not None:
            return await self._done(method, *refusal, size)
        self._outstanding += 1  # the slot is taken before anything is awaited
        flow_refusal = await self._flow_refusal(params)
        if flow_refusal is not None:
            result, value, flow = flow_refusal
            return await self._done(method, result, value, size, flow)
        rpc_id, answer = self.desk.expect(self.session)
        try:
            self.push({"jsonrpc": "2.0", "id": rpc_id, "method": method, "params": dict(params)})
            async with deadline.timeout():
                body = await answer
        except TimeoutError:  # the call's deadline: the upstream hears it, the call runs on to its outcome
            return await self._done(method, "timeout", InputRefused(
                REQUEST_TIMEOUT, "The client did not answer within the call's deadline"), size)
        except asyncio.CancelledError:
            await self._done(method, "closed", None, size)
            raise
        finally:
            self.desk.forget(rpc_id)
            self._outstanding -= 1
        return await self._answered(method, body, size)

    def _admission(self, method: str, params: Mapping[str, Any]) -> tuple[tuple[str, InputRefused] | None, int | None]:
        """Why the request is not relayed at all (None: it may be, within the flow labels), and its size once
        the client declared the capability it needs."""
        need = required(method, params)
        if need is None:
            return ("not_declared", InputRefused(METHOD_NOT_FOUND, "Method not found")), None
        if self.session is None or self.push is None or need not in self.session.client_capabilities:
            return ("not_declared", InputRefused(INVALID_REQUEST, _NOT_SUPPORTED[method])), None
        size = len(json_bytes(params))
        if size > self.desk.max_bytes:
            return ("too_large", InputRefused(INVALID_REQUEST, "Request too large to relay")), size
        if self._outstanding >= MAX_OUTSTANDING:
            return ("too_many", InputRefused(INVALID_REQUEST, "Too many outstanding requests")), size
        return None, size

    async def _flow_refusal(self, params: Mapping[str, Any]
                            ) -> tuple[str, InputRefused, Mapping[str, Any] | None] | None:
        """Why the flow labels forbid relaying the request (None: relay it, its values now recorded as seen);
        the call's outstanding slot is given back when they forbid it or cannot be read."""
        try:
            seen = await self._flow_out()
            if not seen:
                async with self._flow_lock:
                    await self._flow_in(params)
        except ProxyError:  # the labels cannot be read or recorded: nothing is relayed unlabelled
            self._outstanding -= 1
            return "flow_unavailable", InputRefused(
                INVALID_REQUEST, "Cannot relay now (data-flow state unavailable)"), None
        except BaseException:
            self._outstanding -= 1
            raise
        if seen:
            self._outstanding -= 1
            return "flow_refused", InputRefused(
                INVALID_REQUEST, "Refused: the client's context holds private data, and this server is an "
                "external sink"), {"refused_by": seen}
        return None

    async def _answered(self, method: str, body: Mapping[str, Any], size: int | None) -> Any:
        """The client's answer as the upstream gets it: its result, else its error (bounded), else invalid."""
        error = body.get("error")
        if isinstance(error, Mapping):
            code, message = error.get("code"), error.get("message")
            return await self._done(method, "client_error", InputRefused(
                code if isinstance(code, int) and not isinstance(code, bool) else INVALID_REQUEST,
                message[:_MESSAGE_CHARS] if isinstance(message, str) else "Client error"), size)
        result = body.get("result")
        if not isinstance(result, Mapping):
            return await self._done(method, "client_error", InputRefused(INVALID_PARAMS, "Invalid result"), size)
        return await self._done(method, "answered", result, size)

    async def log(self, params: Mapping[str, Any]) -> None:
        """An upstream's log message during this call: to its client at or above the level it asked for.

        Only ``level``, ``logger`` and ``data`` pass (the upstream's ``_meta`` does not); the
        content is untrusted data for the client to show, never logged here.
        """
        level, logger = params.get("level"), params.get("logger")
        message: dict[str, Any] = {"level": level, "data": params.get("data")}
        if isinstance(logger, str):
            message["logger"] = logger
        if self.push is None or self.log_level is None:
            result = "not_requested"
        elif level not in LOG_LEVELS:
            result = "invalid"
        elif LOG_LEVELS.index(level) < LOG_LEVELS.index(self.log_level):
            result = "below_level"
        elif len(json_bytes(message)) > self.desk.log_max_bytes:
            result = "too_large"
        else:
            try:
                async with self._flow_lock:  # (uncontended once labelled: no wait, and the order stays)
                    await self._flow_in(message)
                    self.push({"jsonrpc": "2.0", "method": "notifications/message", "params": message})
                result = "relayed"
            except ProxyError:  # never shown unlabelled
                result = "flow_unavailable"
        self.desk.count_log(result)

    async def _done(self, method: str, result: str, value: Any, size: int | None = None,
                    flow: Mapping[str, Any] | None = None) -> Any:
        if flow is None and result == "answered" and self._labelled:
            flow = {"recorded": ["untrusted"]}
        await self.desk.account(self, method, result, size, flow)
        return value
