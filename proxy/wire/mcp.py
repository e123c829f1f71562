"""One ``tools/call`` to a stateless MCP upstream as a plain POST over the hot path's wire.

Owns: sending a call that relays nothing (no progress, no log level) to an upstream whose session
negotiated a stateless revision (2026-07-28: no session id, every request
self-describing) as one POST over the hot path's keep-alive wire (``proxy.wire.http``),
with exactly the body and headers the SDK session would send (its own stamp
writes the ``_meta`` protocol version, client info and capabilities and the
``Mcp-Method``/``Mcp-Name``/``Mcp-Param-*`` headers), reading the answer the
way the SDK's Streamable HTTP transport does (a JSON body, or an SSE stream up
to the response; a JSON-RPC error at a non-2xx status; 404 as "method not
found"; 202, redirects and unknown content types as refusals) and treating
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
from dataclasses import dataclass
from typing import Any, Mapping

import mcp_types as types
from jsonschema import Draft202012Validator
from mcp import Client
from mcp.client.extension import UnexpectedClaimedResult
from mcp.client.session import _clamp_inbound_ttl, _later_revision_fields
from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE
from mcp.shared.dispatcher import CallOptions
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types import methods
from mcp_types.jsonrpc import CONNECTION_CLOSED, INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from . import schema_fast
from . import json_bytes as dumps
from .http import Answer as WireAnswer, HttpWire, Progress
from .schema_fast import FastValidator

_ids = itertools.count(1)


def stateless(client: Client) -> bool:
    """Whether this session's requests may go out as plain POSTs (no session state in the transport)."""
    return client.protocol_version in MODERN_PROTOCOL_VERSIONS


@dataclass
class Answer:
    """What the POST came back with: the validated result, and whether it arrived as an SSE stream."""

    result: types.CallToolResult | types.InputRequiredResult
    streamed: bool


async def call_tool(wire: HttpWire, url: str, client: Client, name: str, arguments: dict[str, Any],
                    extra_headers: Mapping[str, str], progress: Any) -> Answer:
    """``client.session.call_tool(name, arguments, allow_input_required=True)`` as one POST; fill in
    ``progress`` (headers_sent, connect_failed, status) as ``_ObservedTransport`` does for a call's first POST.

    Raises ``MCPError`` for every JSON-RPC or transport failure, like ``ClientSession.send_request``."""
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
        answer = await wire.post(url, body, headers.items(), progress=sent, feed=_EventFeed())
    except (TimeoutError, OSError) as exc:  # the wire's own errors; TimeoutError: the connect timeout
        if not sent.connected or isinstance(exc, TimeoutError):
            progress.connect_failed = True
            raise MCPError(code=CONNECTION_CLOSED, message="Connection failed") from None
        raise MCPError(code=CONNECTION_CLOSED, message="Connection closed") from None
    finally:
        progress.headers_sent = progress.headers_sent or sent.sent
    progress.status = answer.status
    raw, streamed = _answer(answer)
    result = _validated(raw, client.protocol_version, client.session._call_tool_adapter)
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


class _EventFeed:
    """The first response or error on an SSE answer, read as it arrives (the wire's ``EventFeed``);
    notifications (and requests) before it are skipped. Lines are split here; an event is bounded as the
    SDK bounds it."""

    def __init__(self) -> None:
        self._event, self._data, self._size, self._pending = "message", [], 0, b""

    def feed(self, chunk: bytes) -> dict[str, Any] | None:
        pending, start = self._pending + chunk, 0
        while (end := pending.find(b"\n", start)) >= 0:
            line, start = pending[start:end].rstrip(b"\r").decode("utf-8"), end + 1
            if line:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    self._event = value
                elif field == "data":
                    self._data.append(value)
                    self._size += len(value)
                continue
            payload, kind = "\n".join(self._data), self._event
            self._event, self._data, self._size = "message", [], 0
            if kind != "message" or not payload:
                continue  # a priming event (resumption id only) or an unknown event type
            try:
                message = types.jsonrpc_message_adapter.validate_json(payload, by_name=False)
            except ValidationError:
                raise MCPError(code=PARSE_ERROR, message="Failed to parse SSE message") from None
            if isinstance(message, (types.JSONRPCResponse, types.JSONRPCError)):
                return _outcome(message)
        self._pending = pending[start:]
        if self._size + len(self._pending) > DEFAULT_MAX_SSE_EVENT_SIZE:
            raise MCPError(code=CONNECTION_CLOSED, message="SSE event too large")
        return None

    def end(self) -> Exception:
        return MCPError(code=CONNECTION_CLOSED, message="SSE stream ended without a response")


_fast_output: dict[str, FastValidator] = {}  # per tool name: the compiled verdict for its cached output schema


def _surely_conforms(session: Any, name: str, content: Any) -> bool:
    """The SDK's check of a result against the tool's output schema (``validate_tool_result``) would
    pass: structured content that the compiled validator of ``proxy.wire.schema_fast`` accepts, for a schema the
    SDK has already checked and compiled as Draft 2020-12 without formats (as schema_fast reads it). Else
    (first call, another draft, content the fast path refuses or cannot take) the SDK decides, with its own
    error. Why: its ``jsonschema`` walk and ``best_match`` were the largest part of this path beside the
    HTTP request."""
    schema = session._tool_output_schemas.get(name)
    checked = session._tool_output_validators.get(name)
    if content is None or schema is None or type(checked) is not Draft202012Validator or checked.schema is not schema:
        return False
    fast = _fast_output.get(name)
    if fast is None or fast.schema is not schema:
        fast = _fast_output[name] = schema_fast.validator(schema)
    return fast.surely_valid(content)


def _validated(raw: dict[str, Any], version: str, adapter: Any) -> Any:
    """As ``ClientSession.send_request`` does for a tools/call result (the session's own result adapter)."""
    _clamp_inbound_ttl(raw)
    try:
        methods.validate_server_result("tools/call", version, raw)
    except KeyError:
        pass
    if not (foreign := _later_revision_fields("tools/call", version)).isdisjoint(raw):
        raw = {key: value for key, value in raw.items() if key not in foreign}
    return adapter.validate_python(raw, by_name=False)
