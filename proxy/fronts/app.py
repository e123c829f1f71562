"""The aiohttp applications: wiring only.

Owns: the agent and ops listeners' routes, translating HTTP requests into
pipeline calls and envelopes back, and running the three listeners
(``serve``). The admin listener's routes are ``proxy/fronts/admin_api.py``'s, the
shared edge (runtime key, JSON answers, the error middleware)
``proxy/fronts/http_edge.py``'s, and the runtime is opened and closed by
``proxy/process/runtime.py``. Must never: hold business rules — every decision lives
in a stage module; handlers translate.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from . import ingress, openai as openai_front
from .admin_api import admin_app  # noqa: F401  (importable from here too)
from ..config import Config
from .http_edge import RUNTIME, envelope_errors, json_response  # noqa: F401  (importable from here too)
from .http_server import EnvelopeRunner
from ..identity import Caller
from ..idempotency import derive_key
from ..policy.listing import visible_tools
from .rebinding import HostGuard
from ..operation_views import find_operation
from ..pipeline import RequestMeta, ToolCallRequest
from ..policy.client import RequestFacts
from ..policy.operation_access import Authorize, authorizer
from ..batch.plan import plan_from_json
from ..quotas import retry_after_header
from ..registry import Registry
from ..process.runtime import Runtime, create_runtime  # noqa: F401  (importable from here too)

log = logging.getLogger("toolproxy.app")


async def _accept(request: web.Request, schema: str) -> tuple[Runtime, RequestMeta, Caller, Any]:
    """Transport facts, then the trusted caller (before the body is read), then the body checked
    against its API schema: the same order for every agent-facing JSON endpoint."""
    runtime = request.app[RUNTIME]
    meta = ingress.request_meta(request, runtime.config)
    caller = await runtime.authenticator.authenticate(request.headers, request.remote)
    body = await ingress.read_json(request, runtime.config)
    ingress.validate_body(body, schema)
    return runtime, meta, caller, body


async def post_tool_call(request: web.Request) -> web.Response:
    runtime, meta, caller, body = await _accept(request, "tool-call-request.schema.json")
    call = ToolCallRequest(call_id=body["call_id"], tool=body["tool"], version=body.get("version"),
                           arguments=body["arguments"], meta=meta)
    result = await runtime.pipeline.execute(call, caller)
    headers = {**result.headers, **retry_after_header(result.envelope.error)}
    return json_response(result.envelope.to_json(), result.status, headers)  # the edge: the envelope's JSON, once


async def post_tool_call_batch(request: web.Request) -> web.Response:
    """A batch completed (whatever each call's outcome) is 200; a plan refused before anything ran is 400."""
    runtime, meta, caller, body = await _accept(request, "batch-request.schema.json")
    result = await runtime.scheduler.run(plan_from_json(body, meta), caller)
    return json_response(result.to_json())


def _operation_authorizer(runtime: Runtime, request: web.Request, caller: Caller, action: str) -> Authorize:
    """The subject check of an operation route (proxy/policy/operation_access.py)."""
    meta = ingress.request_meta(request, runtime.config)
    return authorizer(runtime.policy, caller, action, RequestFacts(request_id=meta.request_id,
                                                                   trace_id=meta.trace.trace_id),
                      meta.deadline)


async def get_operation(request: web.Request) -> web.Response:
    """One operation of this caller (or, when OPA says so, of another subject of its tenant), by its operation
    key or, with ``?tool=<name>``, by the caller's own Idempotency-Key as :cancel and :compensate take it. A stored result
    (or partial items) it shows brings the contract's flow labels into the reader's context, as the call did."""
    runtime = request.app[RUNTIME]
    caller = await runtime.authenticator.authenticate(request.headers, request.remote)
    key = operation_key_of(request.match_info["key"], request.query.get("tool"), caller)
    view = await find_operation(
        runtime.operations, key, tenant=caller.tenant, registry=runtime.registry,
        authorize=_operation_authorizer(runtime, request, caller, "read_operation"), integrity=runtime.integrity)
    contract = runtime.registry.get(view.get("tool") or "", view.get("tool_version") or "")
    if contract is not None and (view.get("result") is not None or view.get("partial")):
        await runtime.pipeline.record_flow(caller, ingress.request_meta(request, runtime.config).run_id, contract,
                                           output=view.get("result") if view.get("result") is not None
                                           else view.get("partial"), call_id=str(view.get("call_id") or key))
    return json_response(view)


def operation_key_of(raw: str, tool: str | None, caller: Caller) -> str:
    """The operation key a path names: the ``ik_...`` key itself, or with ``?tool=<name>`` the caller's own
    ``Idempotency-Key`` for that tool (derived with the caller's tenant, so it can only name its own)."""
    if tool is None:
        return raw
    op = derive_key(tenant=caller.tenant, subject=caller.subject, tool=tool, tool_version="", args_hash="",
                    idempotency_key=raw, run_id=None)
    return op.key if op is not None else raw


async def cancel_operation(request: web.Request) -> web.Response:
    """Cancel one operation (scoped like the read: this subject's, or OPA's ``cancel``): docs/transactions.md."""
    runtime = request.app[RUNTIME]
    caller = await runtime.authenticator.authenticate(request.headers, request.remote)
    key = operation_key_of(request.match_info["key"], request.query.get("tool"), caller)
    return json_response(await runtime.pipeline.cancellations.cancel_operation(
        key, tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
        authorize=_operation_authorizer(runtime, request, caller, "cancel")))


async def compensate_operation(request: web.Request) -> web.Response:
    """Compensate one committed operation by its declared compensating call: docs/transactions.md."""
    runtime = request.app[RUNTIME]
    meta = ingress.request_meta(request, runtime.config)
    caller = await runtime.authenticator.authenticate(request.headers, request.remote)
    key = operation_key_of(request.match_info["key"], request.query.get("tool"), caller)
    status, body = await runtime.compensations.compensate(key, caller, meta)
    return json_response(body, status)


async def cancel_batch(request: web.Request) -> web.Response:
    """Cancel a running batch of this caller (tenant and subject) by its batch id: docs/transactions.md."""
    runtime = request.app[RUNTIME]
    caller = await runtime.authenticator.authenticate(request.headers, request.remote)
    return json_response(await runtime.scheduler.cancel(request.match_info["batch_id"], tenant=caller.tenant,
                                                        subject=caller.subject))


async def _callers_tools(request: web.Request) -> list[Any]:
    """Discovery follows authorization: only the tools this caller may call (OPA, action "list")."""
    runtime = request.app[RUNTIME]
    caller = await runtime.authenticator.authenticate(request.headers, request.remote)
    meta = ingress.request_meta(request, runtime.config)
    return await visible_tools(runtime.registry, runtime.policy, caller, request_id=meta.request_id,
                               trace_id=meta.trace.trace_id, deadline=meta.deadline,
                               quarantine=runtime.pipeline.quarantine)


async def list_tools(request: web.Request) -> web.Response:
    return json_response({"tools": [tool.listing() for tool in await _callers_tools(request)]})


async def list_openai_tools(request: web.Request) -> web.Response:
    """The same tools in OpenAI's function-calling shape (``tools: [{type: function, function: {...}}]``), one
    per name (the version a call without one gets), so a runner passes them to the model as they are."""
    functions: dict[str, dict[str, Any]] = {}
    for tool in await _callers_tools(request):
        functions.setdefault(tool.name, {"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.listing()["inputSchema"]}})
    return json_response({"tools": list(functions.values())})


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


async def jwks(request: web.Request) -> web.Response:
    """The public keys that verify this proxy's call tokens (the signing key's, then any configured ones)."""
    return json_response(request.app[RUNTIME].call_tokens.jwks, 200, headers={"Cache-Control": "max-age=60"})


def agent_app(runtime: Runtime) -> web.Application:
    # client_max_size is a backstop; ingress enforces the configured limit with an envelope.
    # Every agent route behind the Host/Origin check (DNS rebinding); /mcp answers it in JSON-RPC shape itself.
    hosts = HostGuard(runtime.config.mcp).middleware(skip=frozenset({"/mcp"}))
    app = web.Application(middlewares=[envelope_errors, runtime.drain.middleware, hosts],
                          client_max_size=runtime.config.listen.max_body_bytes + 1024)
    app[RUNTIME] = runtime
    app.router.add_post("/v1/tool-calls", post_tool_call)
    app.router.add_post("/v1/tool-calls:batch", post_tool_call_batch)
    app.router.add_get("/v1/tools", list_tools)
    app.router.add_get("/v1/openai/tools", list_openai_tools)
    # The fronts get the few collaborators they use, not the runtime.
    if runtime.config.mcp.front:  # the MCP SDK's server side is imported only by a process that serves /mcp
        from .mcp.front import McpFront
        McpFront(config=runtime.config, authenticator=runtime.authenticator, registry=runtime.registry,
                 policy=runtime.policy, pipeline=runtime.pipeline, scheduler=runtime.scheduler,
                 metrics=runtime.metrics, audit=runtime.audit).install(app)
    openai_front.install(app, config=runtime.config, authenticator=runtime.authenticator, scheduler=runtime.scheduler)
    app.router.add_post(r"/v1/operations/{key:[^{}/:]+}:cancel", cancel_operation)
    app.router.add_post(r"/v1/operations/{key:[^{}/:]+}:compensate", compensate_operation)
    app.router.add_post(r"/v1/batches/{batch_id:[^{}/:]+}:cancel", cancel_batch)
    app.router.add_get("/v1/operations/{key}", get_operation)
    return app


def ops_app(runtime: Runtime) -> web.Application:
    app = web.Application(middlewares=[envelope_errors])
    app[RUNTIME] = runtime
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/.well-known/jwks.json", jwks)
    return app


async def serve(config: Config, *, registry: Registry | None = None, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, on_runtime: Callable[[Runtime], None] | None = None) -> None:
    """Run all listeners until ``stop`` is set (or forever); ``on_runtime`` gets the runtime once it exists
    (the CLI hooks SIGHUP to its registry reload there). ``registry``: already loaded (the CLI checked it
    before start-up), else loaded from ``registry.paths``."""
    runtime = await create_runtime(config, registry)
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
        await runtime.drain.run(runtime.pipeline.cut_running)  # new calls refused, readiness fails, calls finish
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        await runtime.close()
