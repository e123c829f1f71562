"""Static credentials: a secret as a header, a bearer token or basic auth, and TLS-only credentials.

Owns: the header a static secret becomes (built once at start-up: the call path only hands it out). Must never:
read a file or format a header at call time, or show the secret in a ``repr``.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass, field

from ..config import CredentialConfig
from . import Headers, OnBehalfOf
from .secrets import read_secret


@dataclass(frozen=True)
class StaticCredential:
    name: str
    kind: str
    tls: ssl.SSLContext | None
    _headers: Headers = field(repr=False)

    async def headers(self, audience: str, caller: OnBehalfOf, wait_s: float) -> Headers:
        return self._headers

    @property
    def fixed(self) -> Headers:
        """The same headers, for a client that sets them once (an MCP upstream's)."""
        return self._headers


def static_credential(name: str, config: CredentialConfig, where: str, tls: ssl.SSLContext | None) -> StaticCredential:
    if config.kind == "tls":
        return StaticCredential(name, config.kind, tls, ())
    secret = read_secret(config.secret_file, f"{where}.secret_file")
    if config.kind == "header":
        headers: Headers = ((config.header, secret),)
    elif config.kind == "bearer":
        headers = (("Authorization", f"Bearer {secret}"),)
    else:  # basic (RFC 7617): user-id ":" password, UTF-8
        pair = base64.b64encode(f"{config.username}:{secret}".encode("utf-8")).decode("ascii")
        headers = (("Authorization", f"Basic {pair}"),)
    return StaticCredential(name, config.kind, tls, headers)
