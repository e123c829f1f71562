"""MCP shapes of the proxy's tools: listings, annotations, cursors, call results.

Owns: turning trusted tool contracts into MCP ``Tool`` definitions (schemas and
annotations derived from the registry only), paging a listing with opaque
cursors, and turning a result envelope into an MCP ``CallToolResult``
(success: ``structuredContent`` = the verified data; failure: ``isError`` with
a short text for the model and the full envelope in ``structuredContent``).
Pure functions, no I/O. Must never: take descriptions or hints from anywhere
but the registry, or put anything into a result that the envelope does not
already expose.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Mapping, Sequence

from .registry import ToolContract, thaw

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
    output_schema = thaw(tool.output_schema)
    # Before 2026-07-28 an outputSchema (and structuredContent) must be an object.
    if modern or output_schema.get("type") == "object":
        definition["outputSchema"] = output_schema
    return definition


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
    try:
        decoded = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError):
        raise BadCursor("cursor is not one this server issued") from None
    if not isinstance(decoded, dict) or not isinstance(decoded.get("after"), str):
        raise BadCursor("cursor is not one this server issued")
    return decoded["after"]


def call_result(envelope: Mapping[str, Any], *, modern: bool) -> dict[str, Any]:
    """The MCP CallToolResult for one envelope (the envelope's error decides isError)."""
    if envelope["error"] is None:
        data = envelope["data"]
        result: dict[str, Any] = {
            "content": [{"type": "text", "text": json.dumps(data, ensure_ascii=False, separators=(",", ":"))}],
            "isError": False,
        }
        if modern or isinstance(data, dict):
            result["structuredContent"] = data
    else:
        result = {
            "content": [{"type": "text", "text": model_text(envelope)}],
            "structuredContent": dict(envelope),
            "isError": True,
        }
    if modern:
        result["resultType"] = "complete"
    return result


def model_text(envelope: Mapping[str, Any]) -> str:
    """A short, actionable sentence for the model; never more than the envelope exposes."""
    error = envelope["error"]
    if not error.get("expose_to_model", True):
        return f"{error['code']}: the call failed inside the proxy. Next step: {error['resolution']}."
    parts = [f"{error['code']}: {error['message'].rstrip('.')}."]
    violations = (error.get("details") or {}).get("violations")
    if isinstance(violations, list) and len(violations) > 1:
        # The message names the first problem; list the next few so one repair fixes them all.
        rest = [v for v in violations[1:_MAX_VIOLATIONS_IN_TEXT + 1] if isinstance(v, dict)]
        shown = "; ".join(f"{v.get('path', '$')}: {v.get('message', '')}" for v in rest)
        more = len(violations) - 1 - len(rest)
        parts.append(f"Also: {shown}" + (f" (and {more} more)" if more > 0 else "") + ".")
    details = error.get("details") or {}
    if isinstance(details.get("retry_after_s"), (int, float)):
        limit = f" (limit {details['limit']})" if isinstance(details.get("limit"), str) else ""
        parts.append(f"Retry after {details['retry_after_s']} s{limit}.")
    side_effect = envelope.get("side_effect") or {}
    if side_effect.get("committed") is None:
        parts.append("Whether the effect happened is unknown; do not repeat the call with a new request id.")
    parts.append(f"Next step: {error['resolution']}.")
    return " ".join(parts)
