"""OAuth 2.1 access tokens for MCP upstreams, as the MCP authorization spec has them.

Owns: one ``TokenSource`` per upstream and principal (the proxy's own client, or one user's grant):
the access token it holds, cached until shortly before it expires and renewed single-flight (one
renewal at a time however many calls wait, bounded in time, shared by every call), and the
renewal itself, which is the ``mcp`` SDK's own OAuth client flow (``mcp.client.auth``: protected
resource metadata from the upstream's ``401 WWW-Authenticate`` or its well-known URLs, RFC 9728;
authorization server metadata, RFC 8414; the ``resource`` parameter, RFC 8707; scope step-up on
``403 insufficient_scope``; client credentials with ``client_secret_basic``,
``client_secret_post`` or ``private_key_jwt``; refresh tokens) driven here over a client of our own
whose every answer is bounded in bytes and time. ``UpstreamBearer`` attaches the token to an MCP
session's requests and renews it once when the upstream challenges it.

Must never: put a client secret, private key, assertion, access or refresh token into a log line,
an exception message, an error's details or a repr (the settings holding them are ``repr=False``;
errors carry a fixed ``reason`` word); send the client's credentials to an authorization server
other than the configured issuer's (the SDK refuses metadata of another issuer); accept protected
resource metadata whose ``resource`` is not the upstream (``resource_mismatch``); follow a
redirect off an authorization server's origin; retry a renewal in a loop (one renewal per
challenge, one retry of the challenged request).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Awaitable, Callable, Mapping

import httpx2
from mcp.client.auth import OAuthClientProvider, OAuthFlowError, OAuthRegistrationError, OAuthTokenError
from mcp.client.auth.extensions.client_credentials import (ClientCredentialsOAuthProvider, PrivateKeyJWTOAuthProvider,
                                                           SignedJWTParameters)
from mcp.client.auth.utils import extract_field_from_www_auth
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken, ProtectedResourceMetadata
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types import LATEST_PROTOCOL_VERSION

from ..errors import ProxyError

log = logging.getLogger("toolproxy.credentials.mcp_oauth")
# The SDK logs a failed flow with ``logger.exception``: its message quotes the token endpoint's error body,
# which is the authorization server's text and may echo what was sent. Failures are reported here, by reason.
logging.getLogger("mcp.client.auth").setLevel(logging.CRITICAL + 1)  # its modules' loggers inherit the level

GRANTS = ("client_credentials", "authorization_code")
AUTH_METHODS = ("client_secret_basic", "client_secret_post", "private_key_jwt", "none")
_PROBE = b'{"jsonrpc":"2.0","id":"toolproxy-authorization-probe","method":"ping"}'
_DROPPED_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})


@dataclass(frozen=True)
class OAuthClientSpec:
    """An MCP upstream's OAuth client as configured; the secrets are read from their files at start-up."""

    grant: str
    client_id: str
    auth_method: str
    issuer: str | None
    scope: str | None = None
    client_secret: str | None = field(default=None, repr=False)
    private_key_pem: str | None = field(default=None, repr=False)
    signing_algorithm: str = "RS256"
    redirect_uri: str | None = None  # authorization_code: the console's callback


@dataclass(frozen=True)
class Bounds:
    """How far the proxy lets an authorization server (and the upstream's discovery answers) go."""

    timeout_s: float = 10.0        # one renewal, start to end (every request of the flow)
    max_answer_bytes: int = 256 * 1024  # one answer's body (metadata, registration, token)
    refresh_before_s: float = 60.0  # a token is renewed this long before it expires (at most half its life)


def failure(reason: str, message: str, *, upstream: str | None, retryable: bool = True) -> ProxyError:
    """The one error of a credential that could not be had (``credential_unavailable``): nothing was sent to the
    upstream. ``upstream`` is the credential's name; ``reason`` a fixed word, never the server's text."""
    details: dict[str, Any] = {"reason": reason}
    if upstream:
        details["credential"] = upstream
    return ProxyError("credential_unavailable", message, details=details, phase="execute", attempted=False,
                      committed=False, retryable=retryable, resolution="retry_same_key" if retryable else "stop")


class GrantRequired(Exception):
    """The flow reached the point where a person must authorize: a call cannot, it asks the user to connect."""


class ResourceMismatch(Exception):
    """Protected resource metadata names another resource than the upstream (RFC 9728 section 3.3)."""


class _AnswerTooLarge(Exception):
    pass


class _EncodedAnswer(Exception):
    pass


def _mismatch_checked(cls: type[OAuthClientProvider]) -> type[OAuthClientProvider]:
    """``cls`` whose resource check raises ``ResourceMismatch`` (a reason of its own) instead of a flow error."""

    class Checked(cls):  # type: ignore[valid-type,misc]
        async def _validate_resource_match(self, prm: ProtectedResourceMetadata) -> None:
            try:
                await super()._validate_resource_match(prm)
            except OAuthFlowError:
                raise ResourceMismatch() from None

    Checked.__name__ = Checked.__qualname__ = f"Checked{cls.__name__}"
    return Checked


_ClientCredentials = _mismatch_checked(ClientCredentialsOAuthProvider)
_PrivateKeyJwt = _mismatch_checked(PrivateKeyJWTOAuthProvider)
_AuthorizationCode = _mismatch_checked(OAuthClientProvider)


def authorization_code_class() -> type[OAuthClientProvider]:
    """The SDK's authorization-code provider (PKCE, ``resource``, dynamic registration), resource-checked."""
    return _AuthorizationCode


class MemoryStorage:
    """The SDK's ``TokenStorage`` in this process's memory (the proxy's own client: nothing to keep)."""

    def __init__(self) -> None:
        self._tokens: OAuthToken | None = None
        self._client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self._tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self._tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self._client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self._client = client_info


def client_credentials_provider(url: str, spec: OAuthClientSpec, storage: Any) -> OAuthClientProvider:
    """The SDK provider of an unattended client (grant ``client_credentials``)."""
    if spec.auth_method == "private_key_jwt":
        assertion = SignedJWTParameters(issuer=spec.client_id, subject=spec.client_id,
                                        signing_key=spec.private_key_pem or "",
                                        signing_algorithm=spec.signing_algorithm).create_assertion_provider()
        return _PrivateKeyJwt(server_url=url, storage=storage, client_id=spec.client_id,
                              assertion_provider=assertion, scope=spec.scope, issuer=spec.issuer)
    return _ClientCredentials(server_url=url, storage=storage, client_id=spec.client_id,
                              client_secret=spec.client_secret or "", token_endpoint_auth_method=spec.auth_method,
                              scope=spec.scope, issuer=spec.issuer)


class AuthHttp:
    """The client the flows talk through: no redirects followed, no content coding (an encoded answer is refused,
    never inflated), every answer read whole up to a byte limit (the flow's time is bounded by
    ``Bounds.timeout_s`` around it). One per credential."""

    def __init__(self, bounds: Bounds, connect_timeout_s: float) -> None:
        self.bounds = bounds
        self._client = httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(retries=0), follow_redirects=False,
                                          timeout=httpx2.Timeout(bounds.timeout_s, connect=connect_timeout_s))

    async def send(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = "identity"
        response = await self._client.send(request, stream=True)
        try:
            if response.headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity"):
                raise _EncodedAnswer()  # never decoded: a small compressed body inflates past any count of it
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > self.bounds.max_answer_bytes:
                    raise _AnswerTooLarge()
        finally:
            await response.aclose()
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _DROPPED_HEADERS]
        return httpx2.Response(response.status_code, headers=headers, content=bytes(body), request=request)

    async def aclose(self) -> None:
        await self._client.aclose()


def is_challenge(response: httpx2.Response) -> bool:
    """A 401, or a 403 asking for more scope: the upstream did not run the request and says how to authorize."""
    if response.status_code == 401:
        return True
    return response.status_code == 403 and extract_field_from_www_auth(response, "error") == "insufficient_scope"


def _challenge_copy(response: httpx2.Response) -> httpx2.Response:
    """What of a challenge the flow reads (its status and ``WWW-Authenticate``), detached from its connection."""
    headers = [("WWW-Authenticate", v) for v in response.headers.get_list("WWW-Authenticate")]
    return httpx2.Response(response.status_code, headers=headers, request=response.request)


class TokenSource:
    """The access token of one upstream for one principal, renewed single-flight by the SDK's flow.

    ``current()`` is the hot path: the cached token while it is good (no await). ``token()`` renews
    when there is none; ``challenged()`` when the upstream refused the token it was sent.
    """

    def __init__(self, url: str, provider: OAuthClientProvider, http: AuthHttp, *, upstream: str | None,
                 on_grant_required: Callable[[httpx2.Response | None], Awaitable[ProxyError]] | None = None,
                 on_result: Callable[[str], None] | None = None) -> None:
        self.url = url
        self._on_result = on_result  # told of each renewal: ``issued`` or the reason it failed (a metric)
        self._on_grant_required = on_grant_required  # per-user grants: what a call gets when a person must act
        self.upstream = upstream
        self._provider = provider
        self._http = http
        self._token: str | None = None
        self._good_until = 0.0
        self._challenge: httpx2.Response | None = None  # the last one: renewing without a refresh token
        self._flight: asyncio.Task[str] | None = None
        self.last_challenge: httpx2.Response | None = None  # of the flow that ran last (a step-up's, for one)
        self.renewals = 0
        self.protocol_version: str | None = None

    @property
    def per_user(self) -> bool:
        """One user's grant (not the proxy's own client)."""
        return self._on_grant_required is not None

    def current(self) -> str | None:
        if self._token is not None and time.monotonic() < self._good_until:
            return self._token
        return None

    def invalidate(self, token: str | None) -> None:
        """The upstream refused ``token``: the next call renews (unless it was already replaced)."""
        if token is not None and token == self._token:
            self._good_until = 0.0

    async def token(self) -> str:
        return self.current() or await self._renew(None, self._token)

    async def challenged(self, response: httpx2.Response, sent_with: str | None) -> str:
        """A token for the retry of a request the upstream challenged (it carried ``sent_with``)."""
        if sent_with is not None and self._token not in (None, sent_with) and self.current():
            return self._token  # another call renewed it meanwhile
        self.invalidate(sent_with)
        return await self._renew(_challenge_copy(response), sent_with)

    async def _renew(self, challenge: httpx2.Response | None, stale: str | None) -> str:
        if self._flight is None or self._flight.done():
            # A context of its own, and shielded: one caller's deadline must not cancel what others wait on.
            self._flight = asyncio.get_running_loop().create_task(self._run(challenge, stale),
                                                                  context=contextvars.Context())
            self._flight.add_done_callback(_retrieve)
        return await asyncio.shield(self._flight)

    async def connect(self, challenge: httpx2.Response | None = None) -> None:
        """Run the whole flow as a person's connection does (authorization whatever is held); the provider's
        handlers take the person through it. Unbounded here: the caller bounds it."""
        try:
            await self._flow(challenge, self._token, connecting=True)
        except ProxyError:
            raise
        except BaseException as exc:
            raise self._classified(exc) from None

    async def _run(self, challenge: httpx2.Response | None, stale: str | None) -> str:
        try:
            async with asyncio.timeout(self._http.bounds.timeout_s):
                return await self._flow(challenge, stale)
        except GrantRequired:
            if self._on_grant_required is None:
                raise self._failed("grant_required") from None
            self._report("grant_required")
            raise await self._on_grant_required(self.last_challenge) from None
        except ProxyError:
            raise
        except Exception as exc:
            raise self._classified(exc) from None

    def _classified(self, exc: BaseException) -> ProxyError:
        """A failed flow as one reason (never the exception's text: it may quote the server's answer)."""
        try:
            raise exc
        except TimeoutError:
            return self._failed("timeout", retryable=True)
        except ResourceMismatch:
            return self._failed("resource_mismatch")
        except _AnswerTooLarge:
            return self._failed("answer_too_large")
        except _EncodedAnswer:
            return self._failed("invalid_answer")
        except GrantRequired:
            return self._failed("grant_required")
        except (OAuthRegistrationError, OAuthTokenError):
            return self._failed("refused")
        except (httpx2.HTTPError, OSError):
            return self._failed("unreachable", retryable=True)
        except BaseException:  # a flow error, the SDK's metadata models, an unusable key: never its text
            return self._failed("invalid_answer")

    async def _flow(self, challenge: httpx2.Response | None, stale: str | None, *, connecting: bool = False) -> str:
        context = self._provider.context
        if context.current_tokens is not None:
            context.token_expiry_time = 1.0  # renewing: past the SDK's own idea of the token's life
        if challenge is None:
            challenge = self._challenge or await self._probe()
        self.last_challenge = challenge
        version = self.protocol_version or LATEST_PROTOCOL_VERSION
        request = httpx2.Request("POST", self.url, headers={MCP_PROTOCOL_VERSION_HEADER: version})
        flow = self._provider.async_auth_flow(request)
        seen = 0
        try:
            outgoing = await flow.__anext__()
            while True:
                if outgoing is request:  # the flow's turn to send the request it authorizes
                    seen += 1
                    if seen == 1 and (connecting or not self._fresh(stale)):
                        outgoing = await flow.asend(challenge)
                        continue
                    break
                outgoing = await flow.asend(await self._http.send(outgoing))
        except StopAsyncIteration:
            pass
        finally:
            await flow.aclose()
        if not self._fresh(stale):
            raise self._failed("no_token")
        tokens = context.current_tokens
        assert tokens is not None
        self._challenge = challenge
        self._token = tokens.access_token
        self._good_until = time.monotonic() + self._lifetime(tokens.expires_in)
        self.renewals += 1
        self._report("issued")
        return tokens.access_token

    def _report(self, result: str) -> None:
        if self._on_result is not None:
            self._on_result(result)

    def _fresh(self, stale: str | None) -> bool:
        context = self._provider.context
        tokens = context.current_tokens
        return bool(tokens and tokens.access_token and tokens.access_token != stale and context.is_token_valid())

    def _lifetime(self, expires_in: int | None) -> float:
        if expires_in is None:
            return math.inf  # until the upstream refuses it
        return max(0.0, expires_in - min(self._http.bounds.refresh_before_s, expires_in / 2))

    async def _probe(self) -> httpx2.Response:
        """An unauthenticated request, for the upstream's challenge (its ``WWW-Authenticate`` names its metadata).
        Anything else than a challenge: discovery goes to the well-known URLs."""
        request = httpx2.Request("POST", self.url, content=_PROBE, headers={
            "Content-Type": "application/json", "Accept": "application/json, text/event-stream"})
        response = await self._http.send(request)
        if is_challenge(response):
            return _challenge_copy(response)
        return httpx2.Response(401, request=request)

    def _failed(self, reason: str, *, retryable: bool = False) -> ProxyError:
        """Failures that a retry of the same call would meet again (a refused client, a resource that is not
        the upstream's) say ``stop``; an authorization server away or slow says retry with the same key."""
        log.warning("MCP upstream authorization failed", extra={"upstream": self.upstream, "reason": reason})
        self._report(reason)
        return failure(reason, "The proxy could not obtain an access token for the tool's MCP server.",
                       upstream=self.upstream, retryable=retryable)


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved even when every waiter gave up


class UpstreamBearer(httpx2.Auth):
    """Attaches a ``TokenSource``'s token to every request of an MCP session; on a challenge renews it and
    sends the request once more (a challenged request did not run). A renewal that fails is handed to
    ``on_failure`` and the challenge is returned as the answer."""

    def __init__(self, source: TokenSource, on_failure: Callable[[ProxyError], None]) -> None:
        self._source = source
        self._on_failure = on_failure

    async def async_auth_flow(self, request: httpx2.Request) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        version = request.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if version:
            self._source.protocol_version = version
        sent_with = self._source.current()
        if sent_with is None:
            try:
                sent_with = await self._source.token()
            except ProxyError as exc:
                self._on_failure(exc)
        if sent_with is not None:
            request.headers["Authorization"] = f"Bearer {sent_with}"
        response = yield request
        if not is_challenge(response):
            return
        try:
            token = await self._source.challenged(response, sent_with)
        except ProxyError as exc:
            self._on_failure(exc)
            return
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


def sources_by_upstream(specs: Mapping[str, tuple[str, OAuthClientSpec]], http: AuthHttp) -> dict[str, TokenSource]:
    """The unattended sources: upstream name -> source (``specs``: name -> (URL, client))."""
    return {name: TokenSource(url, client_credentials_provider(url, spec, MemoryStorage()), http, upstream=name)
            for name, (url, spec) in specs.items() if spec.grant == "client_credentials"}
