"""Per-user grants to MCP upstreams (OAuth authorization code with PKCE), connected in the console.

Owns: the grant of one user (tenant and subject, as the calls carry them) to one upstream credential: the client
the authorization server registered for it (or the pre-registered one) and the user's tokens, sealed with
AES-GCM under the grant key (a Secret file) with the tenant, subject and credential as associated data (a record
moved to another user's key does not open), kept in Redis under a key that names the subject only by hash; the
SDK's ``TokenStorage`` over that record; the token sources of the users who call (least recently used dropped
past a bound); and the pending connections: a user starts one in the console, the SDK's flow (discovery, dynamic
registration where no client is configured, PKCE, ``resource``, the scope it selects) gives the authorization
URL the browser is sent to, and the browser's return with ``code`` and ``state`` finishes it (bounded in number
and time; ``state`` is the SDK's own, compared in constant time).

Must never: keep a token in clear anywhere but this process's memory; hand the agent a login URL (a call without
a usable grant fails with ``user_grant_required``, resolution ``ask_user``, which names the credential and
nothing else); keep a grant the authorization server no longer honours (a refused refresh or a revoked grant
drops it: the same code follows); let one user's connection finish another's (the pending flow is found by
``state``, was started by its user, and only the browser that started it, holding its nonce, finishes it).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextvars
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

import httpx2
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthClientMetadata, OAuthToken

from ..errors import ProxyError
from ..store import Client as RedisClient, key as store_key, redis_call, unavailable_on_fault
from .mcp_oauth import AuthHttp, GrantRequired, OAuthClientSpec, TokenSource, authorization_code_class, failure

log = logging.getLogger("toolproxy.credentials.mcp_grants")

GRANT_KEY_BYTES = 32  # AES-256-GCM


def grant_required(credential: str) -> ProxyError:
    """The stable answer to a call that needs a grant the user has not given (or that was revoked)."""
    return ProxyError("user_grant_required", "This tool acts with the user's own account at its service, and the "
                      "user has not connected it (or the connection was revoked or expired). Ask the user to "
                      "connect it in the toolproxy console, then call again.",
                      details={"credential": credential}, phase="execute", attempted=False, committed=False)


class Sealer:
    """AES-GCM with a 96-bit random nonce per record; the associated data binds a record to its owner."""

    def __init__(self, key: bytes) -> None:
        if len(key) != GRANT_KEY_BYTES:
            raise ValueError(f"a grant key is {GRANT_KEY_BYTES} bytes")
        self._aead = AESGCM(key)

    def seal(self, record: dict[str, Any], owner: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, json.dumps(record, separators=(",", ":")).encode(), owner)

    def open(self, blob: bytes, owner: bytes) -> dict[str, Any] | None:
        """The record, or None when it was not sealed for this owner with this key (or was altered)."""
        try:
            value = json.loads(self._aead.decrypt(blob[:12], blob[12:], owner))
        except (InvalidTag, ValueError):
            return None
        return value if isinstance(value, dict) else None


def read_grant_key(text: str) -> bytes:
    """A grant key file holds 32 random bytes as base64 (``openssl rand -base64 32``)."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except ValueError:
        raise ValueError("not base64") from None
    if len(key) != GRANT_KEY_BYTES:
        raise ValueError(f"{len(key)} bytes, expected {GRANT_KEY_BYTES}")
    return key


@dataclass(frozen=True)
class Owner:
    tenant: str
    subject: str
    credential: str

    @property
    def associated_data(self) -> bytes:
        return json.dumps([self.tenant, self.subject, self.credential]).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.associated_data).hexdigest()


class GrantStore:
    """Sealed grant records in Redis: ``<prefix>:grant:{<tenant>}:<sha256(tenant, subject, credential)>``."""

    def __init__(self, redis: RedisClient, prefix: str, sealers: dict[str, Sealer]) -> None:
        self._redis = redis
        self._prefix = prefix
        self._sealers = sealers  # credential name -> its sealer

    def _key(self, owner: Owner) -> str:
        return store_key(self._prefix, "grant", owner.tenant, owner.digest)

    async def get(self, owner: Owner) -> dict[str, Any] | None:
        with unavailable_on_fault("The user's connection to the tool's service could not be read.",
                                  phase="execute"):
            blob = await redis_call(self._redis.get(self._key(owner)))
        if blob is None:
            return None
        return self._sealers[owner.credential].open(bytes(blob), owner.associated_data)

    async def put(self, owner: Owner, record: dict[str, Any]) -> None:
        blob = self._sealers[owner.credential].seal(record, owner.associated_data)
        with unavailable_on_fault("The user's connection to the tool's service could not be saved.",
                                  phase="execute"):
            await redis_call(self._redis.set(self._key(owner), blob))

    async def drop(self, owner: Owner) -> bool:
        with unavailable_on_fault("The user's connection to the tool's service could not be removed.",
                                  phase="execute"):
            return bool(await redis_call(self._redis.delete(self._key(owner))))


class UserStorage:
    """The SDK's ``TokenStorage`` of one user's grant: the sealed record, read once and written through."""

    def __init__(self, store: GrantStore, owner: Owner, preregistered: OAuthClientInformationFull | None) -> None:
        self.store = store
        self._owner = owner
        self._preregistered = preregistered
        self._record: dict[str, Any] | None = None
        self.had_tokens = False

    async def _load(self) -> dict[str, Any]:
        if self._record is None:
            self._record = await self.store.get(self._owner) or {}
            self.had_tokens = "tokens" in self._record
        return self._record

    async def get_tokens(self) -> OAuthToken | None:
        record = await self._load()
        return OAuthToken.model_validate(record["tokens"]) if "tokens" in record else None

    async def set_tokens(self, tokens: OAuthToken) -> None:
        record = await self._load()
        record["tokens"] = tokens.model_dump(mode="json", exclude_none=True)
        await self.store.put(self._owner, record)

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        record = await self._load()
        if "client" in record:
            return OAuthClientInformationFull.model_validate(record["client"])
        return self._preregistered

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        record = await self._load()
        if self._preregistered is None:  # a configured client's secret stays in its file, never in Redis
            record["client"] = client_info.model_dump(mode="json", exclude_none=True)

    async def forget(self) -> None:
        self._record = {}
        await self.store.drop(self._owner)


def _preregistered(spec: OAuthClientSpec) -> OAuthClientInformationFull | None:
    if not spec.client_id:
        return None  # dynamic client registration at the authorization server
    return OAuthClientInformationFull(client_id=spec.client_id, client_secret=spec.client_secret,
                                      token_endpoint_auth_method=spec.auth_method,  # type: ignore[arg-type]
                                      redirect_uris=[spec.redirect_uri] if spec.redirect_uri else None,
                                      grant_types=["authorization_code", "refresh_token"], issuer=spec.issuer)


def _client_metadata(spec: OAuthClientSpec) -> OAuthClientMetadata:
    return OAuthClientMetadata(redirect_uris=[spec.redirect_uri] if spec.redirect_uri else None,
                               client_name="toolproxy", grant_types=["authorization_code", "refresh_token"],
                               response_types=["code"], scope=spec.scope,
                               token_endpoint_auth_method=spec.auth_method if spec.client_id else None)


async def _never(*_: Any) -> Any:
    raise GrantRequired()  # a call cannot send a person anywhere: it asks the user to connect


def _digest(nonce: str) -> bytes:
    return hashlib.sha256(nonce.encode()).digest()


def _not_finished(reason: str) -> ProxyError:
    return ProxyError("invalid_request", "This connection cannot be finished here; start it again from the "
                      "connections page.", details={"reason": reason}, phase="execute")


@dataclass(frozen=True)
class UserUpstream:
    """A credential whose calls use each user's own grant: its upstream and its client."""

    name: str
    url: str
    spec: OAuthClientSpec
    http: AuthHttp  # its authorization server's client, with the credential's bounds
    report: Callable[[str], None] | None = None  # each renewal's result (``issued`` or why not): a metric


class _Pending:
    def __init__(self, owner: Owner, task: asyncio.Task[None], code: asyncio.Future[AuthorizationCodeResult],
                 started: float, browser: bytes) -> None:
        self.owner, self.task, self.code, self.started = owner, task, code, started
        self.browser = browser  # sha256 of the nonce the starting browser holds (its connection cookie)


class UserGrants:
    """Every per-user credential of the process: the sources calls use, and the connections the console makes."""

    def __init__(self, upstreams: dict[str, UserUpstream], store: GrantStore, *,
                 max_sources: int = 10000, max_pending: int = 1000, connect_window_s: float = 600.0) -> None:
        self.upstreams = upstreams
        self.store = store
        self._sources: collections.OrderedDict[Owner, TokenSource] = collections.OrderedDict()
        self._max_sources = max_sources
        self._pending: dict[str, _Pending] = {}
        self._wanted: dict[Owner, httpx2.Response] = {}  # a step-up challenge the next connection answers
        self._max_pending = max_pending
        self._window_s = connect_window_s

    def source(self, credential: str, tenant: str, subject: str) -> TokenSource:
        """The token source of one user's calls through ``credential`` (loaded from the grant when first asked)."""
        owner = Owner(tenant, subject, credential)
        source = self._sources.get(owner)
        if source is None:
            source = self._sources[owner] = self._new_source(owner)
            while len(self._sources) > self._max_sources:
                self._sources.popitem(last=False)
        self._sources.move_to_end(owner)
        return source

    def _new_source(self, owner: Owner) -> TokenSource:
        upstream = self.upstreams[owner.credential]
        storage = UserStorage(self.store, owner, _preregistered(upstream.spec))
        provider = authorization_code_class()(server_url=upstream.url, client_metadata=_client_metadata(upstream.spec),
                                              storage=storage, redirect_handler=_never, callback_handler=_never)
        return TokenSource(upstream.url, provider, upstream.http, upstream=owner.credential,
                           on_grant_required=lambda challenge: self._drop(owner, storage, challenge),
                           on_result=upstream.report)

    async def _drop(self, owner: Owner, storage: UserStorage, challenge: httpx2.Response | None) -> ProxyError:
        """A call reached the point where the user must authorize: a grant it held is no longer honoured (or
        asks for less scope than the upstream wants: the next connection asks for what it challenged)."""
        self._sources.pop(owner, None)
        log.info("a user's grant is needed", extra={"credential": owner.credential, "tenant": owner.tenant,
                                                     "held": storage.had_tokens})
        if challenge is not None and challenge.status_code == 403:
            self._wanted[owner] = challenge
        if storage.had_tokens:
            await storage.forget()
        return grant_required(owner.credential)

    def forget_sources(self) -> None:
        """Drop every cached source: the next call of each user reads the grant from Redis again."""
        self._sources.clear()

    async def connected(self, credential: str, tenant: str, subject: str) -> bool:
        record = await self.store.get(Owner(tenant, subject, credential))
        return bool(record and "tokens" in record)

    async def disconnect(self, credential: str, tenant: str, subject: str) -> bool:
        owner = Owner(tenant, subject, credential)
        self._sources.pop(owner, None)
        return await self.store.drop(owner)

    async def start(self, credential: str, tenant: str, subject: str, browser: str) -> str:
        """Begin a connection: the authorization URL the user's browser goes to (PKCE, ``state``, ``resource``).
        ``browser`` is a nonce the starting browser keeps (a cookie): only that browser's return finishes it, so
        nobody can have another person's account connected to their own identity by sending them the URL."""
        self._expire()
        owner = Owner(tenant, subject, credential)
        for state, pending in list(self._pending.items()):  # one pending connection per user and credential
            if pending.owner == owner:
                pending.task.cancel()
                del self._pending[state]
        if len(self._pending) >= self._max_pending:
            raise ProxyError("rate_limited", "Too many connections are waiting for their users; try again shortly.",
                             phase="execute", retryable=True)
        upstream = self.upstreams[credential]
        loop = asyncio.get_running_loop()
        url: asyncio.Future[str] = loop.create_future()
        code: asyncio.Future[AuthorizationCodeResult] = loop.create_future()

        async def redirect(authorization_url: str) -> None:
            url.set_result(authorization_url)

        async def callback() -> AuthorizationCodeResult:
            return await code

        storage = UserStorage(self.store, owner, _preregistered(upstream.spec))
        provider = authorization_code_class()(server_url=upstream.url, client_metadata=_client_metadata(upstream.spec),
                                              storage=storage, redirect_handler=redirect, callback_handler=callback)
        source = TokenSource(upstream.url, provider, upstream.http, upstream=credential, on_result=upstream.report)
        task = loop.create_task(self._connect(source, url, self._wanted.pop(owner, None)),
                                context=contextvars.Context())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            async with asyncio.timeout(upstream.http.bounds.timeout_s * 2):
                await asyncio.wait({task, url}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            task.cancel()
            raise failure("timeout", "The tool's service did not answer in time.", upstream=credential,
                          retryable=True) from None
        if not url.done() or url.cancelled():
            task.cancel()
            exc = task.exception() if task.done() and not task.cancelled() else None
            raise exc if isinstance(exc, ProxyError) else failure(
                "invalid_answer", "The connection could not be started.", upstream=credential)
        state = parse_qs(urlsplit(url.result()).query).get("state", [""])[0]
        self._pending[state] = _Pending(owner, task, code, time.monotonic(), _digest(browser))
        return url.result()

    async def _connect(self, source: TokenSource, url: asyncio.Future[str],
                       challenge: httpx2.Response | None) -> None:
        try:
            async with asyncio.timeout(self._window_s):
                await source.connect(challenge)
        finally:
            if not url.done():
                url.cancel()

    async def finish(self, state: str, code: str, iss: str | None, browser: str) -> str:
        """The browser came back: the pending connection of ``state`` exchanges ``code`` and keeps the grant.
        Returns the credential's name."""
        self._expire()
        pending = self._pending.get(state) if state else None
        if pending is None:
            raise _not_finished("unknown_or_expired")
        if not hmac.compare_digest(pending.browser, _digest(browser)):
            raise _not_finished("another_browser")  # left pending: its own browser may still come back
        del self._pending[state]
        pending.code.set_result(AuthorizationCodeResult(code=code, state=state, iss=iss))
        try:
            async with asyncio.timeout(self.upstreams[pending.owner.credential].http.bounds.timeout_s * 2):
                await asyncio.shield(pending.task)
        except TimeoutError:
            pending.task.cancel()
            raise failure("timeout", "The tool's service did not answer in time.",
                          upstream=pending.owner.credential, retryable=True) from None
        self._sources.pop(pending.owner, None)  # the next call reads the new grant
        return pending.owner.credential

    def cancel(self, state: str, browser: str) -> None:
        """The browser came back without a code (the user declined): the pending connection ends."""
        pending = self._pending.get(state)
        if pending is not None and hmac.compare_digest(pending.browser, _digest(browser)):
            del self._pending[state]
            pending.task.cancel()

    def _expire(self) -> None:
        now = time.monotonic()
        for state, pending in list(self._pending.items()):
            if pending.task.done() or now - pending.started > self._window_s:
                pending.task.cancel()
                del self._pending[state]

    async def aclose(self) -> None:
        for pending in self._pending.values():
            pending.task.cancel()
        self._pending.clear()
