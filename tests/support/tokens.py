"""Real signed JWTs for tests: an RSA key pair per ``Issuer``, its JWKS written to a file.

No mocks: the proxy verifies these with PyJWT against the JWKS file exactly as
it would a platform's tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm


class Issuer:
    def __init__(self, directory: Path, *, issuer: str, kid: str = "k1") -> None:
        self.issuer = issuer
        self.kid = kid
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.jwks_file = directory / f"{kid}-jwks.json"
        public = json.loads(RSAAlgorithm.to_jwk(self._key.public_key()))
        self.jwks_file.write_text(json.dumps({"keys": [{**public, "kid": kid, "alg": "RS256", "use": "sig"}]}))

    def token(self, subject: str, *, audience: str = "toolproxy", tenant: str | None = "acme",
              roles: list[str] | None = None, scope: str = "tools:read tools:write", ttl_s: int = 300,
              **extra: Any) -> str:
        now = int(time.time())
        claims: dict[str, Any] = {"iss": self.issuer, "sub": subject, "aud": audience, "iat": now,
                                  "nbf": now, "exp": now + ttl_s, "roles": ["agent"] if roles is None else roles,
                                  "scope": scope, **extra}
        if tenant is not None:
            claims["tenant"] = tenant
        return jwt.encode(claims, self._key, algorithm="RS256", headers={"kid": self.kid})


def jwt_overrides(agent: Issuer, admin: Issuer) -> dict[str, Any]:
    """Config: agents authenticate with ``agent``'s tokens, approvers with ``admin``'s."""
    return {
        "identity.mode": "jwt",
        "identity.agent_id": "agent-under-test",
        "identity.jwt": {"issuer": agent.issuer, "audience": "toolproxy", "jwks_file": str(agent.jwks_file)},
        "admin_identity.jwt": {"issuer": admin.issuer, "audience": "toolproxy-admin",
                               "jwks_file": str(admin.jwks_file)},
    }
