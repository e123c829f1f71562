"""One request to an OAuth 2.0 token endpoint, treated as a hostile peer (RFC 6749 section 5, RFC 8693).

Owns: authenticating the proxy's client (``client_secret_basic``, ``client_secret_post``: authlib's
``ClientAuth``; ``private_key_jwt``: authlib's ``PrivateKeyJWT`` assertion, RFC 7523) on a form POST sent through
the process's one ``aiohttp`` session, bounded in time and bytes, without following redirects; reading the answer
into a ``Token`` (its value, and how long it lives) or one of a fixed set of reasons. Must never: put the
endpoint's error body, an ``error_description`` or any token into a log line or an error (only the HTTP status and
an RFC 6749 error code from a fixed list are logged); accept a token a header cannot carry.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import urlencode

import aiohttp

from ..config import ConfigError, CredentialConfig
from ..decode import strict_loads
from ..errors import ProxyError
from . import unavailable
from .secrets import read_bytes, read_secret

log = logging.getLogger("toolproxy.credentials")

# RFC 6749 section 5.2 and RFC 8693 section 2.2.2: the only error words of a refusal that reach a log line.
OAUTH_ERRORS = frozenset({"invalid_request", "invalid_client", "invalid_grant", "unauthorized_client",
                          "unsupported_grant_type", "invalid_scope", "invalid_target", "access_denied"})
_TOKEN = re.compile(r"^[\x21-\x7e]{1,16384}$")  # visible ASCII: what a header value can carry as is
MAX_LIFETIME_S = 366 * 86400
UNSTATED_LIFETIME_S = 60.0  # an answer without expires_in (nor a JWT exp): reused this long at most


@dataclass(frozen=True)
class Token:
    value: str = field(repr=False)
    lifetime_s: float  # from when it was issued


class TokenEndpoint:
    """The token endpoint of one credential: the client's authentication prepared once, each request bounded."""

    def __init__(self, name: str, config: CredentialConfig, where: str, session: aiohttp.ClientSession,
                 verify: ssl.SSLContext | bool, on_answer: Callable[[str], None] | None = None) -> None:
        from authlib.oauth2.auth import ClientAuth  # imported only where an OAuth credential is configured

        self.name = name
        self.url = config.token_url
        self._session = session
        self._verify = verify
        self._timeout_s = config.timeout_ms / 1000.0
        self._max_bytes = config.max_answer_bytes
        self._on_answer = on_answer or (lambda result: None)
        if config.client_auth == "private_key_jwt":
            from authlib.oauth2.rfc7523 import PrivateKeyJWT
            from joserfc.jwk import ECKey, RSAKey

            pem = read_bytes(config.private_key_file, f"{where}.private_key_file")
            try:
                key = (ECKey if config.private_key_alg.startswith("ES") else RSAKey).import_key(pem)
            except Exception:  # joserfc raises several types for a key it cannot read; the file's content stays out
                raise ConfigError(f"{where}.private_key_file: {config.private_key_file} is not a PEM private key "
                                  f"for {config.private_key_alg}") from None
            method = PrivateKeyJWT(self.url, alg=config.private_key_alg,
                                   headers={"kid": config.private_key_id} if config.private_key_id else None)
            self._auth = ClientAuth(config.client_id, key, method)
        else:
            secret = read_secret(config.client_secret_file, f"{where}.client_secret_file")
            self._auth = ClientAuth(config.client_id, secret, config.client_auth)

    async def request(self, form: Mapping[str, str]) -> Token:
        """The token the endpoint issues for ``form`` (the grant's parameters), or ``credential_unavailable``;
        bounded by the credential's own ``timeout_ms`` (a fetch is shared: one caller's short deadline does not cut
        it short for the others, each of whom waits within its own)."""
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"}
        _, headers, body = self._auth.prepare("POST", self.url, headers, urlencode(form))
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._session.post(self.url, data=body.encode("utf-8"), headers=headers,
                                              allow_redirects=False, ssl=self._verify) as response:
                    status = response.status
                    data = await response.content.read(self._max_bytes + 1)
        except TimeoutError:
            raise self._failed("timeout") from None
        except (aiohttp.ClientError, OSError, ValueError):
            raise self._failed("unreachable") from None
        if len(data) > self._max_bytes:
            raise self._failed("answer_too_large")
        if status != 200:
            code = _error_code(data)
            log.warning("credential %s: the token endpoint refused (HTTP %d%s)", self.name, status,
                        f", {code}" if code else "")
            raise self._failed("refused", status=status, **({"oauth_error": code} if code else {}))
        token = _token(data)
        if token is None:
            raise self._failed("invalid_answer")
        self._on_answer("issued")
        return token

    def _failed(self, reason: str, **details: Any) -> ProxyError:
        if reason != "refused":
            log.warning("credential %s: no token from the token endpoint (%s)", self.name, reason)
        self._on_answer(reason)
        return unavailable(self.name, reason, **details)


def _error_code(data: bytes) -> str | None:
    try:
        document = strict_loads(data, what="token endpoint answer", max_depth=8)
    except ProxyError:
        return None
    code = document.get("error") if isinstance(document, dict) else None
    return code if code in OAUTH_ERRORS else None


def _token(data: bytes) -> Token | None:
    """The answer's access token and lifetime, or None when it is not a usable token answer."""
    try:
        document = strict_loads(data, what="token endpoint answer", max_depth=8)
    except ProxyError:
        return None
    if not isinstance(document, dict):
        return None
    value = document.get("access_token")
    if not isinstance(value, str) or not _TOKEN.match(value):
        return None
    kind = document.get("token_type")
    if not isinstance(kind, str) or kind.lower() not in ("bearer", "n_a"):
        return None  # a DPoP or MAC token would need more than a bearer header
    expires_in = document.get("expires_in")
    if isinstance(expires_in, (int, float)) and not isinstance(expires_in, bool) and 0 < expires_in:
        return Token(value, float(min(expires_in, MAX_LIFETIME_S)))
    return Token(value, _jwt_lifetime(value))


def _jwt_lifetime(value: str) -> float:
    """A JWT access token's own ``exp`` (unverified: it only bounds how long the proxy reuses it)."""
    parts = value.split(".")
    if len(parts) == 3:
        try:
            claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
            left = float(claims["exp"]) - time.time()
            if 0 < left:
                return min(left, MAX_LIFETIME_S)
        except (ValueError, KeyError, TypeError):
            pass
    return UNSTATED_LIFETIME_S
