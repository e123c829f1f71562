"""Verifying call tokens: the backend's side, importable without the rest of the proxy.

Owns: the one check a backend runs on every request the proxy sends for a call
(``CallTokenVerifier.verify``): a ``Txn-Token`` is present and small; its header says
``typ: txntoken+jwt`` with EdDSA or ES256 and a ``kid`` this backend knows; the signature holds; ``aud``
is this backend, ``iss`` the expected one (when set), ``exp`` not passed (``iat`` and ``exp`` required,
within the clock-skew leeway); ``scope`` is the kind of request the route serves; ``tctx.tool`` is the
route's tool (and ``tctx.idempotency_key`` the route's key for status and cancel requests); for a call,
``tctx.args_hash`` is the SHA-256 of the body actually received (the proxy sends the RFC 8785 form; a
body re-encoded on the way is put in that form here, and one with a duplicate key is refused: a backend
whose parser keeps the first value would read other arguments than the hash covers), so a token cannot
carry other arguments; the request's ``Idempotency-Key`` and ``X-Fencing-Token`` headers, when the
caller passes ``headers`` and they are present, say what ``tctx`` says (a backend that keys its effects on headers would
otherwise turn a replayed token with another key, or a huge fence, into a second effect or a locked-out
resource); and replay: a token (its ``jti``) is good once — the proxy signs a new one for every request
it sends — and a ``txn`` seen before is refused unless it comes with the same idempotency key (the proxy's
own retry of an operation: a new token, the same key).

Must never: accept ``alg: none``, an HMAC algorithm or a key whose algorithm differs from the header's;
fetch keys from a URL named in the token; keep more than ``max_seen`` transactions in memory.
Refusals are ``Refused`` with a stable ``reason`` (below); never the token in a message.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import jwt
import rfc8785

from . import ALGORITHMS, HEADER, SCOPES, TOKEN_TYPE

MAX_TOKEN_BYTES = 8192
MAX_JWKS_BYTES = 64 * 1024

# Why a request was refused (``Refused.reason``).
REASONS = (
    "missing",          # no Txn-Token header
    "malformed",        # not a compact JWS, or too large
    "wrong_type",       # header typ is not txntoken+jwt
    "wrong_algorithm",  # not EdDSA / ES256, or not the algorithm of the key
    "unknown_key",      # kid not in this backend's key set
    "bad_signature",
    "expired",
    "wrong_audience",
    "wrong_issuer",
    "missing_claim",    # iat, exp, aud, txn, sub, tenant, req_wl, scope or tctx absent
    "wrong_scope",      # a status token on a call route, ...
    "wrong_tool",       # tctx.tool is not the route's tool
    "wrong_key",        # tctx.idempotency_key is not the route's key (status, cancel)
    "wrong_arguments",  # tctx.args_hash is not the hash of the body received
    "replayed",         # a token (jti) seen before, or a txn seen before with another (or no) key
    "header_mismatch",  # an Idempotency-Key or X-Fencing-Token header that differs from tctx (or tctx lacks)
)

KEY_HEADER = "Idempotency-Key"
FENCE_HEADER = "X-Fencing-Token"


class Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class VerifiedCall:
    """What a verified token says about the request (``context`` is its whole ``tctx``)."""

    txn: str
    subject: str
    tenant: str
    agent: str
    scope: str
    tool: str
    version: str | None
    args_hash: str | None
    idempotency_key: str | None
    fencing_token: int | None
    decision_id: str | None
    approval_id: str | None
    expires: int
    context: Mapping[str, Any] = field(repr=False)


class KeySet(Protocol):
    def get(self, kid: str) -> "jwt.PyJWK | None": ...


class StaticKeys:
    """A JWKS given as a value (``{"keys": [...]}``); only EdDSA (Ed25519) and ES256 (P-256) keys."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self._keys = _parse(document)

    def get(self, kid: str) -> "jwt.PyJWK | None":
        return self._keys.get(kid)


class JwksFile:
    """A JWKS file, read again when it changes (a rotation adds the new key, later removes the old)."""

    def __init__(self, path: str | os.PathLike[str], *, check_every_s: float = 1.0) -> None:
        self._path = Path(path)
        self._every = check_every_s
        self._checked = 0.0
        self._stamp: tuple[int, int] | None = None
        self._keys: dict[str, jwt.PyJWK] = {}
        self._lock = threading.Lock()
        self._reload()

    def get(self, kid: str) -> "jwt.PyJWK | None":
        now = time.monotonic()
        if now - self._checked >= self._every or kid not in self._keys:
            with self._lock:
                self._checked = now
                self._reload()
        return self._keys.get(kid)

    def _reload(self) -> None:
        try:
            stat = self._path.stat()
        except OSError:
            return  # keep the last good set
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp or stat.st_size > MAX_JWKS_BYTES:
            return
        try:
            self._keys = _parse(json.loads(self._path.read_bytes()))
            self._stamp = stamp
        except (OSError, ValueError):
            pass  # a half-written file: the next check reads it again


def _parse(document: Any) -> dict[str, "jwt.PyJWK"]:
    keys = document.get("keys") if isinstance(document, Mapping) else None
    if not isinstance(keys, list):
        raise ValueError("a JWKS is {\"keys\": [...]}")
    parsed: dict[str, jwt.PyJWK] = {}
    for item in keys:
        if not isinstance(item, Mapping) or not isinstance(item.get("kid"), str):
            continue
        if item.get("kty") == "OKP" and item.get("crv") == "Ed25519":
            alg = "EdDSA"
        elif item.get("kty") == "EC" and item.get("crv") == "P-256":
            alg = "ES256"
        else:
            continue  # another kind of key is never a call-token key
        public = {k: v for k, v in item.items() if k not in ("d", "p", "q", "dp", "dq", "qi")}
        parsed[item["kid"]] = jwt.PyJWK({**public, "alg": alg})
    return parsed


class ReplayCache:
    """The transactions seen, each kept until its token expires, at most ``max_seen`` (oldest out first).

    One process's memory: a backend with several replicas that must refuse a replay on another
    replica gives ``CallTokenVerifier`` its own shared implementation (``seen``)."""

    def __init__(self, max_seen: int = 100_000) -> None:
        self._max = max_seen
        self._seen: collections.OrderedDict[str, tuple[str | None, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def seen(self, txn: str, key: str | None, expires: float, now: float) -> bool:
        """Record ``txn``; True when it was seen before with another (or no) idempotency key. The verifier
        passes a token's ``jti`` here with the key ``None``: a token id is then good exactly once."""
        with self._lock:
            while self._seen:
                oldest, (_, until) = next(iter(self._seen.items()))
                if until >= now and len(self._seen) < self._max:
                    break
                del self._seen[oldest]
            previous = self._seen.get(txn)
            if previous is not None:
                return previous[0] is None or previous[0] != key
            self._seen[txn] = (key, expires)
            return False


_REQUIRED = ("iat", "exp", "aud", "txn", "sub", "tenant", "req_wl", "scope", "tctx")


class CallTokenVerifier:
    """``verify`` checks one request's token; ``keys`` is a JWKS value, or a key set (``JwksFile``)."""

    def __init__(self, keys: Mapping[str, Any] | KeySet, *, audience: str, issuer: str | None = None,
                 leeway_s: float = 5.0, replay: ReplayCache | None = None) -> None:
        self._keys: KeySet = StaticKeys(keys) if isinstance(keys, Mapping) else keys
        self._audience = audience
        self._issuer = issuer
        self._leeway = leeway_s
        self._replay = replay if replay is not None else ReplayCache()
        self._jwt = jwt.PyJWT()

    def verify(self, token: str | None, *, tool: str | tuple[str, ...], body: bytes = b"",
               scope: str = "tool:call", key: str | None = None, headers: Mapping[str, str] | None = None,
               now: float | None = None) -> VerifiedCall:
        """The verified facts of a request to ``tool``'s route, or ``Refused``. ``tool``: the tool the route
        serves (or a tuple of the contract names it serves under); ``body``: the bytes received (a call's
        arguments); ``key``: the operation key in a status or cancel route; ``headers``: the request's
        headers (a case-insensitive mapping), whose ``Idempotency-Key`` and ``X-Fencing-Token`` must then
        say what the token says. Take the key and fence from the result, never from the headers."""
        jwk, alg = self._key_of(token)
        now = time.time() if now is None else now
        claims = self._decode(token, jwk, alg, now)
        if any(name not in claims for name in _REQUIRED) or not isinstance(claims["tctx"], dict):
            raise Refused("missing_claim")
        context = claims["tctx"]
        named, op_key = _check_call(context, claims["scope"], tool=tool, body=body, scope=scope, key=key)
        if headers is not None:
            _check_headers(headers, op_key, context.get("fencing_token"))
        jti, until = claims.get("jti"), float(claims["exp"]) + self._leeway
        if isinstance(jti, str) and jti and self._replay.seen("jti:" + jti, None, until, now):
            raise Refused("replayed")  # this very token again
        if self._replay.seen(str(claims["txn"]), op_key, until, now):
            raise Refused("replayed")  # the operation under another (or no) key
        return VerifiedCall(txn=str(claims["txn"]), subject=str(claims["sub"]), tenant=str(claims["tenant"]),
                            agent=str(claims["req_wl"]), scope=scope, tool=named, version=context.get("version"),
                            args_hash=context.get("args_hash"), idempotency_key=op_key,
                            fencing_token=context.get("fencing_token"), decision_id=context.get("decision_id"),
                            approval_id=context.get("approval_id"), expires=int(claims["exp"]), context=context)

    def _key_of(self, token: str | None) -> tuple["jwt.PyJWK", str]:
        """The token's shape and header: its type, its algorithm and a key this verifier holds by ``kid``."""
        if not token:
            raise Refused("missing")
        if len(token) > MAX_TOKEN_BYTES or token.count(".") != 2:
            raise Refused("malformed")
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.PyJWTError, RecursionError):  # a header nested past the parser's depth: malformed
            raise Refused("malformed") from None
        if header.get("typ") != TOKEN_TYPE:
            raise Refused("wrong_type")
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Refused("wrong_algorithm")
        jwk = self._keys.get(header.get("kid")) if isinstance(header.get("kid"), str) else None
        if jwk is None:
            raise Refused("unknown_key")
        if jwk.algorithm_name != alg:
            raise Refused("wrong_algorithm")
        return jwk, alg

    def _decode(self, token: str, jwk: "jwt.PyJWK", alg: str, now: float) -> dict[str, Any]:
        options = {"require": ["iat", "exp", "aud"], "verify_iat": False}
        try:
            claims = self._jwt.decode(token, jwk.key, algorithms=[alg], audience=self._audience,
                                      issuer=self._issuer, leeway=self._leeway, options=options)
        except jwt.ExpiredSignatureError:
            raise Refused("expired") from None
        except jwt.InvalidAudienceError:
            raise Refused("wrong_audience") from None
        except jwt.InvalidIssuerError:
            raise Refused("wrong_issuer") from None
        except jwt.MissingRequiredClaimError:
            raise Refused("missing_claim") from None
        except jwt.InvalidSignatureError:
            raise Refused("bad_signature") from None
        except (jwt.PyJWTError, RecursionError):
            raise Refused("malformed") from None
        if claims["exp"] + self._leeway < now:  # PyJWT read the clock itself; the caller's ``now`` decides too
            raise Refused("expired")
        return claims


def _check_call(context: Mapping[str, Any], claimed_scope: Any, *, tool: str | tuple[str, ...], body: bytes,
                scope: str, key: str | None) -> tuple[str, Any]:
    """The call the token names is this route's: its scope, its tool, its operation (status and cancel) or the
    arguments received (a call). (tool, operation key) when it is."""
    if claimed_scope != scope or scope not in SCOPES:
        raise Refused("wrong_scope")
    named = context.get("tool")
    if not isinstance(named, str) or (named != tool if isinstance(tool, str) else named not in tool):
        raise Refused("wrong_tool")
    op_key = context.get("idempotency_key")
    if scope != "tool:call" and (key is None or op_key != key):
        raise Refused("wrong_key")
    if scope == "tool:call":
        expected = context.get("args_hash")
        if hashlib.sha256(body).hexdigest() != expected and arguments_hash(body) != expected:
            raise Refused("wrong_arguments")
    return named, op_key


def _check_headers(headers: Mapping[str, str], op_key: Any, fence: Any) -> None:
    """The request's key and fence headers, where present, say what the token says: the proxy sends them
    as the token has them, so another value, or one the token lacks, did not come from the proxy. (An
    absent header is no claim: the handler takes both from the token.)"""
    sent_key, sent_fence = headers.get(KEY_HEADER), headers.get(FENCE_HEADER)
    if sent_key is not None and sent_key != op_key:
        raise Refused("header_mismatch")
    if sent_fence is not None and (not isinstance(fence, int) or isinstance(fence, bool) or sent_fence != str(fence)):
        raise Refused("header_mismatch")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("duplicate key")
    return found


def arguments_hash(body: bytes) -> str:
    """SHA-256 (hex) of the RFC 8785 form of a JSON body: the proxy's ``args_hash`` of the arguments it sent.
    (The proxy sends that form itself, so ``verify`` first compares the hash of the bytes as received; a
    body an intermediary re-encoded is parsed and put in canonical form here.) Not JSON, or JSON with a
    duplicate key (parsers disagree on which value counts): the bytes' hash, which the token never has."""
    try:
        canonical = rfc8785.dumps(json.loads(body, object_pairs_hook=_unique_keys))
    except (ValueError, TypeError, rfc8785.CanonicalizationError, RecursionError):
        return hashlib.sha256(body).hexdigest()
    return hashlib.sha256(canonical).hexdigest()


def header_token(headers: Mapping[str, str]) -> str | None:
    """The one Txn-Token of a request's headers (a case-insensitive mapping)."""
    return headers.get(HEADER)
