"""The aiohttp applications: wiring only.

Owns: building the process-wide runtime (one ``aiohttp.ClientSession``, the
registry, the pipeline) and translating HTTP requests into pipeline calls and
envelopes back. Must never: hold business rules — every decision lives in a
stage module; handlers translate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import aiohttp
import redis.exceptions
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from . import console, envelope, ingress, logs, openai_front
from .adapters.http import HttpAdapter, trace_config
from .adapters.mcp import McpAdapter
from .audit import Auditor, build_sinks
from .decisions import build_recorder
from .approvals import ApprovalStore
from .authorize import Authorizer
from .config import Config
from .denials import DenialLog
from .envelope import dumps
from .errors import ProxyError
from .health import Health
from .http_server import EnvelopeRunner
from .idempotency import IdempotencyStage, find_operation
from .identity import Authenticator, Caller
from .locks import LockManager
from .mcp_front import McpFront
from .metrics import Metrics
from .operations import OperationStore
from .pipeline import Pipeline, RequestMeta, ToolCallRequest
from .listing import visible_tools
from .policy import PolicyClient
from .reconcile import Reconciler, list_takeovers, resolve_by_operator
from .registry import LiveRegistry, Registry, load_registry
from .registry_reload import RegistryReloader
from .plan import plan_from_json
from .backpressure import BackendGuard
from .quotas import QuotaStage, retry_after_header
from .scheduler import Scheduler
from . import approvals as approvals_module, locks as locks_module, operations as operations_module, store
from .store import key
from .unknowns import UnknownIndex
from .versions import VersionResolver

log = logging.getLogger("toolproxy.app")


@dataclass
class Runtime:
    """Process-wide shared objects, created once at start-up and closed at shutdown."""

    config: Config
    registry: Registry
    session: aiohttp.ClientSession
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

    def count_refusal(self, code: str) -> None:
        """A request refused before it reached a handler (aiohttp's parser): counted like any other."""
        self.metrics.request_errors.labels(code).inc()

    async def close(self) -> None:
        await self.reloader.stop()
        await self.reconciler.stop()
        await self.quotas.guard.stop()
        await self.pipeline.aclose()
        await self.session.close()
        await self.policy.close()
        await self.health.close()
        await store.close_client(self.redis)


RUNTIME = web.AppKey("runtime", Runtime)


def check_key_layout(config: Config) -> None:
    """Every Lua script's keys, as the stores build them, hash to one Cluster slot (ConfigError if not)."""
    prefix = config.redis.key_prefix
    store.check_one_slot({**operations_module.script_key_sets(prefix),
                          **locks_module.script_key_sets(prefix, config.locks.scope),
                          **approvals_module.script_key_sets(prefix)})


async def create_runtime(config: Config, registry: Registry | None = None) -> Runtime:
    """Open everything the process shares. If any step fails, what was already opened is closed
    again (no unclosed session or pool, no reconciler left running) and the error goes on."""
    check_key_layout(config)
    registry = LiveRegistry(registry or load_registry(config.registry.paths))
    async with contextlib.AsyncExitStack() as opened:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.backends.pool_size),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.backends.connect_timeout_ms / 1000.0),
            trace_configs=[trace_config()],
            json_serialize=json.dumps,
        )
        opened.push_async_callback(session.close)
        redis = store.create_client(config.redis)
        opened.push_async_callback(store.close_client, redis)
        limits = {"max_response_bytes": config.backends.max_response_bytes, "max_json_depth": config.decode.max_depth}
        mcp_adapter = McpAdapter(config.backends.services, **limits,
                                 connect_timeout_s=config.backends.connect_timeout_ms / 1000.0,
                                 handshake_timeout_s=config.mcp.upstream_handshake_timeout_ms / 1000.0,
                                 mode=config.mcp.upstream_mode)
        opened.push_async_callback(mcp_adapter.aclose)
        adapters = {"http": HttpAdapter(session, config.backends.services, **limits), "mcp": mcp_adapter}
        metrics = Metrics()
        audit = Auditor(config.audit, build_sinks(config.audit, redis, key(config.redis.key_prefix, "audit", "stream"),
                                                  metrics), metrics)
        operations = OperationStore(redis, config.redis.key_prefix, replica_acks=config.redis.replica_acks,
                                    ack_timeout_ms=config.redis.replica_ack_timeout_ms,
                                    on_shortfall=metrics.replica_ack_shortfall)
        unknowns = UnknownIndex(redis, config.redis.key_prefix, operations)
        recorder = build_recorder(config.decisions, redis, key(config.redis.key_prefix, "decisions", "stream"),
                                  metrics, config.opa.decision_path)
        policy = PolicyClient(config.opa, session, metrics, registry, recorder)
        await policy.open()
        opened.push_async_callback(policy.close)
        approvals = ApprovalStore(redis, config.approvals, metrics, config.redis.key_prefix, audit,
                                  replica_acks=config.redis.replica_acks,
                                  ack_timeout_ms=config.redis.replica_ack_timeout_ms)
        denials = DenialLog(redis, config.redis.key_prefix, metrics)
        idempotency = IdempotencyStage(store=operations, config=config.idempotency, reconcile=config.reconcile,
                                       metrics=metrics, margin_s=config.deadline.margin_ms / 1000.0)
        quotas = QuotaStage(redis, config, registry, metrics,
                            BackendGuard(redis, config.quotas, registry, key_prefix=config.redis.key_prefix,
                                         metrics=metrics))
        if config.quotas.enabled:
            quotas.guard.start()
            opened.push_async_callback(quotas.guard.stop)
        locks = LockManager(redis, config.locks, key_prefix=config.redis.key_prefix, metrics=metrics,
                            margin_s=config.deadline.margin_ms / 1000.0)
        pipeline = Pipeline(config=config, registry=registry, adapters=adapters, metrics=metrics, audit=audit,
                            unknowns=unknowns, authorizer=Authorizer(policy, approvals, denials),
                            idempotency=idempotency,
                            locks=locks, quotas=quotas,
                            versions=VersionResolver(redis=redis, prefix=config.redis.key_prefix,
                                                     pin_ttl_s=config.registry.run_pin_ttl_s,
                                                     read_policy=config.idempotency.read_policy),
                            redis=redis)
        health = Health(config=config, registry=registry, redis=redis, metrics=metrics,
                        unknowns=unknowns, gauge_refreshers=(approvals.refresh_gauges,))
        await health.open()
        opened.push_async_callback(health.close)
        authenticator = Authenticator(config.identity, config.admin_identity, session)
        if config.identity.mode == "static":
            log.warning("identity.mode is static: every call runs as %s/%s (dev stack and tests only)",
                        config.identity.static_tenant, config.identity.static_subject)
        if config.opa.push_catalog:
            await policy.push_catalog()  # best effort: a missing catalog is reloaded on first use
        reconciler = Reconciler(store=operations, registry=registry, session=session,
                                services=config.backends.services, config=config.reconcile, metrics=metrics,
                                audit=audit, max_json_depth=config.decode.max_depth)
        reconciler.start()
        opened.push_async_callback(reconciler.stop)
        reloader = RegistryReloader(paths=config.registry.paths, live=registry, policy=policy, metrics=metrics,
                                    interval_ms=config.registry.reload_interval_ms,
                                    push_catalog=config.opa.push_catalog)
        reloader.start()
        opened.push_async_callback(reloader.stop)
        scheduler = Scheduler(pipeline=pipeline, registry=registry, config=config.scheduler, deadline=config.deadline,
                              metrics=metrics, audit=audit)
        runtime = Runtime(config=config, registry=registry, session=session, authenticator=authenticator,
                          pipeline=pipeline, metrics=metrics, redis=redis, audit=audit, unknowns=unknowns,
                          health=health, policy=policy, approvals=approvals, operations=operations,
                          reconciler=reconciler, scheduler=scheduler, denials=denials, locks=locks,
                          reloader=reloader, quotas=quotas)
        opened.pop_all()  # from here on Runtime.close() closes them
    return runtime


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=dumps(body), status=status, content_type="application/json", headers=headers)


@web.middleware
async def envelope_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
    """Every failure leaves as an envelope; nothing internal leaks."""
    request_id = ingress.request_id_of(request)
    try:
        with logs.bound(request_id=request_id):
            response = await handler(request)
    except ProxyError as error:
        body = envelope.request_error(error, request_id)
        response = json_response(body, envelope.http_status(body))
    except redis.exceptions.RedisError:
        body = envelope.request_error(ProxyError("dependency_unavailable", "The state store is unreachable.",
                                                 details={"dependency": "state_store"}, phase="request"), request_id)
        response = json_response(body, envelope.http_status(body))
    except web.HTTPException as exc:
        code = {404: "route_not_found", 405: "method_not_allowed", 413: "payload_too_large",
                415: "unsupported_media_type"}.get(exc.status, "invalid_request")
        body = envelope.request_error(ProxyError(code, _HTTP_MESSAGES.get(code, "The request was refused."),
                                                 phase="request"), request_id)
        response = json_response(body, envelope.http_status(body))
    except asyncio.CancelledError:
        raise
    except Exception:
        with logs.bound(request_id=request_id):
            log.exception("unhandled error")
        body = envelope.request_error(ProxyError("internal_error", "The proxy failed unexpectedly.",
                                                 phase="request"), request_id)
        response = json_response(body, 500)
    else:
        body = None
    if body is not None:  # refused before (or instead of) a tool call: count it by code
        runtime = request.app.get(RUNTIME)
        if runtime is not None:
            runtime.metrics.request_errors.labels(body["error"]["code"]).inc()
    response.headers["X-Request-Id"] = request_id
    return response


_HTTP_MESSAGES = {
    "route_not_found": "No such endpoint.",
    "method_not_allowed": "This method is not allowed on this endpoint.",
    "payload_too_large": "The request body is too large.",
    "unsupported_media_type": "The request body must be application/json.",
}


async def _accept(request: web.Request, schema: str) -> tuple[Runtime, RequestMeta, Caller, Any]:
    """Transport facts, then the trusted caller (before the body is read), then the body checked
    against its API schema: the same order for every agent-facing JSON endpoint."""
    runtime = request.app[RUNTIME]
    meta = ingress.request_meta(request, runtime.config)
    caller = await runtime.authenticator.authenticate(request.headers)
    body = await ingress.read_json(request, runtime.config)
    ingress.validate_body(body, schema)
    return runtime, meta, caller, body


async def post_tool_call(request: web.Request) -> web.Response:
    runtime, meta, caller, body = await _accept(request, "tool-call-request.schema.json")
    call = ToolCallRequest(call_id=body["call_id"], tool=body["tool"], version=body.get("version"),
                           arguments=body["arguments"], meta=meta)
    result = await runtime.pipeline.execute(call, caller)
    return json_response(result.envelope, result.status, {**result.headers, **retry_after_header(result.envelope)})


async def post_tool_call_batch(request: web.Request) -> web.Response:
    """A batch completed (whatever each call's outcome) is 200; a plan refused before anything ran is 400."""
    runtime, meta, caller, body = await _accept(request, "batch-request.schema.json")
    result = await runtime.scheduler.run(plan_from_json(body, meta), caller)
    return json_response(result.to_json())


async def get_operation(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    caller = await runtime.authenticator.authenticate(request.headers)
    return json_response(await find_operation(runtime.operations, request.match_info["key"], tenant=caller.tenant))


async def admin_get_operation(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    return json_response(await find_operation(runtime.operations, request.match_info["key"],
                                              tenant=operator.tenant))


async def admin_list_takeovers(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    return json_response({"takeovers": await list_takeovers(runtime.operations, tenant=operator.tenant)})


async def admin_resolve_operation(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    body = await ingress.read_json(request, runtime.config)
    return json_response(await resolve_by_operator(runtime.operations, runtime.registry, runtime.metrics,
                                                   runtime.audit, request.match_info["key"], principal, body))


async def admin_list_unknown_operations(request: web.Request) -> web.Response:
    """Operations in UNKNOWN that the reconciler is still querying (not yet handed to a person)."""
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    return json_response({"unknown_operations": await list_takeovers(runtime.operations, tenant=operator.tenant,
                                                                     state="UNKNOWN")})


async def admin_whoami(request: web.Request) -> web.Response:
    """Who this admin token is and which of the admin API's roles it holds (the console's sign-in)."""
    principal, roles = await request.app[RUNTIME].authenticator.admin_console_roles(request.headers)
    return json_response({"subject": principal.subject, "tenant": principal.tenant, "roles": list(roles)})


async def admin_list_denials(request: web.Request) -> web.Response:
    """Recent policy denials by tool and reason; approvers and operators both see them."""
    runtime = request.app[RUNTIME]
    principal, _ = await runtime.authenticator.admin_console_roles(request.headers)
    return json_response(await runtime.denials.recent(tenant=principal.tenant))


async def admin_list_locks(request: web.Request) -> web.Response:
    """Locks held now (an operator's tenant only, unless the operator is cross-tenant): see docs/operations.md."""
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    return json_response(await runtime.locks.held(tenant=operator.tenant))


async def admin_list_unknown_calls(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    return json_response({"unknown_calls": await runtime.unknowns.open_calls(tenant=operator.tenant)})


async def admin_settle_unknown_call(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    body = await ingress.read_json(request, runtime.config)
    return json_response(await runtime.unknowns.settle(runtime.audit, runtime.metrics, operator, body))


async def admin_quotas(request: web.Request) -> web.Response:
    """Configured limits and every backend's back-pressure state (an operator with a tenant claim sees
    only its own tenant's override)."""
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    limits = runtime.quotas.rules.describe()
    if operator.tenant:
        limits["tenants"] = {k: v for k, v in limits["tenants"].items() if k == operator.tenant}
    return json_response({"enabled": runtime.config.quotas.enabled, "limits": limits,
                          "backends": runtime.quotas.guard.describe()})


async def list_tools(request: web.Request) -> web.Response:
    """Discovery follows authorization: only the tools this caller may call (OPA, action "list")."""
    runtime = request.app[RUNTIME]
    caller = await runtime.authenticator.authenticate(request.headers)
    meta = ingress.request_meta(request, runtime.config)
    tools = await visible_tools(runtime, caller, request_id=meta.request_id, trace_id=meta.trace.trace_id,
                                budget_s=meta.deadline.remaining())
    return json_response({"tools": [tool.listing() for tool in tools]})


async def list_approvals(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers)
    return json_response({"approvals": await runtime.approvals.list_pending(principal)})


async def list_decided_approvals(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers)
    return json_response({"approvals": await runtime.approvals.list_decided(principal)})


async def get_approval(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers)
    return json_response(await runtime.approvals.get(request.match_info["approval_id"], principal))


async def approve(request: web.Request) -> web.Response:
    return await _decide_approval(request, approve=True)


async def deny(request: web.Request) -> web.Response:
    return await _decide_approval(request, approve=False)


async def _decide_approval(request: web.Request, *, approve: bool) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers)
    body = await ingress.read_json(request, runtime.config) if request.body_exists else None
    return json_response(await runtime.approvals.decide(request.match_info["approval_id"], principal,
                                                        approve=approve, body=body))


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    readiness = await request.app[RUNTIME].health.readiness()
    return json_response(readiness.to_json(), 200 if readiness.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    await runtime.health.before_scrape()
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encoder(runtime.metrics.registry), headers={"Content-Type": content_type})


def agent_app(runtime: Runtime) -> web.Application:
    # client_max_size is a backstop; ingress enforces the configured limit with an envelope.
    app = web.Application(middlewares=[envelope_errors],
                          client_max_size=runtime.config.listen.max_body_bytes + 1024)
    app[RUNTIME] = runtime
    app.router.add_post("/v1/tool-calls", post_tool_call)
    app.router.add_post("/v1/tool-calls:batch", post_tool_call_batch)
    app.router.add_get("/v1/tools", list_tools)
    McpFront(runtime).install(app)
    openai_front.install(app, runtime)
    app.router.add_get("/v1/operations/{key}", get_operation)
    return app


def admin_app(runtime: Runtime) -> web.Application:
    """Approver/operator API on its own listener; every handler authenticates an admin principal.
    The operator console (``/ui``) is served here too, and nowhere else."""
    app = web.Application(middlewares=[console.security_headers, envelope_errors], client_max_size=64 * 1024)
    app[RUNTIME] = runtime
    console.install(app)
    app.router.add_get("/v1/whoami", admin_whoami)
    app.router.add_get("/v1/denials", admin_list_denials)
    app.router.add_get("/v1/approvals", list_approvals)
    app.router.add_get("/v1/approvals/decided", list_decided_approvals)
    app.router.add_get(r"/v1/approvals/{approval_id:apr_[0-9a-f]{1,64}}", get_approval)
    app.router.add_post(r"/v1/approvals/{approval_id:apr_[0-9a-f]{1,64}}/approve", approve)
    app.router.add_post(r"/v1/approvals/{approval_id:apr_[0-9a-f]{1,64}}/deny", deny)
    app.router.add_get("/v1/takeovers", admin_list_takeovers)
    app.router.add_get("/v1/operations/{key}", admin_get_operation)
    app.router.add_post("/v1/operations/{key}/resolve", admin_resolve_operation)
    app.router.add_get("/v1/unknown-calls", admin_list_unknown_calls)
    app.router.add_get("/v1/unknown-operations", admin_list_unknown_operations)
    app.router.add_get("/v1/locks", admin_list_locks)
    app.router.add_get("/v1/quotas", admin_quotas)
    app.router.add_post("/v1/unknown-calls/settle", admin_settle_unknown_call)
    return app


def ops_app(runtime: Runtime) -> web.Application:
    app = web.Application(middlewares=[envelope_errors])
    app[RUNTIME] = runtime
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(config: Config, *, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, on_runtime: Callable[[Runtime], None] | None = None) -> None:
    """Run all listeners until ``stop`` is set (or forever); ``on_runtime`` gets the runtime once it exists
    (the CLI hooks SIGHUP to its registry reload there)."""
    runtime = await create_runtime(config)
    if on_runtime is not None:
        on_runtime(runtime)
    runners: list[web.AppRunner] = []
    try:
        for app, listener in ((agent_app(runtime), config.listen), (admin_app(runtime), config.admin),
                              (ops_app(runtime), config.ops)):
            runner = EnvelopeRunner(app, access_log=None, count_refusal=runtime.count_refusal)
            await runner.setup()
            await web.TCPSite(runner, listener.host, listener.port).start()
            runners.append(runner)
        log.info("toolproxy listening: agent %s:%d, admin %s:%d, ops %s:%d", config.listen.host,
                 config.listen.port, config.admin.host, config.admin.port, config.ops.host, config.ops.port)
        if ready is not None:
            ready.set()
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        await runtime.close()
