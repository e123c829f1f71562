"""MCP shapes of the proxy's tools: listings, annotations, cursors, call results.

Owns: turning trusted tool contracts into MCP ``Tool`` definitions (schemas and
annotations derived from the registry only), paging a listing with opaque
cursors, and turning a result envelope into an MCP ``CallToolResult``:

* success with a declared outputSchema: ``structuredContent`` = the verified
  data, and its JSON as text;
* success of an MCP-backed tool without one: the upstream's content blocks
  (and its ``structuredContent``, when it gave one) as the upstream gave them
  (``data`` is ``{"content": [...], "structuredContent"?: ...}``, see
  ``passes_content``);
* failure: ``isError`` with a short text for the model in ``content`` and the
  full envelope in ``_meta["io.toolproxy/envelope"]`` — never in
  ``structuredContent``, which must conform to the declared outputSchema and
  which clients (the TypeScript SDK) validate even on errors.

Pure functions, no I/O. Must never: take descriptions or hints from anywhere
but the registry, emit a ``structuredContent`` the declared outputSchema does
not allow, or put anything into a result that the envelope does not already
expose.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Sequence

from ...decode import strict_loads
from ...envelope import Envelope, dumps
from ...errors import ProxyError
from ...registry import ToolContract, thaw

# Where an isError result carries the proxy's result envelope (a namespaced _meta key).
ENVELOPE_META_KEY = "io.toolproxy/envelope"
# Each text message to the model stays short; the envelope carries the rest.
_MAX_VIOLATIONS_IN_TEXT = 5


class BadCursor(ValueError):
    """A tools/list cursor that this proxy did not issue."""


def annotations(tool: ToolContract) -> dict[str, Any]:
    """MCP tool annotations derived from the trusted contract (never from upstream hints).

    readOnly: ``mode: read``. destructive: writes whose risk is ``destructive``
    or ``financial`` (they change or remove existing state irreversibly).
    idempotent: reads, and writes whose contract requires idempotency (the proxy
    deduplicates repeats that carry the same business request id).
    openWorld: ``risk: external`` (the effect leaves the organisation).
    """
    read = tool.mode == "read"
    return {
        "readOnlyHint": read,
        "destructiveHint": (not read) and tool.risk in ("destructive", "financial"),
        "idempotentHint": read or tool.idempotency_required,
        "openWorldHint": tool.risk == "external",
    }


def tool_definition(tool: ToolContract, *, modern: bool) -> dict[str, Any]:
    input_schema = thaw(tool.input_schema)
    # Arguments are always objects (the decode stage refuses anything else).
    input_schema.setdefault("type", "object")
    definition: dict[str, Any] = {
        "name": tool.name,
        "description": tool.description,
        "inputSchema": input_schema,
        "annotations": annotations(tool),
    }
    # The registry only accepts object output schemas, which every revision can carry;
    # a contract without one advertises none (an empty schema would promise nothing).
    if tool.declares_output:
        definition["outputSchema"] = thaw(tool.visible_output_schema)  # the shape the model sees (output_filter)
    return definition


def passes_content(tool: ToolContract) -> bool:
    """Whether the tool's ``data`` is an MCP upstream's content, passed through unchanged.

    An MCP-backed tool without a declared outputSchema has no JSON shape to
    verify, so its results travel as the upstream gave them: ``data`` is
    ``{"content": [content blocks], "structuredContent": ...}`` (the latter only
    when the upstream sent one).
    """
    return tool.backend.type == "mcp" and not tool.declares_output


def page(tools: Sequence[ToolContract], cursor: Any, size: int) -> tuple[list[ToolContract], str | None]:
    """One page of a name-sorted listing after ``cursor``; the cursor of the next page or None."""
    after = decode_cursor(cursor) if cursor is not None else None
    rest = [t for t in tools if after is None or t.name > after]
    chunk = rest[:max(1, size)]
    more = len(rest) > len(chunk)
    return chunk, encode_cursor(chunk[-1].name) if more else None


def encode_cursor(after: str) -> str:
    raw = json.dumps({"after": after}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: Any) -> str:
    if not isinstance(cursor, str) or not 0 < len(cursor) <= 512:
        raise BadCursor("cursor must be a string this server issued")
    try:  # the cursor this server issues is one flat object
        decoded = strict_loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)), what="cursor", max_depth=1)
    except (binascii.Error, ValueError, ProxyError):
        raise BadCursor("cursor is not one this server issued") from None
    if not isinstance(decoded, dict) or not isinstance(decoded.get("after"), str):
        raise BadCursor("cursor is not one this server issued")
    return decoded["after"]


DEPRECATION_META_KEY = "io.toolproxy/deprecation"


def call_result(env: Envelope, tool: ToolContract | None, *, modern: bool) -> dict[str, Any]:
    """The MCP CallToolResult for one envelope (the envelope's error decides isError)."""
    if env.error is not None:
        result: dict[str, Any] = {
            "content": [{"type": "text", "text": model_text(env)}],
            "isError": True,
            "_meta": {ENVELOPE_META_KEY: env.to_json()},
        }
    elif env.partial is not None:  # no result to conform to outputSchema: reported like a failure, with its items
        result = {
            "content": [{"type": "text", "text": partial_text(env)}],
            "isError": True,
            "_meta": {ENVELOPE_META_KEY: env.to_json()},
        }
    elif tool is not None and passes_content(tool):
        data = env.data
        result = {"content": list(data["content"]), "isError": False}
        structured = data.get("structuredContent")
        # Up to 2025-11-25 structuredContent must be an object.
        if structured is not None and (modern or isinstance(structured, dict)):
            result["structuredContent"] = structured
    else:
        data = env.data
        result = {
            "content": [{"type": "text", "text": dumps(data).decode()}],  # the answer's own compact JSON
            "isError": False,
        }
        # Verified against the declared (object) outputSchema, or none declared: nothing to violate.
        if isinstance(data, dict) or (modern and not (tool and tool.declares_output)):
            result["structuredContent"] = data
    if modern:
        result["resultType"] = "complete"
    if env.deprecation:  # a namespaced key of its own: _meta holds other io.toolproxy/ entries too
        result.setdefault("_meta", {})[DEPRECATION_META_KEY] = dict(env.deprecation)
    return result


def partial_text(env: Envelope) -> str:
    """A partly applied call, for the model: what is done, what is pending, where it is followed."""
    partial = env.partial
    assert partial is not None
    recovery = partial["recovery"]
    follow = (f" The pending items are followed to the end: {recovery['operation']}." if partial["pending"]
              else " Nothing more will be applied; ask the user how to proceed.")
    return (f"partial: {len(partial['committed'])} item(s) applied, {len(partial['pending'])} pending."
            f"{follow} Applied: {dumps(partial['committed']).decode()}")


def model_text(env: Envelope) -> str:
    """A short, actionable sentence for the model; never more than the envelope exposes."""
    error = env.error
    assert error is not None  # only failures are explained
    if not error.spec.expose_to_model:
        return f"{error.code}: the call failed inside the proxy. Next step: {error.resolution}."
    parts = [f"{error.code}: {error.message.rstrip('.')}."]
    details = error.details
    violations = details.get("violations")
    if isinstance(violations, list) and len(violations) > 1:
        # The message names the first problem; list the next few so one repair fixes them all.
        rest = [v for v in violations[1:_MAX_VIOLATIONS_IN_TEXT + 1] if isinstance(v, dict)]
        shown = "; ".join(f"{v.get('path', '$')}: {v.get('message', '')}" for v in rest)
        more = len(violations) - 1 - len(rest)
        parts.append(f"Also: {shown}" + (f" (and {more} more)" if more > 0 else "") + ".")
    if isinstance(details.get("retry_after_s"), (int, float)):
        limit = f" (limit {details['limit']})" if isinstance(details.get("limit"), str) else ""
        parts.append(f"Retry after {details['retry_after_s']} s{limit}.")
    if env.side_effect.committed is None:
        parts.append("Whether the effect happened is unknown; do not repeat the call with a new request id.")
    parts.append(f"Next step: {error.resolution}.")
    return " ".join(parts)
