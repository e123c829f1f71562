"""The process-wide runtime: everything one toolproxy process opens once and shares.

Owns: opening the shared objects in order (one ``aiohttp.ClientSession``, the
hot path's ``HttpWire``, one Redis client, refused at once if a master may evict
(proxy/eviction.py), the registry, the stages, the pipeline, the background tasks),
closing all of them at shutdown, and closing again whatever was already
opened when a step of start-up fails. Must never: serve HTTP (the fronts in
``proxy/fronts/app.py``, ``proxy/fronts/admin_api.py``, ``proxy/fronts/mcp/front.py`` and
``proxy/fronts/openai.py`` do) or hold a stage's rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp

from ..policy import approvals as approvals_module
from .. import flow as flow_module, locks as locks_module, operations as operations_module, store
from ..adapters.call_tokens import CallTokens, load_call_tokens, warn_if_ephemeral
from ..adapters import DeferredAdapter
from ..adapters.http import HttpAdapter
from ..credentials import Credentials
from ..credentials.load import load_credentials
from ..credentials.references import check_references
from ..adapters.mcp_pins import PinWatcher
from ..policy.approvals import ApprovalStore
from ..audit import Auditor, build_sinks
from ..policy.authorize import Authorizer
from ..transactions.cancellation import Cancellations
from ..transactions.compensation import Compensations
from ..backpressure import BackendGuard
from ..config import Config, ConfigError
from ..drift import Quarantine
from ..policy.decisions import build_recorder
from ..policy.denials import DenialLog
from ..eviction import EvictionWatch
from ..flow import FlowLedger
from .drain import Drain
from .health import Health
from ..idempotency import IdempotencyStage
from ..identity import Authenticator, self_approval_warning
from ..wire.http import HttpWire, Limits
from ..locks import LockManager
from ..telemetry import record_view, spans
from ..telemetry.metrics import Metrics
from ..operations import OperationStore, answer_bound_problem
from ..integrity import IntegrityGuard, IntegrityKeyError, RecordMac
from ..policy.opa_control import read_token
from ..pipeline import Pipeline
from ..policy.client import PolicyClient
from ..quotas import QuotaStage
from ..transactions.reconcile import Reconciler
from ..registry import LiveRegistry, Registry, load_registry, notices, unmapped_services
from .registry_reload import RegistryReloader
from ..batch.scheduler import Scheduler
from ..store import key
from ..transactions.unknowns import UnknownIndex
from ..versions import VersionResolver

log = logging.getLogger("toolproxy.runtime")


@dataclass
class Runtime:
    """Process-wide shared objects, created once at start-up and closed at shutdown."""

    config: Config
    registry: Registry
    session: aiohttp.ClientSession
    wire: HttpWire  # the backend POST's keep-alive connections
    decision_wire: HttpWire  # everything asked of OPA (decisions, catalog, health), on its socket or TCP address
    authenticator: Authenticator
    pipeline: Pipeline
    metrics: Metrics
    redis: store.Client
    audit: Auditor
    unknowns: UnknownIndex
    health: Health
    policy: PolicyClient
    approvals: ApprovalStore
    operations: OperationStore
    reconciler: Reconciler
    scheduler: Scheduler  # batches; holds the per-tenant/per-tool limits every batch of this process shares
    denials: DenialLog
    locks: LockManager
    reloader: RegistryReloader
    quotas: QuotaStage    # fleet-wide limits and the backends' back-pressure (its guard listens to Redis)
    compensations: Compensations  # POST /v1/operations/{key}:compensate and the failed compensations' takeovers
    call_tokens: CallTokens       # signs every backend request's Txn-Token; its JWKS is served on the ops listener
    drain: Drain                  # SIGTERM: refuse new calls, finish or cut the ones in flight (readiness fails)
    integrity: IntegrityGuard | None = None  # refuses (counts, audits) records whose MAC does not verify
    pins: PinWatcher | None = None  # pinned MCP upstreams, checked; their drifted tools quarantined (proxy/drift.py)
    credentials: Credentials | None = None  # what backend requests carry (backend.auth), asked per call by adapters
    # MCP upstreams behind OAuth (credentials of kind mcp_*): their token sources; None when none is configured
    mcp_credentials: Any = None
    user_grants: Any = None  # the per-user grants the console's connections page connects (mcp_authorization_code)

    def count_refusal(self, code: str) -> None:
        """A request refused before it reached a handler (aiohttp's parser): counted like any other."""
        self.metrics.request_errors.labels(code).inc()

    async def close(self) -> None:
        await self.reloader.stop()
        if self.pins is not None:
            await self.pins.stop()
        await self.reconciler.stop()
        await self.pipeline.cancellations.stop()
        await self.quotas.guard.stop()
        await self.pipeline.aclose()
        if self.credentials is not None:
            await self.credentials.aclose()
        if self.mcp_credentials is not None:
            await self.mcp_credentials.aclose()
        await self.session.close()
        await self.wire.close()
        await self.decision_wire.close()
        await store.close_client(self.redis)
        await asyncio.to_thread(spans.shutdown)  # the last spans, bounded by tracing.export_timeout_ms


def _mcp_adapter(config: Config, call_tokens: CallTokens, wire: HttpWire, credentials: Any = None,
                 backend_credentials: Any = None) -> Any:
    """The MCP adapter, and with it the MCP SDK's client side (imported here: ``DeferredAdapter``)."""
    from ..adapters.mcp import McpAdapter
    from ..wire import mcp as mcp_wire
    def upstream_tokens(call: Any, url: str) -> Any:  # the access tokens of the call's upstream, as its caller
        return credentials.source(call.tool.backend.auth, url, call.tenant, call.subject)
    oauth = upstream_tokens if credentials is not None else None
    return McpAdapter(config.backends.services, tokens=call_tokens, oauth=oauth,
                      fixed_headers=backend_credentials.fixed_headers if backend_credentials is not None else None,
                      backend_credentials=backend_credentials,
                      max_response_bytes=config.backends.max_response_bytes,
                      max_json_depth=config.decode.max_depth,
                      connect_timeout_s=config.backends.connect_timeout_ms / 1000.0,
                      handshake_timeout_s=config.mcp.upstream_handshake_timeout_ms / 1000.0,
                      mode=config.mcp.upstream_mode, wire=wire,
                      answer_limits=mcp_wire.Limits(max_bytes=config.mcp.upstream_max_answer_bytes,
                                                    max_events=config.mcp.upstream_max_stream_events))


def check_key_layout(config: Config) -> None:
    """Every Lua script's keys, as the stores build them, hash to one Cluster slot (ConfigError if not)."""
    prefix = config.redis.key_prefix
    store.check_one_slot({**operations_module.script_key_sets(prefix),
                          **locks_module.script_key_sets(prefix, config.locks.scope),
                          **approvals_module.script_key_sets(prefix),
                          **flow_module.script_key_sets(prefix)})


def log_notices(registry: Registry) -> None:
    """What the registry relies on, at start-up (``registry.notices``): writes that require a key by default
    without saying so (a warning each, with how to opt out), the opt-outs with their reasons, and writes
    serialized with their whole service for declaring no resources."""
    for level, line in notices(registry):
        if level == "opt-out":
            log.info("registry: opt-out: %s", line)
        else:
            log.warning("registry: %s", line)


def check_services(registry: Registry, services: Mapping[str, str]) -> None:
    """A contract naming a backend service ``backends.services`` does not map stops start-up in one line (a
    misspelled name). With no service mapped at all (a registry served before its backends are configured,
    such as the chart's demo registry) each is a warning instead: its calls fail until it is mapped."""
    unmapped = unmapped_services(registry, services)
    if unmapped and not services:
        for line in unmapped:
            log.warning("%s", line)
    elif unmapped:
        more = f" (and {len(unmapped) - 1} more)" if len(unmapped) > 1 else ""
        raise ConfigError(unmapped[0] + more)


async def create_runtime(config: Config, registry: Registry | None = None) -> Runtime:
    """Open everything the process shares. If any step fails, what was already opened is closed
    again (no unclosed session or pool, no reconciler left running) and the error goes on."""
    mac = _check_files(config)
    call_tokens = load_call_tokens(config.call_tokens)
    registry = LiveRegistry(registry or load_registry(config.registry.paths))
    check_references(registry, config.credentials, config.backends.services)
    log_notices(registry)
    async with contextlib.AsyncExitStack() as opened:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.backends.pool_size),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.backends.connect_timeout_ms / 1000.0),
            json_serialize=json.dumps,
        )
        opened.push_async_callback(session.close)
        # The two requests every call makes (decision, backend POST) go over their own lean wires: one for
        # the backends, one for the decisions (slow backends never take a decision's connection).
        backends = config.backends
        wire_limits = Limits(head_bytes=backends.max_header_bytes, headers=backends.max_headers,
                             body_bytes=backends.max_response_bytes,
                             answer_s=backends.answer_timeout_ms / 1000.0 if backends.answer_timeout_ms else None)
        wire = HttpWire(max_connections=backends.pool_size, max_per_origin=backends.pool_per_origin,
                        connect_timeout_s=backends.connect_timeout_ms / 1000.0,
                        idle_timeout_s=backends.idle_timeout_ms / 1000.0, limits=wire_limits)
        opened.push_async_callback(wire.close)
        # A decision answer is OPA's, not a backend's: backends.max_response_bytes does not bound it (a small
        # backend limit would fail every decision closed); the wire's default body bound does.
        decision_limits = Limits(head_bytes=backends.max_header_bytes, headers=backends.max_headers,
                                 answer_s=wire_limits.answer_s)
        decision_wire = HttpWire(max_connections=config.opa.pool_size,
                                 connect_timeout_s=backends.connect_timeout_ms / 1000.0,
                                 idle_timeout_s=backends.idle_timeout_ms / 1000.0, limits=decision_limits,
                                 unix_socket=config.opa.socket_path)
        opened.push_async_callback(decision_wire.close)
        redis = store.create_client(config.redis)
        opened.push_async_callback(store.close_client, redis)
        metrics = Metrics()
        spans.configure(config.tracing)  # imports the OpenTelemetry SDK only when an endpoint is set
        opened.callback(spans.shutdown)
        # A Redis that may evict is not a state store: refused here (one line) unless redis.accept_eviction.
        eviction = EvictionWatch(config.redis, redis, metrics)
        await eviction.at_startup()
        limits = {"max_response_bytes": config.backends.max_response_bytes, "max_json_depth": config.decode.max_depth}
        mcp_credentials = None
        if any(entry.kind.startswith("mcp_") for entry in config.credentials.values()):
            from ..credentials.mcp_load import load_mcp_credentials  # the MCP SDK's OAuth client: only then
            mcp_credentials = load_mcp_credentials(
                config.credentials, redis=redis, key_prefix=config.redis.key_prefix,
                connect_timeout_s=config.backends.connect_timeout_ms / 1000.0,
                on_answer=lambda name, kind, result: metrics.credential_tokens.labels(name, kind, result).inc())
            opened.push_async_callback(mcp_credentials.aclose)
        credentials = load_credentials(config.credentials, session,
                                       on_answer=lambda name, kind, result:
                                       metrics.credential_tokens.labels(name, kind, result).inc())
        opened.push_async_callback(credentials.aclose)
        mcp_adapter = DeferredAdapter(lambda: _mcp_adapter(config, call_tokens, wire, mcp_credentials,
                                                            credentials),
                                      cancel_by_closing=True)
        if any(tool.backend.type == "mcp" for tool in registry.all()):
            mcp_adapter.warm()  # the MCP SDK: imported at start-up when a tool needs it, never by a first call
        opened.push_async_callback(mcp_adapter.aclose)
        adapters = {"http": HttpAdapter(wire, session, config.backends.services, tokens=call_tokens,
                                        credentials=credentials, **limits), "mcp": mcp_adapter}
        # One fingerprint key for audit and decision records (derived from the record MAC key): one value has
        # one fingerprint in both, on every sidecar that shares the key.
        fingerprint_key = mac.derived_key(record_view.KEY_PURPOSE)
        audit = Auditor(config.audit, build_sinks(config.audit, redis, key(config.redis.key_prefix, "audit", "stream"),
                                                  metrics), metrics, fingerprint_key=fingerprint_key)
        integrity = IntegrityGuard(mac, metrics, audit)
        too_large = answer_bound_problem(max(config.backends.max_response_bytes,
                                             config.mcp.upstream_max_answer_bytes))
        if too_large:
            raise ConfigError(too_large)
        operations = OperationStore(redis, config.redis.key_prefix, mac=mac, replica_acks=config.redis.replica_acks,
                                    ack_timeout_ms=config.redis.replica_ack_timeout_ms,
                                    on_shortfall=metrics.replica_ack_shortfall)
        unknowns = UnknownIndex(redis, config.redis.key_prefix, operations)
        recorder = build_recorder(config.decisions, redis, key(config.redis.key_prefix, "decisions", "stream"),
                                  metrics, config.opa.decision_path, fingerprint_key=fingerprint_key)
        policy = PolicyClient(config.opa, decision_wire, metrics, registry, recorder)
        approvals = ApprovalStore(redis, config.approvals, metrics, config.redis.key_prefix, audit, integrity,
                                  replica_acks=config.redis.replica_acks,
                                  ack_timeout_ms=config.redis.replica_ack_timeout_ms)
        denials = DenialLog(redis, config.redis.key_prefix, metrics)
        idempotency = IdempotencyStage(store=operations, config=config.idempotency, reconcile=config.reconcile,
                                       metrics=metrics,
                                       integrity=integrity)
        quotas = QuotaStage(redis, config, registry, metrics,
                            BackendGuard(redis, config.quotas, registry, key_prefix=config.redis.key_prefix,
                                         metrics=metrics))
        if config.quotas.enabled:
            quotas.guard.start()
            opened.push_async_callback(quotas.guard.stop)
        locks = LockManager(redis, config.locks, key_prefix=config.redis.key_prefix, metrics=metrics)
        reconciler = Reconciler(store=operations, registry=registry, session=session,
                                services=config.backends.services, config=config.reconcile, metrics=metrics,
                                audit=audit, max_json_depth=config.decode.max_depth, locks=locks,
                                tokens=call_tokens, credentials=credentials)
        cancellations = Cancellations(config=config.cancellation, store=operations, adapters=adapters, audit=audit,
                                      metrics=metrics, redis=redis, registry=registry, integrity=integrity,
                                      channel=key(config.redis.key_prefix, "cancel", "all"))
        cancellations.status_query = reconciler.query_status
        flow = FlowLedger(redis, prefix=config.redis.key_prefix, window_s=config.flow.window_s,
                          read_for=config.flow.read_for, fingerprint_key=mac.derived_key("provenance"),
                          provenance_max_values=config.flow.provenance_max_values)
        pipeline = Pipeline(config=config, registry=registry, adapters=adapters, metrics=metrics, audit=audit,
                            unknowns=unknowns, authorizer=Authorizer(policy, approvals, denials, flow),
                            idempotency=idempotency,
                            locks=locks, quotas=quotas,
                            versions=VersionResolver(redis=redis, prefix=config.redis.key_prefix,
                                                     pin_ttl_s=config.registry.run_pin_ttl_s,
                                                     read_policy=config.idempotency.read_policy),
                            redis=redis, cancellations=cancellations, flow=flow,
                            quarantine=Quarantine(serve_unverified=config.mcp_pins.unverified == "serve",
                                                  max_age_s=config.mcp_pins.max_age_ms / 1000.0,
                                                  read_max_age_s=config.mcp_pins.read_max_age_ms / 1000.0))
        compensations = Compensations(store=operations, registry=registry, pipeline=pipeline, policy=policy,
                                      audit=audit, metrics=metrics, key_prefix=config.redis.key_prefix,
                                      max_json_depth=config.decode.max_depth, integrity=integrity)
        async def refresh_records_held() -> None:
            metrics.operation_records.set(await operations.held_records())

        async def refresh_freezes() -> None:
            frozen = await locks.frozen(tenant=None, limit=0)
            metrics.frozen_resources.set(frozen["frozen_resources"])
            metrics.oldest_freeze_age.set(frozen["oldest_age_s"])

        drain = Drain(config.shutdown)
        health = Health(config=config, registry=registry, redis=redis, metrics=metrics, opa_wire=decision_wire,
                        accepting=lambda: not drain.draining,
                        unknowns=unknowns, eviction=eviction,
                        gauge_refreshers=(approvals.refresh_gauges, refresh_records_held, refresh_freezes))
        authenticator = Authenticator(config.identity, config.admin_identity, session)
        check_services(registry, config.backends.services)  # after the settings' own checks: one line each
        if config.identity.mode == "static":
            log.warning("identity.mode is static: every call runs as %s/%s (dev stack and tests only)",
                        config.identity.static_tenant, config.identity.static_subject)
        warn_if_ephemeral(call_tokens)
        if config.opa.push_catalog:
            await policy.push_catalog()  # best effort: a missing catalog is reloaded on first use
        reconciler.start()
        opened.push_async_callback(reconciler.stop)
        cancellations.start()  # cancel requests published by other replicas
        opened.push_async_callback(cancellations.stop)
        pins = PinWatcher(registry, pipeline.quarantine, services=config.backends.services, config=config.mcp_pins,
                          mode=config.mcp.upstream_mode, metrics=metrics,
                          connect_timeout_s=config.backends.connect_timeout_ms / 1000.0,
                          auth_for=mcp_credentials.pin_auth if mcp_credentials is not None else None,
                          headers_for=credentials.fixed_headers)
        opened.push_async_callback(pins.stop)
        await pins.start()  # the first check of every pinned upstream, bounded by mcp_pins.check_timeout_ms
        reloader = RegistryReloader(paths=config.registry.paths, live=registry, policy=policy, metrics=metrics,
                                    services=config.backends.services,
                                    interval_ms=config.registry.reload_interval_ms,
                                    push_catalog=config.opa.push_catalog, on_swap=pins.sync,
                                    check=lambda new: check_references(new, config.credentials,
                                                                       config.backends.services))
        reloader.start()
        opened.push_async_callback(reloader.stop)
        scheduler = Scheduler(pipeline=pipeline, registry=registry, config=config.scheduler,
                              metrics=metrics, audit=audit,
                              cancel_answer_wait_s=config.cancellation.answer_wait_ms / 1000.0)
        runtime = Runtime(config=config, registry=registry, session=session, wire=wire, decision_wire=decision_wire,
                          authenticator=authenticator,
                          pipeline=pipeline, metrics=metrics, redis=redis, audit=audit, unknowns=unknowns,
                          health=health, policy=policy, approvals=approvals, operations=operations,
                          reconciler=reconciler, scheduler=scheduler, denials=denials, locks=locks,
                          reloader=reloader, quotas=quotas, compensations=compensations, integrity=integrity,
                          call_tokens=call_tokens, pins=pins, drain=drain, credentials=credentials,
                          mcp_credentials=mcp_credentials,
                          user_grants=mcp_credentials.user_grants if mcp_credentials is not None else None)
        opened.pop_all()  # from here on Runtime.close() closes them
    _warn_once_up(config, eviction, mac)
    return runtime


def _check_files(config: Config) -> RecordMac:
    """What start-up reads before opening anything: the Lua scripts' key layout, the record MAC key and the OPA
    token file. A bad one stops start-up in one line; the MAC key is returned."""
    check_key_layout(config)
    try:
        mac = RecordMac.from_file(config.integrity.mac_key_file)
    except IntegrityKeyError as exc:
        raise ConfigError(str(exc)) from None
    try:
        read_token(config.opa.token_file)  # read again by the OPA clients; a bad file stops start-up here
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return mac


def _warn_once_up(config: Config, eviction: EvictionWatch, mac: RecordMac) -> None:
    """The warnings said once the process is up, after any refusal could have come: a start-up failure stays
    one line."""
    eviction.log_startup_warnings()
    warning = self_approval_warning(config.identity, config.admin_identity)
    if warning:
        log.warning("%s", warning)
    if mac.ephemeral:
        log.warning("integrity.mac_key_file is not set: records are signed with a key of this process only, so "
                    "approvals and outcomes written by any other process (or before a restart) are refused")
