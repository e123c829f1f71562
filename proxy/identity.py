"""Identify stage: who is calling, from trusted context only.

Owns: turning the transport's trusted context into a frozen ``Caller``
(subject, tenant, roles, scopes, agent) — a verified JWT (``jwt`` mode), the
headers of a mesh that already authenticated the caller (``headers`` mode,
only when configured and only with a proof that they came through the trusted
hop: a secret header the mesh injects, compared in constant time, or Envoy's
XFCC from a configured trusted proxy), or fixed values (``static``, dev stack and tests) —
and authenticating the admin listener's approver with its own credential.
Must never: read identity, tenant, roles or approval from tool arguments,
accept a header-borne identity unless the operator configured that mode
and the request proves its hop, accept ``alg: none`` or an HS* token without a configured secret, or echo a
token or a verification error's internals back to the caller.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import aiohttp
import jwt
from jwt import PyJWK, PyJWKSet
from jwt.exceptions import PyJWKError, PyJWKSetError, PyJWTError

from .config import (AdminIdentityConfig, ConfigError, HeaderIdentityConfig, IdentityConfig, JwtConfig,
                     xfcc_range_problem)
from .errors import ProxyError
from .provenance import TaskContext, task_context_from

log = logging.getLogger("toolproxy.identity")

HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
DEV_AGENT = "dev-agent"  # the agent name of static mode (dev stack, tests) when identity.agent_id is empty
JWKS_MIN_REFETCH_S = 10.0  # an unknown kid triggers at most one JWKS fetch per this interval


@dataclass(frozen=True)
class Caller:
    subject: str
    tenant: str
    roles: tuple[str, ...]
    scopes: tuple[str, ...]
    agent: str
    source: str  # static | jwt | headers | admin (an approver's related read, proxy/fronts/related_read.py)
    # Who the person is, for the self-approval check: identity.person_claim of the token in jwt mode ("" when
    # the token lacks it), the subject in the other modes; lower-cased.
    person: str = ""
    # jwt mode: the verified bearer token itself, which a token_exchange credential sends to its authorization
    # server as the subject token (proxy/credentials). Never in a record, a log or the policy's input.
    token: str = field(default="", repr=False, compare=False)
    # What the user asked, from the token's claim or a header behind the hop proof (never from the call's
    # arguments): values it names are trusted targets (proxy/provenance.py). Never in a record or a log.
    task: TaskContext | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"subject": self.subject, "tenant": self.tenant, "roles": list(self.roles),
                "scopes": list(self.scopes), "agent": self.agent, "source": self.source}


@dataclass(frozen=True)
class AdminPrincipal:
    """An approver or operator on the admin listener: never the agent's credential.

    ``tenant`` is None for a cross-tenant approver or operator (no tenant claim, and the configured
    cross-tenant role). ``person`` is admin_identity.person_claim (the self-approval check)."""

    subject: str
    tenant: str | None
    roles: tuple[str, ...]
    scopes: tuple[str, ...]
    person: str = ""


def _unauthorized(message: str = "A valid credential is required.") -> ProxyError:
    return ProxyError("unauthorized", message, phase="identity")


def _lacks_role(what: str, role: str) -> ProxyError:
    return ProxyError("forbidden", f"This credential is valid but is not an {what}'s (role {role} needed).",
                      details={"required_role": role}, phase="identity")


class KeySource:
    """Verification keys for one JWT configuration: a JWKS (file or URL) or a PEM key.

    JWKS URL keys are cached for ``jwks_refresh_s`` and refetched early (rate
    limited) when a token names an unknown ``kid`` — the key-rotation case.
    With no key cached (first use, or the JWKS server failing) fetches are
    rate limited the same way: at most one per ``JWKS_MIN_REFETCH_S``, however
    many requests (garbage tokens included) arrive meanwhile.
    """

    def __init__(self, config: JwtConfig, session: aiohttp.ClientSession | None, where: str = "identity.jwt") -> None:
        self._config = config
        self._session = session
        self._keys: dict[str | None, PyJWK] = {}
        self._fetched_at: float | None = None  # monotonic time of the last JWKS URL fetch, even a failed one
        self._file_mtime: float | None = None
        self._lock = asyncio.Lock()
        self._static: Any = None
        try:
            if config.public_key_file:
                self._static = Path(config.public_key_file).read_bytes()
            elif config.hmac_secret_file:
                self._static = Path(config.hmac_secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {config.public_key_file or config.hmac_secret_file}: "
                              f"{exc.strerror or type(exc).__name__}") from None
        if self._static is None and not (config.jwks_file or config.jwks_url):
            raise ConfigError(f"{where}: jwt mode needs jwks_file, jwks_url, public_key_file or hmac_secret_file")

    async def key_for(self, header: Mapping[str, Any]) -> Any:
        if self._static is not None:
            return self._static
        kid = header.get("kid")
        await self._refresh(force=False)
        key = self._pick(kid)
        if key is None and self._config.jwks_url and self._due(JWKS_MIN_REFETCH_S):
            await self._refresh(force=True)
            key = self._pick(kid)
        if key is None:
            raise _unauthorized()
        return key

    def _due(self, interval_s: float) -> bool:
        return self._fetched_at is None or time.monotonic() - self._fetched_at >= interval_s

    def _pick(self, kid: Any) -> PyJWK | None:
        if kid is None:
            return next(iter(self._keys.values()), None) if len(self._keys) == 1 else None
        return self._keys.get(kid)

    async def _refresh(self, *, force: bool) -> None:
        config = self._config
        if config.jwks_file:
            try:
                mtime = Path(config.jwks_file).stat().st_mtime
                if mtime != self._file_mtime:
                    self._keys = _parse_jwks(Path(config.jwks_file).read_text(encoding="utf-8"))
                    self._file_mtime = mtime
            except (OSError, ValueError) as exc:
                log.warning("cannot read JWKS file: %s", type(exc).__name__)
            return
        # With keys: refreshed every jwks_refresh_s. Without (never fetched, or the JWKS server failed): at
        # most one fetch per JWKS_MIN_REFETCH_S, so requests (garbage tokens included) never each fetch.
        # A forced refetch (an unknown kid) is throttled by the same interval.
        interval = JWKS_MIN_REFETCH_S if force or not self._keys else config.jwks_refresh_s
        if not self._due(interval):
            if not self._keys and self._lock.locked():  # the first fetch is under way: its keys, not a refusal
                async with self._lock:
                    pass
            return
        async with self._lock:
            if not self._due(interval):  # another request fetched while this one waited
                return
            self._fetched_at = time.monotonic()
            try:
                assert self._session is not None
                async with asyncio.timeout(5):
                    async with self._session.get(config.jwks_url, allow_redirects=False) as response:
                        if response.status != 200:
                            raise ValueError(f"HTTP {response.status}")
                        self._keys = _parse_jwks(await response.text())
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                # Keep serving the keys we had: a JWKS outage must not log everyone out.
                log.warning("cannot fetch JWKS: %s", type(exc).__name__)


def _parse_jwks(text: str) -> dict[str | None, PyJWK]:
    try:
        jwks = PyJWKSet.from_json(text)
    except (PyJWKSetError, PyJWKError, json.JSONDecodeError) as exc:
        raise ValueError("invalid JWKS") from exc
    return {key.key_id: key for key in jwks.keys}


class JwtVerifier:
    """Verifies one kind of bearer token: algorithm allow-list, signature, iss/aud/exp/nbf."""

    def __init__(self, config: JwtConfig, session: aiohttp.ClientSession | None, where: str = "identity.jwt") -> None:
        algorithms = [a for a in config.algorithms if a.lower() != "none"]
        if not config.hmac_secret_file:
            algorithms = [a for a in algorithms if a not in HMAC_ALGORITHMS]
        else:
            # A shared secret must never verify an asymmetric algorithm (key confusion).
            algorithms = [a for a in algorithms if a in HMAC_ALGORITHMS]
        if not algorithms:
            raise ConfigError(f"{where}.algorithms: none of {', '.join(config.algorithms)} is usable with the "
                              "configured key (HS* needs hmac_secret_file, and only HS* works with it)")
        if not config.issuer:
            log.warning("JWT issuer is not configured: tokens of any issuer signed by the configured keys pass")
        self._config = config
        self._algorithms = algorithms
        self._keys = KeySource(config, session, where)

    async def verify(self, token: str) -> dict[str, Any]:
        config = self._config
        try:
            header = jwt.get_unverified_header(token)
        except (PyJWTError, RecursionError):  # RecursionError: a header of deeply nested JSON
            raise _unauthorized() from None
        if header.get("alg") not in self._algorithms:
            raise _unauthorized()
        key = await self._keys.key_for(header)
        options: dict[str, Any] = {"require": ["exp"], "verify_aud": bool(config.audience),
                                   "verify_iss": bool(config.issuer)}
        try:
            return jwt.decode(token, key=key, algorithms=self._algorithms, audience=config.audience or None,
                              issuer=config.issuer or None, leeway=config.leeway_s, options=options)
        except (PyJWTError, RecursionError):
            raise _unauthorized() from None

    def claims_to_identity(self, claims: Mapping[str, Any]) -> tuple[str, str | None, tuple[str, ...],
                                                                       tuple[str, ...]]:
        config = self._config
        subject = claims.get(config.claim_subject)
        tenant = claims.get(config.claim_tenant)
        if not isinstance(subject, str) or not subject:
            raise _unauthorized()
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise _unauthorized()
        return subject, tenant, _string_list(claims.get(config.claim_roles)), \
            _string_list(claims.get(config.claim_scopes))


def _task_header(headers: Mapping[str, str], config: IdentityConfig) -> TaskContext | None:
    """The task context header (headers mode: checked by the hop proof with the identity headers; static
    mode: believed as static mode believes everything): JSON {text, values}, or the task's text."""
    text = single_header(headers, config.task_context_header).strip()
    if not text:  # (most calls: no header, no task context)
        return None
    if text.startswith("{"):
        try:
            return task_context_from(json.loads(text))
        except (ValueError, RecursionError):
            return None
    return task_context_from(text)


def _person(claims: Mapping[str, Any], claim: str) -> str:
    """The person a token names for the self-approval check ("" when the claim is absent or not a string;
    the check then refuses to compare: see proxy/policy/approvals.py)."""
    value = claims.get(claim)
    return value.strip().lower() if isinstance(value, str) else ""


def _string_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(v for v in value.replace(",", " ").split() if v)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise _unauthorized()


class HopProof:
    """Headers mode: proof that the identity headers came through the trusted hop, not from whatever
    connected (in a pod, the agent container shares the proxy's network namespace).

    ``secret``: the mesh injects ``proof_header`` with a shared secret; compared in constant time.
    ``xfcc``: the TCP peer is a configured trusted proxy and its ``X-Forwarded-Client-Cert`` element
    (the last one: the nearest hop's) names that proxy in ``By=`` and a verified client certificate
    (``Hash=``, ``URI=`` or ``Subject=``). Every configured proof must hold."""

    def __init__(self, config: HeaderIdentityConfig) -> None:
        self._config = config
        self._secret: bytes | None = None
        if config.proof_secret_file:
            try:
                self._secret = Path(config.proof_secret_file).read_bytes().strip()
            except OSError as exc:
                raise ConfigError(f"identity.headers.proof_secret_file: cannot read {config.proof_secret_file}: "
                                  f"{exc.strerror or type(exc).__name__}") from None
            if len(self._secret) < 16:
                raise ConfigError("identity.headers.proof_secret_file: the secret must be at least 16 bytes")
        self._proxies = tuple(ipaddress.ip_network(a, strict=False) for a in config.xfcc_trusted_proxies)
        own = own_addresses()
        for text, network in zip(config.xfcc_trusted_proxies, self._proxies):
            covered = next((a for a in own if a.version == network.version and a in network), None)
            if covered is not None:
                raise ConfigError(xfcc_range_problem(text, f"{covered} (this pod's own address)"))
        self._proxy_ids = frozenset(config.xfcc_proxy_ids)

    def check(self, headers: Mapping[str, str], peer: str | None) -> None:
        if self._secret is not None:
            presented = single_header(headers, self._config.proof_header).strip().encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(presented, self._secret):
                raise _unauthorized()
        if self._proxies:
            if not self._from_trusted_proxy(peer):
                raise _unauthorized()
            element = _last_xfcc_element(single_header(headers, self._config.xfcc_header))
            if element.get("by") not in self._proxy_ids or not any(element.get(k) for k in ("hash", "uri",
                                                                                            "subject")):
                raise _unauthorized()

    def _from_trusted_proxy(self, peer: str | None) -> bool:
        try:
            address = ipaddress.ip_address((peer or "").split("%", 1)[0])
        except ValueError:
            return False
        return any(address in network for network in self._proxies)


def own_addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This pod's own addresses (its host name's, and the kernel's local IPv4 and IPv6 addresses), loopback
    included: a process in the pod can connect from any of them."""
    found: set[str] = set()
    try:
        found.update(str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    try:  # IPv4: the "host LOCAL" entries of the routing trie
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        found.update(lines[i - 1].split()[-1] for i, line in enumerate(lines) if "/32 host LOCAL" in line and i)
    except OSError:
        pass
    try:  # IPv6: one address (32 hex digits) per interface line
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            digits = line.split()[0]
            found.add(":".join(digits[i:i + 4] for i in range(0, 32, 4)))
    except (OSError, IndexError):
        pass
    addresses = []
    for text in found:
        try:
            addresses.append(ipaddress.ip_address(text.split("%", 1)[0].lstrip("|- ")))
        except ValueError:
            continue
    return addresses


MAX_XFCC_CHARS = 16384  # a header larger than this is no proof


def _last_xfcc_element(value: str) -> dict[str, str]:
    """The last element of an XFCC header (Envoy: ``By=...;Hash=...;URI=...``, elements comma separated,
    values optionally double-quoted); keys lower-cased. Malformed: {}."""
    if not value or len(value) > MAX_XFCC_CHARS:
        return {}
    elements, pairs, current, quoted = [], [], [], False
    for char in value:
        if char == '"':
            quoted = not quoted
        elif char in ",;" and not quoted:
            pairs.append("".join(current))
            current = []
            if char == ",":
                elements.append(pairs)
                pairs = []
        else:
            current.append(char)
    if quoted:
        return {}
    pairs.append("".join(current))
    elements.append(pairs)
    fields: dict[str, str] = {}
    for pair in elements[-1]:
        name, sep, item = pair.strip().partition("=")
        if not sep:
            return {}
        fields[name.strip().lower()] = item
    return fields


def single_header(headers: Mapping[str, str], name: str) -> str:
    """The one value of an identity header ("" when absent). Two lines of it are refused: readers disagree on
    which one counts (the first, the last, or both joined), so a second line appended behind a proven hop
    could name another caller."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        values = getall(name, [])
        if len(values) > 1:
            raise _unauthorized(f"The request carries the {name} header more than once; send it once.")
        return values[0] if values else ""
    return headers.get(name, "")


def bearer_token(headers: Mapping[str, str]) -> str:
    raw = single_header(headers, "Authorization")
    scheme, _, token = raw.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized()
    return token.strip()


class Authenticator:
    """The agent listener's identity source plus the admin listener's approver check."""

    def __init__(self, config: IdentityConfig, admin: AdminIdentityConfig | None = None,
                 session: aiohttp.ClientSession | None = None) -> None:
        # The modes themselves were checked by the config loader.
        problem = configuration_problem(config)
        if problem:
            raise ConfigError(problem)
        self._config = config
        self._agent = config.agent_id or DEV_AGENT
        self._jwt = JwtVerifier(config.jwt, session) if config.mode == "jwt" else None
        self._hop = HopProof(config.headers) if config.mode == "headers" else None
        self._admin_config = admin or AdminIdentityConfig(mode="disabled")
        self._admin_jwt = None
        if self._admin_config.mode == "jwt" and _has_keys(self._admin_config.jwt):
            self._admin_jwt = JwtVerifier(self._admin_config.jwt, session, "admin_identity.jwt")

    async def authenticate(self, headers: Mapping[str, str], peer: str | None = None) -> Caller:
        """The caller of one agent request; ``peer`` is the TCP peer address (headers mode with XFCC)."""
        config = self._config
        if config.mode == "jwt":
            assert self._jwt is not None
            token = bearer_token(headers)
            claims = await self._jwt.verify(token)
            subject, tenant, roles, scopes = self._jwt.claims_to_identity(claims)
            if tenant is None:
                raise _unauthorized()
            return Caller(subject=subject, tenant=tenant, roles=roles, scopes=scopes, agent=self._agent,
                          source="jwt", person=_person(claims, config.person_claim), token=token,
                          task=task_context_from(claims.get(config.task_context_claim)))
        if config.mode == "headers":
            assert self._hop is not None
            self._hop.check(headers, peer)
            names = config.headers
            subject = single_header(headers, names.subject).strip()
            tenant = single_header(headers, names.tenant).strip()
            if not subject or not tenant:
                raise _unauthorized()
            return Caller(subject=subject, tenant=tenant, roles=_string_list(single_header(headers, names.roles)),
                          scopes=_string_list(single_header(headers, names.scopes)), agent=self._agent,
                          source="headers", person=subject.lower(), task=_task_header(headers, config))
        if not config.static_subject or not config.static_tenant:
            raise _unauthorized("No trusted identity is configured.")
        return Caller(subject=config.static_subject, tenant=config.static_tenant,
                      roles=tuple(config.static_roles), scopes=tuple(config.static_scopes),
                      agent=self._agent, source="static", person=config.static_subject.lower(),
                      task=_task_header(headers, config))

    async def admin_console_roles(self, headers: Mapping[str, str]) -> tuple[AdminPrincipal, tuple[str, ...]]:
        """The console's sign-in check: the admin token and which of the admin API's roles
        ("approver", "operator") it holds; a token with neither is refused like on the API."""
        principal = await self._admin_principal(headers)
        held = tuple(role for role in ("approver", "operator") if self._holds(principal, role))
        if not held:
            raise _unauthorized("This credential is neither an approver's nor an operator's.")
        return principal, held

    async def authenticate_admin(self, headers: Mapping[str, str], *, role: str = "approver") -> AdminPrincipal:
        """The approver (or, with ``role="operator"``, the operator who settles unknown operations) on the
        admin listener: its own token (audience/issuer/keys) and role."""
        principal = await self._admin_principal(headers)
        if not self._holds(principal, role):
            # A valid admin token without the needed role is known but not allowed: 403, not 401.
            raise _lacks_role(role, self._admin_config.operator_role if role == "operator"
                              else self._admin_config.approver_role)
        return principal

    async def _admin_principal(self, headers: Mapping[str, str]) -> AdminPrincipal:
        if self._admin_jwt is None:
            raise _unauthorized("The admin API requires an approver credential; none is configured.")
        claims = await self._admin_jwt.verify(bearer_token(headers))
        subject, tenant, roles, scopes = self._admin_jwt.claims_to_identity(claims)
        if tenant is None and self._admin_config.cross_tenant_role not in roles:
            # No tenant claim would mean "every tenant": only a token that says so explicitly gets that.
            raise ProxyError("forbidden", "This admin token names no tenant and does not carry the cross-tenant "
                             "role; it is refused.", details={"required_role": self._admin_config.cross_tenant_role},
                             phase="identity")
        return AdminPrincipal(subject=subject, tenant=tenant, roles=roles, scopes=scopes,
                              person=_person(claims, self._admin_config.person_claim))

    def _holds(self, principal: AdminPrincipal, role: str) -> bool:
        config = self._admin_config
        if role == "operator":
            return config.operator_role in principal.roles
        return config.approver_role in principal.roles and \
            (not config.approver_scope or config.approver_scope in principal.scopes)


def configuration_problem(config: IdentityConfig) -> str | None:
    """Why this identity configuration cannot authenticate anyone (checked before listening)."""
    if config.mode == "jwt" and not _has_keys(config.jwt):
        # Fail at start-up, not on the first call: a sidecar without keys would refuse everyone.
        return ("identity.mode is jwt (the default) but no key is configured: set identity.jwt.jwks_file, "
                "jwks_url, public_key_file or hmac_secret_file, or choose identity.mode headers/static")
    if config.mode != "static" and not config.agent_id:
        # Every audit record names the agent: a made-up default would put a false name there.
        return (f"identity.agent_id (TOOLPROXY_IDENTITY_AGENT_ID) is empty; with identity.mode {config.mode} it "
                "is required: set it to the agent's identity (in Kubernetes, the pod's service account)")
    if config.mode == "headers" and config.headers.hop_proof is None:
        # Without a proof, whatever connects (in a pod: the agent itself) could name any subject and tenant.
        return ("identity.mode is headers but no proof of the trusted hop is configured: set "
                "identity.headers.proof_secret_file (a secret header the mesh injects) or "
                "identity.headers.xfcc_trusted_proxies and xfcc_proxy_ids (Envoy's X-Forwarded-Client-Cert)")
    return None


def self_approval_warning(agents: IdentityConfig, admins: AdminIdentityConfig) -> str | None:
    """Why the self-approval check cannot tell one person under two accounts (said once at start), or None.
    The check compares the agent token's person claim with the admin token's; when both are ``sub`` and the
    two tokens come from different IdPs, one person's two subjects never compare equal."""
    if admins.mode != "jwt" or admins.person_claim != "sub" or agents.mode == "static":
        return None
    if agents.mode == "jwt":
        if agents.person_claim != "sub" or _idp(agents.jwt) == _idp(admins.jwt):
            return None
        claim = "identity.person_claim"
    else:  # headers: the agent's person is its subject, named by the mesh, not by the admins' IdP
        claim = f"the agent's subject (identity.mode {agents.mode})"
    return (f"self-approval check: {claim} and admin_identity.person_claim are both the subject (`sub`) of two "
            "different IdPs, so one person with an agent account and an approver account can approve their own "
            "request; set identity.person_claim and admin_identity.person_claim to a claim both IdPs carry for a "
            "person (e.g. email)")


def _idp(config: JwtConfig) -> tuple[str, ...]:
    return (config.issuer, config.jwks_file, config.jwks_url, config.public_key_file, config.hmac_secret_file)


def _has_keys(config: JwtConfig) -> bool:
    return bool(config.jwks_file or config.jwks_url or config.public_key_file or config.hmac_secret_file)
