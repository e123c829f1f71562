"""The HTTP edge every listener shares: the runtime key, JSON answers, failures as envelopes.

Owns: how an aiohttp application finds the runtime (``RUNTIME``), writing a
JSON answer, and the middleware that turns every failure a handler raises
into an error envelope with a stable code (counted in
``toolproxy_request_errors_total``). Must never: hold a route or a rule;
let a stack trace, an exception's text or a hostname reach a client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from .. import envelope
from . import ingress
from ..telemetry import logs
from ..envelope import dumps
from ..errors import ProxyError
from ..process.runtime import Runtime
from ..store import StoreError, unavailable

log = logging.getLogger("toolproxy.app")


RUNTIME = web.AppKey("runtime", Runtime)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(body), status=status, content_type="application/json", headers=headers)


@web.middleware
async def envelope_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    """Every failure leaves as an envelope; nothing internal leaks."""
    request_id = ingress.request_id_of(request)
    try:
        with logs.bound(request_id=request_id):
            response = await handler(request)
    except ProxyError as error:
        body = envelope.request_error(error, request_id)
        response = json_response(body, envelope.http_status(body))
    except StoreError:  # policy: the edge's catch-all: a stage let a fault through unanswered
        body = envelope.request_error(unavailable("The state store is unreachable.", phase="request"), request_id)
        response = json_response(body, envelope.http_status(body))
    except web.HTTPException as exc:
        code = {404: "route_not_found", 405: "method_not_allowed", 413: "payload_too_large",
                415: "unsupported_media_type"}.get(exc.status, "invalid_request")
        body = envelope.request_error(ProxyError(code, _HTTP_MESSAGES.get(code, "The request was refused."),
                                                 phase="request"), request_id)
        response = json_response(body, envelope.http_status(body))
    except asyncio.CancelledError:
        raise
    except Exception:
        with logs.bound(request_id=request_id):
            log.exception("unhandled error")
        body = envelope.request_error(ProxyError("internal_error", "The proxy failed unexpectedly.",
                                                 phase="request"), request_id)
        response = json_response(body, 500)
    else:
        body = None
    if body is not None:  # refused before (or instead of) a tool call: count it by code
        runtime = request.app.get(RUNTIME)
        if runtime is not None:
            runtime.metrics.request_errors.labels(body["error"]["code"]).inc()
    response.headers["X-Request-Id"] = request_id
    return response


_HTTP_MESSAGES = {
    "route_not_found": "No such endpoint.",
    "method_not_allowed": "This method is not allowed on this endpoint.",
    "payload_too_large": "The request body is too large.",
    "unsupported_media_type": "The request body must be application/json.",
}
