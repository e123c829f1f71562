"""Configuration: one typed, frozen object built from a YAML file plus ``TOOLPROXY_*`` env.

Owns: the shape of every setting, its default and its one-line help, and the
rules for overriding a setting from the environment. Must never: read the
environment or files anywhere else in the package, or hold mutable state.

Every leaf setting ``section.key`` can be overridden by the environment
variable ``TOOLPROXY_SECTION_KEY`` (upper case). Lists are comma separated;
mappings are ``name=value`` pairs separated by commas.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import yaml

ENV_PREFIX = "TOOLPROXY_"


class ConfigError(Exception):
    """A configuration file or variable is malformed; the message names it."""


def setting(default: Any, help: str, *, choices: tuple[str, ...] = (), bounds: tuple[int, int] | None = None) -> Any:
    """One setting. ``choices``: the only values allowed (each item, for a list); ``bounds``: the
    inclusive range of a number. Both are checked by the loader, in one place (``_check_allowed``)."""
    metadata = {"help": help, "choices": choices, "bounds": bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
                  "HS256", "HS384", "HS512")


@dataclass(frozen=True)
class ListenerConfig:
    """The settings of ``admin`` and ``ops`` (approver/operator API; metrics and probes)."""

    host: str = setting("127.0.0.1", "address the listener binds to")
    port: int = setting(8787, "TCP port of the listener")


@dataclass(frozen=True)
class AgentListenerConfig(ListenerConfig):
    """The settings of ``listen`` (agent-facing API)."""

    max_body_bytes: int = setting(1024 * 1024, "largest accepted request body (payload_too_large above)")


def _admin_listener() -> ListenerConfig:
    return ListenerConfig(port=8788)


def _ops_listener() -> ListenerConfig:
    return ListenerConfig(port=9464)


@dataclass(frozen=True)
class RegistryConfig:
    """The settings of ``registry`` (tool contracts)."""

    paths: list[str] = setting(["examples/registry"], "registry YAML files or directories of *.yaml")
    reload_interval_ms: int = setting(2000, "how often the registry files are checked for changes and reloaded "
                                            "(0: only on SIGHUP); an invalid new registry is refused as a whole")
    run_pin_ttl_s: int = setting(86400, "lifetime of a run's version pin (X-Run-Id): the run keeps the contract "
                                        "version it first resolved for this long after its first call")

    def __post_init__(self) -> None:
        if self.reload_interval_ms < 0:
            raise ConfigError("registry.reload_interval_ms: must be 0 (off) or a positive number of milliseconds")
        if self.run_pin_ttl_s < 1:
            raise ConfigError("registry.run_pin_ttl_s: must be at least 1 second")


@dataclass(frozen=True)
class BackendsConfig:
    """The settings of ``backends`` (tool backends)."""

    services: dict[str, str] = setting({}, "service name -> base URL for registry backends that say `service:`")
    max_response_bytes: int = setting(4 * 1024 * 1024, "largest backend response accepted (output_invalid above)")
    connect_timeout_ms: int = setting(1000, "cap on TCP connect time to a backend")
    pool_size: int = setting(100, "open connections to backends per HTTP client: the hot path's wire (backend "
                                  "POSTs, stateless MCP calls) and the shared aiohttp session (the rest); past "
                                  "it a request waits (decisions have opa.pool_size)", bounds=(1, 100000))
    pool_per_origin: int = setting(64, "of backends.pool_size, most connections to one backend origin (scheme, "
                                       "host, port), so a slow backend leaves the rest for the others; past it a "
                                       "request to that origin waits", bounds=(1, 100000))
    idle_timeout_ms: int = setting(15000, "a pooled connection idle this long is closed (keep it below the idle "
                                          "timeout of any load balancer or NAT between proxy and backend)",
                                   bounds=(100, 3600000))
    max_header_bytes: int = setting(65536, "largest head (status line and headers) of a backend's or OPA's answer; "
                                           "output_invalid above (policy_unavailable for OPA)",
                                    bounds=(1024, 16 * 1024 * 1024))
    max_headers: int = setting(128, "most header lines in a backend's or OPA's answer; refused like "
                                    "max_header_bytes", bounds=(8, 100000))
    answer_timeout_ms: int = setting(30000, "longest time from the first byte of a backend's or OPA's answer to its "
                                            "last (a peer trickling bytes); the call's own deadline still applies; "
                                            "0: only the deadline. Not for event streams", bounds=(0, 3600000))


CREDENTIAL_KINDS = ("header", "bearer", "basic", "client_credentials", "token_exchange", "tls",
                    "mcp_client_credentials", "mcp_authorization_code")
CLIENT_AUTH_METHODS = ("client_secret_basic", "client_secret_post", "private_key_jwt", "none")
ASSERTION_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512")
TOKEN_TYPE = "urn:ietf:params:oauth:token-type:"
SUBJECT_TOKEN_TYPES = (TOKEN_TYPE + "access_token", TOKEN_TYPE + "jwt", TOKEN_TYPE + "id_token")


@dataclass(frozen=True)
class CredentialConfig:
    """One entry of ``credentials`` (docs/backends.md#credentials): what the proxy attaches to a backend request
    whose contract names it (``backend.auth``). Secrets only as files, read at start-up."""

    kind: str = setting("bearer", "header (secret_file as the value of `header`), bearer (Authorization: Bearer), "
                                  "basic (username + secret_file), client_credentials (OAuth 2.0), token_exchange "
                                  "(RFC 8693, on behalf of the caller), tls (client certificate and CA only); MCP "
                                  "upstreams behind OAuth: mcp_client_credentials (the proxy's own client), "
                                  "mcp_authorization_code (each user's grant, connected in the console)",
                        choices=CREDENTIAL_KINDS)
    header: str = setting("", "kind header: the header that carries the secret (e.g. X-API-Key)")
    secret_file: str = setting("", "header, bearer: file with the secret; basic: file with the password")
    username: str = setting("", "basic: the user name")
    token_url: str = setting("", "client_credentials, token_exchange: the authorization server's token endpoint "
                                 "(https, or http on a loopback address)")
    client_id: str = setting("", "client_credentials, token_exchange: the proxy's client id at the server")
    client_secret_file: str = setting("", "client_secret_basic, client_secret_post: file with the client secret")
    client_auth: str = setting("client_secret_basic", "how the proxy authenticates at the token endpoint (none: a "
                                                      "public client, mcp_authorization_code only)",
                               choices=CLIENT_AUTH_METHODS)
    private_key_file: str = setting("", "private_key_jwt: PEM private key that signs the client assertion")
    private_key_alg: str = setting("RS256", "private_key_jwt: the assertion's algorithm", choices=ASSERTION_ALGORITHMS)
    private_key_id: str = setting("", "private_key_jwt: kid of the assertion's key (empty: none)")
    scope: str = setting("", "client_credentials, token_exchange: space-separated scopes asked for (empty: none)")
    audience: str = setting("", "token_exchange: the audience asked for (empty: the tool's backend service name); "
                                "client_credentials: an `audience` parameter, for servers that want one")
    resource: str = setting("", "client_credentials, token_exchange: an RFC 8707 resource indicator (empty: none); "
                                "mcp_authorization_code: the MCP server's URL the users connect to (the tools naming "
                                "this credential call it)")
    subject_token_type: str = setting(TOKEN_TYPE + "access_token", "token_exchange: the type of the caller's "
                                                                   "verified token sent as subject_token",
                                      choices=SUBJECT_TOKEN_TYPES)
    actor_token: bool = setting(False, "token_exchange: send the proxy's own access token (client credentials of "
                                       "the same client) as actor_token, so the new token names the proxy in `act` "
                                       "(servers that support delegation)")
    refresh_before_s: int = setting(30, "client_credentials, token_exchange: a cached token is replaced this long "
                                        "before it expires", bounds=(0, 3600))
    timeout_ms: int = setting(5000, "longest wait for the token endpoint (the call's own deadline still applies)",
                              bounds=(100, 60000))
    max_answer_bytes: int = setting(65536, "largest token endpoint answer read (refused above)",
                                    bounds=(1024, 1048576))
    max_cached: int = setting(10000, "token_exchange: most exchanged tokens kept (per subject, audience and scope); "
                                     "the least recently used goes first", bounds=(1, 1000000))
    token_ca_file: str = setting("", "client_credentials, token_exchange: CA bundle that verifies the token "
                                     "endpoint (empty: the system's CAs)")
    tls_cert_file: str = setting("", "any kind: client certificate (PEM) presented to the backend (mutual TLS)")
    tls_key_file: str = setting("", "any kind: private key (PEM) of tls_cert_file")
    tls_ca_file: str = setting("", "any kind: CA bundle that verifies the backend (empty: the system's CAs)")
    issuer: str = setting("", "mcp kinds: the issuer identifier of the authorization server the client is "
                              "registered with; its credentials go only to that server's token endpoint, "
                              "whatever server the MCP upstream's metadata names (required with a client_id)")
    redirect_uri: str = setting("", "mcp_authorization_code: where the authorization server sends the user's "
                                    "browser back: the admin listener's /connect/callback as the browser reaches "
                                    "it (registered with the client)")
    grant_key_file: str = setting("", "mcp_authorization_code: file with the 32-byte AES-GCM key (base64) that "
                                      "seals each user's grant in Redis (a Secret; the same file for every replica)")

    def check(self, where: str) -> None:
        """The kind's own needs, one line naming the setting and the fix (the loader calls it per entry)."""
        needs = {"header": ("header", "secret_file"), "bearer": ("secret_file",), "basic": ("username", "secret_file"),
                 "client_credentials": ("token_url", "client_id"), "token_exchange": ("token_url", "client_id"),
                 "tls": (), "mcp_client_credentials": ("client_id", "issuer"),
                 "mcp_authorization_code": ("resource", "redirect_uri", "grant_key_file")}[self.kind]
        for name in needs:
            if not getattr(self, name):
                raise ConfigError(f"{where}.{name}: kind {self.kind} needs it")
        if self.client_auth == "none" and self.kind != "mcp_authorization_code":
            raise ConfigError(f"{where}.client_auth: none (a public client) is for kind mcp_authorization_code only")
        if self.kind in ("client_credentials", "token_exchange"):
            self._check_token_endpoint(where)
        if self.kind.startswith("mcp_"):
            self._check_mcp_client(where)
        self._check_tls(where)
        if self.header and not _header_name(self.header):
            raise ConfigError(f"{where}.header: {self.header!r} is not an HTTP header name")

    def _check_tls(self, where: str) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError(f"{where}.tls_cert_file and tls_key_file go together (mutual TLS needs both)")
        if self.kind == "tls" and not (self.tls_cert_file or self.tls_ca_file):
            raise ConfigError(f"{where}: kind tls needs tls_cert_file and tls_key_file, or tls_ca_file")

    def _check_token_endpoint(self, where: str) -> None:
        parts = urllib.parse.urlsplit(self.token_url)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ConfigError(f"{where}.token_url: {self.token_url!r} is not an http(s) URL")
        if parts.scheme == "http" and not _loopback(parts.hostname):
            raise ConfigError(f"{where}.token_url: plain http sends the client's secret in clear; use https "
                              "(http only on a loopback address)")
        if self.client_auth == "private_key_jwt" and not self.private_key_file:
            raise ConfigError(f"{where}.private_key_file: client_auth private_key_jwt needs it")
        if self.client_auth != "private_key_jwt" and not self.client_secret_file:
            raise ConfigError(f"{where}.client_secret_file: client_auth {self.client_auth} needs it")


    def _check_mcp_client(self, where: str) -> None:
        """An MCP upstream's client: its authorization server is found through the upstream (RFC 9728); a
        configured client is bound to ``issuer``; without ``client_id`` the client registers itself (RFC 7591)."""
        if self.client_id and not self.issuer:
            raise ConfigError(f"{where}.issuer: a configured client_id belongs to one authorization server; name "
                              "its issuer so the client's credentials go nowhere else")
        for name in ("issuer", "resource", "redirect_uri"):
            value = getattr(self, name)
            if value:
                parts = urllib.parse.urlsplit(value)
                if parts.scheme not in ("https", "http") or not parts.hostname:
                    raise ConfigError(f"{where}.{name}: {value!r} is not an http(s) URL")
        if not self.client_id or self.client_auth == "none":
            return
        if self.client_auth == "private_key_jwt" and not self.private_key_file:
            raise ConfigError(f"{where}.private_key_file: client_auth private_key_jwt needs it")
        if self.client_auth != "private_key_jwt" and not self.client_secret_file:
            raise ConfigError(f"{where}.client_secret_file: client_auth {self.client_auth} needs it")


def _header_name(name: str) -> bool:
    """ASCII, no colon, no whitespace anywhere (a header name no HTTP library would refuse to send)."""
    return name.isascii() and ":" not in name and name.strip() != "" and not any(c in name for c in " \t\r\n")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class CallTokensConfig:
    """The settings of ``call_tokens`` (the signed Txn-Token on every backend request)."""

    signing_key_file: str = setting("", "PEM private key (Ed25519 or EC P-256) that signs the Txn-Token every "
                                        "request for a call carries; a Secret mounted into the toolproxy container "
                                        "only, its public keys published to backends beside it (a ConfigMap). "
                                        "Required by `toolproxy run`; empty (the dev stack's in-process proxy and "
                                        "tests only): a key generated at start-up, this process's alone")
    key_id: str = setting("", "kid of the signing key (empty: its RFC 7638 thumbprint)")
    verification_keys_file: str = setting("", "JWKS file of further public keys served beside the signing key's: "
                                              "the old key while a rotation overlaps, or the next one before it "
                                              "signs")
    issuer: str = setting("toolproxy", "`iss` of every call token")
    ttl_s: int = setting(300, "longest lifetime of a call token in seconds; a call's token expires at the call's "
                              "deadline when that comes first", bounds=(1, 300))
    audiences: dict[str, str] = setting({}, "backend service name -> `aud` of the tokens sent to it (default: the "
                                            "service name; a backend given by `url`: its scheme://host:port)")


@dataclass(frozen=True)
class DecodeConfig:
    """The settings of ``decode`` (untrusted JSON)."""

    max_depth: int = setting(64, "deepest nesting of arrays/objects accepted in any untrusted JSON: request bodies, "
                                 "tool arguments (also inside an `arguments` string), MCP messages, admin bodies, "
                                 "backend and status endpoint answers (invalid_json above)", bounds=(2, 256))


@dataclass(frozen=True)
class DeadlineConfig:
    """The settings of ``deadline`` (deadlines)."""

    margin_ms: int = setting(50, "budget kept back for serialization and replying")
    max_request_timeout_ms: int = setting(600000, "upper bound of a caller's deadline: a later one is clamped to "
                                                  "it, not refused (timing.deadline_ms shows the budget used)")


@dataclass(frozen=True)
class JwtConfig:
    """The settings of ``identity.jwt`` and ``admin_identity.jwt`` (jwt mode: the agent's bearer token; the
    approver's token: its own audience/issuer/keys)."""

    issuer: str = setting("", "required `iss` of accepted tokens (empty: not checked; set it in production)")
    audience: str = setting("toolproxy", "required `aud` of accepted tokens")
    jwks_file: str = setting("", "JWKS file with the verification keys (re-read when it changes)")
    jwks_url: str = setting("", "JWKS URL with the verification keys (cached, refreshed)")
    public_key_file: str = setting("", "PEM public key, when there is no JWKS")
    hmac_secret_file: str = setting("", "file with a shared HS* secret; HS* algorithms are refused without it")
    algorithms: list[str] = setting(["RS256", "ES256", "EdDSA"], "accepted JWT algorithms (`none` never is)",
                                    choices=JWT_ALGORITHMS)
    leeway_s: int = setting(30, "clock skew allowed on exp/nbf/iat")
    jwks_refresh_s: int = setting(300, "how long fetched JWKS keys are cached")
    claim_subject: str = setting("sub", "claim holding the subject")
    claim_tenant: str = setting("tenant", "claim holding the tenant")
    claim_roles: str = setting("roles", "claim holding the roles (list or space-separated string)")
    claim_scopes: str = setting("scope", "claim holding the scopes (list or space-separated string)")


def _admin_jwt() -> JwtConfig:
    return JwtConfig(audience="toolproxy-admin")


# Addresses any process in the pod can connect from: a trusted XFCC range covering one is no proof of a hop.
POD_LOCAL_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("127.0.0.0/8", "0.0.0.0/32", "::1/128", "::/128",
                                                               "::ffff:127.0.0.0/104"))


def xfcc_range_problem(address: str, covered: str) -> str:
    """The one line that refuses a trusted XFCC range any process in the pod can connect from."""
    return (f"identity.headers.xfcc_trusted_proxies: {address!r} covers {covered}, an address any process in "
            "the pod (the agent too) connects from; name the mesh proxy's own address outside the pod, or prove "
            "the hop with identity.headers.proof_secret_file")


@dataclass(frozen=True)
class HeaderIdentityConfig:
    """The settings of ``identity.headers`` (headers mode: identity set by a trusted mesh, believed only with a
    proof of the hop)."""

    subject: str = setting("X-Auth-Subject", "headers mode: header with the subject")
    tenant: str = setting("X-Auth-Tenant", "headers mode: header with the tenant")
    roles: str = setting("X-Auth-Roles", "headers mode: header with comma-separated roles")
    scopes: str = setting("X-Auth-Scopes", "headers mode: header with space- or comma-separated scopes")
    proof_header: str = setting("X-Toolproxy-Hop-Secret", "headers mode, hop proof by secret: header the trusted "
                                                          "mesh hop injects with the shared secret")
    proof_secret_file: str = setting("", "headers mode, hop proof by secret: file with the secret the mesh injects "
                                         "in proof_header (compared in constant time; mount it from a Secret)")
    xfcc_header: str = setting("X-Forwarded-Client-Cert", "headers mode, hop proof by client certificate: header "
                                                          "in which the trusted proxy (Envoy) forwards the "
                                                          "verified client certificate (XFCC)")
    xfcc_trusted_proxies: list[str] = setting([], "headers mode, hop proof by client certificate: peer addresses "
                                                  "(IP or CIDR) of the trusted proxy; XFCC from any other peer is "
                                                  "refused")
    xfcc_proxy_ids: list[str] = setting([], "headers mode, hop proof by client certificate: accepted `By=` values "
                                            "of the XFCC element (the trusted proxy's own certificate URI)")

    def __post_init__(self) -> None:
        for address in self.xfcc_trusted_proxies:
            try:
                network = ipaddress.ip_network(address, strict=False)
            except ValueError:
                raise ConfigError(f"identity.headers.xfcc_trusted_proxies: {address!r} is not an IP address "
                                  "or CIDR") from None
            covered = next((n for n in POD_LOCAL_NETWORKS if n.version == network.version and n.overlaps(network)),
                           None)
            if covered is not None:
                raise ConfigError(xfcc_range_problem(address, f"{covered} (loopback or unspecified)"))
        if bool(self.xfcc_trusted_proxies) != bool(self.xfcc_proxy_ids):
            raise ConfigError("identity.headers.xfcc_trusted_proxies and xfcc_proxy_ids go together (the proxy's "
                              "address and the identity it writes into XFCC's By=)")

    @property
    def hop_proof(self) -> str | None:
        """Which proof of the trusted hop is configured: "secret", "xfcc", or None."""
        if self.proof_secret_file:
            return "secret"
        if self.xfcc_trusted_proxies:
            return "xfcc"
        return None


@dataclass(frozen=True)
class IdentityConfig:
    """The settings of ``identity`` (trusted identity)."""

    mode: str = setting("jwt", "where the caller's identity comes from: jwt, headers (trusted mesh) or static "
                              "(dev stack and tests only; never the default)", choices=("jwt", "headers", "static"))
    static_subject: str = setting("dev-user", "static mode: subject of every call")
    static_tenant: str = setting("acme", "static mode: tenant of every call")
    static_roles: list[str] = setting(["agent"], "static mode: roles of every call")
    static_scopes: list[str] = setting(["tools:read", "tools:write"], "static mode: scopes of every call")
    person_claim: str = setting("sub", "jwt mode: claim that names the person behind the agent's token, stored "
                                       "on an approval and compared with the approver's admin_identity.person_claim "
                                       "(self-approval check; other modes use the subject)")
    task_context_claim: str = setting("task_context", "jwt mode: claim of the caller's token with what the user "
                                                     "asked (a string, or {text, values}); values it names are "
                                                     "trusted targets (input.flow.provenance, docs/security.md)")
    task_context_header: str = setting("X-Task-Context", "headers mode (behind the hop proof: the mesh sets it) and "
                                                         "static mode: header with what the user asked (text, or "
                                                         "JSON {text, values}); ignored in jwt mode")
    agent_id: str = setting("", "identity of the agent this sidecar serves (pod service account), written into "
                                "every audit record; required unless identity.mode is static (which uses "
                                "`dev-agent` when it is empty)")
    jwt: JwtConfig = field(default_factory=JwtConfig, metadata={"help": "jwt mode: the agent's bearer token"})
    headers: HeaderIdentityConfig = field(default_factory=HeaderIdentityConfig,
                                          metadata={"help": "headers mode: identity set by a trusted mesh, "
                                                            "believed only with a proof of the hop"})


@dataclass(frozen=True)
class AdminIdentityConfig:
    """The settings of ``admin_identity`` (approver credential)."""

    mode: str = setting("jwt", "how approvers authenticate on the admin listener: jwt or disabled",
                        choices=("jwt", "disabled"))
    approver_role: str = setting("approver", "role an admin token needs to list, approve or deny approvals")
    approver_scope: str = setting("", "scope an admin token needs as well (empty: none)")
    operator_role: str = setting("operator", "role an admin token needs to see and resolve unknown operations "
                                             "and takeovers")
    cross_tenant_role: str = setting("cross-tenant", "role an admin token without a tenant claim needs; without "
                                                     "it such a token is refused (a tenant claim scopes the "
                                                     "token to that tenant)")
    person_claim: str = setting("sub", "claim of the admin token that names the person; compared with the agent "
                                       "token's identity.person_claim so nobody approves their own request across "
                                       "the two IdPs (e.g. email in both)")
    jwt: JwtConfig = field(default_factory=_admin_jwt,
                           metadata={"help": "the approver's token: its own audience/issuer/keys"})


@dataclass(frozen=True)
class ApprovalsConfig:
    """The settings of ``approvals`` (human approvals)."""

    ttl_s: int = setting(900, "how long a pending or approved approval stays valid")
    max_list: int = setting(200, "most approvals one admin listing returns")
    max_pending_per_subject: int = setting(50, "most approvals one subject may have waiting for a decision in its "
                                               "tenant; one more is refused (rate_limited) until one is decided or "
                                               "expires", bounds=(1, 100000))
    max_summary_bytes: int = setting(65536, "largest summary an approver is shown (every bound argument in full, "
                                            "masked fields as hashes); a call whose summary is larger is refused "
                                            "(approval_summary_too_large) rather than shown in part",
                                     bounds=(1024, 1048576))


@dataclass(frozen=True)
class OpaConfig:
    """The settings of ``opa`` (policy decisions)."""

    url: str = setting("unix:///var/run/toolproxy-opa/opa.sock",
                       "where OPA listens: unix:///absolute/path.sock (a Unix socket in a directory only the proxy "
                       "and OPA share: nothing else in the pod can bind it or answer in OPA's place) or "
                       "http(s)://host:port (TCP: needs opa.allow_tcp for `toolproxy run`)")
    allow_tcp: bool = setting(False, "let `toolproxy run` reach OPA over TCP (an http:// or https:// opa.url). Any "
                                     "process in the pod's network namespace can bind a loopback port before OPA "
                                     "does and then answer every decision (and read the OPA token): use only where "
                                     "no untrusted process shares the network (docs/security.md)")
    decision_path: str = setting("toolproxy/decision", "Data API path of the decision document")
    timeout_ms: int = setting(500, "timeout of one OPA query (fail closed after it)")
    pool_size: int = setting(32, "open connections for decision queries, a pool of their own: slow backends "
                                 "never take the decisions' connections; past it a query waits (within "
                                 "opa.timeout_ms)", bounds=(1, 10000))
    push_catalog: bool = setting(True, "PUT the registry's tool catalog into OPA at start-up and when OPA lost it "
                                       "(false when a bundle ships it)")
    token_file: str = setting("", "file holding the bearer token sent to OPA on every request (OPA runs with "
                                  "--authentication=token --authorization=basic and proxy/policy/opa_authz.rego, "
                                  "which admits only this token, and only on the decision path; a Secret). Empty: "
                                  "no token (an OPA that answers anyone in the pod)")

    def __post_init__(self) -> None:
        if self.url.startswith("unix:"):
            path = self.url.removeprefix("unix://")
            if not self.url.startswith("unix:///") or path.endswith("/") or "?" in path or "#" in path:
                raise ConfigError(f"opa.url: {self.url!r} is not a Unix socket URL; write unix:///absolute/path.sock")
            return
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"opa.url: {self.url!r} is neither unix:///absolute/path.sock nor http(s)://host:port")

    @property
    def socket_path(self) -> str | None:
        """The Unix socket OPA listens on (None: OPA is reached over TCP)."""
        return self.url.removeprefix("unix://") if self.url.startswith("unix://") else None

    @property
    def http_base(self) -> str:
        """The base of every URL asked of OPA: over a Unix socket ``http://localhost`` (the socket is the
        connection; the host only fills the Host header), else ``opa.url`` itself."""
        return "http://localhost" if self.socket_path is not None else self.url.rstrip("/")


@dataclass(frozen=True)
class IntegrityConfig:
    """The settings of ``integrity`` (record MACs, docs/scale.md)."""

    mac_key_file: str = setting("", "file holding the key (at least 32 bytes, e.g. `openssl rand -hex 32`) of the "
                                    "MACs on approvals, spent approvals and settled outcomes in Redis; every proxy "
                                    "and admin API of a fleet needs the same one (a Secret). Required by `toolproxy "
                                    "run`; empty (the dev stack's in-process proxy and tests only): an ephemeral "
                                    "key of this process only, so no record another process wrote is honoured")


REDIS_MODES = ("standalone", "sentinel", "cluster")


@dataclass(frozen=True)
class RedisConfig:
    """The settings of ``redis`` (state store)."""

    mode: str = setting("standalone", "standalone (redis.url), sentinel (redis.sentinels + redis.sentinel_service) "
                                      "or cluster (redis.cluster_nodes)")
    url: str = setting("redis://127.0.0.1:6379/0", "standalone: Redis URL (redis:// or rediss://)")
    sentinels: list[str] = setting([], "sentinel mode: host:port of the Sentinels asked for the current master")
    sentinel_service: str = setting("mymaster", "sentinel mode: the master's service name in the Sentinels")
    sentinel_password: str = setting("", "sentinel mode: AUTH password of the Sentinels themselves (empty: none)")
    cluster_nodes: list[str] = setting([], "cluster mode: host:port of startup nodes (any few; the rest is "
                                           "discovered)")
    tls: bool = setting(False, "sentinel and cluster modes: connect over TLS (standalone: use a rediss:// URL)")
    key_prefix: str = setting("toolproxy", "prefix of every key this proxy writes")
    timeout_ms: int = setting(500, "socket timeout of one Redis command")
    max_connections: int = setting(100, "connections in the process's Redis pool (cluster: per node; standalone: "
                                        "the scripts' wire has a pool of its own of this size too); past it a "
                                        "command waits up to timeout_ms for a free one")
    password: str = setting("", "Redis password (AUTH), used when the URL carries none; set it from a Secret")
    username: str = setting("", "Redis ACL user (AUTH username password; docs/scale.md gives its least-privilege "
                                "ACL), used with redis.password when the URL carries none; empty: the default user")
    tls_ca_file: str = setting("", "TLS only: CA bundle that verifies the Redis server (default: system CAs)")
    tls_cert_file: str = setting("", "TLS only: client certificate for mutual TLS")
    tls_key_file: str = setting("", "TLS only: private key of tls_cert_file")
    tls_check_hostname: bool = setting(True, "TLS only: check that the Redis server's certificate names the host "
                                             "connected to (always passed to redis-py explicitly, never left to "
                                             "its version's default)")
    min_replica_acks: int = setting(-1, "replicas that must acknowledge a write's reservation, its committed "
                                        "outcome and a spent approval (WAIT) before the call goes on; -1: 0 in "
                                        "standalone, 1 in sentinel and cluster modes")
    replica_ack_timeout_ms: int = setting(200, "longest WAIT for min_replica_acks; a shortfall is logged and "
                                               "counted (toolproxy_redis_replica_ack_shortfalls_total), not fatal")
    accept_eviction: bool = setting(False, "DANGER: run on a Redis whose maxmemory-policy may evict keys (anything "
                                           "but noeviction, volatile-* too). An evicted operation record lets a "
                                           "same-key retry run a write twice. false: such a Redis stops the process "
                                           "at start-up and makes /readyz not ready")

    @property
    def address(self) -> str:
        """Where this Redis is, as a log line may name it (never a password) and the setting that says so."""
        from urllib.parse import urlsplit

        if self.mode == "sentinel":
            return f"Sentinels {', '.join(self.sentinels)} (redis.sentinels)"
        if self.mode == "cluster":
            return f"cluster nodes {', '.join(self.cluster_nodes)} (redis.cluster_nodes)"
        parts = urlsplit(self.url)
        host = parts.netloc.rpartition("@")[2]
        return f"{parts.scheme}://{host}{parts.path} (redis.url)"

    def __post_init__(self) -> None:
        if self.mode not in REDIS_MODES:
            raise ConfigError(f"redis.mode: expected standalone, sentinel or cluster, got {self.mode!r}")
        self._check_credentials()
        self._check_topology()
        if self.min_replica_acks < -1:
            raise ConfigError("redis.min_replica_acks must be -1 (by mode) or a replica count (0 = no WAIT)")
        if self.replica_acks > 0 and not 0 < self.replica_ack_timeout_ms < self.timeout_ms:
            raise ConfigError("redis.replica_ack_timeout_ms must be positive and below redis.timeout_ms")

    def _check_credentials(self) -> None:
        tls = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(tls) and not self.uses_tls:
            raise ConfigError("redis.tls_* files are set but TLS is off (standalone: rediss:// URL; "
                              "sentinel/cluster: redis.tls: true)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("redis.tls_cert_file and redis.tls_key_file go together (mutual TLS needs both)")
        if self.username and not self.password:
            raise ConfigError("redis.username needs redis.password (an ACL user authenticates with both)")

    def _check_topology(self) -> None:
        if self.mode == "sentinel" and not self.sentinels:
            raise ConfigError("redis.sentinels: sentinel mode needs at least one host:port")
        if self.mode == "sentinel" and not self.sentinel_service:
            raise ConfigError("redis.sentinel_service: sentinel mode needs the master's service name")
        if self.mode == "cluster" and not self.cluster_nodes:
            raise ConfigError("redis.cluster_nodes: cluster mode needs at least one host:port")
        for name in ("sentinels", "cluster_nodes"):
            for address in getattr(self, name):
                host, _, port = address.rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ConfigError(f"redis.{name}: expected host:port, got {address!r}")

    @property
    def uses_tls(self) -> bool:
        return self.url.startswith("rediss://") if self.mode == "standalone" else self.tls

    @property
    def replica_acks(self) -> int:
        """How many replicas a durable write waits for (WAIT), the mode's default resolved."""
        if self.min_replica_acks >= 0:
            return self.min_replica_acks
        return 0 if self.mode == "standalone" else 1


@dataclass(frozen=True)
class McpConfig:
    """The settings of ``mcp`` (MCP front and MCP backends)."""

    front: bool = setting(True, "serve the MCP front on the agent listener (/mcp); off: the JSON and "
                                "OpenAI-shaped fronts only, and the MCP SDK's server side is never imported "
                                "(its client side is imported only when a tool's backend is an MCP upstream)")
    page_size: int = setting(50, "MCP tools/list: tools per page (nextCursor beyond)")
    max_sessions: int = setting(1000, "MCP legacy sessions (initialize + Mcp-Session-Id) held at once; 503 above")
    max_sessions_per_owner: int = setting(100, "MCP legacy sessions one caller (subject, tenant, agent) holds at "
                                               "once, so one caller cannot fill mcp.max_sessions; 503 above",
                                          bounds=(1, 1000000))
    batch_max_members: int = setting(64, "MCP JSON-RPC batch (2025-03-26 sessions): most members accepted in one "
                                         "batch; a larger one is refused whole (-32600, nothing runs); its "
                                         "tools/call members also count against scheduler.max_calls and run "
                                         "within scheduler.max_parallel and the per-tenant and per-tool caps",
                                     bounds=(1, 100000))
    sse_queue_max: int = setting(256, "MCP: notifications (progress, log messages) waiting to be written to one "
                                      "call's SSE stream; past it they are dropped and counted "
                                      "(toolproxy_mcp_sse_dropped_total)", bounds=(1, 1000000))
    upstream_max_answer_bytes: int = setting(16 * 1024 * 1024, "MCP backends, stateless calls: largest answer read "
                                             "from an upstream (a JSON body, or an SSE stream's bytes up to its "
                                             "result); output_invalid above (a write: upstream_error_unknown)",
                                             bounds=(1024, 1024 * 1024 * 1024))
    upstream_max_stream_events: int = setting(10000, "MCP backends, stateless calls: most SSE events (notifications, "
                                                     "pings) read before the result; refused like "
                                                     "upstream_max_answer_bytes above", bounds=(1, 10000000))
    session_idle_s: int = setting(1800, "MCP legacy session expiry after this long without a request (404 after)")
    sse_after_ms: int = setting(10000, "MCP tools/call still running after this long answers as an SSE stream "
                                       "with keepalive pings, when the client accepts text/event-stream")
    sse_ping_ms: int = setting(15000, "MCP SSE keepalive comment interval")
    relay_max_bytes: int = setting(65536, "MCP: largest request an upstream may relay to the client during a "
                                          "call (sampling/createMessage, elicitation/create); refused above",
                                   bounds=(1024, 1048576))
    log_message_max_bytes: int = setting(8192, "MCP: largest upstream log message (notifications/message) relayed "
                                               "to the client during a call; dropped (and counted) above",
                                         bounds=(256, 1048576))
    upstream_mode: str = setting("auto", "MCP backends: auto (2026-07-28 stateless if the upstream offers it, else "
                                         "initialize + session) or legacy (always initialize + session)",
                           choices=("auto", "legacy"))
    allowed_hosts: list[str] = setting(["localhost", "127.0.0.1", "[::1]"],
                                       "agent listener (/mcp and every other route): Host header values accepted "
                                       "(name = any port, or name:port; * = any); others get 403 (DNS rebinding "
                                       "protection)")
    allowed_origins: list[str] = setting(["http://localhost", "http://127.0.0.1", "http://[::1]",
                                          "https://localhost", "https://127.0.0.1", "https://[::1]"],
                                         "agent listener (/mcp and every other route): Origin header values "
                                         "accepted (scheme://name = any port; * = any); requests without Origin "
                                         "are accepted; others get 403")
    upstream_handshake_timeout_ms: int = setting(5000, "MCP backends: cap on opening a session to an upstream "
                                                       "(discover or initialize), also bounded by the call budget")


@dataclass(frozen=True)
class McpPinsConfig:
    """The settings of ``mcp_pins`` (pinned MCP upstream tools, quarantined on drift: docs/mcp.md)."""

    check_interval_ms: int = setting(60000, "how often every pinned MCP upstream's tools/list is compared with the "
                                            "registry's pins (backend.pin), besides at start, after a registry "
                                            "reload and on the upstream's notifications/tools/list_changed; 0: "
                                            "only then. It bounds how long a silently changed tool is served",
                                     bounds=(0, 86400000))
    check_timeout_ms: int = setting(5000, "cap on one check of one upstream (opening its session, every page of "
                                          "tools/list); a check that fails leaves its tools unverified",
                                    bounds=(100, 600000))
    min_gap_ms: int = setting(1000, "least time between two checks of one upstream, however many "
                                    "notifications/tools/list_changed it sends", bounds=(0, 3600000))
    max_age_ms: int = setting(1500, "a write or external-sink call of a pinned tool is sent only if its upstream "
                                    "was verified by a check that started at most this long before; else it "
                                    "waits (within its budget) for a check. It bounds how long a silently "
                                    "changed tool can write or send data out", bounds=(100, 3600000))
    read_max_age_ms: int = setting(3000, "the same bound for the other calls of a pinned tool (reads)",
                                   bounds=(100, 3600000))
    max_tools: int = setting(1000, "most tools one upstream may list; a longer list fails the check",
                             bounds=(1, 100000))
    max_answer_bytes: int = setting(4 * 1024 * 1024, "largest answer read from an upstream for a check (one "
                                                      "tools/list page; the bytes of one listen stream); a check "
                                                      "fails above", bounds=(1024, 1024 * 1024 * 1024))
    unverified: str = setting("refuse", "a pinned tool whose upstream has not been checked successfully (at start, "
                                        "after a failed check, after a reload that changed its pin): refuse "
                                        "(dependency_unavailable, retryable; hidden from listings) or serve",
                              choices=("refuse", "serve"))


@dataclass(frozen=True)
class IdempotencyConfig:
    """The settings of ``idempotency`` (idempotency records)."""

    lease_grace_ms: int = setting(2000, "added to a call's budget to form its IN_PROGRESS lease; a lease that runs "
                                        "out means the proxy died mid-call (UNKNOWN for a write)")
    max_attempts: int = setting(5, "executions allowed under one key; the next retry of a FAILED_RETRYABLE key "
                                   "makes it FAILED_FINAL (operation_failed)")
    max_wait_ms: int = setting(30000, "cap on `Prefer: wait=<s>` while another call holds the key")
    wait_poll_ms: int = setting(50, "how often a waiting call re-reads the record")
    read_policy: str = setting("proceed", "reads that use idempotency when Redis is unreachable: proceed (without "
                                          "a record) or fail_closed (dependency_unavailable)",
                               choices=("proceed", "fail_closed"))


@dataclass(frozen=True)
class ReconcileConfig:
    """The settings of ``reconcile`` (unknown outcomes)."""

    enabled: bool = setting(True, "run the background reconciler in this process (one per key across replicas)")
    scan_interval_ms: int = setting(1000, "how often the reconciler looks for expired leases and due UNKNOWN records")
    window_ms: int = setting(900000, "how long an UNKNOWN record is reconciled before it needs a human takeover")
    backoff_initial_ms: int = setting(1000, "delay before the first status query; doubles after each inconclusive one")
    backoff_max_ms: int = setting(60000, "upper bound of the delay between two status queries of one key")
    claim_ms: int = setting(15000, "lease of one replica on one key while it queries the status endpoint")
    status_timeout_ms: int = setting(2000, "timeout of one status endpoint query")
    batch_size: int = setting(100, "records taken per bucket and scan")
    concurrency: int = setting(8, "status queries in flight at once per process")


@dataclass(frozen=True)
class CancellationConfig:
    """The settings of ``cancellation`` (cancelling calls, docs/transactions.md)."""

    grace_ms: int = setting(2000, "after a sent call is told to cancel: how long its own answer is awaited "
                                  "before the stream is closed and the status endpoint asked", bounds=(0, 600000))
    cancel_timeout_ms: int = setting(2000, "timeout of one request to a contract's cancel_endpoint",
                                     bounds=(1, 60000))
    answer_wait_ms: int = setting(10000, "how long POST /v1/operations/{key}:cancel waits for the "
                                         "call's final outcome before answering with the CANCELLING record",
                                   bounds=(0, 600000))


@dataclass(frozen=True)
class LocksConfig:
    """The settings of ``locks`` (resource locks)."""

    scope: str = setting("tenant", "lock namespace and Redis Cluster hash tag: tenant (a tenant's locks share one "
                                   "slot; tenants never exclude each other) or global (one slot for all locks)",
                         choices=("tenant", "global"))
    lease_ms: int = setting(5000, "lease of a held lock set, renewed while the call runs; a crashed proxy's "
                                  "locks free up after it")
    renew_interval_ms: int = setting(1500, "how often a held lock set is renewed (well below lease_ms)")
    poll_min_ms: int = setting(5, "first pause between attempts while waiting for a busy resource")
    poll_max_ms: int = setting(100, "longest pause between attempts (exponential backoff with jitter)")
    max_wait_ms: int = setting(30000, "longest lock wait for a caller that sent no deadline")

    def __post_init__(self) -> None:
        if not 0 < self.renew_interval_ms < self.lease_ms:
            raise ConfigError("locks.renew_interval_ms must be positive and below locks.lease_ms")
        if not 0 < self.poll_min_ms <= self.poll_max_ms:
            raise ConfigError("locks.poll_min_ms must be positive and at most locks.poll_max_ms")
        if self.max_wait_ms < 0:
            raise ConfigError("locks.max_wait_ms must not be negative")


@dataclass(frozen=True)
class SchedulerConfig:
    """The settings of ``scheduler`` (batch scheduler, POST /v1/tool-calls:batch)."""

    max_calls: int = setting(64, "most calls accepted in one batch (invalid_plan above)")
    default_timeout_ms: int = setting(60000, "deadline of a batch whose caller sent none")
    max_parallel: int = setting(8, "calls of one batch running at once")
    tenant_max_parallel: int = setting(32, "batch calls of one tenant running at once in this process "
                                           "(shared by all batches)")
    tool_max_parallel: int = setting(16, "batch calls of one tool running at once in this process "
                                         "(shared by all batches)")
    tool_limits: dict[str, str] = setting({}, "per-tool override of tool_max_parallel: tool=N")

    def __post_init__(self) -> None:
        if min(self.max_calls, self.max_parallel, self.tenant_max_parallel, self.tool_max_parallel) < 1:
            raise ConfigError("scheduler.max_calls and scheduler.*max_parallel must be at least 1")
        for tool, raw in self.tool_limits.items():
            if not str(raw).isdigit() or int(raw) < 1:
                raise ConfigError(f"scheduler.tool_limits: {tool}={raw!r} is not a positive integer")


@dataclass(frozen=True)
class QuotasConfig:
    """The settings of ``quotas`` (rate limits, concurrency quotas, backend back-pressure)."""

    enabled: bool = setting(True, "apply quotas and backend back-pressure (docs/quotas.md); false: neither")
    tenant: str = setting("", "limit of each tenant, e.g. `rate=100/1s burst=50 concurrency=20` (empty: none)")
    tenants: dict[str, str] = setting({}, "per-tenant override of quotas.tenant: tenant=<limit>")
    subject: str = setting("", "limit of each caller (tenant + subject), same form (empty: none)")
    fleet: str = setting("", "one limit shared by every call of the fleet, same form (empty: none)")
    classes: dict[str, str] = setting({}, "quota classes an OPA decision may name (`quota_class`): class=<limit>; "
                                           "replaces the caller's subject limit (`per=tenant`: the tenant's)")
    slot_grace_ms: int = setting(2000, "a concurrency slot's lease is the call's longest possible life plus this; "
                                       "a crashed proxy's slots free up after it")
    wait_poll_max_ms: int = setting(200, "batch calls waiting for a concurrency slot poll at most this far apart")
    max_pause_s: int = setting(300, "longest backend Retry-After honoured (longer ones are capped)")
    breaker_enabled: bool = setting(True, "circuit breaker per backend service (registry `services:` may override "
                                          "the breaker_* settings per service)")
    breaker_failure_ratio: float = setting(0.5, "failed share of a backend's calls in the window that opens its "
                                                "breaker")
    breaker_min_calls: int = setting(20, "calls a window needs before the failure ratio counts")
    breaker_window_s: int = setting(30, "sliding window of the failure ratio (each proxy counts its own calls)")
    breaker_open_s: int = setting(10, "how long an open breaker refuses calls before one probe is let through")

    def __post_init__(self) -> None:
        from .quota_rules import LimitSpecError, parse_spec  # pure module; import here keeps config at the bottom

        texts = {"quotas.tenant": self.tenant, "quotas.subject": self.subject, "quotas.fleet": self.fleet,
                 **{f"quotas.tenants.{k}": v for k, v in self.tenants.items()},
                 **{f"quotas.classes.{k}": v for k, v in self.classes.items()}}
        for where, text in texts.items():
            if text.strip():
                try:
                    parse_spec(text)
                except LimitSpecError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
        if not 0 < self.breaker_failure_ratio <= 1:
            raise ConfigError("quotas.breaker_failure_ratio must be in (0, 1]")
        if min(self.breaker_min_calls, self.breaker_window_s, self.breaker_open_s, self.slot_grace_ms,
               self.wait_poll_max_ms, self.max_pause_s) < 1:
            raise ConfigError("quotas.breaker_*, slot_grace_ms, wait_poll_max_ms and max_pause_s must be positive")


@dataclass(frozen=True)
class ShutdownConfig:
    """The settings of ``shutdown`` (SIGTERM)."""

    drain_timeout_ms: int = setting(20000, "on SIGTERM: how long calls in flight may take to finish while new ones "
                                           "are refused (shutting_down) and readiness fails; past it the calls "
                                           "still running are cut, each answered and recorded (a write whose "
                                           "request left: shutdown_unknown, reconciled). Keep it below the pod's "
                                           "terminationGracePeriodSeconds", bounds=(0, 3600000))


@dataclass(frozen=True)
class LogConfig:
    """The settings of ``log`` (logging)."""

    level: str = setting("info", "log level: debug, info, warning, error",
                         choices=("debug", "info", "warning", "error"))
    format: str = setting("json", "log line format on stderr: json or kv (key=value)", choices=("json", "kv"))


@dataclass(frozen=True)
class AuditConfig:
    """The settings of ``audit`` (audit records)."""

    sinks: list[str] = setting(["stdout"], "where audit records go: stdout (JSON lines), redis (a Redis Stream), "
                                           "or both", choices=("stdout", "redis"))
    stream_maxlen: int = setting(100000, "redis sink: approximate maximum length of the audit stream (XADD MAXLEN ~)")
    on_failure_write: str = setting("fail_closed", "write tools when a sink fails: fail_closed (no audit intent, "
                                    "no call) or fail_open (count and log, go on)", choices=("fail_closed", "fail_open"))
    on_failure_read: str = setting("fail_open", "read tools when a sink fails: fail_open or fail_closed",
                                   choices=("fail_closed", "fail_open"))
    timeout_ms: int = setting(500, "bound on writing one record to one sink")
    stdout_queue_records: int = setting(10000, "stdout sink: records held while stdout's pipe is full (nobody "
                                        "reads it); past that they are dropped and counted, never blocking a call")
    max_string_chars: int = setting(256, "argument strings longer than this are truncated in audit records")


@dataclass(frozen=True)
class DecisionsConfig:
    """The settings of ``decisions`` (policy decision records)."""

    enabled: bool = setting(False, "record every policy decision (exact OPA input with sensitive arguments masked, "
                                   "decision, revision, decision id) for `toolproxy policy replay`")
    sinks: list[str] = setting(["redis"], "where decision records go: redis (a Redis Stream), stdout (JSON lines), "
                                          "or both")
    stream_maxlen: int = setting(100000, "redis sink: approximate maximum length of the decision stream")
    retention_s: int = setting(7 * 86400, "redis sink: records older than this are trimmed (XTRIM MINID ~)")
    max_record_bytes: int = setting(65536, "a record larger than this keeps its decision but not its input "
                                           "(replay reports it not replayable)")
    timeout_ms: int = setting(200, "bound on writing one record to one sink (a failure never affects the call)")


SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces (docs/observability.md#traces). The standard ``OTEL_*`` variables are read as this
    section's defaults (``otel_defaults``); the config file and ``TOOLPROXY_TRACING_*`` override them."""

    endpoint: str = setting("", "OTLP/HTTP base URL of the trace receiver (an OpenTelemetry Collector), e.g. "
                                "http://otel-collector:4318; spans go to <endpoint>/v1/traces. Empty: tracing is "
                                "off and the OpenTelemetry SDK is never imported (OTEL_EXPORTER_OTLP_ENDPOINT)")
    traces_endpoint: str = setting("", "full OTLP/HTTP URL for spans, used as given instead of "
                                       "<endpoint>/v1/traces (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    headers: dict[str, str] = setting({}, "headers sent with every export, e.g. an API key of a hosted backend "
                                          "(OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_TRACES_HEADERS)")
    service_name: str = setting("toolproxy", "service.name of every span (OTEL_SERVICE_NAME)")
    resource_attributes: dict[str, str] = setting({}, "further resource attributes, e.g. deployment.environment "
                                                      "(OTEL_RESOURCE_ATTRIBUTES)")
    sampler: str = setting("parentbased_traceidratio", "which calls are traced (OTEL_TRACES_SAMPLER): the parent_* "
                           "samplers follow the agent's traceparent sampled flag and apply the rest to calls "
                           "without one", choices=SAMPLERS)
    sampler_arg: float = setting(0.1, "the ratio of the *traceidratio samplers, 0 to 1 (OTEL_TRACES_SAMPLER_ARG)")
    stages: str = setting("events", "how a call's stages (decision, quota, reservation, lock wait, backend, "
                                    "verify, commit) appear: 'events' on the call span, each with its duration "
                                    "(one span per call: about a third of the cost of a sampled call), or "
                                    "'spans', a child span each (a timeline of bars; the backend's request "
                                    "continues under the execute span)", choices=("events", "spans"))
    export_timeout_ms: int = setting(10000, "bound on one export request (OTEL_EXPORTER_OTLP_TIMEOUT)",
                                     bounds=(1, 600000))
    max_queue_size: int = setting(2048, "spans held while the receiver is slow or away; past it spans are dropped, "
                                        "never a call slowed (OTEL_BSP_MAX_QUEUE_SIZE)", bounds=(1, 1000000))
    max_export_batch_size: int = setting(512, "most spans in one export request (OTEL_BSP_MAX_EXPORT_BATCH_SIZE)",
                                         bounds=(1, 1000000))
    schedule_delay_ms: int = setting(5000, "longest time a finished span waits to be exported "
                                           "(OTEL_BSP_SCHEDULE_DELAY)", bounds=(1, 3600000))

    def __post_init__(self) -> None:
        if not 0.0 <= self.sampler_arg <= 1.0:
            raise ConfigError(f"tracing.sampler_arg: {self.sampler_arg!r} is not a ratio from 0 to 1")
        if self.max_export_batch_size > self.max_queue_size:
            raise ConfigError("tracing.max_export_batch_size must not exceed tracing.max_queue_size")
        for name in ("endpoint", "traces_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("http://", "https://")):
                raise ConfigError(f"tracing.{name}: {value!r} is not an http:// or https:// URL")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint or self.traces_endpoint)

    @property
    def spans_url(self) -> str:
        return self.traces_endpoint or self.endpoint.rstrip("/") + "/v1/traces"


# The OpenTelemetry environment variables (the SDK's own names) -> the tracing setting each one sets.
OTEL_ENV = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "endpoint",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "traces_endpoint",
    "OTEL_EXPORTER_OTLP_HEADERS": "headers",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "headers",
    "OTEL_SERVICE_NAME": "service_name",
    "OTEL_RESOURCE_ATTRIBUTES": "resource_attributes",
    "OTEL_TRACES_SAMPLER": "sampler",
    "OTEL_TRACES_SAMPLER_ARG": "sampler_arg",
    "OTEL_EXPORTER_OTLP_TIMEOUT": "export_timeout_ms",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "export_timeout_ms",
    "OTEL_BSP_MAX_QUEUE_SIZE": "max_queue_size",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "max_export_batch_size",
    "OTEL_BSP_SCHEDULE_DELAY": "schedule_delay_ms",
}


def otel_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """The tracing settings the standard ``OTEL_*`` variables give (dotted keys, the lowest layer above the
    built-in defaults). ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn tracing off
    whatever else says it is on; an exporter other than otlp is refused (only OTLP/HTTP is built in)."""
    out: dict[str, Any] = {}
    hints = _type_hints(TracingConfig)
    for name, key in OTEL_ENV.items():  # the traces-specific variable comes later and wins
        if name in env and env[name].strip():
            raw = env[name]
            if key == "resource_attributes" or key == "headers":
                raw = ",".join(urllib.parse.unquote(p) for p in raw.split(","))
            out["tracing." + key] = _parse_env(name, raw, hints[key])
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter not in ("otlp", "none"):
        raise ConfigError(f"OTEL_TRACES_EXPORTER: {exporter!r} is not supported; expected otlp or none")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")).strip()
    if protocol not in ("", "http/protobuf"):
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported; expected http/protobuf")
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter == "none":
        out["tracing.endpoint"] = out["tracing.traces_endpoint"] = ""
    return out


@dataclass(frozen=True)
class FlowConfig:
    """The settings of ``flow`` (data-flow labels for the policy, docs/policy-authors.md#flow)."""

    # A day: an agent's context (a conversation, a long run) rarely outlives a working day, and the labels
    # must outlive any run the model can start afresh; much longer keeps refusing an agent's sends long
    # after its context was discarded. Same as the default retention of an operation record.
    window_s: int = setting(86400, "how long a flow label (contract flow.produces) an agent was exposed to is "
                                   "remembered per tenant, agent and subject (and per X-Run-Id) for the policy's "
                                   "input.flow: from the last call that brought it", bounds=(1, 30 * 86400))
    read_for: str = setting("external_sinks", "which calls read the flow labels for their decision (one Redis "
                                              "command each): external_sinks (tools with flow.sink external, and "
                                              "tools naming flow.sink_arguments) or every_call",
                            choices=("external_sinks", "every_call"))
    # A working day of an agent reading mail, pages and files rarely holds more distinct targets than this;
    # past it the scope is marked full and every unseen sink value counts as untrusted until the mark leaves
    # the window (nothing an attacker floods past the bound goes unnoticed).
    provenance_max_values: int = setting(4096, "how many value fingerprints (tokens of untrusted or trusted_source "
                                               "output, for input.flow.provenance) are kept per tenant, agent and "
                                               "subject within flow.window_s; past it, unseen sink values count as "
                                               "untrusted", bounds=(64, 1_000_000))


@dataclass(frozen=True)
class Config:
    """The whole configuration: one section per field."""

    listen: AgentListenerConfig = field(default_factory=AgentListenerConfig, metadata={"help": "agent-facing API"})
    admin: ListenerConfig = field(default_factory=_admin_listener, metadata={"help": "approver/operator API"})
    ops: ListenerConfig = field(default_factory=_ops_listener, metadata={"help": "metrics and probes"})
    registry: RegistryConfig = field(default_factory=RegistryConfig, metadata={"help": "tool contracts"})
    backends: BackendsConfig = field(default_factory=BackendsConfig, metadata={"help": "tool backends"})
    call_tokens: CallTokensConfig = field(default_factory=CallTokensConfig,
                                          metadata={"help": "the signed Txn-Token on every backend request"})
    deadline: DeadlineConfig = field(default_factory=DeadlineConfig, metadata={"help": "deadlines"})
    decode: DecodeConfig = field(default_factory=DecodeConfig, metadata={"help": "untrusted JSON"})
    identity: IdentityConfig = field(default_factory=IdentityConfig, metadata={"help": "trusted identity"})
    admin_identity: AdminIdentityConfig = field(default_factory=AdminIdentityConfig,
                                                metadata={"help": "approver credential"})
    opa: OpaConfig = field(default_factory=OpaConfig, metadata={"help": "policy decisions"})
    approvals: ApprovalsConfig = field(default_factory=ApprovalsConfig, metadata={"help": "human approvals"})
    redis: RedisConfig = field(default_factory=RedisConfig, metadata={"help": "state store"})
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig,
                                       metadata={"help": "record MACs (docs/scale.md)"})
    mcp: McpConfig = field(default_factory=McpConfig, metadata={"help": "MCP front and MCP backends"})
    mcp_pins: McpPinsConfig = field(default_factory=McpPinsConfig,
                                    metadata={"help": "pinned MCP upstream tools, quarantined on drift (docs/mcp.md)"})
    idempotency: IdempotencyConfig = field(default_factory=IdempotencyConfig,
                                           metadata={"help": "idempotency records"})
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig, metadata={"help": "unknown outcomes"})
    cancellation: CancellationConfig = field(default_factory=CancellationConfig,
                                             metadata={"help": "cancelling calls (docs/transactions.md)"})
    locks: LocksConfig = field(default_factory=LocksConfig, metadata={"help": "resource locks"})
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig, metadata={"help": "draining on SIGTERM"})
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": "logging"})
    audit: AuditConfig = field(default_factory=AuditConfig, metadata={"help": "audit records"})
    decisions: DecisionsConfig = field(default_factory=DecisionsConfig, metadata={"help": "policy decision records"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig,
                                       metadata={"help": "batch scheduler (POST /v1/tool-calls:batch)"})
    quotas: QuotasConfig = field(default_factory=QuotasConfig,
                                 metadata={"help": "rate limits, concurrency quotas, backend back-pressure"})
    flow: FlowConfig = field(default_factory=FlowConfig,
                             metadata={"help": "data-flow labels for the policy (docs/policy-authors.md#flow)"})
    tracing: TracingConfig = field(default_factory=TracingConfig,
                                   metadata={"help": "OpenTelemetry traces (off unless an endpoint is set)"})
    credentials: dict[str, CredentialConfig] = field(
        default_factory=dict, metadata={"help": "credential name -> what the proxy attaches to the requests of the "
                                                "tools whose backend says `auth: <name>` (kind and its settings, "
                                                "secrets as files: docs/backends.md#credentials); from the YAML "
                                                "file, or as JSON in the environment variable"})

    def __post_init__(self) -> None:
        exchanges = [name for name, entry in self.credentials.items() if entry.kind == "token_exchange"]
        if exchanges and self.identity.mode != "jwt":
            raise ConfigError(f"credentials.{exchanges[0]}: kind token_exchange sends the caller's verified token, "
                              f"which only identity.mode jwt has (it is {self.identity.mode})")


def serving_problem(config: Config) -> str | None:
    """What ``toolproxy run`` refuses and only the dev stack and tests may do (one line naming the settings
    and the fix), else None.

    - Both fleet keys: with a key made at start-up, a restarted process or a second replica refuses every
      record this one signed (approvals, outcomes), and backends can only learn the call-token key from this
      process's own JWKS, which anything that binds the ops port first can serve.
    - OPA over a Unix socket: a TCP port on loopback can be bound by any process in the pod before OPA is,
      which then answers every decision and receives the OPA token."""
    missing = [name for name, value in (("integrity.mac_key_file", config.integrity.mac_key_file),
                                        ("call_tokens.signing_key_file", config.call_tokens.signing_key_file))
               if not value]
    if missing:
        return (f"{' and '.join(missing)} not set: `toolproxy run` needs both integrity.mac_key_file and "
                "call_tokens.signing_key_file, or a restart or a second replica could not read this process's own "
                "records and backends could not verify its call tokens; mount both from a Secret "
                "(`openssl rand -hex 32`, `toolproxy call-token-key --out <file>`)")
    if config.opa.socket_path is None and not config.opa.allow_tcp:
        return (f"opa.url: {config.opa.url} is TCP, which any process in the pod can bind first and answer every "
                "decision for; use unix:///<dir>/opa.sock in a directory only the proxy and OPA mount, or set "
                "opa.allow_tcp=true to accept that risk")
    return None


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None,
                base: Mapping[str, Any] | None = None) -> Config:
    """Build the config: defaults < ``base`` (a caller's own defaults, e.g. the dev
    stack's) < the standard ``OTEL_*`` variables (tracing only) < YAML file < ``TOOLPROXY_*`` environment
    < explicit overrides."""
    data: dict[str, Any] = {}
    env = os.environ if env is None else env
    for dotted, value in {**(base or {}), **otel_defaults(env)}.items():
        _set_dotted(data, dotted, value)
    if path is not None:
        try:
            with Path(path).open(encoding="utf-8") as handle:  # a stream: the parser's marks name the file
                loaded = yaml.safe_load(handle)
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read config: {' '.join(str(exc).split())}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        deep_merge(data, loaded or {})
    for dotted, hint in _leaves(Config):
        name = ENV_PREFIX + dotted.replace(".", "_").upper()
        if name in env:
            _set_dotted(data, dotted, _parse_env(name, env[name], hint))
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    return _build(Config, data, "config")


def deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for name, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            deep_merge(into[name], value)
        else:
            into[name] = value


def describe() -> Iterator[tuple[str, str, Any, str]]:
    """(key, env var, default, help) for every setting: the reference table in docs/configuration.md."""
    yield from _describe(Config, Config(), "")


def _describe(cls: type, instance: Any, prefix: str) -> Iterator[tuple[str, str, Any, str]]:
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _describe(type(value), value, key + ".")
        else:
            yield key, ENV_PREFIX + key.replace(".", "_").upper(), value, f.metadata.get("help", "")


def json_schema() -> dict[str, Any]:
    """The config file's shape as a JSON Schema (draft-07 keywords only, for the Helm chart's
    ``proxy.config``): every section and key, each key's type, its choices and bounds, nothing else allowed.
    Generated from the typed config, so the chart refuses at render what ``toolproxy run`` would refuse."""
    return _object_schema(Config)


def _object_schema(cls: type) -> dict[str, Any]:
    hints = _type_hints(cls)
    properties: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            properties[f.name] = _object_schema(hint)
            continue
        schema = _value_schema(hint)
        choices, bounds, help_ = f.metadata.get("choices"), f.metadata.get("bounds"), f.metadata.get("help")
        target = schema.get("items", schema) if schema.get("type") == "array" else schema
        if choices:
            target["enum"] = list(choices)
        if bounds is not None:
            schema["minimum"], schema["maximum"] = bounds
        if help_:
            schema["description"] = help_
        properties[f.name] = schema
    return {"type": "object", "additionalProperties": False, "properties": properties}


def _value_schema(hint: Any) -> dict[str, Any]:
    scalar = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if hint in scalar:
        return {"type": scalar[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return {"type": "array", "items": _value_schema(args[0])}
    if origin is dict:
        value = _object_schema(args[1]) if dataclasses.is_dataclass(args[1]) else _value_schema(args[1])
        return {"type": "object", "additionalProperties": value}
    return {}  # a type the loader checks itself


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, resolved once per section class: resolving evaluates every annotation's text
    again, and each load of the configuration walks every section for its environment variables."""
    return typing.get_type_hints(cls)


def _leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _leaves(hint, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hint


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} must be a mapping")
    node[leaf] = value


def _parse_env(name: str, raw: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            return _env_bool(raw)
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        if origin is list:
            return [item.strip() for item in raw.split(",") if item.strip()]
        if _entries_type(hint) is not None:  # named sections (credentials): a JSON object
            value = yaml.safe_load(raw) if raw.strip() else {}
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object of named entries")
            return value
        if origin is dict:
            return _env_pairs(raw)
        return raw
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _env_bool(raw: str) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case); ValueError otherwise."""
    lowered = raw.strip().lower()
    if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
        raise ValueError("expected true or false")
    return lowered in {"1", "true", "yes", "on"}


def _env_pairs(raw: str) -> dict[str, str]:
    """``a=1,b=2`` as a mapping (blank items skipped); ValueError on an item without ``=``."""
    result = {}
    for pair in (item for item in raw.split(",") if item.strip()):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"expected name=value, got {pair!r}")
        result[key.strip()] = value.strip()
    return result


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping")
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        hint = hints[f.name]
        value = data[f.name]
        path = f"{where}.{f.name}"
        if dataclasses.is_dataclass(hint):
            # Start from the section's own default so per-field defaults of
            # non-default section instances (admin/ops ports) survive.
            default = getattr(cls(), f.name)
            merged = {**dataclasses.asdict(default), **(value or {})}
            kwargs[f.name] = _build(hint, merged, path)
        elif (entry_type := _entries_type(hint)) is not None:
            kwargs[f.name] = _build_entries(entry_type, value, path)
        else:
            kwargs[f.name] = _check_allowed(_check_type(value, hint, path), f, path)
    return cls(**kwargs)


def _entries_type(hint: Any) -> type | None:
    """The section type of a ``dict[str, Section]`` setting (named entries such as ``credentials``), else None."""
    if typing.get_origin(hint) is dict:
        value_type = typing.get_args(hint)[1]
        if dataclasses.is_dataclass(value_type):
            return value_type  # type: ignore[return-value]
    return None


def _build_entries(entry_type: type, value: Any, where: str) -> dict[str, Any]:
    """Named entries, each built and checked like a section (``check(where)`` when the type has one)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a mapping of names to entries")
    entries = {}
    for name, raw in value.items():
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
            raise ConfigError(f"{where}: {name!r} is not a name (letters, digits, - _ .)")
        entry = _build(entry_type, raw, f"{where}.{name}")
        if hasattr(entry, "check"):
            entry.check(f"{where.removeprefix('config.')}.{name}")
        entries[name] = entry
    return entries


def _check_allowed(value: Any, f: dataclasses.Field[Any], where: str) -> Any:
    """The one place enumerated and bounded settings are checked; the error names key, value and rule."""
    key = where.removeprefix("config.")
    env = ENV_PREFIX + key.replace(".", "_").upper()
    choices = f.metadata.get("choices") or ()
    for item in (value if isinstance(value, list) else [value]):
        if choices and item not in choices:
            raise ConfigError(f"{key} ({env}): {item!r} is not allowed; expected one of: {', '.join(choices)}")
    bounds = f.metadata.get("bounds")
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise ConfigError(f"{key} ({env}): {value!r} is not allowed; expected {bounds[0]} to {bounds[1]}")
    return value


_SCALARS: dict[Any, Callable[[Any], bool]] = {  # a setting's type -> does a value have it (bool is no number)
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it has the setting's type (an int where a float is wanted becomes a float), else a
    ConfigError naming the setting."""
    if not _has_type(value, hint):
        raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
    return float(value) if hint is float else value


def _has_type(value: Any, hint: Any) -> bool:
    if hint in _SCALARS:
        return _SCALARS[hint](value)
    origin = typing.get_origin(hint)
    if origin is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    if origin in (typing.Union, types.UnionType):
        return value is None or any(_matches(value, arg) for arg in typing.get_args(hint))
    return True


def _matches(value: Any, hint: Any) -> bool:
    try:
        _check_type(value, hint, "")
        return True
    except ConfigError:
        return False
