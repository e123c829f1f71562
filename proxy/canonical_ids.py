"""Canonical resource ids: the one spelling of an argument that names an object.

Owns: a template's declared canonical form of its arguments (``resources[].canonical`` in the registry)
and applying it to one value: a Unicode normal form, a case, an alias table (other names of one object,
from the trusted registry or a file it names), a time notation (an instant in UTC to the second, or a
calendar date), and the pattern the result must match. Two spellings of one object give one id, so one
lock, one freeze, one operation key and one object at the backend. Reading a form from the registry
(``form_from_registry``), with its alias file, bounded.

Must never: guess what an ambiguous value means (a time without an offset, a value in no notation the form
accepts: ``invalid_arguments`` naming the argument), follow an alias more than one step, or take an alias
from anywhere but the registry.
"""

from __future__ import annotations

import datetime
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from .errors import ProxyError

MAX_ALIAS_FILE_BYTES = 8 * 1024 * 1024  # the trusted registry's, but still read whole into memory
MAX_ALIASES = 100_000
MAX_TIME_CHARS = 64  # the longest ISO 8601 / RFC 3339 text worth parsing (offset and fraction included)

TIME_FORMS = ("instant", "date")


class FormError(ValueError):
    """A canonical form the registry cannot use: ``where`` is the field under ``canonical``."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(what)
        self.where = where


@dataclass(frozen=True)
class CanonicalForm:
    """How a resource id's argument is written before it names a lock, a freeze, a key or the backend's
    object: a Unicode normal form, a case, an alias table, a time notation, and the pattern the result must
    match (one object, one id). Applied in that order: aliases are looked up in the normalized text, and an
    alias may name a time."""

    unicode: str | None = None        # NFC | NFKC
    case: str | None = None           # lower | upper | fold
    pattern: re.Pattern[str] | None = None
    time: str | None = None           # instant: YYYY-MM-DDTHH:MM:SS[.f]Z in UTC | date: YYYY-MM-DD
    aliases: tuple[tuple[str, str], ...] = ()   # (alias as normalized, canonical value), sorted
    aliases_file: str | None = None   # where the table was read (the registry reload watches it)
    _lookup: Mapping[str, str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lookup", MappingProxyType(dict(self.aliases)))

    def apply(self, name: str, value: Any) -> Any:
        """``value`` in this form (strings; an array's strings one by one); ``invalid_arguments`` naming the
        argument when it has no canonical form (no time in an accepted notation, or the pattern unmatched)."""
        if isinstance(value, list):
            return [self.apply(name, item) for item in value]
        if not isinstance(value, str):
            return value
        value = self._spelled(value)
        value = self._lookup.get(value, value)
        if self.time is not None:
            value = canonical_time(name, value, self.time)
        if self.pattern is not None and not self.pattern.fullmatch(value):
            raise ProxyError("invalid_arguments", f"argument {name!r} does not name a resource in its canonical "
                             f"form (must match {self.pattern.pattern[:100]})", details={"path": name},
                             phase="normalize")
        return value

    def _spelled(self, value: str) -> str:
        if self.unicode is not None:
            value = unicodedata.normalize(self.unicode, value)
        if self.case == "lower":
            value = value.lower()
        elif self.case == "upper":
            value = value.upper()
        elif self.case == "fold":
            value = value.casefold()
        return value


def canonical_time(name: str, value: str, form: str) -> str:
    """``value`` (ISO 8601 / RFC 3339, extended or basic notation, ``T`` or a space, any offset or ``Z``,
    either case) as ``instant`` — ``YYYY-MM-DDTHH:MM:SSZ`` in UTC, a fraction kept only when it is not zero —
    or as ``date`` — ``YYYY-MM-DD`` (calendar, basic or week notation). An instant without an offset names
    no one instant: refused, as is anything else that does not parse."""
    text = value.strip().upper() if len(value) <= MAX_TIME_CHARS else ""
    try:
        if form == "date":
            return datetime.date.fromisoformat(text).isoformat()
        moment = datetime.datetime.fromisoformat(text)
        if moment.tzinfo is None or moment.utcoffset() is None:
            raise ValueError("no offset")
        moment = moment.astimezone(datetime.timezone.utc)
    except (ValueError, OverflowError):
        what = "a calendar date (YYYY-MM-DD)" if form == "date" else \
            "an instant with its offset (e.g. 2026-12-02T09:00:00Z or 2026-12-02T10:00:00+01:00)"
        raise ProxyError("invalid_arguments", f"argument {name!r} must be {what}", details={"path": name},
                         phase="normalize") from None
    fraction = f".{moment.microsecond:06d}".rstrip("0") if moment.microsecond else ""
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"


def form_from_registry(raw: Mapping[str, Any] | None, base_dir: Path) -> CanonicalForm | None:
    """A template's ``canonical`` block as a form (``aliases_file`` relative to ``base_dir``, the registry
    file's folder); ``FormError`` names the field when it cannot be used: a bad pattern, an unreadable or
    oversized alias file, an alias whose target has no canonical form or is itself an alias."""
    if not raw:
        return None
    try:
        pattern = re.compile(raw["pattern"]) if "pattern" in raw else None
    except re.error as exc:
        raise FormError("pattern", f"not a regular expression ({exc})") from None
    spelling = CanonicalForm(unicode=raw.get("unicode"), case=raw.get("case"))
    table = dict(raw.get("aliases") or {})
    aliases_file = None
    if raw.get("aliases_file"):
        aliases_file = str((base_dir / raw["aliases_file"]).resolve())
        for alias, target in _read_alias_file(aliases_file).items():
            if table.setdefault(alias, target) != target:
                raise FormError("aliases_file", f"{aliases_file}: alias {alias!r} also names {table[alias]!r} "
                                "in aliases")
    target_form = CanonicalForm(unicode=raw.get("unicode"), case=raw.get("case"), pattern=pattern,
                                time=raw.get("time"))
    aliases: dict[str, str] = {}
    for alias, target in table.items():
        try:
            canonical = target_form.apply("alias", target)
        except ProxyError as exc:
            raise FormError("aliases", f"the target of alias {alias!r} has no canonical form: {exc.message}") \
                from None
        key = spelling._spelled(alias)
        if aliases.setdefault(key, canonical) != canonical:
            raise FormError("aliases", f"alias {alias!r} names two objects once spelled canonically")
    chained = sorted(set(aliases) & set(aliases.values()))
    if chained:
        raise FormError("aliases", f"{chained[0]!r} is both an alias and the target of one (an alias names "
                        "the canonical id directly: no chains)")
    return CanonicalForm(unicode=raw.get("unicode"), case=raw.get("case"), pattern=pattern, time=raw.get("time"),
                         aliases=tuple(sorted(aliases.items())), aliases_file=aliases_file)


def _read_alias_file(path: str) -> dict[str, str]:
    """A JSON object of alias -> canonical id, both strings, bounded in bytes and entries."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_ALIAS_FILE_BYTES + 1)
    except OSError as exc:
        raise FormError("aliases_file", f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_ALIAS_FILE_BYTES:
        raise FormError("aliases_file", f"{path} is larger than {MAX_ALIAS_FILE_BYTES} bytes")
    try:
        table = json.loads(data, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormError("aliases_file", f"{path} is not JSON ({exc})") from None
    if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                              for k, v in table.items()):
        raise FormError("aliases_file", f"{path} must hold one JSON object of alias -> canonical id (non-empty "
                        "strings)")
    if len(table) > MAX_ALIASES:
        raise FormError("aliases_file", f"{path} holds {len(table)} aliases; at most {MAX_ALIASES}")
    return table


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose every key appears once (a second entry for one alias is a mistake, not an update)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"alias {key!r} appears twice")
        out[key] = value
    return out
