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
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

ENV_PREFIX = "TOOLPROXY_"


class ConfigError(Exception):
    """A configuration file or variable is malformed; the message names it."""


def setting(default: Any, help: str) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ListenerConfig:
    host: str = setting("127.0.0.1", "address the listener binds to")
    port: int = setting(8787, "TCP port of the listener")


@dataclass(frozen=True)
class AgentListenerConfig(ListenerConfig):
    max_body_bytes: int = setting(1024 * 1024, "largest accepted request body (payload_too_large above)")


def _admin_listener() -> ListenerConfig:
    return ListenerConfig(port=8788)


def _ops_listener() -> ListenerConfig:
    return ListenerConfig(port=9464)


@dataclass(frozen=True)
class RegistryConfig:
    paths: list[str] = setting(["examples/registry"], "registry YAML files or directories of *.yaml")


@dataclass(frozen=True)
class BackendsConfig:
    services: dict[str, str] = setting({}, "service name -> base URL for registry backends that say `service:`")
    max_response_bytes: int = setting(4 * 1024 * 1024, "largest backend response accepted (output_invalid above)")
    connect_timeout_ms: int = setting(1000, "cap on TCP connect time to a backend")
    pool_size: int = setting(100, "connections in the shared HTTP client pool")


@dataclass(frozen=True)
class DeadlineConfig:
    margin_ms: int = setting(50, "budget kept back for serialization and replying (epsilon of seed 000 4.2)")
    max_request_timeout_ms: int = setting(600000, "upper bound accepted for a caller's deadline")


@dataclass(frozen=True)
class JwtConfig:
    issuer: str = setting("", "required `iss` of accepted tokens (empty: not checked; set it in production)")
    audience: str = setting("toolproxy", "required `aud` of accepted tokens")
    jwks_file: str = setting("", "JWKS file with the verification keys (re-read when it changes)")
    jwks_url: str = setting("", "JWKS URL with the verification keys (cached, refreshed)")
    public_key_file: str = setting("", "PEM public key, when there is no JWKS")
    hmac_secret_file: str = setting("", "file with a shared HS* secret; HS* algorithms are refused without it")
    algorithms: list[str] = setting(["RS256", "ES256", "EdDSA"], "accepted JWT algorithms (`none` never is)")
    leeway_s: int = setting(30, "clock skew allowed on exp/nbf/iat")
    jwks_refresh_s: int = setting(300, "how long fetched JWKS keys are cached")
    claim_subject: str = setting("sub", "claim holding the subject")
    claim_tenant: str = setting("tenant", "claim holding the tenant")
    claim_roles: str = setting("roles", "claim holding the roles (list or space-separated string)")
    claim_scopes: str = setting("scope", "claim holding the scopes (list or space-separated string)")


def _admin_jwt() -> JwtConfig:
    return JwtConfig(audience="toolproxy-admin")


@dataclass(frozen=True)
class HeaderIdentityConfig:
    subject: str = setting("X-Auth-Subject", "headers mode: header with the subject")
    tenant: str = setting("X-Auth-Tenant", "headers mode: header with the tenant")
    roles: str = setting("X-Auth-Roles", "headers mode: header with comma-separated roles")
    scopes: str = setting("X-Auth-Scopes", "headers mode: header with space- or comma-separated scopes")


@dataclass(frozen=True)
class IdentityConfig:
    mode: str = setting("jwt", "where the caller's identity comes from: jwt, headers (trusted mesh) or static "
                              "(dev stack and tests only; never the default)")
    static_subject: str = setting("dev-user", "static mode: subject of every call")
    static_tenant: str = setting("acme", "static mode: tenant of every call")
    static_roles: list[str] = setting(["agent"], "static mode: roles of every call")
    static_scopes: list[str] = setting(["tools:read", "tools:write"], "static mode: scopes of every call")
    agent_id: str = setting("dev-agent", "identity of the agent this sidecar serves (pod service account)")
    jwt: JwtConfig = field(default_factory=JwtConfig, metadata={"help": "jwt mode: the agent's bearer token"})
    headers: HeaderIdentityConfig = field(default_factory=HeaderIdentityConfig,
                                          metadata={"help": "headers mode: identity set by a trusted mesh"})


@dataclass(frozen=True)
class AdminIdentityConfig:
    mode: str = setting("jwt", "how approvers authenticate on the admin listener: jwt or disabled")
    approver_role: str = setting("approver", "role an admin token needs to list, approve or deny approvals")
    approver_scope: str = setting("", "scope an admin token needs as well (empty: none)")
    operator_role: str = setting("operator", "role an admin token needs to see and resolve unknown operations "
                                             "and takeovers")
    jwt: JwtConfig = field(default_factory=_admin_jwt,
                           metadata={"help": "the approver's token: its own audience/issuer/keys"})


@dataclass(frozen=True)
class ApprovalsConfig:
    ttl_s: int = setting(900, "how long a pending or approved approval stays valid")
    max_list: int = setting(200, "most approvals one admin listing returns")


@dataclass(frozen=True)
class OpaConfig:
    url: str = setting("http://127.0.0.1:8181", "base URL of the OPA server")
    decision_path: str = setting("toolproxy/decision", "Data API path of the decision document")
    timeout_ms: int = setting(500, "timeout of one OPA query (fail closed after it)")
    push_catalog: bool = setting(True, "PUT the registry's tool catalog into OPA at start-up and when OPA lost it "
                                       "(false when a bundle ships it)")


@dataclass(frozen=True)
class RedisConfig:
    url: str = setting("redis://127.0.0.1:6379/0", "Redis URL (redis:// or rediss://)")
    key_prefix: str = setting("toolproxy", "prefix of every key this proxy writes")
    timeout_ms: int = setting(500, "socket timeout of one Redis command")
    max_connections: int = setting(100, "connections in the process's Redis pool; past it a command waits up to "
                                        "timeout_ms for a free one")
    password: str = setting("", "Redis password (AUTH), used when the URL carries none; set it from a Secret")
    tls_ca_file: str = setting("", "rediss:// only: CA bundle that verifies the Redis server (default: system CAs)")
    tls_cert_file: str = setting("", "rediss:// only: client certificate for mutual TLS")
    tls_key_file: str = setting("", "rediss:// only: private key of tls_cert_file")

    def __post_init__(self) -> None:
        tls = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(tls) and not self.url.startswith("rediss://"):
            raise ConfigError("redis.tls_* files are set but redis.url is not rediss://")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("redis.tls_cert_file and redis.tls_key_file go together (mutual TLS needs both)")


@dataclass(frozen=True)
class McpConfig:
    page_size: int = setting(50, "MCP tools/list: tools per page (nextCursor beyond)")
    max_sessions: int = setting(1000, "MCP legacy sessions (initialize + Mcp-Session-Id) held at once; 503 above")
    session_idle_s: int = setting(1800, "MCP legacy session expiry after this long without a request (404 after)")
    sse_after_ms: int = setting(10000, "MCP tools/call still running after this long answers as an SSE stream "
                                       "with keepalive pings, when the client accepts text/event-stream")
    sse_ping_ms: int = setting(15000, "MCP SSE keepalive comment interval")
    upstream_mode: str = setting("auto", "MCP backends: auto (2026-07-28 stateless if the upstream offers it, else "
                                         "initialize + session) or legacy (always initialize + session)")
    upstream_handshake_timeout_ms: int = setting(5000, "MCP backends: cap on opening a session to an upstream "
                                                       "(discover or initialize), also bounded by the call budget")


@dataclass(frozen=True)
class IdempotencyConfig:
    lease_grace_ms: int = setting(2000, "added to a call's budget to form its IN_PROGRESS lease; a lease that runs "
                                        "out means the proxy died mid-call (UNKNOWN for a write)")
    max_attempts: int = setting(5, "executions allowed under one key; the next retry of a FAILED_RETRYABLE key "
                                   "makes it FAILED_FINAL (operation_failed)")
    max_wait_ms: int = setting(30000, "cap on `Prefer: wait=<s>` while another call holds the key")
    wait_poll_ms: int = setting(50, "how often a waiting call re-reads the record")
    read_policy: str = setting("proceed", "reads that use idempotency when Redis is unreachable: proceed (without "
                                          "a record) or fail_closed (dependency_unavailable)")

    def __post_init__(self) -> None:
        if self.read_policy not in ("proceed", "fail_closed"):
            raise ConfigError(f"idempotency.read_policy: expected proceed or fail_closed, got {self.read_policy!r}")


@dataclass(frozen=True)
class ReconcileConfig:
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
class LocksConfig:
    scope: str = setting("tenant", "lock namespace and Redis Cluster hash tag: tenant (a tenant's locks share one "
                                   "slot; tenants never exclude each other) or global (one slot for all locks)")
    lease_ms: int = setting(5000, "lease of a held lock set, renewed while the call runs; a crashed proxy's "
                                  "locks free up after it")
    renew_interval_ms: int = setting(1500, "how often a held lock set is renewed (well below lease_ms)")
    poll_min_ms: int = setting(5, "first pause between attempts while waiting for a busy resource")
    poll_max_ms: int = setting(100, "longest pause between attempts (exponential backoff with jitter)")
    max_wait_ms: int = setting(30000, "longest lock wait for a caller that sent no deadline")

    def __post_init__(self) -> None:
        if self.scope not in ("tenant", "global"):
            raise ConfigError(f"locks.scope: expected tenant or global, got {self.scope!r}")
        if not 0 < self.renew_interval_ms < self.lease_ms:
            raise ConfigError("locks.renew_interval_ms must be positive and below locks.lease_ms")
        if not 0 < self.poll_min_ms <= self.poll_max_ms:
            raise ConfigError("locks.poll_min_ms must be positive and at most locks.poll_max_ms")
        if self.max_wait_ms < 0:
            raise ConfigError("locks.max_wait_ms must not be negative")


@dataclass(frozen=True)
class SchedulerConfig:
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
class LogConfig:
    level: str = setting("info", "log level: debug, info, warning, error")
    format: str = setting("json", "log line format on stderr: json or kv (key=value)")


@dataclass(frozen=True)
class AuditConfig:
    sinks: list[str] = setting(["stdout"], "where audit records go: stdout (JSON lines), redis (a Redis Stream), or both")
    stream_maxlen: int = setting(100000, "redis sink: approximate maximum length of the audit stream (XADD MAXLEN ~)")
    on_failure_write: str = setting("fail_closed", "write tools when a sink fails: fail_closed (no audit intent, "
                                    "no call) or fail_open (count and log, go on)")
    on_failure_read: str = setting("fail_open", "read tools when a sink fails: fail_open or fail_closed")
    timeout_ms: int = setting(500, "bound on writing one record to one sink")
    stdout_queue_records: int = setting(10000, "stdout sink: records held while stdout's pipe is full (nobody "
                                        "reads it); past that they are dropped and counted, never blocking a call")
    max_string_chars: int = setting(256, "argument strings longer than this are truncated in audit records")


@dataclass(frozen=True)
class Config:
    listen: AgentListenerConfig = field(default_factory=AgentListenerConfig, metadata={"help": "agent-facing API"})
    admin: ListenerConfig = field(default_factory=_admin_listener, metadata={"help": "approver/operator API"})
    ops: ListenerConfig = field(default_factory=_ops_listener, metadata={"help": "metrics and probes"})
    registry: RegistryConfig = field(default_factory=RegistryConfig, metadata={"help": "tool contracts"})
    backends: BackendsConfig = field(default_factory=BackendsConfig, metadata={"help": "tool backends"})
    deadline: DeadlineConfig = field(default_factory=DeadlineConfig, metadata={"help": "deadlines"})
    identity: IdentityConfig = field(default_factory=IdentityConfig, metadata={"help": "trusted identity"})
    admin_identity: AdminIdentityConfig = field(default_factory=AdminIdentityConfig,
                                                metadata={"help": "approver credential"})
    opa: OpaConfig = field(default_factory=OpaConfig, metadata={"help": "policy decisions"})
    approvals: ApprovalsConfig = field(default_factory=ApprovalsConfig, metadata={"help": "human approvals"})
    redis: RedisConfig = field(default_factory=RedisConfig, metadata={"help": "state store"})
    mcp: McpConfig = field(default_factory=McpConfig, metadata={"help": "MCP front and MCP backends"})
    idempotency: IdempotencyConfig = field(default_factory=IdempotencyConfig,
                                           metadata={"help": "idempotency records"})
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig, metadata={"help": "unknown outcomes"})
    locks: LocksConfig = field(default_factory=LocksConfig, metadata={"help": "resource locks"})
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": "logging"})
    audit: AuditConfig = field(default_factory=AuditConfig, metadata={"help": "audit records"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig,
                                       metadata={"help": "batch scheduler (POST /v1/tool-calls:batch)"})


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None,
                base: Mapping[str, Any] | None = None) -> Config:
    """Build the config: defaults < ``base`` (a caller's own defaults, e.g. the dev
    stack's) < YAML file < environment < explicit overrides."""
    data: dict[str, Any] = {}
    for dotted, value in (base or {}).items():
        _set_dotted(data, dotted, value)
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read config: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        _deep_merge(data, loaded or {})
    env = os.environ if env is None else env
    for dotted, hint in _leaves(Config):
        name = ENV_PREFIX + dotted.replace(".", "_").upper()
        if name in env:
            _set_dotted(data, dotted, _parse_env(name, env[name], hint))
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    return _build(Config, data, "config")


def _deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for name, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            _deep_merge(into[name], value)
        else:
            into[name] = value


def describe() -> Iterator[tuple[str, str, Any, str]]:
    """(key, env var, default, help) for every setting: the README's reference table."""
    yield from _describe(Config, Config(), "")


def _describe(cls: type, instance: Any, prefix: str) -> Iterator[tuple[str, str, Any, str]]:
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _describe(type(value), value, key + ".")
        else:
            yield key, ENV_PREFIX + key.replace(".", "_").upper(), value, f.metadata.get("help", "")


def _leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
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
            lowered = raw.strip().lower()
            if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                raise ValueError("expected true or false")
            return lowered in {"1", "true", "yes", "on"}
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        if origin is list:
            return [item.strip() for item in raw.split(",") if item.strip()]
        if origin is dict:
            pairs = [item for item in raw.split(",") if item.strip()]
            result = {}
            for pair in pairs:
                key, sep, value = pair.partition("=")
                if not sep:
                    raise ValueError(f"expected name=value, got {pair!r}")
                result[key.strip()] = value.strip()
            return result
        return raw
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping")
    hints = typing.get_type_hints(cls)
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
        else:
            kwargs[f.name] = _check_type(value, hint, path)
    return cls(**kwargs)


def _check_type(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    elif origin is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    elif origin in (typing.Union, types.UnionType):
        ok = value is None or any(_matches(value, arg) for arg in typing.get_args(hint))
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {type(value).__name__}")
    return value


def _matches(value: Any, hint: Any) -> bool:
    try:
        _check_type(value, hint, "")
        return True
    except ConfigError:
        return False
