"""What of a verified result reaches the model ("输出字段在进入模型前过滤";
"写入工具只返回确认凭证").

Owns: a contract's ``output_filter`` (``expose``: an allow-list of RFC 6901
pointers into the output, the only fields the model sees — a write that
returns only its confirmation lists them; or ``redact``: pointers removed), the
defaults every contract gets (``with_defaults``: the model sees only the fields
the outputSchema declares, and never an output field the contract marks
sensitive or that looks like a credential, echoed from the arguments or not;
``declared_only: false`` lets undeclared fields through) and
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
from .telemetry.redaction import looks_secret
from .wire import json_bytes

Pointer = tuple[str, ...]


@dataclass(frozen=True)
class OutputPolicy:
    expose: tuple[Pointer, ...] | None = None  # None: everything not redacted
    redact: tuple[Pointer, ...] = ()
    max_bytes: int | None = None
    truncate: bool = False
    declared: Mapping[str, Any] | None = None  # project onto the properties this (output) schema declares

    @property
    def filters(self) -> bool:
        return self.expose is not None or bool(self.redact) or self.declared is not None


NO_POLICY = OutputPolicy()


def parse_pointer(text: str) -> Pointer:
    """RFC 6901 (``~1`` is ``/``, ``~0`` is ``~``); the registry schema guarantees the leading ``/``."""
    return tuple(part.replace("~1", "/").replace("~0", "~") for part in text.split("/")[1:])


def with_defaults(policy: OutputPolicy, output_schema: Mapping[str, Any], sensitive_fields: tuple[str, ...], *,
                  declared_only: bool) -> OutputPolicy:
    """``policy`` with what every contract gets: only the declared fields (``declared_only``, where the
    outputSchema leaves an object open to others), and the declared fields named in ``sensitive_fields``
    (dotted paths from the output's root, crossing arrays) or looking like a credential left out. NO_POLICY
    when neither changes anything (a closed schema with nothing sensitive: the common case costs nothing)."""
    masked = tuple(p for p in _sensitive_pointers(output_schema, [tuple(f.split(".")) for f in sensitive_fields])
                   if p not in policy.redact)
    declared = output_schema if declared_only and _open_somewhere(output_schema) else None
    if not masked and declared is None:
        return policy
    return OutputPolicy(expose=policy.expose, redact=policy.redact + masked, max_bytes=policy.max_bytes,
                        truncate=policy.truncate, declared=declared)


def _sensitive_pointers(schema: Any, paths: list[tuple[str, ...]], at: Pointer = (), names: tuple[str, ...] = (),
                        depth: int = 0) -> list[Pointer]:
    """Pointers to the declared properties a person must not read: a sensitive path, or a credential-like name."""
    if not isinstance(schema, Mapping) or depth > 8:
        return []
    found: list[Pointer] = []
    if isinstance(schema.get("items"), Mapping):
        found += _sensitive_pointers(schema["items"], paths, at + ("*",), names, depth + 1)
    for name, sub in (schema.get("properties") or {}).items():
        if names + (name,) in paths or looks_secret(str(name)):
            found.append(at + (name,))
        else:
            found += _sensitive_pointers(sub, paths, at + (name,), names + (name,), depth + 1)
    return found


def _open_somewhere(schema: Any, depth: int = 0) -> bool:
    """Whether an object the schema declares properties of lets others through (then the view is projected)."""
    if not isinstance(schema, Mapping) or depth > 32:
        return False
    props = schema.get("properties")
    if isinstance(props, Mapping) and schema.get("additionalProperties", True) is not False:
        return True
    subs = list(props.values()) if isinstance(props, Mapping) else []
    if isinstance(schema.get("items"), Mapping):
        subs.append(schema["items"])
    return any(_open_somewhere(sub, depth + 1) for sub in subs)


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
    copied = False
    if policy.declared is not None:
        data, copied = _declared(data, policy.declared), True
    if policy.expose is not None:
        data, copied = _keep(data, policy.expose), True
    if policy.redact:
        data = data if copied else copy.deepcopy(data)
        for pointer in policy.redact:
            _remove(data, pointer)
    return data


def _declared(node: Any, schema: Any) -> Any:
    """``node`` with only the properties ``schema`` declares, where it declares some (a copy; a part the schema
    leaves free-form is copied whole)."""
    if not isinstance(schema, Mapping):
        return copy.deepcopy(node)
    props = schema.get("properties")
    if isinstance(node, dict) and isinstance(props, Mapping):
        return {key: _declared(value, props[key]) for key, value in node.items() if key in props}
    if isinstance(node, list) and isinstance(schema.get("items"), Mapping):
        return [_declared(item, schema["items"]) for item in node]
    return copy.deepcopy(node)


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
