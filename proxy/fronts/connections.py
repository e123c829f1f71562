"""The console's "connect your account" page: a user grants toolproxy access to an MCP upstream as themselves.

Owns: the page (``GET /ui/connect`` and its script ``/ui/connect.js``), the JSON routes it calls with the user's
own identity token (the one the user's agent calls carry: ``identity``, not ``admin_identity``, so the grant is
scoped to the tenant and subject those calls have): ``GET /v1/connections`` (each per-user credential and
whether this user has connected it), ``POST /v1/connections/{name}/start`` (the authorization URL the browser
goes to: PKCE, ``state``, ``resource``) and ``DELETE /v1/connections/{name}`` (forget the grant); and the
authorization server's return, ``GET /connect/callback`` (``state`` finds the connection its user started, and
the nonce cookie set by the start proves it is the same browser; the page it renders says connected or not, and
why by a fixed word). Must never: show a token, a code or the
authorization server's words on a page or in an answer; be mounted on the agent listener; finish a connection
for anyone but the user who started it, in another browser than the one that started it.
"""

from __future__ import annotations

import html
import logging
import secrets
from typing import Any

from aiohttp import web

from ..errors import ProxyError
from .console import STATIC, page_head
from .http_edge import RUNTIME, json_response

log = logging.getLogger("toolproxy.connections")
COOKIE = "toolproxy_connection"
CONNECT_WINDOW_S = 600  # a connection not finished within this is forgotten (``UserGrants``)


def install(app: web.Application) -> None:
    app.router.add_get("/ui/connect", page)
    app.router.add_get("/ui/connect.js", script)
    app.router.add_get("/v1/connections", list_connections)
    app.router.add_post(r"/v1/connections/{name:[A-Za-z0-9._-]{1,128}}/start", start)
    app.router.add_delete(r"/v1/connections/{name:[A-Za-z0-9._-]{1,128}}", disconnect)
    app.router.add_get("/connect/callback", callback)


def _grants(request: web.Request) -> Any:
    grants = getattr(request.app[RUNTIME], "user_grants", None)
    if grants is None:
        raise ProxyError("route_not_found", "No tool here acts with the user's own account.", phase="identity")
    return grants


async def _user(request: web.Request) -> Any:
    runtime = request.app[RUNTIME]
    return await runtime.authenticator.authenticate(request.headers, request.remote)


def _credential(request: web.Request, grants: Any) -> str:
    name = request.match_info["name"]
    if name not in grants.upstreams:
        raise ProxyError("route_not_found", "There is no such connection.", details={"credential": name},
                         phase="identity")
    return name


async def list_connections(request: web.Request) -> web.Response:
    grants = _grants(request)
    user = await _user(request)
    rows = [{"credential": name, "connected": await grants.connected(name, user.tenant, user.subject)}
            for name in sorted(grants.upstreams)]
    return json_response({"subject": user.subject, "tenant": user.tenant, "connections": rows})


async def start(request: web.Request) -> web.Response:
    grants = _grants(request)
    user = await _user(request)
    name = _credential(request, grants)
    browser = secrets.token_urlsafe(32)
    url = await grants.start(name, user.tenant, user.subject, browser)
    log.info("connection started", extra={"credential": name, "tenant": user.tenant})
    response = json_response({"credential": name, "authorization_url": url})
    # Binds the connection to this browser (not a credential: it authorizes nothing by itself); sent back only
    # to the callback, on the top-level navigation the authorization server's redirect is.
    response.set_cookie(COOKIE, browser, path="/connect/callback", max_age=CONNECT_WINDOW_S, httponly=True,
                        samesite="Lax", secure=request.secure)
    return response


async def disconnect(request: web.Request) -> web.Response:
    grants = _grants(request)
    user = await _user(request)
    name = _credential(request, grants)
    removed = await grants.disconnect(name, user.tenant, user.subject)
    log.info("connection removed", extra={"credential": name, "tenant": user.tenant, "held": removed})
    return json_response({"credential": name, "connected": False})


async def callback(request: web.Request) -> web.Response:
    """The browser's return from the authorization server (``code`` and ``state``, or ``error``)."""
    grants = _grants(request)
    state = request.query.get("state", "")
    code = request.query.get("code", "")
    browser = request.cookies.get(COOKIE, "")
    if not code:
        grants.cancel(state, browser)
        return _result(False, "declined")
    try:
        name = await grants.finish(state, code, request.query.get("iss"), browser)
    except ProxyError as exc:
        reason = str((exc.details or {}).get("reason", exc.code))
        log.info("connection not finished", extra={"reason": reason})
        return _result(False, reason, status=400)
    log.info("connection finished", extra={"credential": name})
    return _result(True, name)


def _result(connected: bool, word: str, status: int = 200) -> web.Response:
    text = (f"Connected: {html.escape(word)}. You can close this page; your agent's calls now act with this "
            "account." if connected else
            f"Not connected ({html.escape(word)}). Start again from the connections page.")
    body = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>toolproxy</title></head>'
            f'<body><p id="result" data-connected="{str(connected).lower()}">{text}</p>'
            f'<p><a href="/ui/connect">Connections</a></p></body></html>')
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html", charset="utf-8")


async def script(request: web.Request) -> web.Response:
    return web.Response(body=(STATIC / "connect.js").read_bytes(), content_type="application/javascript",
                        charset="utf-8")


# Static, as the console's page is: every value arrives through the JSON routes and is written as text.
PAGE = page_head("toolproxy: connect your accounts", "/ui/connect.js") + """<body>
<header><h1>Connect your accounts</h1></header>
<p>Some tools act at their service with your own account. Connect it here once: your agent never sees the
account's tokens (toolproxy keeps them encrypted and attaches them to your agent's calls after each call is
allowed), and you can disconnect at any time.</p>
<p id="status" role="status"></p>
<section id="sign-in">
  <form id="sign-in-form" autocomplete="off">
    <label for="token">Your identity token (the one your agent's calls carry)</label>
    <input id="token" type="password" required>
    <button type="submit">Continue</button>
  </form>
</section>
<section id="list" hidden>
  <table><thead><tr><th>Service</th><th>State</th><th></th></tr></thead><tbody id="rows"></tbody></table>
</section>
</body>
</html>
"""
