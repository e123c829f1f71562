"""Ingress: one HTTP request -> validated transport facts (body, meta).

Owns: body size and media type limits, strict parsing of the request body,
validating it against a request schema, and reading the transport headers
(request id, trace, deadline, run id, idempotency key, approval id,
``Prefer: wait``) into a
``RequestMeta``. Shared by every protocol front (JSON API, MCP, OpenAI) so
none of them re-implements it. Must never: interpret tool arguments or
identity claims.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from aiohttp import web
from .. import deadline as deadlines
from ..wire import schema_fast
from ..config import Config
from ..decode import schema_violations, strict_loads
from ..errors import ProxyError
from ..requests import RequestMeta
from ..state_guard import parse_if_match
from ..registry import load_schema
from ..wire.schema_fast import FastValidator
from ..telemetry import tracing
from ..telemetry.tracing import new_request_id, safe_id

JSON_TYPES = ("application/json",)
REQUEST_ID = web.RequestKey("toolproxy_request_id", str)


def request_id_of(request: web.Request) -> str:
    """The request id of this HTTP request, chosen once and cached on it."""
    existing = request.get(REQUEST_ID)
    if existing is None:
        existing = safe_id(request.headers.get("X-Request-Id")) or new_request_id()
        request[REQUEST_ID] = existing
    return existing


async def read_json(request: web.Request, config: Config, *, phase: str = "request",
                    limit: int | None = None) -> Any:
    """Read and strictly parse a JSON body within the size limit (``limit``, else ``listen.max_body_bytes``):
    never more than that many bytes are read, whatever the ``Content-Length`` says or omits."""
    if request.content_type not in JSON_TYPES:
        raise ProxyError("unsupported_media_type", "The request body must be application/json.",
                         details={"content_type": request.content_type[:64]}, phase=phase)
    limit = config.listen.max_body_bytes if limit is None else limit
    if request.content_length is not None and request.content_length > limit:
        raise ProxyError("payload_too_large", "The request body is too large.",
                         details={"limit_bytes": limit}, phase=phase)
    if request.content_length is not None:  # within the limit, and the parser stops the body there: one read
        return strict_loads(await request.content.read(), what="request body", phase=phase,
                            max_depth=config.decode.max_depth)
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(65536):
        size += len(chunk)
        if size > limit:
            raise ProxyError("payload_too_large", "The request body is too large.",
                             details={"limit_bytes": limit}, phase=phase)
        chunks.append(chunk)
    return strict_loads(b"".join(chunks), what="request body", phase=phase, max_depth=config.decode.max_depth)


@functools.cache
def api_validator(schema_name: str) -> FastValidator:
    """The validator of one API request schema, built once per process (schemas ship with the code)."""
    return schema_fast.validator(load_schema(schema_name))


def validate_body(body: Any, schema_name: str) -> None:
    validator = api_validator(schema_name)
    if validator.is_valid(body):
        return
    violations = schema_violations(body, validator)
    if violations:
        raise ProxyError("invalid_request", "The request body does not match the API schema.",
                         details={"violations": violations[:50]}, phase="request")


def request_meta(request: web.Request, config: Config) -> RequestMeta:
    headers = request.headers
    return RequestMeta(
        request_id=request_id_of(request),
        trace=tracing.accept(headers),
        deadline=deadlines.from_headers(headers, max_timeout_s=config.deadline.max_request_timeout_ms / 1000.0,
                                     margin_s=config.deadline.margin_ms / 1000.0),
        run_id=_header_id(headers, "X-Run-Id"),
        idempotency_key=_header_id(headers, "Idempotency-Key"),
        approval_id=_header_id(headers, "X-Approval-Id"),
        wait_s=prefer_wait(headers),
        if_match=parse_if_match(headers.get("If-Match")),
    )


_WAIT = re.compile(r"^\d{1,6}(\.\d{1,3})?$")


def prefer_wait(headers: Any) -> float | None:
    """``Prefer: wait=<seconds>`` (RFC 7240): how long the caller will wait for a running duplicate.
    A preference the proxy does not understand is ignored, as RFC 7240 asks."""
    for value in headers.getall("Prefer", []):
        for preference in value.split(","):
            name, _, raw = preference.split(";")[0].strip().partition("=")
            raw = raw.strip().strip('"')
            if name.strip().lower() == "wait" and _WAIT.match(raw):
                return float(raw)
    return None


def _header_id(headers: Any, name: str) -> str | None:
    raw = headers.get(name)
    if raw is None:
        return None
    value = safe_id(raw.strip().strip('"'))  # the IETF draft sends a quoted string
    if value is None:
        raise ProxyError("invalid_request", f"{name} must be 1-128 characters of [A-Za-z0-9._:-].",
                         details={"header": name}, phase="request")
    return value
