"""Tool backends that want a credential, for the credential tests: real HTTP(S) on loopback, no mocks.

``KeyBackend``: answers only a request that carries the expected header value (a bearer key, an API key header,
basic auth), 401 otherwise; it records what each request carried. ``VerifyingBackend``: answers only a bearer
token a real authorization server signed for it (its JWKS), and records the token's claims. ``PrivateCA``: a
private CA made in the test (cryptography), a server certificate for 127.0.0.1 and a client certificate, as PEM
files; ``mtls_context()`` is the server side that demands a client certificate of that CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jwt
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class KeyBackend:
    """``header`` must be ``expected`` (exactly); ``seen`` holds each request's headers (lower-cased names)."""

    header: str
    expected: str
    seen: list[dict[str, str]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> "KeyBackend":
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
        return self

    async def _handle(self, request: web.Request) -> web.Response:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        if request.headers.get(self.header) != self.expected:
            return web.json_response({"error": {"code": "unauthenticated"}}, status=401)
        body: Any = await request.json()
        return web.json_response({"echo": body.get("text", ""), "caller": request.headers.get("X-Toolproxy-Subject")})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


class PrivateCA:
    """A CA of the test's own, a server certificate for 127.0.0.1/localhost and a client certificate it signed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        now = datetime.datetime.now(datetime.timezone.utc)
        self._key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name("toolproxy test CA")
        self._cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5))
                      .not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.ca_file = self._write("ca.pem", self._cert.public_bytes(serialization.Encoding.PEM))
        self.server_cert, self.server_key = self.issue("server", ExtendedKeyUsageOID.SERVER_AUTH, server=True)
        self.client_cert, self.client_key = self.issue("toolproxy", ExtendedKeyUsageOID.CLIENT_AUTH)

    def _write(self, name: str, data: bytes) -> str:
        path = self.directory / name
        path.write_bytes(data)
        return str(path)

    def issue(self, common: str, usage: x509.ObjectIdentifier, *, server: bool = False) -> tuple[str, str]:
        now = datetime.datetime.now(datetime.timezone.utc)
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(self._cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return (self._write(f"{common}.pem", cert.public_bytes(serialization.Encoding.PEM)),
                self._write(f"{common}-key.pem", key_pem))

    def mtls_context(self) -> ssl.SSLContext:
        """The backend's side: its certificate, and a client certificate of this CA required."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca_file)
        context.load_cert_chain(self.server_cert, self.server_key)
        context.verify_mode = ssl.CERT_REQUIRED
        return context


class VerifyingBackend:
    """A backend that accepts only a bearer token its authorization server signed (``issuer``, keys at ``jwks_url``)
    for it (``audience``; None: any), and records each token and its claims."""

    def __init__(self, issuer: str, jwks_url: str, audience: str | None) -> None:
        self.issuer, self.jwks_url, self.audience = issuer, jwks_url, audience
        self.claims: list[dict] = []
        self.tokens: list[str] = []
        self.keys: dict[str, jwt.PyJWK] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def load_keys(self) -> "VerifyingBackend":
        async with aiohttp.ClientSession() as session:
            async with session.get(self.jwks_url) as response:
                self.keys = {k.key_id: k for k in jwt.PyJWKSet.from_dict(await response.json()).keys}
        return self

    def verify(self, authorization: str) -> bool:
        """Whether ``authorization`` is a bearer token this backend accepts (recorded with its claims if so)."""
        scheme, _, token = authorization.partition(" ")
        try:
            key = self.keys[jwt.get_unverified_header(token)["kid"]]
            claims = jwt.decode(token, key.key, algorithms=["RS256", "ES256"], issuer=self.issuer,
                                audience=self.audience, options={"verify_aud": self.audience is not None})
        except (jwt.PyJWTError, KeyError):
            return False
        self.claims.append(claims)
        self.tokens.append(token)
        return scheme == "Bearer"

    async def start(self) -> "VerifyingBackend":
        await self.load_keys()
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def _handle(self, request: web.Request) -> web.Response:
        if not self.verify(request.headers.get("Authorization", "")):
            return web.json_response({"error": {"code": "unauthenticated"}}, status=401)
        claims = self.claims[-1]
        body = await request.json()
        return web.json_response({"echo": body.get("text", ""), "sub": claims["sub"], "azp": claims.get("azp")})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def echo_tool(name: str, service: str, auth: str | None) -> str:
    """A registry entry (YAML, under ``tools:``) for a read that echoes ``text`` through ``service``, with the
    credential ``auth`` (None: none)."""
    auth_line = f", auth: {auth}" if auth else ""
    return f"""
  - name: {name}
    version: "1.0.0"
    description: Echo text through a backend that wants a credential.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [text]
      properties: {{text: {{type: string}}}}
    outputSchema: {{type: object}}
    backend: {{type: http, service: {service}, path: /echo{auth_line}}}
"""


def write_file(path: Path, text: str) -> str:
    """``text`` into ``path`` (a secret file, a registry file); its path as a string, for the config."""
    path.write_text(text)
    return str(path)
