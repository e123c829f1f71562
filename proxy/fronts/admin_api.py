"""The operator (admin) API: approvers' and operators' endpoints on the admin listener.

Owns: the admin routes (approvals, operations and takeovers, unknown calls,
locks and freezes, denials, quotas, pins, whoami, the console), authenticating an admin
principal with the role each route needs before anything else, checking
request bodies against their JSON Schemas in ``schemas/``
(``operation-resolution``, ``unknown-call-settlement``; a bad body is
``invalid_request`` with the violations; a body past ``MAX_BODY_BYTES`` is
``payload_too_large``, never read further), and the two operator actions that
change state: resolving an open operation, settling a call-level unknown and
acknowledging a drifted MCP tool that matches its pins again, each audited
(the first two before they take effect). Must never: run a tool call (the one
read an approver may see beside a pending approval goes through the pipeline
with the approver's authority, ``related_read.py``), decide an
outcome without an operator's evidence, or show a tenant-bound operator
another tenant's data.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from aiohttp import web

from . import connections, console, ingress, related_read
from ..audit import Auditor
from ..decode import schema_violations
from ..errors import ProxyError, SideEffect
from .http_edge import RUNTIME, envelope_errors, json_response
from ..identity import AdminPrincipal
from ..idempotency import KEY_PATTERN, stored_outcome
from ..telemetry.metrics import Metrics
from ..operation_views import find_operation, list_takeovers
from ..locks import LockManager
from ..operations import OperationStore
from ..transactions.reconcile import audit_fields
from ..registry import Registry
from ..process.runtime import Runtime
from ..transactions.unknowns import UnknownIndex

log = logging.getLogger("toolproxy.admin")
# Largest admin request body (approval notes, resolutions, settlements): applied where the body is read
# (``ingress.read_json``), whatever the Content-Length says; payload_too_large above.
MAX_BODY_BYTES = 64 * 1024


async def admin_get_operation(request: web.Request) -> web.Response:
    """One operation's record for an operator. The read is audited first (``operator_read``; an audit sink
    that cannot take it refuses the read): the record may hold a full result the model was never shown."""
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    view = await find_operation(runtime.operations, request.match_info["key"], tenant=operator.tenant,
                                registry=runtime.registry)
    await runtime.audit.record("operator_read", critical=True, idempotency_key=view["idempotency_key"],
                               tool=view["tool"], **({"tenant": operator.tenant} if operator.tenant else {}),
                               details={"operator": operator.subject, "operator_tenant": operator.tenant,
                                        "result": view.get("result") is not None})
    return json_response(view)


async def admin_list_takeovers(request: web.Request) -> web.Response:
    """Operations waiting for a person: unknown outcomes the reconciler gave up on, and failed compensations
    (docs/transactions.md), told apart by ``kind``."""
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    unknown = [{"kind": "unknown_outcome", **entry}
               for entry in await list_takeovers(runtime.operations, tenant=operator.tenant)]
    return json_response({"takeovers": unknown + await runtime.compensations.takeovers(tenant=operator.tenant)})


async def admin_resolve_operation(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    body = await ingress.read_json(request, runtime.config, limit=MAX_BODY_BYTES)
    return json_response(await resolve_operation(runtime.operations, runtime.registry, runtime.metrics,
                                                 runtime.audit, request.match_info["key"], principal, body,
                                                 locks=runtime.locks))


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


async def admin_list_freezes(request: web.Request) -> web.Response:
    """Frozen resources, oldest first, each with the operation that froze it, its state and the one request
    that lifts it: ``POST /v1/operations/{key}/resolve`` with the operator's evidence (the same resolution as a
    takeover's; the freeze ends with it). An operator's tenant only, unless the operator is cross-tenant."""
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    listing = await runtime.locks.frozen(tenant=operator.tenant)
    freezes = []
    for mark in listing["freezes"]:
        record = await runtime.operations.get(mark["operation"])
        tenant = record.tenant if record is not None else mark["tenant"]
        if operator.tenant is not None and tenant != operator.tenant:
            continue
        freezes.append({**mark, "tenant": tenant, "tool": record.tool if record is not None else None,
                        "state": record.state if record is not None else None,
                        "resolve": f"/v1/operations/{mark['operation']}/resolve"})
    return json_response({**listing, "freezes": freezes})


async def admin_list_unknown_calls(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    return json_response({"unknown_calls": await runtime.unknowns.open_calls(tenant=operator.tenant)})


async def admin_settle_unknown_call(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    body = await ingress.read_json(request, runtime.config, limit=MAX_BODY_BYTES)
    return json_response(await settle_unknown_call(runtime.unknowns, runtime.audit, runtime.metrics, operator,
                                                   body))


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


async def list_approvals(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers)
    approvals = await runtime.approvals.list_pending(principal)
    # The listing stops at approvals.max_list: say so, and how many there are when the principal may know.
    return json_response({"approvals": approvals, "limit": runtime.approvals.list_limit,
                          "total": await runtime.approvals.count_pending(principal)})


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
    body = await ingress.read_json(request, runtime.config, limit=MAX_BODY_BYTES) if request.body_exists else None
    return json_response(await runtime.approvals.decide(request.match_info["approval_id"], principal,
                                                        approve=approve, body=body))


# -- operator actions -----------------------------------------------------------------

_RESOLUTIONS = {"committed": "SUCCEEDED", "not_applied": "FAILED_RETRYABLE", "rejected": "FAILED_FINAL"}
_SETTLEMENTS = {"committed": True, "not_applied": False}


def _operator_error(verdict: str, tool: str) -> ProxyError | None:
    """The failure an operator's resolution records (None for a success)."""
    if verdict == "FAILED_RETRYABLE":
        return ProxyError("dependency_unavailable", "An operator recorded that this operation was not applied; "
                          "it may run again with the same key.", details={"tool": tool}, phase="reconcile")
    if verdict == "FAILED_FINAL":
        return ProxyError("business_rejected", "An operator recorded that the backend rejected this operation.",
                          details={"tool": tool}, phase="reconcile")
    return None


async def resolve_operation(store: OperationStore, registry: Registry, metrics: Metrics, audit: Auditor,
                            key: str, principal: AdminPrincipal, body: Any,
                            locks: LockManager | None = None) -> dict[str, Any]:
    """Settle an UNKNOWN / NEEDS_TAKEOVER operation from an operator's evidence.

    Body: ``schemas/operation-resolution.schema.json`` (``result`` only with
    ``committed``, checked against the tool's outputSchema).
    """
    if not re.match(KEY_PATTERN, key):
        raise ProxyError("operation_not_found", "No such operation.", phase="request")
    ingress.validate_body(body, "operation-resolution.schema.json")
    record = await store.get(key)
    if record is None or (principal.tenant is not None and record.tenant != principal.tenant):
        raise ProxyError("operation_not_found", "No such operation.", phase="request")
    tool = next((t for t in registry.all() if t.name == record.tool and t.version == record.tool_version), None)
    result = body.get("result")
    if result is not None and tool is not None:
        violations = schema_violations(result, tool.output_validator)
        if violations:
            raise ProxyError("invalid_request", "result does not match the tool's output schema.",
                             details={"violations": violations[:50]}, phase="request")
    verdict = _RESOLUTIONS[body["outcome"]]
    error = _operator_error(verdict, record.tool)
    outcome = stored_outcome(data=result, error=error, side_effect=SideEffect(True, verdict == "SUCCEEDED"),
                             tool_version=record.tool_version, call_id=record.meta.get("call_id"),
                             request_id=record.meta.get("request_id"))
    evidence = {"source": "operator", "operator": principal.subject, "observed": body["outcome"],
                "note": body["evidence"].strip(), "at_ms": int(time.time() * 1000)}
    # No resolution takes effect unaudited: the record comes first (audit_unavailable stops it).
    await audit.record("reconciliation", critical=True, **audit_fields(record),
                       details={"from": record.state, "to": verdict, "requested_by": "operator",
                                "evidence": evidence})
    answer = await store.resolve_by_operator(key, verdict=verdict, outcome=outcome, evidence=evidence,
                                             fingerprint=record.fingerprint)
    if answer.status == "missing":
        raise ProxyError("operation_not_found", "No such operation.", phase="request")
    if answer.status != "ok":
        raise ProxyError("operation_not_open", "Only an UNKNOWN or NEEDS_TAKEOVER operation can be resolved.",
                         details={"state": answer.text(0)}, phase="request")
    metrics.reconciliations.labels("operator").inc()
    log.warning("operation %s resolved by operator %s as %s", key, principal.subject, verdict)
    if locks is not None:  # the freeze ends with the takeover
        await locks.thaw_settled(key, record.meta)
    settled = await store.get(key)
    return {"idempotency_key": key, "state": settled.state if settled else verdict}


async def settle_unknown_call(unknowns: UnknownIndex, audit: Auditor, metrics: Metrics, principal: AdminPrincipal,
                              body: Any) -> dict[str, Any]:
    """An operator settles one call-level unknown (a call without an operation record) from evidence.

    Body: ``schemas/unknown-call-settlement.schema.json``. The entry is found by
    its ids (one tenant's, unless the operator is cross-tenant).
    """
    ingress.validate_body(body, "unknown-call-settlement.schema.json")
    found = await unknowns.find(body["request_id"], body["call_id"], tenant=principal.tenant)
    if found is None:
        raise ProxyError("operation_not_found", "No such open unknown call.", phase="request")
    committed = _SETTLEMENTS[body["outcome"]]
    await audit.record(
        "reconciliation", critical=True, request_id=found["request_id"], call_id=found["call_id"],
        tool=found["tool"], tenant=found["tenant"], outcome="succeeded" if committed else "failed",
        error_code=None if committed else "dependency_unavailable", side_effect_committed=committed,
        details={"from": "unknown", "to": body["outcome"], "requested_by": "operator",
                 "operator": principal.subject, "evidence": body["evidence"].strip()})
    if not await unknowns.close(found["ref"]):
        raise ProxyError("operation_not_open", "This call was settled meanwhile.", phase="request")
    metrics.reconciliations.labels("operator").inc()
    log.warning("unknown call %s/%s settled by operator %s as %s", found["request_id"], found["call_id"],
                principal.subject, body["outcome"])
    return {"request_id": found["request_id"], "call_id": found["call_id"], "settled": body["outcome"]}


async def admin_pins(request: web.Request) -> web.Response:
    """Pinned MCP tools and their state (verified, drifted with its diff, unverified): docs/mcp.md."""
    runtime = request.app[RUNTIME]
    await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    return json_response({"pins": runtime.pins.rows() if runtime.pins is not None else []})


async def admin_acknowledge_pin(request: web.Request) -> web.Response:
    """An operator lifts a drift quarantine whose upstream matches its pins again (body ``{"tool", "version"?}``).
    A drift never lifts itself: the upstream that changed a tool back could change it again at will."""
    runtime = request.app[RUNTIME]
    operator = await runtime.authenticator.authenticate_admin(request.headers, role="operator")
    body = await ingress.read_json(request, runtime.config, limit=MAX_BODY_BYTES)
    ingress.validate_body(body, "pin-acknowledgement.schema.json")
    if runtime.pins is None:
        raise ProxyError("operation_not_open", "No pinned MCP tool is watched here.", phase="request")
    lifted = runtime.pipeline.quarantine.acknowledge(body["tool"], body.get("version"))
    await runtime.audit.record("pin_acknowledgement", critical=True, tool=body["tool"], subject=operator.subject,
                               details={"lifted": [version for _, version in lifted],
                                        "operator": operator.subject})
    log.warning("contract drift of %s acknowledged by operator %s: served again", body["tool"], operator.subject)
    return json_response({"tool": body["tool"], "lifted": [version for _, version in lifted],
                          "pins": runtime.pins.rows()})


def admin_app(runtime: Runtime) -> web.Application:
    """Approver/operator API on its own listener; every handler authenticates an admin principal.
    The operator console (``/ui``) is served here too, and nowhere else."""
    app = web.Application(middlewares=[console.security_headers, envelope_errors], client_max_size=MAX_BODY_BYTES)
    app[RUNTIME] = runtime
    console.install(app)
    related_read.install(app)  # the read beside a pending approval, run through the pipeline as the approver
    connections.install(app)  # "connect your accounts": users' grants to MCP upstreams (their own identity)
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
    app.router.add_get("/v1/freezes", admin_list_freezes)
    app.router.add_get("/v1/quotas", admin_quotas)
    app.router.add_post("/v1/unknown-calls/settle", admin_settle_unknown_call)
    app.router.add_get("/v1/pins", admin_pins)
    app.router.add_post("/v1/pins/acknowledge", admin_acknowledge_pin)
    return app
