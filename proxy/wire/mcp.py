"""One ``tools/call`` to a stateless MCP upstream as a plain POST over the hot path's wire.

Owns: sending a call that relays nothing (no progress, no log level) to an upstream whose session
negotiated a stateless revision (2026-07-28: no session id, every request
self-describing) as one POST over the hot path's keep-alive wire (``proxy.wire.http``),
with exactly the body and headers the SDK session would send (its own stamp
writes the ``_meta`` protocol version, client info and capabilities and the
``Mcp-Method``/``Mcp-Name``/``Mcp-Param-*`` headers), reading the answer the
way the SDK's Streamable HTTP transport does (a JSON body, or an SSE stream up
to the response; a JSON-RPC error at a non-2xx status; 404 as "method not
found"; 202, redirects and unknown content types as refusals; SSE lines ending
at CR, LF or CRLF) within bounds (``Limits``: a JSON answer's bytes, an SSE
stream's bytes and events before its result; ``AnswerTooLarge`` past one, with
no more read) and treating
the result as ``ClientSession.call_tool(..., allow_input_required=True)``
does (its result adapter, its check of a result against the tool's output
schema, ``InputRequiredResult`` handed back for ``McpAdapter``'s input rounds,
which go through the SDK). Why: in the SDK's client stack (httpx,
httpcore, anyio task groups, the dispatcher) a call through an MCP upstream
spent about half its CPU, and aiohttp's client machinery most of what was left beside the pipeline
(profiles in docs/performance.md).

Must never: run for a handshake session (its session id lives in the SDK
transport), resend, resume a broken SSE stream (the call is then "sent, no
answer" and classified as such; ``McpAdapter`` hands an upstream that answers
with SSE back to the SDK, which resumes), or answer a request the upstream
sends on the stream (it is ignored: the stateless revision asks for input in
results, not requests).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Mapping

import mcp_types as types
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from mcp import Client
from mcp.client.extension import UnexpectedClaimedResult
from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE
from mcp.shared.dispatcher import CallOptions
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types import methods
from mcp_types.jsonrpc import CONNECTION_CLOSED, INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR
from mcp_types.version import KNOWN_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter, ValidationError

from . import schema_fast
from . import json_bytes as dumps
from .http import Answer as WireAnswer, HttpWire, Progress, TooLarge
from .schema_fast import FastValidator

_ids = itertools.count(1)

# The private names of the ``mcp`` SDK this module still reads (``mcp`` is pinned exactly in pyproject.toml;
# tests/unit/test_mcp_private_names.py fails when one of them disappears or changes shape):
#   ``ClientSession._stamp``: the session's own stamp (``_meta`` protocol version, client info and capabilities,
#       ``Mcp-Method`` / ``Mcp-Name`` / ``Mcp-Param-*`` headers); no public API stamps a request it does not send.
#   ``ClientSession._tool_output_schemas``: the output schemas its ``list_tools`` cached, which its own
#       ``validate_tool_result`` checks a result against; no public API reads them.
PRIVATE_SDK_NAMES = ("ClientSession._stamp", "ClientSession._tool_output_schemas")

# What ``ClientSession.call_tool`` validates a tools/call result with (its ``_CallToolResultAdapter`` for a
# client without result claims, as the adapter's ``Client`` is built).
_CALL_TOOL_RESULT: TypeAdapter[types.CallToolResult | types.InputRequiredResult] = TypeAdapter(
    types.CallToolResult | types.InputRequiredResult)


class AnswerTooLarge(Exception):
    """The upstream's answer passed a limit before its result arrived: ``what`` is ``body`` (a JSON answer's
    bytes), ``stream_bytes`` (an SSE stream's bytes up to the result) or ``stream_events`` (its events);
    the connection is closed, nothing more is read."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(what)
        self.what, self.limit = what, limit


@dataclass(frozen=True)
class Limits:
    """Bounds on one answer (``mcp.upstream_max_answer_bytes``, ``mcp.upstream_max_stream_events``)."""

    max_bytes: int = 16 * 1024 * 1024
    max_events: int = 10000


def stateless(client: Client) -> bool:
    """Whether this session's requests may go out as plain POSTs (no session state in the transport): a
    stateless revision that is also the newest this SDK knows, so no later revision's result fields exist
    to drop (what the SDK's ``send_request`` strips on older sessions)."""
    return client.protocol_version in MODERN_PROTOCOL_VERSIONS and \
        client.protocol_version == KNOWN_PROTOCOL_VERSIONS[-1]


@dataclass
class Answer:
    """What the POST came back with: the validated result, and whether it arrived as an SSE stream."""

    result: types.CallToolResult | types.InputRequiredResult
    streamed: bool


async def call_tool(wire: HttpWire, url: str, client: Client, name: str, arguments: dict[str, Any],
                    extra_headers: Mapping[str, str], progress: Any, limits: Limits = Limits()) -> Answer:
    """``client.session.call_tool(name, arguments, allow_input_required=True)`` as one POST; fill in
    ``progress`` (headers_sent, connect_failed, status) as ``_ObservedTransport`` does for a call's first POST.

    Raises ``MCPError`` for every JSON-RPC or transport failure, like ``ClientSession.send_request``, and
    ``AnswerTooLarge`` when the answer passes ``limits`` (a JSON body's bytes; an SSE stream's bytes or
    events before its result), having read at most that much."""
    progress.observed = True  # later POSTs of this call (input rounds, through the SDK) are not its first
    # ``CallToolRequest(...).model_dump(by_alias=True, mode="json", exclude_none=True)`` of decoded JSON
    # arguments, without building the models (a fifth of this path's pydantic time, measured)
    data: dict[str, Any] = {"method": "tools/call", "params": {"name": name, "arguments": arguments}}
    opts: CallOptions = {}
    client.session._stamp(data, opts)  # the SDK's own stamp: the same _meta and routing headers
    body = dumps({"jsonrpc": "2.0", "id": next(_ids), **data})  # the bytes the SDK's dump_json writes
    headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
               MCP_PROTOCOL_VERSION_HEADER: client.protocol_version, **opts.get("headers", {}), **extra_headers}
    sent = Progress()
    try:
        answer = await wire.post(url, body, headers.items(), progress=sent, max_body=limits.max_bytes,
                                 feed=_EventFeed(limits))
    except TooLarge:
        raise AnswerTooLarge("body", limits.max_bytes) from None
    except (TimeoutError, OSError) as exc:  # the wire's own errors; TimeoutError: the connect timeout
        if not sent.connected or isinstance(exc, TimeoutError):
            progress.connect_failed = True
            raise MCPError(code=CONNECTION_CLOSED, message="Connection failed") from None
        raise MCPError(code=CONNECTION_CLOSED, message="Connection closed") from None
    finally:
        progress.headers_sent = progress.headers_sent or sent.sent
    progress.status = answer.status
    raw, streamed = _answer(answer)
    result = _validated(raw, client.protocol_version)
    # What ClientSession.call_tool does with the result.
    if isinstance(result, types.CallToolResult) and not result.is_error \
            and not _surely_conforms(client.session, name, result.structured_content):
        await client.session.validate_tool_result(name, result)
    if not isinstance(result, (types.CallToolResult, types.InputRequiredResult)):
        raise UnexpectedClaimedResult(result)
    return Answer(result, streamed)


def _answer(answer: WireAnswer) -> tuple[dict[str, Any], bool]:
    """The JSON-RPC result of the POST (mirrors ``StreamableHTTPTransport._handle_post_request``)."""
    content_type = answer.headers.get("content-type", "").lower()
    if answer.status == 202:
        raise MCPError(code=INVALID_REQUEST, message="server answered a request with 202 Accepted")
    if 300 <= answer.status < 400:
        raise MCPError(code=INVALID_REQUEST, message="redirect not followed")
    if answer.status >= 400:
        if content_type.startswith("application/json"):
            try:
                message = types.jsonrpc_message_adapter.validate_json(answer.body, by_name=False)
            except ValidationError:
                message = None
            if isinstance(message, types.JSONRPCError):
                raise MCPError.from_error_data(message.error)
        if answer.status == 404:  # no session: the HTTP spelling of "method not found"
            raise MCPError(code=METHOD_NOT_FOUND, message="Not Found")
        raise MCPError(code=INTERNAL_ERROR, message="Server returned an error response")
    if answer.event is not None:  # an SSE stream, read by _EventFeed up to the response
        return answer.event, True
    if content_type.startswith("application/json"):
        return _result(answer.body), False
    raise MCPError(code=INVALID_REQUEST, message="Unexpected content type")


def _result(payload: bytes | str) -> dict[str, Any]:
    try:
        message = types.jsonrpc_message_adapter.validate_json(payload, by_name=False)
    except ValidationError:
        raise MCPError(code=PARSE_ERROR, message="Failed to parse JSON response") from None
    return _outcome(message)


def _outcome(message: Any) -> dict[str, Any]:
    if isinstance(message, types.JSONRPCError):
        raise MCPError.from_error_data(message.error)
    if isinstance(message, types.JSONRPCResponse):
        return message.result
    raise MCPError(code=PARSE_ERROR, message="The answer was not a response")


_LINE_END = re.compile(rb"\r\n|\r|\n")  # SSE: a line ends at CRLF, a lone CR or a lone LF


class _EventFeed:
    """The first response or error on an SSE answer, read as it arrives (the wire's ``EventFeed``);
    notifications (and requests) before it are skipped but counted: the stream's bytes and its events
    are bounded (``Limits``), and one event as the SDK bounds it. Lines end at CR, LF or CRLF (the SSE
    spec), a CRLF split across two chunks included."""

    def __init__(self, limits: Limits = Limits()) -> None:
        self._limits = limits
        self._event, self._data, self._size, self._pending = "message", [], 0, b""
        self._lines = 0  # lines of the event being read (fields and comments)
        self._bytes = self._events = 0
        self._after_cr = False  # the last chunk ended with CR: an LF opening the next one belongs to it

    def feed(self, chunk: bytes) -> dict[str, Any] | None:
        self._bytes += len(chunk)
        if self._bytes > self._limits.max_bytes:
            raise AnswerTooLarge("stream_bytes", self._limits.max_bytes)
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        pending, start = self._pending + chunk, 0
        for end in _LINE_END.finditer(pending):
            line, start = pending[start:end.start()].decode("utf-8"), end.end()
            if line:
                self._field(line)
                continue
            outcome = self._dispatch()  # a blank line ends an event (comments and priming events included)
            if outcome is not None:
                return outcome
        self._pending = pending[start:]
        if self._size + len(self._pending) > DEFAULT_MAX_SSE_EVENT_SIZE:
            raise MCPError(code=CONNECTION_CLOSED, message="SSE event too large")
        return None

    def _field(self, line: str) -> None:
        self._lines += 1
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
            self._size += len(value)

    def _dispatch(self) -> dict[str, Any] | None:
        """The event just ended: counted, and the call's outcome when it is its JSON-RPC answer."""
        if self._lines:
            self._events += 1
            if self._events > self._limits.max_events:
                raise AnswerTooLarge("stream_events", self._limits.max_events)
        payload, kind = "\n".join(self._data), self._event
        self._event, self._data, self._size, self._lines = "message", [], 0, 0
        if kind != "message" or not payload:
            return None  # a priming event (resumption id only) or an unknown event type
        try:
            message = types.jsonrpc_message_adapter.validate_json(payload, by_name=False)
        except ValidationError:
            raise MCPError(code=PARSE_ERROR, message="Failed to parse SSE message") from None
        if isinstance(message, (types.JSONRPCResponse, types.JSONRPCError)):
            return _outcome(message)
        return None

    def end(self) -> Exception:
        return MCPError(code=CONNECTION_CLOSED, message="SSE stream ended without a response")


_fast_output: dict[str, FastValidator] = {}  # per tool name: the compiled verdict for its cached output schema


def _surely_conforms(session: Any, name: str, content: Any) -> bool:
    """The SDK's check of a result against the tool's output schema (``validate_tool_result``) would
    pass: structured content that the compiled validator of ``proxy.wire.schema_fast`` accepts, for the
    schema the SDK cached from the upstream's listing (``_tool_output_schemas``), when that schema is a
    valid Draft 2020-12 schema (checked here once per schema, as the SDK checks it) read as schema_fast reads
    it. Else (not listed yet, another draft, an invalid schema, content the fast path refuses or cannot take)
    the SDK decides, with its own error. Why: its ``jsonschema`` walk and ``best_match`` were the largest
    part of this path beside the HTTP request."""
    schema = session._tool_output_schemas.get(name)
    if content is None or not isinstance(schema, dict):
        return False
    fast = _fast_output.get(name)
    if fast is None or fast.schema is not schema:
        if validator_for(schema, default=Draft202012Validator) is not Draft202012Validator:
            return False
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError:
            return False
        fast = _fast_output[name] = schema_fast.validator(schema)
    return fast.surely_valid(content)


def _validated(raw: dict[str, Any], version: str) -> Any:
    """As ``ClientSession.send_request`` does for a tools/call result: a negative ``ttlMs`` floored to 0
    (the 2026-07-28 caching rule), the revision's result check, then the result types. (It also drops a
    later revision's fields; ``stateless`` admits only the newest revision, which has none.)"""
    ttl = raw.get("ttlMs")
    if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl < 0:
        raw["ttlMs"] = 0
    try:
        methods.validate_server_result("tools/call", version, raw)
    except KeyError:
        pass
    return _CALL_TOOL_RESULT.validate_python(raw, by_name=False)
