"""Decode stage: untrusted bytes -> a validated JSON object of tool arguments.

Owns: strict JSON parsing (no duplicate keys, no NaN/Infinity, no trailing
data, no lenient literals, no nesting deeper than ``decode.max_depth``) of
every piece of untrusted JSON the proxy reads — request bodies, tool
arguments, MCP messages, backend answers, status endpoint answers — and
validation against the tool's ``inputSchema``
(JSON Schema 2020-12, no type coercion). Codes: ``invalid_json``,
``invalid_arguments``, ``schema_violation``. Must never: coerce a value,
drop an unknown field, look at anything but the bytes and the schema, or pass
the parser's own error text to a client (fixed messages, with the position).
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import Draft202012Validator, ValidationError

from .errors import ProxyError

MAX_VIOLATIONS = 50
MAX_MESSAGE = 200
DEFAULT_MAX_DEPTH = 64  # the documented default of decode.max_depth (proxy/config.py)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)  # built in C; a key given twice leaves it shorter (a Python loop here was 1-2% of a call)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


def _no_constants(name: str) -> Any:
    raise ValueError("not a JSON number")


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def strict_loads(text: str | bytes, *, what: str = "tool arguments", phase: str = "decode",
                 max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Parse JSON text strictly; raise ``invalid_json`` with the error position, or when arrays and
    objects nest deeper than ``max_depth`` (the parser's own recursion limit is never reached)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProxyError("invalid_json", f"{what} {_are(what)} not valid UTF-8",
                             details={"position": exc.start}, phase=phase) from None
    try:
        value, end = _DECODER.raw_decode(text, _skip_ws(text, 0))
    except json.JSONDecodeError as exc:
        # A fixed message: the parser's own text never reaches a client (only where it stopped).
        raise ProxyError("invalid_json",
                         f"{what} {_are(what)} not valid JSON at line {exc.lineno}, column {exc.colno}",
                         details={"position": exc.pos, "line": exc.lineno, "column": exc.colno},
                         phase=phase) from None
    except _DuplicateKey as exc:
        raise ProxyError("invalid_json", f"{what} {'contain' if _are(what) == 'are' else 'contains'} a duplicate key",
                         details={"key": exc.key[:MAX_MESSAGE]}, phase=phase) from None
    except RecursionError:  # deeper than the parser's own stack allows: far above any max_depth
        raise _nested_too_deep(what, phase, max_depth) from None
    except ValueError:  # NaN, Infinity, -Infinity
        raise ProxyError("invalid_json", f"{what} {_are(what)} not valid JSON: NaN and Infinity are not JSON numbers",
                         phase=phase) from None
    end = _skip_ws(text, end)
    if end != len(text):
        raise ProxyError("invalid_json", f"{what} {_are(what)} not valid JSON: extra data after the value",
                         details={"position": end}, phase=phase)
    check_depth(value, max_depth, what=what, phase=phase)
    return value


def check_depth(value: Any, max_depth: int, *, what: str, phase: str) -> None:
    """``invalid_json`` if arrays/objects in ``value`` nest deeper than ``max_depth``. Iterative (no
    recursion of its own); also used on JSON another library parsed (an MCP upstream's result)."""
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > max_depth:
            raise _nested_too_deep(what, phase, max_depth)
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _nested_too_deep(what: str, phase: str, max_depth: int) -> ProxyError:
    return ProxyError("invalid_json", f"{what} nest arrays/objects deeper than {max_depth} levels",
                      details={"max_depth": max_depth}, phase=phase)


def _are(what: str) -> str:
    """The verb for ``what``: "tool arguments are", "request body is" (every caller names a noun phrase)."""
    return "are" if what.split()[-1].endswith("s") else "is"


def _skip_ws(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\n\r":
        index += 1
    return index


def decode_arguments(raw: Any, validator: Draft202012Validator, *,
                     max_depth: int = DEFAULT_MAX_DEPTH) -> dict[str, Any]:
    """``raw`` is a JSON object already parsed strictly (its nesting was checked with its body), or a
    JSON-encoded string as models emit it."""
    value = strict_loads(raw, max_depth=max_depth) if isinstance(raw, (str, bytes)) else raw
    if not isinstance(value, dict):
        raise ProxyError("invalid_arguments", "tool arguments must be a JSON object",
                         details={"type": _json_type(value)}, phase="decode")
    violations = schema_violations(value, validator)
    if violations:
        first = violations[0]
        raise ProxyError("schema_violation",
                         f"arguments do not match the tool's input schema: {first['path']}: {first['message']}",
                         details={"violations": violations[:MAX_VIOLATIONS],
                                  "count": len(violations)}, phase="decode")
    return value


def schema_violations(value: Any, validator: Draft202012Validator) -> list[dict[str, str]]:
    """Every violation as {path, keyword, message}, sorted by path then keyword."""
    found: list[dict[str, str]] = []
    for error in validator.iter_errors(value):
        found.extend(_explain(error))
    unique = {(v["path"], v["keyword"], v["message"]): v for v in found}
    return sorted(unique.values(), key=lambda v: (v["path"], v["keyword"], v["message"]))


def _explain(error: ValidationError) -> list[dict[str, str]]:
    base = list(error.absolute_path)
    explain = _EXPLAINERS.get(str(error.validator))
    return (explain(error, base) if explain is not None else None) or [_plain(error, base)]


def _unknown_fields(error: ValidationError, base: list[Any]) -> list[dict[str, str]] | None:
    if not isinstance(error.instance, dict):
        return None
    schema = error.schema if isinstance(error.schema, dict) else {}
    known = set(schema.get("properties", {}))
    patterns = list(schema.get("patternProperties", {}))
    extras = [k for k in error.instance if k not in known and not any(re.search(p, k) for p in patterns)]
    return [{"path": json_path(base + [k]), "keyword": "additionalProperties",
             "message": "unknown field is not allowed"} for k in sorted(extras)]


def _missing_fields(error: ValidationError, base: list[Any]) -> list[dict[str, str]] | None:
    if not isinstance(error.instance, dict):
        return None
    return [{"path": json_path(base + [k]), "keyword": "required", "message": "required field is missing"}
            for k in error.validator_value if k not in error.instance]


def _deepest_branches(error: ValidationError, base: list[Any]) -> list[dict[str, str]] | None:
    """Of an anyOf / oneOf, the branch errors that got furthest, so the model sees the real reason."""
    if not error.context:
        return None
    deepest = max(len(list(e.absolute_path)) for e in error.context)
    if deepest <= len(base):
        return None
    return [item for sub in error.context if len(list(sub.absolute_path)) == deepest for item in _explain(sub)]


_EXPLAINERS = {"additionalProperties": _unknown_fields, "required": _missing_fields,
               "anyOf": _deepest_branches, "oneOf": _deepest_branches}


def _plain(error: ValidationError, base: list[Any]) -> dict[str, str]:
    message = error.message
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + "..."
    return {"path": json_path(base), "keyword": str(error.validator), "message": message}


def json_path(parts: list[Any]) -> str:
    """``amount``, ``items[0].sku``; ``$`` for the whole object."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "$"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
