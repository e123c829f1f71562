"""Signing call tokens: the proxy's side, on every call's hot path.

Owns: the encoded JOSE header (``alg``, ``typ: txntoken+jwt``, ``kid``) and the key's PyJWT algorithm
object, both made once; per request only the claims are encoded and signed (one Ed25519 or P-256
signature). ``exp`` is the earlier of the request's deadline and ``ttl_s`` (at most five minutes),
rounded down so it is never later than the deadline; ``jti`` is a fresh random id per token (a
backend takes each token once). Must never: sign without ``exp``, ``aud``, ``txn`` and ``jti``, sign for
longer than ``MAX_TTL_S``, or log a token.
"""

from __future__ import annotations

import base64
import math
import os
import time
from typing import Any, Mapping

import jwt
import orjson

from . import MAX_TTL_S, TOKEN_TYPE
from .keys import SigningKey


def _b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


class CallTokenSigner:
    def __init__(self, key: SigningKey, *, issuer: str, ttl_s: int = MAX_TTL_S) -> None:
        if not 1 <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"call-token ttl_s must be 1..{MAX_TTL_S}")
        self.key = key
        self._issuer = issuer
        self._ttl_s = ttl_s
        self._algorithm = jwt.get_algorithm_by_name(key.alg)
        self._private = key.private
        header = {"alg": key.alg, "typ": TOKEN_TYPE, "kid": key.kid}
        self._head = _b64(orjson.dumps(header)) + b"."

    def sign(self, *, audience: str, scope: str, txn: str, subject: str, tenant: str, agent: str,
             context: Mapping[str, Any], budget_s: float | None = None, now: float | None = None) -> str:
        """A token for one request; ``budget_s`` is what is left of its call's deadline (None: ``ttl_s``)."""
        now = time.time() if now is None else now
        life = self._ttl_s if budget_s is None else max(0.0, min(float(self._ttl_s), budget_s))
        claims = {"iss": self._issuer, "aud": audience, "iat": int(now), "exp": math.floor(now + life),
                  "txn": txn, "jti": _b64(os.urandom(16)).decode("ascii"), "sub": subject, "tenant": tenant,
                  "req_wl": agent, "scope": scope,
                  "tctx": context}
        signing_input = self._head + _b64(orjson.dumps(claims))
        signature = self._algorithm.sign(signing_input, self._private)
        return (signing_input + b"." + _b64(signature)).decode("ascii")
