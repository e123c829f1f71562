"""Normalize stage: defaults, RFC 8785 canonical JSON, ``args_hash``, resource ids.

Owns: the one canonical form of a decoded call (so that key order and
whitespace never change identity) and the canonical resource identifiers
built from the contract's templates, after the canonical form a template
declares for its arguments (Unicode normal form, case, aliases, time notation,
pattern; proxy/canonical_ids.py): one object is one id, for the decision, the
locks and freezes, the operation key and the backend alike. Must never:
change a value the caller supplied other than by its contract's declared
defaults and canonical forms, or trust a resource id that did not come from a
template.
"""

from __future__ import annotations

from collections import abc  # isinstance against the ABC itself: typing.Mapping adds a Python-level check
import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import quote

import orjson
import rfc8785

from .errors import ProxyError
from .registry import ToolContract, thaw


@dataclass(frozen=True)
class NormalizedCall:
    arguments: Mapping[str, Any]
    canonical: bytes
    args_hash: str
    resources: tuple["ResourceRef", ...]


@dataclass(frozen=True, order=True)
class ResourceRef:
    id: str       # canonical resource id, e.g. "order:ord_1001"
    access: str   # shared | exclusive | none


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of a JSON value. A value made only of what orjson writes byte for byte as
    JCS does (dicts with ASCII keys, lists, strings, booleans, null, integers within +-(2**53 - 1))
    is written by orjson with sorted keys, about thirty times faster than the ``rfc8785`` library;
    anything else (floats, other key sets, subclasses, what orjson refuses) goes to ``rfc8785``.
    tests/unit/test_canonical_json.py holds the two together."""
    try:
        if _plain(value):
            return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, RecursionError):
        pass  # rfc8785 decides (and names the error)
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, ValueError, TypeError, UnicodeError) as exc:
        raise ProxyError("invalid_arguments",
                         "tool arguments cannot be canonicalized (integer out of range or invalid string)",
                         details={"reason": type(exc).__name__}, phase="normalize") from None


_JCS_INT = 2**53 - 1  # the integers RFC 8785 writes exactly (IEEE 754 doubles)


def _plain(value: Any) -> bool:
    """Whether orjson's text of ``value`` (keys sorted) is its RFC 8785 text: exact JSON types only; object
    keys ASCII (orjson sorts by code point, JCS by UTF-16 unit: the same there); no floats (JCS writes
    ECMAScript number text). Strings are escaped alike (tests/unit/test_canonical_json.py)."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return -_JCS_INT <= value <= _JCS_INT
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or not key.isascii() or not _plain(item):
                return False
        return True
    if kind is list or kind is tuple:
        for item in value:
            if not _plain(item):
                return False
        return True
    return False


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str | None:
    """SHA-256 of the canonical JSON of a value (a result summary that copies nothing); None if it has none."""
    try:
        return sha256_hex(canonical_json(value))
    except ProxyError:
        return None


def normalize(tool: ToolContract, arguments: Mapping[str, Any]) -> NormalizedCall:
    with_defaults = apply_defaults(tool.input_schema, arguments)
    if tool.canonical_ids:  # before anything derives from them (ids, args_hash, the key, the backend's call)
        with_defaults = dict(with_defaults)
        for name, form in tool.canonical_ids:
            if name in with_defaults:
                with_defaults[name] = form.apply(name, with_defaults[name])
    canonical = canonical_json(with_defaults)
    return NormalizedCall(
        arguments=with_defaults,
        canonical=canonical,
        args_hash=sha256_hex(canonical),
        resources=resource_refs(tool, with_defaults),
    )


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill absent properties that declare a ``default`` (recursively through ``properties``)."""
    if not isinstance(value, abc.Mapping) or not isinstance(schema, abc.Mapping):
        return value
    result = dict(value)
    for name, sub in (schema.get("properties") or {}).items():
        if not isinstance(sub, abc.Mapping):
            continue
        if name not in result and "default" in sub:
            result[name] = copy.deepcopy(thaw(sub["default"]))
        if name in result:
            result[name] = apply_defaults(sub, result[name])
    return result


def resource_refs(tool: ToolContract, arguments: Mapping[str, Any]) -> tuple[ResourceRef, ...]:
    refs: dict[str, str] = {}
    for template in tool.resources:
        for rendered in render_all(template.template, arguments):
            # The stronger access wins when two templates render the same id.
            previous = refs.get(rendered)
            refs[rendered] = _stronger(previous, template.access)
    return tuple(sorted(ResourceRef(rid, access) for rid, access in refs.items()))


def render_all(template: str, arguments: Mapping[str, Any]) -> list[str]:
    """Every id a template names: one per element when its placeholder is an array
    (a batch-like call touches, and is authorized and locked for, every item)."""
    arrays = [p for p in template_placeholders(template) if isinstance(arguments.get(p), list)]
    if not arrays:
        rendered = render_template(template, arguments)
        return [] if rendered is None else [rendered]
    if len(arrays) > 1:
        raise ProxyError("invalid_arguments", "a resource template may expand one array argument only",
                         details={"path": arrays[1]}, phase="normalize")
    name = arrays[0]
    out = []
    for item in arguments[name]:
        rendered = render_template(template, {**arguments, name: item})
        if rendered is not None:
            out.append(rendered)
    return out


def template_placeholders(template: str) -> list[str]:
    names, i = [], 0
    while (start := template.find("{", i)) >= 0:
        end = template.index("}", start)
        names.append(template[start + 1:end])
        i = end + 1
    return names


def render_template(template: str, arguments: Mapping[str, Any]) -> str | None:
    out = []
    i = 0
    while i < len(template):
        if template[i] == "{":
            end = template.index("}", i)
            name = template[i + 1:end]
            value = arguments.get(name)
            if value is None:
                return None
            out.append(_canonical_part(name, value))
            i = end + 1
        else:
            out.append(template[i])
            i += 1
    return "".join(out)


def _canonical_part(name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ProxyError("invalid_arguments", f"argument {name!r} cannot identify a resource",
                         details={"path": name}, phase="normalize")
    # Percent-encode everything but a safe alphabet so ids never contain
    # separators (':' or '{') that would let one id impersonate another.
    return quote(str(value), safe="-_.@")


_ORDER = {None: -1, "none": 0, "shared": 1, "exclusive": 2}


def _stronger(a: str | None, b: str) -> str:
    return b if _ORDER[b] >= _ORDER[a] else a  # type: ignore[return-value]

