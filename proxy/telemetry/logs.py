"""Log lines: structured (JSON or key=value), carrying the request id, never secrets.

Owns: the format of every log line the process writes to stderr, the request
context (request id, trace id, call id) that each line carries, and a last
line of defence that scrubs credentials from messages. Must never: print a
stack trace with exception messages (only exception type and code locations),
log request headers, bodies or tool arguments, or hold state other than the
per-task request context.

The request context lives in a ``ContextVar``: each aiohttp request runs in its
own task, so values bound in a handler reach every log call made on its behalf
and never leak into another request.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import traceback
from datetime import datetime, timezone
from typing import Any, TextIO

from . import outlet, redaction

_CONTEXT: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("toolproxy_log_context", default={})

CONTEXT_FIELDS = ("request_id", "trace_id", "call_id")

# Credentials never reach a log line, whatever put them in a message: the one rule of proxy/telemetry/redaction.py.
scrub = redaction.scrub


def bound(**fields: str | None) -> "_Bound":
    """Add request-context fields to every log line written inside the block (``with bound(...)``)."""
    return _Bound(fields)


class _Bound:
    """``bound``'s block: a class rather than a ``contextlib`` generator, since every request and every call
    enters one (no generator, no ``StopIteration`` per block)."""

    __slots__ = ("_fields", "_token")

    def __init__(self, fields: dict[str, str | None]) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        merged = {**_CONTEXT.get(), **{k: v for k, v in self._fields.items() if v is not None}}
        self._token = _CONTEXT.set(merged)

    def __exit__(self, *exc: object) -> bool:
        _CONTEXT.reset(self._token)
        return False


def context() -> dict[str, str]:
    return dict(_CONTEXT.get())


class ContextFilter(logging.Filter):
    """Copies the bound request context onto each record (explicit ``extra`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in _CONTEXT.get().items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


def _where(exc_info: Any) -> dict[str, Any]:
    """Exception type and code locations only: messages may carry data."""
    etype, _, tb = exc_info
    frames = [f"{frame.filename.rsplit('/', 2)[-1] if '/' in frame.filename else frame.filename}:"
              f"{frame.lineno} in {frame.name}" for frame in traceback.extract_tb(tb)[-8:]]
    return {"type": getattr(etype, "__name__", "Exception"), "at": frames}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "time": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds")
        .replace("+00:00", "Z"),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": scrub(record.getMessage()),
    }
    for name in CONTEXT_FIELDS:
        value = getattr(record, name, None)
        if value is not None:
            out[name] = scrub(str(value))
    if record.exc_info and record.exc_info[0] is not None:
        out["error"] = _where(record.exc_info)
    return out


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), ensure_ascii=False, separators=(",", ":"), default=str)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, value in _fields(record).items():
            if isinstance(value, dict):
                value = f"{value['type']}@{'|'.join(value['at'][-1:])}"
            parts.append(f"{key}={kv_value(str(value))}")
        return " ".join(parts)


# Characters that end, split or forge a key=value line: space, quote, equals, and every control character
# (C0 with CR and LF, DEL, C1 with NEL, and the Unicode line and paragraph separators).
_KV_UNSAFE = re.compile('[ "=\x00-\x1f\x7f-\x9f\u2028\u2029]')
_KV_ESCAPE = re.compile('[\x7f-\x9f\u2028\u2029]')  # json.dumps(ensure_ascii=False) leaves these raw


def kv_value(text: str) -> str:
    """One value of the key=value format: bare when safe, else a JSON string with every control character
    escaped, so a value can never start a new line or a new field."""
    if text and not _KV_UNSAFE.search(text):
        return text
    return _KV_ESCAPE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False))


class OutletHandler(logging.StreamHandler):
    """A stream handler whose lines to a pipe go through the stream's ``outlet`` (never blocking the event
    loop: a full pipe queues them, bounded, then drops them); other streams are written as usual."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        out = outlet.outlet(fd) if fd is not None else None
        if out is None or not out.is_pipe:
            super().emit(record)
            return
        try:
            text = self.format(record) + self.terminator
        except Exception:  # as logging.StreamHandler does
            self.handleError(record)
            return
        out.write(text.encode("utf-8", "backslashreplace"))


def configure(level: str, fmt: str, stream: TextIO | None = None) -> logging.Handler:
    """Install the one stderr handler on the root logger (replacing earlier ones)."""
    if fmt not in {"json", "kv"}:
        raise ValueError(f"log.format must be json or kv, not {fmt!r}")
    handler = OutletHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # aiohttp's access log would echo request lines; the proxy never enables it,
    # and its client/server internals stay at warning even in debug mode. So do the
    # MCP client's HTTP stack (httpx logs every upstream request at INFO) and the SDK.
    for noisy in ("aiohttp.access", "aiohttp.client", "aiohttp.server", "asyncio", "httpx", "httpx2",
                  "httpcore", "httpcore2", "mcp"):
        logging.getLogger(noisy).setLevel(max(root.level, logging.WARNING))
    return handler
