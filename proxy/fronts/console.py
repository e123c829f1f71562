"""The operator console: one page on the admin listener for the people in the loop.

Owns: the console's server-rendered page (``GET /ui``: the panels' structure,
forms and empty tables), its own script and stylesheet (``/ui/console.js``,
``/ui/console.css``, shipped in ``proxy/fronts/console_static/``), and the security
headers of every admin listener response (a strict Content-Security-Policy
with no inline script, no framing, no sniffing, no referrer, no caching).
The page holds no data and no credential: the script asks for the admin
token, keeps it in the tab's ``sessionStorage`` only, and calls the admin
JSON API with it in the ``Authorization`` header, so the console has exactly
the API's roles and tenant scoping. Must never: be mounted on the agent
listener, load anything from another origin, put a credential in a URL or a
cookie, or render an agent- or tool-supplied value as markup (the script
writes every value with ``textContent``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "console_static"
ASSETS = {"console.js": "application/javascript", "console.css": "text/css"}

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'none'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


@web.middleware
async def security_headers(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    """On every admin listener response, the console's pages and the JSON API alike."""
    response = await handler(request)
    response.headers.update(SECURITY_HEADERS)
    return response


def install(app: web.Application) -> None:
    app.router.add_get("/ui", page)
    app.router.add_get("/ui/", page)
    app.router.add_get("/ui/{asset:console\\.(?:js|css)}", asset)
    app.router.add_get("/ui/favicon.svg", favicon)
    app.router.add_get("/favicon.ico", favicon)  # what a browser asks for on its own


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html", charset="utf-8")


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    return web.Response(body=(STATIC / name).read_bytes(), content_type=ASSETS[name], charset="utf-8")


async def favicon(request: web.Request) -> web.Response:
    return web.Response(text=FAVICON, content_type="image/svg+xml", charset="utf-8")


FAVICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
           'fill="#24292f"/><path d="M4 4h8v2H9v7H7V6H4z" fill="#fff"/></svg>')



def page_head(title: str, script: str) -> str:
    """The head of an admin listener page: its title, the console's icon and stylesheet, and one script."""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>{title}</title>
<link rel="icon" href="/ui/favicon.svg" type="image/svg+xml">
<link rel="stylesheet" href="/ui/console.css">
<script src="{script}" defer></script>
</head>
"""


# The page is static on purpose: every value it shows arrives through the admin API and is written as text.
PAGE = page_head("toolproxy console", "/ui/console.js") + """<body>
<header>
  <h1>toolproxy console</h1>
  <div id="who" hidden><span id="who-text"></span>
    <button type="button" id="refresh">Refresh</button>
    <button type="button" id="sign-out">Sign out</button></div>
</header>
<p id="status" role="status"></p>
<p id="connection" role="alert" hidden></p>
<p id="expiry" role="alert" hidden></p>

<section id="sign-in">
  <h2>Sign in</h2>
  <p>Paste your admin token (an approver's or operator's JWT for this admin listener). It stays in this
  tab only (sessionStorage) and is sent as a bearer token to the admin API; it never goes into a URL.</p>
  <form id="sign-in-form" method="post" autocomplete="off">
    <label for="token">Admin token</label>
    <input id="token" name="token" type="password" autocomplete="off" spellcheck="false" required>
    <button type="submit" id="sign-in-button">Sign in</button>
  </form>
  <p>Not an approver? Tools that act with your own account at their service are connected on
  <a href="/ui/connect">Connect your accounts</a>.</p>
</section>

<main id="panels" hidden>
<section id="panel-approvals" data-role="approver" hidden>
  <h2>Pending approvals <span class="count" id="approvals-count"></span></h2>
  <p class="hint">Approving authorizes exactly one execution of exactly these arguments. You cannot decide
  on your own request.</p>
  <div class="filters" role="search" aria-label="Filter pending approvals">
    <label>Tool <select id="filter-tool"><option value="">all tools</option></select></label>
    <label>Tenant <select id="filter-tenant"><option value="">all tenants</option></select></label>
    <label>Risk <select id="filter-risk"><option value="">all risks</option></select></label>
    <label>Search <input id="filter-search" type="search" autocomplete="off" spellcheck="false"
      placeholder="id, who, arguments, reasons"></label>
  </div>
  <table id="approvals"><caption class="sr-only">Approvals waiting for a decision</caption><thead><tr><th scope="col">requested</th><th scope="col">who asked</th><th scope="col">tool</th><th scope="col">arguments (masked)</th>
  <th scope="col">related read</th><th scope="col">risk</th><th scope="col">policy reasons</th><th scope="col">expires</th><th scope="col">decision</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="approvals-empty" hidden>Nothing is waiting for a decision.</p>
  <div class="paging"><button type="button" id="page-prev">Previous page</button>
    <span id="approvals-paging" aria-live="polite"></span>
    <button type="button" id="page-next">Next page</button></div>
</section>

<section id="panel-decided" data-role="approver" hidden>
  <h2>Decided approvals <span class="count" id="decided-count"></span></h2>
  <table id="decided"><caption class="sr-only">The latest decisions</caption><thead><tr><th scope="col">decided</th><th scope="col">status</th><th scope="col">decided by</th><th scope="col">reason</th>
  <th scope="col">who asked</th><th scope="col">tool</th><th scope="col">arguments (masked)</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="decided-empty" hidden>No decisions yet.</p>
</section>

<section id="panel-takeovers" data-role="operator" hidden>
  <h2>Takeovers: operations a person must settle <span class="count" id="takeovers-count"></span></h2>
  <p class="hint">The reconciler could not find out whether these happened. Check the target system, then
  record what you found; repeats of the operation get your outcome.</p>
  <table id="takeovers"><caption class="sr-only">Takeovers to settle</caption><thead><tr><th scope="col">since</th><th scope="col">operation</th><th scope="col">tool</th><th scope="col">who</th><th scope="col">target</th>
  <th scope="col">evidence</th><th scope="col">resolve</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="takeovers-empty" hidden>No takeovers.</p>
</section>

<section id="panel-unknowns" data-role="operator" hidden>
  <h2>Open unknown outcomes</h2>
  <h3>Operations being reconciled</h3>
  <table id="unknown-operations"><caption class="sr-only">Operations being reconciled</caption><thead><tr><th scope="col">open for</th><th scope="col">operation</th><th scope="col">tool</th><th scope="col">who</th>
  <th scope="col">attempts</th><th scope="col">last evidence</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="unknown-operations-empty" hidden>None.</p>
  <h3>Calls without an operation record (only a person can settle them)</h3>
  <table id="unknown-calls"><caption class="sr-only">Calls without an operation record</caption><thead><tr><th scope="col">open for</th><th scope="col">call</th><th scope="col">tool</th><th scope="col">tenant</th>
  <th scope="col">settle</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="unknown-calls-empty" hidden>None.</p>
</section>

<section id="panel-locks" data-role="operator" hidden>
  <h2>Held resource locks <span class="count" id="locks-count"></span></h2>
  <table id="locks"><caption class="sr-only">Resource locks held now</caption><thead><tr><th scope="col">resource</th><th scope="col">tenant</th><th scope="col">mode</th><th scope="col">tool</th><th scope="col">operation</th>
  <th scope="col">fencing token</th><th scope="col">lease left</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="locks-empty" hidden>No lock is held.</p>
  <p class="hint" id="locks-hint"></p>
</section>

<section id="panel-freezes" data-role="operator" hidden>
  <h2>Frozen resources <span class="count" id="freezes-count"></span></h2>
  <table id="freezes"><caption class="sr-only">Resources frozen by an unknown outcome</caption><thead><tr><th scope="col">frozen for</th><th scope="col">resource</th><th scope="col">tenant</th><th scope="col">operation</th><th scope="col">tool</th>
  <th scope="col">resolve</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="freezes-empty" hidden>Nothing is frozen.</p>
  <p class="hint" id="freezes-hint"></p>
</section>

<section id="panel-denials" data-role="any" hidden>
  <h2>Recent policy denials <span class="count" id="denials-count"></span></h2>
  <table id="denials"><caption class="sr-only">Denials by tool and reason</caption><thead><tr><th scope="col">tool</th><th scope="col">reason</th><th scope="col">as the policy said it</th><th scope="col">count</th>
  <th scope="col">last</th></tr></thead>
  <tbody></tbody></table>
  <p class="empty" id="denials-empty" hidden>No denials recorded.</p>
  <p class="hint" id="denials-kept"></p>
  <h3>Latest denials</h3>
  <table id="denials-recent"><caption class="sr-only">The latest denials, newest first</caption><thead><tr><th scope="col">when</th><th scope="col">who was denied</th><th scope="col">tool</th><th scope="col">reasons</th>
  <th scope="col">request</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="denials-recent-empty" hidden>None.</p>
</section>

<section id="panel-pins" data-role="operator" hidden>
  <h2>Pinned MCP tools: quarantined on drift <span class="count" id="pins-count"></span></h2>
  <table id="pins"><caption class="sr-only">Pinned MCP tools and their state</caption><thead><tr><th scope="col">tool</th><th scope="col">state</th><th scope="col">what changed upstream</th>
  <th scope="col">since</th></tr></thead><tbody></tbody></table>
  <p class="empty" id="pins-empty" hidden>No pinned MCP tool.</p>
  <p class="hint">A drifted tool is refused (contract_drift) and hidden until re-pinned after review:
  <code>toolproxy mcp repin FILE</code>.</p>
</section>
</main>
<footer><p>Last updated <time id="updated"></time>. Served by the admin listener. Data refreshes every 10 s;
rows you are typing in are left as they are.</p></footer>
</body>
</html>
"""
