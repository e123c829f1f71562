"""Control-plane conversations with OPA: the serving process's two, and the authoring commands' client.

Owns: ``OpaControl``, the serving process's control plane to its OPA (``GET /health`` for readiness,
``PUT /v1/data/<path>`` for the tool catalog) over the decision wire (``wire/http.py``: it reaches OPA
as the decisions do, over its Unix socket or TCP); and, for
the policy-authoring commands' scratch OPA (policies, data, batched queries, the Compile API), an
``opa-python-client`` ``AsyncOpaClient`` (``control_client``, imported when one is built: the client
imports ``requests`` and ``urllib3`` for its synchronous twin, about 5 MB and 0.1 s that a sidecar making
two kinds of request has no use for). Must never: carry a per-call decision query — those stay on the
proxy's own budgeted wire in ``policy/client.py`` (one fixed timeout per client instead of the call's
remaining budget, retries of 5xx and connection errors with a back-off that would outlive the budget, no
way to tell an undefined decision from an unreachable OPA).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..wire.http import HttpWire, TooLarge

if TYPE_CHECKING:
    from opa_client import AsyncOpaClient

__all__ = ["OpaControl", "control_client", "put_data", "ControlError", "read_token", "AUTHZ_POLICY"]

# What opa-python-client retries (a PUT only: the probe itself is the retry of a health check), and its
# back-off: 0.3 s, then 0.6 s.
_RETRY_STATUS = frozenset({500, 502, 504})
_BACKOFF_S = 0.3

# OPA's system.authz policy: only the proxy's bearer token, only on the decision path (and health).
AUTHZ_POLICY = Path(__file__).with_name("opa_authz.rego")


class ControlError(Exception):
    """OPA refused a control-plane request or could not be reached; the message says which."""


def read_token(path: str) -> str:
    """The bearer token in ``opa.token_file`` ("" when none is configured); ValueError names the file."""
    if not path:
        return ""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"opa.token_file: cannot read {path}: {exc}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"opa.token_file: {path} must hold one token (no spaces)")
    return token


_ANSWER_BYTES = 64 * 1024  # a health or PUT answer is a small JSON object; more is not OPA's answer


class OpaControl:
    """The serving process's control plane to its OPA, over ``wire`` (the decision wire, which knows whether
    OPA is a Unix socket or a TCP address) with the bearer token; ``base`` is ``OpaConfig.http_base``. Each
    request is bounded by ``timeout_s``. A ``put_data`` that met a connection error or a 500/502/504 is sent
    again up to ``retries`` times."""

    def __init__(self, base: str, wire: HttpWire, *, timeout_s: float, retries: int = 0,
                 token: str = "") -> None:
        self._base = base.rstrip("/")
        self._wire = wire
        self._timeout_s = timeout_s
        self._retries = retries
        self._headers: tuple[tuple[str, str], ...] = (("Authorization", f"Bearer {token}"),) if token else ()

    async def healthy(self) -> bool:
        """GET /health: 200 or not (any failure is "not healthy")."""
        try:
            async with asyncio.timeout(self._timeout_s):
                answer = await self._wire.request("GET", self._base + "/health", headers=self._headers,
                                                  max_body=_ANSWER_BYTES)
            return answer.status == 200
        except (TimeoutError, OSError, TooLarge):  # policy: not ready: readiness reports OPA away
            return False

    async def put_data(self, path: str, document: dict[str, Any]) -> None:
        """PUT a document at data.<path>; ControlError when OPA is away or refuses."""
        body = json.dumps(document).encode()
        headers = (*self._headers, ("Content-Type", "application/json"))
        what = ""
        for attempt in range(self._retries + 1):
            if attempt:
                await asyncio.sleep(_BACKOFF_S * 2 ** (attempt - 1))
            try:
                async with asyncio.timeout(self._timeout_s):
                    answer = await self._wire.request("PUT", f"{self._base}/v1/data/{path}", body, headers,
                                                      max_body=_ANSWER_BYTES)
                status = answer.status
            except (ConnectionError, FileNotFoundError) as exc:  # refused, reset, no socket yet: again
                what = type(exc).__name__
                continue
            except (TimeoutError, OSError, TooLarge) as exc:  # not sent again: raised below
                what = type(exc).__name__
                break
            if status in (200, 204):
                return
            what = f"HTTP {status}"
            if status not in _RETRY_STATUS:
                break
        raise ControlError(f"OPA did not take data.{path.replace('/', '.')} ({what})")


def control_client(url: str, *, timeout_s: float, retries: int, token: str = "") -> AsyncOpaClient:
    """An (unopened) ``opa-python-client`` client for the OPA at ``url`` (``unix:///path.sock`` or
    ``http(s)://host:port``; sending ``token`` as a bearer token, if any); use it as ``async with``. For the
    authoring commands: the serving process uses ``OpaControl``."""
    from opa_client import AsyncOpaClient

    if url.startswith("unix://"):
        socket_path = url.removeprefix("unix://")

        class OverUnixSocket(AsyncOpaClient):  # type: ignore[misc]
            async def _init_session(self) -> None:
                # The client's own session (opa-python-client==3.0.0, pinned: this private hook is its
                # connector's one place), on the socket: host and port then only fill the Host header.
                import aiohttp

                self._connector = aiohttp.UnixConnector(path=socket_path)
                self._session = aiohttp.ClientSession(headers=self.headers, connector=self._connector,
                                                      timeout=aiohttp.ClientTimeout(total=self.timeout))

        return OverUnixSocket(host="localhost", port=80, ssl=False, timeout=timeout_s, retries=retries,
                              token=token or None)
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    return AsyncOpaClient(host=parts.hostname or "127.0.0.1", port=parts.port or (443 if secure else 80),
                          ssl=secure, timeout=timeout_s, retries=retries, token=token or None)


async def put_data(client: AsyncOpaClient, path: str, document: dict) -> None:
    """PUT a document at data.<path>; ControlError when OPA is away or refuses."""
    try:
        await client.update_or_create_data(document, path)
    except Exception as exc:  # the client's own errors, aiohttp's, timeouts: all mean "not loaded"
        raise ControlError(f"OPA did not take data.{path.replace('/', '.')} ({type(exc).__name__})") from None
