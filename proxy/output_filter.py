"""What of a verified result reaches the model ("输出字段在进入模型前过滤";
"写入工具只返回确认凭证").

Owns: a contract's ``output_filter`` (``expose``: an allow-list of RFC 6901
pointers into the output, the only fields the model sees — a write that
returns only its confirmation lists them; or ``redact``: pointers removed) and
``output_limit`` (``max_bytes`` of the model's view; ``truncate: true`` lets the
proxy shorten arrays from their end to fit and say ``truncated``, otherwise an
oversized view is ``output_invalid``); checking both against the contract's
outputSchema when the registry loads; the outputSchema a listing advertises
(the filtered shape, so structured results never contradict it).

A pointer's ``*`` segment means every item of an array. Every other segment
must be a property the outputSchema declares under ``properties`` (a filter
never guesses through ``anyOf`` or ``$ref``).

Must never: change the operation record (the full verified result stays there,
for operators behind the admin listener, for replays and compensation), or
let a filtered field reach an envelope, a replay, an agent's operation view or
an MCP ``structuredContent``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ProxyError
from .wire import json_bytes

Pointer = tuple[str, ...]


@dataclass(frozen=True)
class OutputPolicy:
    expose: tuple[Pointer, ...] | None = None  # None: everything not redacted
    redact: tuple[Pointer, ...] = ()
    max_bytes: int | None = None
    truncate: bool = False

    @property
    def filters(self) -> bool:
        return self.expose is not None or bool(self.redact)


NO_POLICY = OutputPolicy()


def parse_pointer(text: str) -> Pointer:
    """RFC 6901 (``~1`` is ``/``, ``~0`` is ``~``); the registry schema guarantees the leading ``/``."""
    return tuple(part.replace("~1", "/").replace("~0", "~") for part in text.split("/")[1:])


def policy_from_registry(raw_filter: Mapping[str, Any] | None, raw_limit: Mapping[str, Any] | None) -> OutputPolicy:
    raw_filter, raw_limit = raw_filter or {}, raw_limit or {}
    expose = raw_filter.get("expose")
    return OutputPolicy(
        expose=tuple(parse_pointer(p) for p in expose) if expose is not None else None,
        redact=tuple(parse_pointer(p) for p in raw_filter.get("redact") or ()),
        max_bytes=raw_limit.get("max_bytes"), truncate=bool(raw_limit.get("truncate", False)))


def problems(policy: OutputPolicy, output_schema: Mapping[str, Any]) -> list[str]:
    """Why the policy does not fit the outputSchema (empty: it fits)."""
    pointers = list(policy.expose or ()) + list(policy.redact)
    if pointers and not output_schema:
        return ["output_filter needs a declared outputSchema"]
    found = []
    for pointer in pointers:
        node: Any = output_schema
        for depth, part in enumerate(pointer):
            if part == "*":
                node = node.get("items") if isinstance(node, Mapping) and isinstance(node.get("items"), Mapping) \
                    else None
            else:
                props = node.get("properties") if isinstance(node, Mapping) else None
                node = props.get(part) if isinstance(props, Mapping) else None
            if node is None:
                found.append(f"output_filter pointer /{'/'.join(pointer)} does not follow the outputSchema's "
                             f"properties/items at /{'/'.join(pointer[:depth + 1])}")
                break
    return found


# -- the model's view of a result ------------------------------------------------


def visible(policy: OutputPolicy, data: Any) -> Any:
    """``data`` as the model may see it (a new value; ``data`` is not changed)."""
    if policy.expose is not None:
        data = _keep(data, policy.expose)
    elif policy.redact:
        data = copy.deepcopy(data)
        for pointer in policy.redact:
            _remove(data, pointer)
    return data


def _keep(node: Any, pointers: tuple[Pointer, ...]) -> Any:
    if any(not p for p in pointers):  # a pointer ended here: the whole subtree
        return copy.deepcopy(node)
    if isinstance(node, list):
        rest = tuple(p[1:] for p in pointers if p[0] == "*")
        return [_keep(item, rest) for item in node] if rest else []
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            rest = tuple(p[1:] for p in pointers if p[0] == key)
            if rest:
                out[key] = _keep(value, rest)
        return out
    return node


def _remove(node: Any, pointer: Pointer) -> None:
    head, rest = pointer[0], pointer[1:]
    if head == "*" and isinstance(node, list):
        for item in node:
            if rest:
                _remove(item, rest)
        if not rest:
            node.clear()
        return
    if isinstance(node, dict) and head in node:
        if rest:
            _remove(node[head], rest)
        else:
            del node[head]


def fit(policy: OutputPolicy, view: Any, *, tool: str, is_write: bool) -> tuple[Any, bool]:
    """The view within ``max_bytes``: as is, or (``truncate``) with arrays shortened from their end,
    the largest first; ``(view, truncated)``. Too large and not truncatable: ``output_invalid``."""
    limit = policy.max_bytes
    if limit is None or len(json_bytes(view)) <= limit:
        return view, False
    if policy.truncate:
        view = copy.deepcopy(view)
        while True:
            over = len(json_bytes(view)) - limit
            if over <= 0:
                return view, True
            array = _largest_array(view)
            if array is None:
                break
            removed = 0
            while array and removed < over:
                removed += len(json_bytes(array.pop())) + 1
    raise ProxyError("output_invalid", "The tool's result is larger than its contract lets the model see.",
                     details={"tool": tool, "limit_bytes": limit}, phase="verify", attempted=True,
                     committed=True if is_write else False)


def _largest_array(node: Any) -> list[Any] | None:
    best: list[Any] | None = None
    best_size = -1
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, list):
            if current:
                size = len(json_bytes(current))
                if size > best_size:
                    best, best_size = current, size
            stack.extend(current)
        elif isinstance(current, dict):
            stack.extend(current.values())
    return best


# -- the advertised shape ----------------------------------------------------------


def visible_schema(policy: OutputPolicy, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The outputSchema of the model's view (plain JSON): filtered properties removed, ``required``
    trimmed to what remains; truncatable arrays lose their ``minItems``."""
    out = copy.deepcopy(dict(schema)) if not isinstance(schema, dict) else copy.deepcopy(schema)
    out = _thaw(out)
    if policy.expose is not None:
        out = _keep_schema(out, policy.expose)
    for pointer in policy.redact:
        _remove_schema(out, pointer)
    if policy.truncate:
        _drop_min_items(out)
    return out


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def _keep_schema(node: dict[str, Any], pointers: tuple[Pointer, ...]) -> dict[str, Any]:
    if any(not p for p in pointers):
        return node
    items = [p[1:] for p in pointers if p[0] == "*"]
    if items and isinstance(node.get("items"), dict):
        node["items"] = _keep_schema(node["items"], tuple(items))
    props = node.get("properties")
    if isinstance(props, dict):
        kept = _keep_properties(props, pointers)
        node["properties"] = kept
        if isinstance(node.get("required"), list):
            node["required"] = [r for r in node["required"] if r in kept]
    return node


def _keep_properties(props: dict[str, Any], pointers: tuple[Pointer, ...]) -> dict[str, Any]:
    kept = {}
    for name, sub in props.items():
        rest = tuple(p[1:] for p in pointers if p[0] == name)
        if rest:
            kept[name] = _keep_schema(sub, rest) if isinstance(sub, dict) else sub
    return kept


def _remove_schema(node: Any, pointer: Pointer) -> None:
    head, rest = pointer[0], pointer[1:]
    if head == "*":
        items = node.get("items") if isinstance(node, dict) else None
        if isinstance(items, dict) and rest:
            _remove_schema(items, rest)
        elif not rest and isinstance(node, dict):
            node["maxItems"] = 0
            node.pop("minItems", None)
        return
    props = node.get("properties") if isinstance(node, dict) else None
    if not isinstance(props, dict) or head not in props:
        return
    if rest:
        _remove_schema(props[head], rest)
        return
    del props[head]
    if isinstance(node.get("required"), list):
        node["required"] = [r for r in node["required"] if r != head]


def _drop_min_items(node: Any) -> None:
    if isinstance(node, dict):
        if "items" in node:
            node.pop("minItems", None)
        for value in node.values():
            _drop_min_items(value)
    elif isinstance(node, list):
        for value in node:
            _drop_min_items(value)
