"""The call-token check as middleware: aiohttp (``aiohttp_middleware``) and ASGI (``AsgiCallTokens``).

Owns: asking the backend's ``route`` what a request's path serves (``Expect``: the tool, the kind of
request, the operation key in the path; ``None``: a route that takes no token, such as a health probe),
reading the body once (bounded) to check it against the token, checking the ``Idempotency-Key`` and
``X-Fencing-Token`` headers against the token's ``tctx``, answering 401 with the refusal's reason
(``{"error": {"code": "call_token_refused", "reason": ..., "applied": false}}``), and handing the
verified facts to the handler (aiohttp: ``request[CALL_TOKEN]``; ASGI: ``scope["state"]["call_token"]``),
whose ``idempotency_key`` and ``fencing_token`` are the ones a handler keys its effects on.
Must never: pass a request that needs a token to the handler without one, pass one whose key or fence
headers disagree with its token, or read more than ``max_body_bytes`` of a body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from . import HEADER
from .verifier import FENCE_HEADER, KEY_HEADER, CallTokenVerifier, Refused, VerifiedCall

try:  # aiohttp is needed by the aiohttp middleware only
    from aiohttp import web as _web
    CALL_TOKEN: Any = _web.RequestKey("call_token", VerifiedCall)  # request[CALL_TOKEN] in an aiohttp handler
except ImportError:  # pragma: no cover - an ASGI-only backend
    CALL_TOKEN = "call_token"


@dataclass(frozen=True)
class Expect:
    tool: str | tuple[str, ...]  # the tool the route serves (or the contract names it serves under)
    scope: str = "tool:call"     # tool:call | tool:status | tool:cancel
    key: str | None = None       # the operation key the path names (status and cancel routes)


Route = Callable[[str, str], "Expect | None"]  # (method, path) -> what it serves; None: no token needed

MAX_BODY_BYTES = 1024 * 1024


def refusal_body(reason: str) -> bytes:
    return json.dumps({"error": {"code": "call_token_refused", "reason": reason, "applied": False,
                                 "message": "a valid Txn-Token from toolproxy is required"}}).encode()


def aiohttp_middleware(verifier: CallTokenVerifier, route: Route, *, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    from aiohttp import web

    @web.middleware
    async def call_tokens(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        expect = route(request.method, request.path)
        if expect is None:
            return await handler(request)
        if request.content_length is not None and request.content_length > max_body_bytes:
            return web.Response(status=413, body=refusal_body("malformed"), content_type="application/json")
        body = await request.read()
        try:
            request[CALL_TOKEN] = verifier.verify(request.headers.get(HEADER), tool=expect.tool, body=body,
                                                    scope=expect.scope, key=expect.key, headers=request.headers)
        except Refused as refused:
            return web.Response(status=401, body=refusal_body(refused.reason), content_type="application/json")
        return await handler(request)

    return call_tokens


class AsgiCallTokens:
    """ASGI middleware: ``app = AsgiCallTokens(app, verifier, route)``."""

    def __init__(self, app: Any, verifier: CallTokenVerifier, route: Route, *,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self._app = app
        self._verifier = verifier
        self._route = route
        self._max = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        expect = self._route(scope["method"], scope["path"])
        if expect is None:
            await self._app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max:
                await _answer(send, 413, "malformed")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        wanted = {name.lower(): name for name in (HEADER, KEY_HEADER, FENCE_HEADER)}
        found: dict[str, str] = {}
        for name, value in scope.get("headers", ()):
            canonical = wanted.get(name.decode("latin-1").lower())
            if canonical is not None:
                if canonical in found:  # two values of one of them: which one would the handler read?
                    await _answer(send, 401, "header_mismatch" if canonical != HEADER else "malformed")
                    return
                found[canonical] = value.decode("latin-1")
        try:
            verified = self._verifier.verify(found.get(HEADER), tool=expect.tool, body=body, scope=expect.scope,
                                             key=expect.key, headers=found)
        except Refused as refused:
            await _answer(send, 401, refused.reason)
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        state = {**scope.get("state", {}), "call_token": verified}
        await self._app({**scope, "state": state}, replay, send)


async def _answer(send: Any, status: int, reason: str) -> None:
    body = refusal_body(reason)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
