"""The aiohttp applications: wiring only.

Owns: the listeners (agent, admin, ops) and translating HTTP requests into
pipeline calls and envelopes back; the runtime they share is opened and
closed by ``proxy/runtime.py``. Must never: hold business rules — every decision lives in a
stage module; handlers translate.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import redis.exceptions
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from . import console, envelope, ingress, logs, openai_front
from .envelope import dumps
from .errors import ProxyError
from .http_server import EnvelopeRunner
from .identity import Caller
from .idempotency import find_operation
from .listing import visible_tools
from .mcp_front import McpFront
from .pipeline import RequestMeta, ToolCallRequest
from .plan import plan_from_json
from .quotas import retry_after_header
from .reconcile import list_takeovers, resolve_by_operator
from .config import Config
from .runtime import Runtime, check_key_layout, create_runtime  # noqa: F401  (importable from here too)

log = logging.getLogger("toolproxy.app")


RUNTIME = web.AppKey("runtime", Runtime)


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
    tools = await visible_tools(runtime.registry, runtime.policy, caller, request_id=meta.request_id, trace_id=meta.trace.trace_id,
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
