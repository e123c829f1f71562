"""What audit and decision records keep of a call's arguments: the values a contract shows, fingerprints
of the rest.

Owns: the record view of a contract (``RecordView``, built once per contract from its ``inputSchema``, the
arguments that name a resource, its ``safe_to_show`` and its ``sensitive_fields``), applying it to one
call's arguments (``apply``: a copy, and the path of every value it did not keep), and the record
fingerprint (``fingerprint``): ``hmac:`` and 16 hex digits of HMAC-SHA256, under a key derived from the
record MAC key, of the value's sorted-key JSON. Equal values have equal fingerprints in every record of
every sidecar that shares the key, so an operator can follow one value (a security code, an address)
across records without reading it; without the key nobody can test a guess against a fingerprint.

Shown in clear by default: what names a resource (a template placeholder), numbers, booleans, ``enum`` /
``const`` values and null, at any depth the schema describes; plus each path the contract lists in
``safe_to_show``. Everything else — text, and any object or array the schema does not describe — is a
fingerprint, as are ``sensitive_fields`` and keys that look like credentials, wherever they stand.

Must never: return the caller's object, keep a value it does not show anywhere in the copy, or depend on a
proxy module outside ``telemetry`` (it sits below all of them).
"""

from __future__ import annotations

from collections import abc  # isinstance against the ABC itself: typing.Mapping adds a Python-level check
import hmac
import json
import secrets
from dataclasses import dataclass, field, replace
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) makes of a str
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from .redaction import looks_secret

PREFIX = "hmac:"
KEY_PURPOSE = "record-fingerprint"  # the record MAC key's derived key for fingerprints (proxy/integrity.py)
MAX_SCHEMA_DEPTH = 32     # a contract's schema deeper than this is fingerprinted from there on
MAX_ITEMS = 50            # audit records: an array's items kept, the rest counted (decision records keep all)

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class RecordView:
    """What of one position of a call's arguments a record keeps. ``clear``: the value in clear (keys that
    look like credentials and the ``fields`` named below aside); else a fingerprint, unless ``keys`` (an
    object: its property names kept, each value as ``fields`` says, fingerprinted where it says nothing) or
    ``items`` (an array's items) say more of what is inside."""

    clear: bool = False
    keys: bool = False
    fields: Mapping[str, "RecordView"] = field(default_factory=lambda: MappingProxyType({}))
    items: "RecordView | None" = None

    @property
    def whole(self) -> bool:
        """Nothing inside is described: the value is shown or fingerprinted as one."""
        return not self.keys and self.items is None


CLEAR = RecordView(clear=True)
HIDDEN = RecordView()
EACH_VALUE_HIDDEN = RecordView(keys=True)  # arguments no contract describes: names kept, every value hidden
_SCALAR_TYPES = {"integer", "number", "boolean", "null"}


def view_from_schema(schema: Any, *, shown: Iterable[str] = (), hidden: Iterable[str] = ()) -> RecordView:
    """The record view of a contract's ``inputSchema``: ``shown`` are dotted paths kept in clear (the
    arguments that name a resource, ``safe_to_show``), ``hidden`` dotted paths always fingerprinted
    (``sensitive_fields``); a path crosses arrays element-wise. Anything else is kept when its schema makes
    it an identifier-free value (numbers, booleans, ``enum`` / ``const``) and fingerprinted otherwise."""
    root = _build(schema, [tuple(p.split(".")) for p in shown], [tuple(p.split(".")) for p in hidden], False, 0)
    return root if root.clear or root.keys else replace(root, keys=True)  # the arguments' names are kept


def _build(schema: Any, shown: list[tuple[str, ...]], hidden: list[tuple[str, ...]], clear: bool,
           depth: int) -> RecordView:
    if () in hidden or depth > MAX_SCHEMA_DEPTH:
        return HIDDEN
    schema = _mapping(schema)
    clear = clear or () in shown or shown_by_type(schema)
    if clear and not hidden:
        return CLEAR
    properties = _mapping(schema.get("properties"))
    names = set(properties) | _heads(shown) | _heads(hidden)
    fields = {name: _build(properties.get(name), _below(shown, name), _below(hidden, name), clear, depth + 1)
              for name in names}
    items = schema.get("items")
    return RecordView(clear=clear, keys=bool(fields), fields=MappingProxyType(fields),
                      items=_build(items, shown, hidden, clear, depth + 1) if isinstance(items, abc.Mapping)
                      else None)


def _mapping(value: Any) -> Mapping[str, Any]:
    """The value if it is a mapping, else an empty one (a schema's malformed part describes nothing)."""
    return value if isinstance(value, abc.Mapping) else {}


def _heads(paths: list[tuple[str, ...]]) -> set[str]:
    """The first names of the non-empty paths."""
    return {p[0] for p in paths if p}


def _below(paths: list[tuple[str, ...]], name: str) -> list[tuple[str, ...]]:
    """The rest of each path that starts at ``name``."""
    return [p[1:] for p in paths if p and p[0] == name]


def shown_by_type(schema: Mapping[str, Any]) -> bool:
    """Whether a schema alone makes a value safe to show: an ``enum``, a ``const``, or only numbers,
    booleans and null (a value that carries no text)."""
    if "enum" in schema or "const" in schema:
        return True
    kinds = schema.get("type")
    if isinstance(kinds, list):
        return bool(kinds) and set(kinds) <= _SCALAR_TYPES and kinds != ["null"]
    return isinstance(kinds, str) and kinds in _SCALAR_TYPES - {"null"}


def fingerprint(value: Any, key: bytes) -> str:
    """``hmac:<16 hex>``: HMAC-SHA256 under ``key`` of the value's sorted-key JSON, cut to 64 bits."""
    if type(value) is str:  # most fingerprinted values: the encoder's own string step, without building one
        text = encode_basestring(value)
    else:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return PREFIX + hmac.digest(key, text.encode("utf-8", "surrogatepass"), "sha256")[:8].hex()  # one C call


def ephemeral_key() -> bytes:
    """A fingerprint key of this process only (tests, tools that write no record another process reads)."""
    return secrets.token_bytes(32)


def apply(arguments: Any, view: RecordView, key: bytes, *, at: Path = (), max_chars: int | None = None,
          max_items: int | None = None) -> tuple[Any, list[Path]]:
    """A copy of ``arguments`` as records keep it, and the path (from ``at``) of each value replaced by its
    fingerprint. ``max_chars`` / ``max_items`` (audit records) cut long strings and arrays that are kept in
    clear; without them nothing is cut (a decision record replays its input: it is dropped whole when too
    large, never cut)."""
    masked: list[Path] = []
    return _apply(arguments, view, at, masked, key, max_chars, max_items), masked


def _apply(value: Any, view: RecordView, at: Path, masked: list[Path], key: bytes, max_chars: int | None,
           max_items: int | None) -> Any:
    if value is None:
        return None  # an empty field says nothing it should not
    if view.clear and view.whole:
        return _clear(value, at, masked, key, max_chars, max_items)
    if isinstance(value, abc.Mapping) and (view.keys or view.clear):
        return _apply_fields(value, view, at, masked, key, max_chars, max_items)
    if isinstance(value, (list, tuple)) and not view.whole:
        return _apply_items(value, view, at, masked, key, max_chars, max_items)
    if view.clear:
        return _clear(value, at, masked, key, max_chars, max_items)
    return _hidden(value, at, masked, key)


def _apply_fields(value: Mapping[Any, Any], view: RecordView, at: Path, masked: list[Path], key: bytes,
                  max_chars: int | None, max_items: int | None) -> dict[str, Any]:
    """An object's fields as the view keeps them: a credential-looking name, or one the view does not
    describe (unless it shows the object in clear), fingerprinted whole."""
    out: dict[str, Any] = {}
    for name, sub in value.items():
        below = view.fields.get(name)
        if looks_secret(str(name)) or (below is None and not view.clear):
            out[name] = _hidden(sub, at + (name,), masked, key)
        else:
            out[name] = _apply(sub, below or CLEAR, at + (name,), masked, key, max_chars, max_items)
    return out


def _apply_items(value: list[Any] | tuple[Any, ...], view: RecordView, at: Path, masked: list[Path], key: bytes,
                 max_chars: int | None, max_items: int | None) -> list[Any]:
    """An array's elements, each under the view's item view; past ``max_items`` one note of how many were cut."""
    item_view = view.items or view  # a path crosses an array element-wise
    kept = value if max_items is None else value[:max_items]
    items = [_apply(v, item_view, at + (i,), masked, key, max_chars, max_items) for i, v in enumerate(kept)]
    if len(value) > len(kept):
        items.append(f"[truncated: {len(value) - len(kept)} more items]")
    return items


def _clear(value: Any, at: Path, masked: list[Path], key: bytes, max_chars: int | None,
           max_items: int | None) -> Any:
    """A value shown in clear: credential-looking keys inside it still fingerprinted, long text cut."""
    if isinstance(value, abc.Mapping):
        return {name: _hidden(sub, at + (name,), masked, key) if looks_secret(str(name))
                else _clear(sub, at + (name,), masked, key, max_chars, max_items) for name, sub in value.items()}
    if isinstance(value, (list, tuple)):
        return _apply(value, RecordView(clear=True, items=CLEAR), at, masked, key, max_chars, max_items)
    if isinstance(value, str) and max_chars is not None and len(value) > max_chars:
        return value[:max_chars] + f"...[truncated: {len(value)} chars]"
    return value


def _hidden(value: Any, at: Path, masked: list[Path], key: bytes) -> Any:
    if value is None:
        return None
    masked.append(at)
    return fingerprint(value, key)
