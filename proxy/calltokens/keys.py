"""Call-token keys: the proxy's signing key and the public keys backends verify with.

Owns: reading a PEM private key (Ed25519 for EdDSA, P-256 for ES256) and its key id (the RFC 7638
thumbprint unless one is given), reading a JWKS file of further verification keys (the old key while
a rotation overlaps, or the next one), the JWKS the ops listener serves, and generating a key (dev
stack, tests, ``toolproxy call-token-key``). Must never: publish a private member, accept a key type
or curve the two algorithms do not name, or fall back to an algorithm the token does not declare.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from jwt.algorithms import ECAlgorithm, OKPAlgorithm

MAX_KEY_FILE_BYTES = 64 * 1024
MAX_KEYS = 16


class KeyFileError(ValueError):
    """A key or JWKS file cannot be used; the message says why (never the key material)."""


@dataclass(frozen=True)
class SigningKey:
    private: Any = field(repr=False)  # Ed25519PrivateKey | EllipticCurvePrivateKey (P-256)
    alg: str
    kid: str

    def public_jwk(self) -> dict[str, Any]:
        return public_jwk(self.private.public_key(), self.alg, self.kid)


def algorithm_of(key: Any) -> str:
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return "EdDSA"
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) and key.curve.name == "secp256r1":
        return "ES256"
    raise KeyFileError("call-token keys are Ed25519 (EdDSA) or EC P-256 (ES256)")


def public_jwk(public_key: Any, alg: str, kid: str) -> dict[str, Any]:
    maker = OKPAlgorithm if alg == "EdDSA" else ECAlgorithm
    jwk = maker.to_jwk(public_key, as_dict=True)
    members = {name: jwk[name] for name in ("kty", "crv", "x", "y") if name in jwk}
    return {**members, "kid": kid or thumbprint(members), "alg": alg, "use": "sig"}


def thumbprint(jwk: Mapping[str, Any]) -> str:
    """RFC 7638: SHA-256 of the required members in lexicographic order, base64url without padding."""
    required = ("crv", "kty", "x") if jwk.get("kty") == "OKP" else ("crv", "kty", "x", "y")
    text = json.dumps({name: jwk[name] for name in required}, separators=(",", ":"), sort_keys=True)
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()


def load_signing_key(path: str | os.PathLike[str], kid: str = "") -> SigningKey:
    data = _read(path, "call_tokens.signing_key_file")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise KeyFileError(f"{path}: not an unencrypted PEM private key") from None
    alg = algorithm_of(private)
    members = {k: v for k, v in public_jwk(private.public_key(), alg, "x").items() if k not in ("kid", "alg", "use")}
    return SigningKey(private=private, alg=alg, kid=kid or thumbprint(members))


def generate(alg: str = "EdDSA") -> Any:
    if alg == "EdDSA":
        return ed25519.Ed25519PrivateKey.generate()
    if alg == "ES256":
        return ec.generate_private_key(ec.SECP256R1())
    raise KeyFileError("call-token keys are EdDSA or ES256")


def private_pem(private: Any) -> bytes:
    return private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())


def signing_key(private: Any, kid: str = "") -> SigningKey:
    """A generated (or otherwise loaded) private key as a ``SigningKey``."""
    alg = algorithm_of(private)
    members = {k: v for k, v in public_jwk(private.public_key(), alg, "x").items() if k not in ("kid", "alg", "use")}
    return SigningKey(private=private, alg=alg, kid=kid or thumbprint(members))


def load_jwks(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The public keys of a JWKS file, each checked (key type, curve, kid, no private member)."""
    try:
        document = json.loads(_read(path, "call_tokens.verification_keys_file"))
    except ValueError:
        raise KeyFileError(f"{path}: not a JSON JWKS") from None
    return checked_keys(document, str(path))


def checked_keys(document: Any, where: str = "JWKS") -> list[dict[str, Any]]:
    keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise KeyFileError(f"{where}: expected {{\"keys\": [...]}} with at most {MAX_KEYS} keys")
    out = []
    for key in keys:
        if not isinstance(key, dict) or not isinstance(key.get("kid"), str) or not key["kid"]:
            raise KeyFileError(f"{where}: every key needs a kid")
        if "d" in key:
            raise KeyFileError(f"{where}: key {key['kid']!r} holds a private member; publish public keys only")
        okp = key.get("kty") == "OKP" and key.get("crv") == "Ed25519"
        p256 = key.get("kty") == "EC" and key.get("crv") == "P-256"
        if not (okp or p256):
            raise KeyFileError(f"{where}: key {key['kid']!r} is neither Ed25519 (OKP) nor P-256 (EC)")
        out.append({**key, "alg": "EdDSA" if okp else "ES256", "use": "sig"})
    return out


def jwks(signing: SigningKey, extra: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The signing key's public half first, then the extra verification keys (a kid once)."""
    keys = [signing.public_jwk()]
    for key in extra:
        if key["kid"] not in {k["kid"] for k in keys}:
            keys.append(dict(key))
    return {"keys": keys}


def _read(path: str | os.PathLike[str], setting: str) -> bytes:
    try:
        with open(Path(path), "rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"{setting}: cannot read {path} ({exc.strerror or type(exc).__name__})") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{setting}: {path} is larger than {MAX_KEY_FILE_BYTES} bytes")
    return data
