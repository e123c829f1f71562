"""DNS-rebinding guard: the Host and Origin checks of the agent listener.

Owns: whether a request's ``Host`` and ``Origin`` are among the configured
ones (``mcp.allowed_hosts`` / ``mcp.allowed_origins``: the agent listener's
names, whatever the route), and the middleware that refuses every other agent
route with ``origin_not_allowed`` (403); ``/mcp`` answers the same check in
JSON-RPC shape (proxy/fronts/mcp/front.py). A web page the agent's browser
opens cannot reach the loopback API under another name. Must never: accept a
request without a ``Host`` unless ``*`` is configured, or read the body.
"""

from __future__ import annotations

from typing import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from ..config import McpConfig
from ..errors import ProxyError


class HostGuard:
    def __init__(self, config: McpConfig) -> None:
        self._hosts = frozenset(h.lower() for h in config.allowed_hosts)
        self._origins = frozenset(o.lower().rstrip("/") for o in config.allowed_origins)

    def refusal(self, request: web.Request) -> str | None:
        """Why this request is refused (None: it is not)."""
        if not host_allowed(request.headers.get("Host"), self._hosts):
            return "Forbidden: Host header not allowed (mcp.allowed_hosts)"
        origin = request.headers.get("Origin")
        if origin is not None and not origin_allowed(origin, self._origins):
            return "Forbidden: Origin not allowed (mcp.allowed_origins)"
        return None

    def middleware(self, *, skip: frozenset[str] = frozenset()) -> Callable[..., Awaitable[web.StreamResponse]]:
        """The guard for every route of an application but ``skip`` (paths that answer it themselves)."""

        @web.middleware
        async def guard(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
            if request.path not in skip:
                refusal = self.refusal(request)
                if refusal is not None:
                    raise ProxyError("origin_not_allowed", refusal, phase="request")
            return await handler(request)

        return guard


def host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    """``Host`` (name, optional port) against entries that are a name (any port) or name:port."""
    if "*" in allowed:
        return True
    if not host:
        return False
    host = host.strip().lower()
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") and "]:" in host else host
    return host in allowed or name in allowed


def origin_allowed(origin: str, allowed: frozenset[str]) -> bool:
    """``Origin`` against entries that are scheme://name (any port) or scheme://name:port."""
    if "*" in allowed:
        return True
    try:
        parts = urlsplit(origin.strip().lower())
        name = f"{parts.scheme}://{parts.hostname if ':' not in (parts.hostname or '') else f'[{parts.hostname}]'}"
    except ValueError:
        return False
    return f"{parts.scheme}://{parts.netloc}" in allowed or name in allowed
