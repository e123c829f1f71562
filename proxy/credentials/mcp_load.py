"""The MCP upstream credentials of the config (kinds ``mcp_client_credentials`` and ``mcp_authorization_code``),
built once at start-up, and the one question the MCP adapter asks per call: which token source its upstream
request uses.

Owns: reading the secret files (client secret, private key, grant key) into the clients' settings, one token
source per unattended credential and upstream URL (built when the first call needs it, shared by every call),
the per-user grants (``mcp_grants.UserGrants``) of the ``mcp_authorization_code`` credentials, and closing what
they opened. Must never: import the MCP SDK when no MCP credential is configured (``runtime`` imports this module
only then), or hand a call a source of another user.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from ..config import ConfigError
from .mcp_grants import GrantStore, Sealer, UserGrants, UserUpstream, read_grant_key
from .mcp_oauth import (AuthHttp, Bounds, MemoryStorage, OAuthClientSpec, TokenSource, UpstreamBearer,
                        client_credentials_provider)
from .secrets import read_bytes, read_secret

log = logging.getLogger("toolproxy.credentials.mcp")

MCP_KINDS = ("mcp_client_credentials", "mcp_authorization_code")


class McpCredentials:
    """The process's MCP credentials by name."""

    def __init__(self, unattended: Mapping[str, tuple[OAuthClientSpec, AuthHttp, Any]], grants: UserGrants | None,
                 https: list[AuthHttp]) -> None:
        self._unattended = dict(unattended)
        self._sources: dict[tuple[str, str], TokenSource] = {}
        self.user_grants = grants
        self._https = https

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._unattended) | frozenset(self.user_grants.upstreams if self.user_grants else ())

    def source(self, name: str | None, url: str, tenant: str, subject: str) -> TokenSource | None:
        """The token source a call to ``url`` through credential ``name`` uses (None: not an MCP credential)."""
        if name is None:
            return None
        entry = self._unattended.get(name)
        if entry is not None:
            source = self._sources.get((name, url))
            if source is None:
                spec, http, report = entry
                source = self._sources[(name, url)] = TokenSource(
                    url, client_credentials_provider(url, spec, MemoryStorage()), http, upstream=name,
                    on_result=report)
            return source
        if self.user_grants is not None and name in self.user_grants.upstreams:
            return self.user_grants.source(name, tenant, subject)
        return None

    def pin_auth(self, url: str, contracts: Sequence[Any]) -> Any:
        """The access token of an unattended credential for the pin checks of ``url`` (None: the upstream's pinned
        tools name no such credential; a per-user grant cannot serve a check, which runs for no one)."""
        names = {contract.backend.auth for contract in contracts} & set(self._unattended)
        if not names:
            return None
        source = self.source(sorted(names)[0], url, "", "")
        assert source is not None
        return UpstreamBearer(source, lambda failure: log.info("MCP pin check: no access token", extra={
            "credential": source.upstream, "reason": (failure.details or {}).get("reason")}))

    async def aclose(self) -> None:
        if self.user_grants is not None:
            await self.user_grants.aclose()
        for http in self._https:
            await http.aclose()


def _spec(config: Any, where: str) -> OAuthClientSpec:
    grant = "client_credentials" if config.kind == "mcp_client_credentials" else "authorization_code"
    secret = key = None
    if config.client_auth == "private_key_jwt":
        key = read_bytes(config.private_key_file, f"{where}.private_key_file").decode("utf-8", "replace")
    elif config.client_auth != "none" and config.client_id:
        secret = read_secret(config.client_secret_file, f"{where}.client_secret_file")
    return OAuthClientSpec(grant=grant, client_id=config.client_id, auth_method=config.client_auth,
                           issuer=config.issuer or None, scope=config.scope or None, client_secret=secret,
                           private_key_pem=key, signing_algorithm=config.private_key_alg,
                           redirect_uri=config.redirect_uri or None)


def load_mcp_credentials(configs: Mapping[str, Any], *, redis: Any, key_prefix: str, connect_timeout_s: float,
                         on_answer: Callable[[str, str, str], None] | None = None) -> McpCredentials:
    """Every ``mcp_*`` credential of the config; a file that cannot be used stops start-up with one line.
    ``on_answer(name, kind, result)`` is told of each token renewal (``issued`` or the reason it failed)."""
    unattended: dict[str, tuple[OAuthClientSpec, AuthHttp, Any]] = {}
    upstreams: dict[str, UserUpstream] = {}
    sealers: dict[str, Sealer] = {}
    https: list[AuthHttp] = []
    max_sources = 0
    for name, config in configs.items():
        if config.kind not in MCP_KINDS:
            continue
        where = f"credentials.{name}"
        spec = _spec(config, where)
        http = AuthHttp(Bounds(timeout_s=config.timeout_ms / 1000.0, max_answer_bytes=config.max_answer_bytes,
                               refresh_before_s=float(config.refresh_before_s)), connect_timeout_s)
        https.append(http)
        report = (lambda result, n=name, k=config.kind: on_answer(n, k, result)) if on_answer else None
        if spec.grant == "client_credentials":
            unattended[name] = (spec, http, report)
            continue
        try:
            sealers[name] = Sealer(read_grant_key(read_secret(config.grant_key_file, f"{where}.grant_key_file")))
        except ValueError as exc:
            raise ConfigError(f"{where}.grant_key_file: {config.grant_key_file} is not a grant key ({exc}); "
                              "write 32 random bytes as base64 into it (openssl rand -base64 32)") from None
        upstreams[name] = UserUpstream(name=name, url=config.resource, spec=spec, http=http, report=report)
        max_sources = max(max_sources, config.max_cached)
    grants = None
    if upstreams:
        grants = UserGrants(upstreams, GrantStore(redis, key_prefix, sealers), max_sources=max_sources or 10000)
    return McpCredentials(unattended, grants, https)
