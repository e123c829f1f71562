"""HTTP server plumbing of the listeners: requests refused before any handler runs.

Owns: what a client gets when aiohttp's own HTTP parser rejects a request
(bare CR, NUL in a header, an over-long request line or header, too many
headers, a duplicate ``Content-Length``, bad chunked framing): the same
``invalid_request`` error envelope every handler answers with, counted in
``toolproxy_request_errors_total``, instead of aiohttp's ``text/plain``
page. These requests never reach the application or its middleware, so the
answer is made at the connection (``RequestHandler.handle_error``, the hook
aiohttp gives its protocol), and the connection is closed after it.

aiohttp has no public switch for the protocol class; ``EnvelopeRunner``
takes the ``Server`` that ``AppRunner`` builds and gives it one overridden
method (``__call__``, which makes each connection's protocol). A test pins
this against the installed aiohttp (tests/test_hardening.py).

Must never: echo the malformed bytes or the parser's message (it may quote
them), log a traceback for a client's mistake, or keep the connection open.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .. import envelope
from ..errors import ProxyError
from ..telemetry.tracing import new_request_id

log = logging.getLogger("toolproxy.http")

_MESSAGES = {400: ("invalid_request", "The HTTP request is malformed and was not read."),
             413: ("payload_too_large", "The request body is too large.")}


class _EnvelopeProtocol(RequestHandler):
    """One connection; parser errors (and the rare error outside the app's middleware) get an envelope."""

    count_refusal: Callable[[str], None] = staticmethod(lambda code: None)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # a response was already under way: nothing can be said now
            raise ConnectionError("response already started")
        code, text = _MESSAGES.get(status, ("internal_error", "The proxy failed unexpectedly."))
        request_id = new_request_id()
        # A client's malformed request is routine (info); anything else reaching here is the proxy's (error).
        log.log(logging.INFO if status < 500 else logging.ERROR, "HTTP request refused before routing: %s (%s)",
                code, type(exc).__name__ if exc else "none", extra={"request_id": request_id})
        self.count_refusal(code)
        body = envelope.request_error(ProxyError(code, text, phase="request"), request_id)
        response = web.Response(status=envelope.http_status(body), content_type="application/json",
                                text=json.dumps(body, separators=(",", ":")), headers={"X-Request-Id": request_id})
        response.force_close()
        return response


class _EnvelopeServer(web.Server):
    count_refusal: Callable[[str], None]

    def __call__(self) -> RequestHandler:
        protocol = _EnvelopeProtocol(self, loop=self._loop, **self._kwargs)
        protocol.count_refusal = self.count_refusal  # type: ignore[method-assign]
        return protocol


class EnvelopeRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer parser errors with an envelope, counted by ``count_refusal``."""

    def __init__(self, app: web.Application, *, count_refusal: Callable[[str], None], **kwargs: object) -> None:
        super().__init__(app, **kwargs)  # type: ignore[arg-type]
        self._count_refusal = count_refusal

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer  # the same server; only how it makes a connection's protocol differs
        server.count_refusal = self._count_refusal  # type: ignore[attr-defined]
        return server
