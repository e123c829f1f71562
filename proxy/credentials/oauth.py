"""OAuth credentials: client credentials (RFC 6749 section 4.4) and token exchange on behalf of the caller
(RFC 8693).

Owns: the grant each kind asks its token endpoint for, and the key its token is kept under: one token per
credential (and audience) for client credentials, shared by every call of the process; one per tenant, subject,
audience and scope for token exchange, whose subject token is the caller's verified identity token and whose
actor token, where configured, is the proxy's own (client credentials of the same client). Must never: exchange a
token for a caller without one (identity modes other than jwt are refused at load), key a caller's token by
anything another caller could share, or log either token.
"""

from __future__ import annotations

import ssl
from typing import Awaitable, Callable

import aiohttp

from ..config import CredentialConfig
from . import Headers, OnBehalfOf, unavailable
from .cache import TokenCache
from .token_endpoint import Token, TokenEndpoint

TOKEN_EXCHANGE_GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"


class _OAuthCredential:
    def __init__(self, name: str, config: CredentialConfig, endpoint: TokenEndpoint,
                 tls: ssl.SSLContext | None) -> None:
        self.name = name
        self.kind = config.kind
        self.tls = tls
        self._config = config
        self._endpoint = endpoint
        self._cache = TokenCache(refresh_before_s=config.refresh_before_s,
                                 max_entries=config.max_cached if config.kind == "token_exchange" else 64)

    def _common(self, form: dict[str, str], audience: str | None) -> dict[str, str]:
        if self._config.scope:
            form["scope"] = self._config.scope
        if audience:
            form["audience"] = audience
        if self._config.resource:
            form["resource"] = self._config.resource
        return form

    async def _own_token(self, wait_s: float) -> str:
        """The proxy's own access token (client credentials), shared by every call."""
        form = self._common({"grant_type": "client_credentials"}, self._config.audience if self.kind ==
                            "client_credentials" else None)
        return await self._wait(("own",), lambda: self._endpoint.request(form), wait_s)

    async def _wait(self, key: tuple[str, ...], fetch: Callable[[], Awaitable[Token]], wait_s: float) -> str:
        try:
            return await self._cache.get(key, fetch, wait_s)
        except TimeoutError:
            raise unavailable(self.name, "timeout") from None

    async def aclose(self) -> None:
        await self._cache.aclose()


class ClientCredentials(_OAuthCredential):
    async def headers(self, audience: str, caller: OnBehalfOf, wait_s: float) -> Headers:
        return (("Authorization", "Bearer " + await self._own_token(wait_s)),)


class TokenExchange(_OAuthCredential):
    async def headers(self, audience: str, caller: OnBehalfOf, wait_s: float) -> Headers:
        if not caller.token:
            raise unavailable(self.name, "no_subject_token")
        audience = self._config.audience or audience
        key = (caller.tenant, caller.subject, audience, self._config.scope)
        token = await self._wait(key, lambda: self._exchange(caller.token, audience), wait_s)
        return (("Authorization", "Bearer " + token),)

    async def _exchange(self, subject_token: str, audience: str) -> Token:
        form = self._common({"grant_type": TOKEN_EXCHANGE_GRANT, "subject_token": subject_token,
                             "subject_token_type": self._config.subject_token_type,
                             "requested_token_type": ACCESS_TOKEN_TYPE}, audience)
        if self._config.actor_token:
            form["actor_token"] = await self._own_token(self._config.timeout_ms / 1000.0)
            form["actor_token_type"] = ACCESS_TOKEN_TYPE
        return await self._endpoint.request(form)


def oauth_credential(name: str, config: CredentialConfig, where: str, session: aiohttp.ClientSession,
                     verify: ssl.SSLContext | bool, tls: ssl.SSLContext | None,
                     on_answer: Callable[[str], None] | None = None) -> _OAuthCredential:
    endpoint = TokenEndpoint(name, config, where, session, verify, on_answer)
    kind = ClientCredentials if config.kind == "client_credentials" else TokenExchange
    return kind(name, config, endpoint, tls)
