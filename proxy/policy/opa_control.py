"""Control-plane conversations with OPA through ``opa-python-client``.

Owns: building an ``AsyncOpaClient`` for an OPA base URL, and the few
control-plane operations the proxy and the policy-authoring commands need:
health, loading data (the tool catalog) and policies. Must never: carry a
per-call decision query — those stay on the proxy's own budgeted session in
``policy.py`` (the client has one fixed timeout per client instead of the
call's remaining budget, retries 5xx and connection errors with back-off that
would outlive the budget, and cannot tell an undefined decision from an
unreachable OPA).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from opa_client import AsyncOpaClient

__all__ = ["control_client", "put_data", "healthy", "ControlError", "read_token", "AUTHZ_POLICY"]

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


def control_client(url: str, *, timeout_s: float, retries: int, token: str = "") -> AsyncOpaClient:
    """An (unopened) client for the OPA at ``url`` (sending ``token`` as a bearer token, if any); use it as
    ``async with``."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    return AsyncOpaClient(host=parts.hostname or "127.0.0.1", port=parts.port or (443 if secure else 80),
                          ssl=secure, timeout=timeout_s, retries=retries, token=token or None)


async def healthy(client: AsyncOpaClient) -> bool:
    """GET /health: False on any failure (the client already swallows them)."""
    return bool(await client.check_health())


async def put_data(client: AsyncOpaClient, path: str, document: dict) -> None:
    """PUT a document at data.<path>; ControlError when OPA is away or refuses."""
    try:
        await client.update_or_create_data(document, path)
    except Exception as exc:  # the client's own errors, aiohttp's, timeouts: all mean "not loaded"
        raise ControlError(f"OPA did not take data.{path.replace('/', '.')} ({type(exc).__name__})") from None
