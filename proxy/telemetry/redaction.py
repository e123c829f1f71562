"""Redaction: the one rule for what a person may read of tool arguments and log text.

Owns: which argument keys are masked (the contract's ``sensitive_fields``,
top-level names or dotted paths that cross arrays element-wise, plus every key
that looks like a credential, at any depth, inside arrays too), truncating
long strings and deep or long structures, showing an approver every bound
value in full with masked fields as per-field hashes (``reveal``), and
scrubbing credentials out of log messages; picking out the sensitive fields a
contract lets an approver read in clear (``select``). Used by every place a person can read arguments or messages: audit
records (``proxy/audit.py``), the approver's summary (``proxy/policy/approvals.py``),
the operator's operation and takeover views (``proxy/idempotency.py``), and
log lines (``proxy/telemetry/logs.py``).

Must never: return the caller's object (always a copy), keep a masked value
anywhere in a masked copy (``select`` alone returns named fields in clear, and
never a credential-like key), or depend on another proxy module (it sits below all
of them).
"""

from __future__ import annotations

from collections import abc  # isinstance against the ABC itself: typing.Mapping adds a Python-level check
import hashlib
import hmac
import json
import re
from typing import Any, Iterable

MASK = "[redacted]"
MAX_DEPTH = 8
MAX_ITEMS = 50

# Parts of a key (lower case, ``-`` read as ``_``) that mark a credential, whatever the contract says.
SECRET_KEY_PARTS = ("password", "passwd", "secret", "token", "authorization", "cookie", "api_key", "apikey",
                    "private_key", "credential")


_SECRET_PART = re.compile("|".join(map(re.escape, SECRET_KEY_PARTS)))  # any one part, anywhere: one C call


def looks_secret(key: str) -> bool:
    return _SECRET_PART.search(key.lower().replace("-", "_")) is not None


def redact(arguments: Any, sensitive_fields: Iterable[str], max_chars: int) -> Any:
    """A copy of ``arguments`` safe to show a person: sensitive fields and credential-like keys masked
    (in nested objects and in arrays alike), strings longer than ``max_chars`` truncated."""
    paths = [tuple(p.split(".")) for p in sensitive_fields]
    return _redact(arguments, paths, max_chars, 0)


def _redact(value: Any, paths: list[tuple[str, ...]], max_chars: int, depth: int) -> Any:
    if depth > MAX_DEPTH:
        return "[truncated: too deep]"
    if isinstance(value, abc.Mapping):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            if (key,) in paths or looks_secret(str(key)):
                out[key] = MASK
                continue
            below = [p[1:] for p in paths if len(p) > 1 and p[0] == key]
            out[key] = _redact(sub, below, max_chars, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        items = [_redact(v, paths, max_chars, depth + 1) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            items.append(f"[truncated: {len(value) - MAX_ITEMS} more items]")
        return items
    if isinstance(value, str) and len(value) > max_chars:
        return value[:max_chars] + f"...[truncated: {len(value)} chars]"
    return value


def reveal(arguments: Any, sensitive_fields: Iterable[str], salt: str, *, key: bytes) -> Any:
    """A copy of ``arguments`` for a person who must see everything a decision binds (an approver): nothing
    truncated; each sensitive field and credential-like key replaced by its per-field hash,
    ``[redacted hmac-sha256:<hex>]`` — HMAC-SHA256 under ``key`` (a secret of the proxy's) of ``salt`` (the
    approval id) and the value's sorted-key JSON — so the approver sees that the value is bound and which
    one, never the value; without the key nobody who reads the hash can try the few values a low-entropy
    field (an account number, an amount) may hold. The caller bounds the size (an approval whose summary is
    too large is refused, never shown in part)."""
    paths = [tuple(p.split(".")) for p in sensitive_fields]
    return _reveal(arguments, paths, salt, key)


def select(arguments: Any, paths: Iterable[str], salt: str, *, key: bytes) -> dict[str, Any]:
    """Only the fields at ``paths`` (top-level names or dotted paths that cross arrays element-wise), in clear
    and in the arguments' own shape, for the one person a contract lets read them (an approver: the contract's
    ``approver_may_read``); credential-like keys below them are still hashed as by ``reveal``."""
    picked = _select(arguments, [tuple(p.split(".")) for p in paths], salt, key)
    return picked if isinstance(picked, dict) else {}


def _select(value: Any, paths: list[tuple[str, ...]], salt: str, key: bytes) -> Any:
    if isinstance(value, abc.Mapping):
        out: dict[str, Any] = {}
        for name, sub in value.items():
            if (name,) in paths:
                out[name] = field_hash(sub, salt, key) if looks_secret(str(name)) else _reveal(sub, [], salt, key)
                continue
            below = [p[1:] for p in paths if len(p) > 1 and p[0] == name]
            if below:
                found = _select(sub, below, salt, key)
                if found not in (None, {}, []):
                    out[name] = found
        return out
    if isinstance(value, (list, tuple)):
        items = [_select(v, paths, salt, key) for v in value]
        return items if any(i not in (None, {}, []) for i in items) else None
    return None


def field_hash(value: Any, salt: str, key: bytes) -> str:
    """The keyed per-field hash ``reveal`` shows for a masked value (``key`` must be a secret: a hash anyone
    can recompute lets them test guesses)."""
    if len(key) < 16:
        raise ValueError("a masked field's hash needs a secret key of at least 16 bytes")
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    tag = hmac.new(key, (salt + "\n" + text).encode("utf-8"), hashlib.sha256).hexdigest()
    return "[redacted hmac-sha256:" + tag + "]"


def _reveal(value: Any, paths: list[tuple[str, ...]], salt: str, key: bytes) -> Any:
    if isinstance(value, abc.Mapping):
        out: dict[str, Any] = {}
        for name, sub in value.items():
            if (name,) in paths or looks_secret(str(name)):
                out[name] = field_hash(sub, salt, key)
                continue
            below = [p[1:] for p in paths if len(p) > 1 and p[0] == name]
            out[name] = _reveal(sub, below, salt, key)
        return out
    if isinstance(value, (list, tuple)):
        return [_reveal(v, paths, salt, key) for v in value]
    return value


# Log text: ``name: value`` / ``name=value`` pairs whose name holds a credential part, bearer/basic
# credentials, and anything shaped like a JWT.
_KEY_NAME = "|".join(part.replace("_", "[-_]?") for part in SECRET_KEY_PARTS)
_SCRUB = (
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), r"\1 " + MASK),
    (re.compile(r"(?i)\b([\w-]*(?:" + _KEY_NAME + r")[\w-]*)(\"?\s*[:=]\s*\"?)[^\s\",;&]+"), r"\1\2" + MASK),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"), "[redacted-jwt]"),
)


def scrub(text: str) -> str:
    """A log message with credentials replaced (the last line of defence: messages should hold none)."""
    for pattern, replacement in _SCRUB:
        text = pattern.sub(replacement, text)
    return text
