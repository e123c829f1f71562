"""The related read beside a pending approval, run for the approver who looks at it.

Owns: ``GET /v1/approvals/{id}/related`` on the admin listener — running the
read a pending approval's contract declares (``related_read``, with the
arguments the approval recorded when it was created, proxy/approval_context.py)
through the pipeline like any call (resolve, decode, OPA's decision, quotas,
audit, the contract's output filter) with the approver's own authority: the
admin token's subject, roles, scopes and person, in the approval's tenant, as
source ``admin`` and agent ``toolproxy-console`` (so a policy tells it apart:
``policies/tools.rego`` lets it read only), its decision under the requester's
flow labels (``input.flow`` is the requesting agent and subject's) — and the answer the console
shows: the read's data, or ``permitted: false`` for a policy's denial, or the
error. Must never: reach a backend except through the pipeline, run a write,
act on an approval the approver cannot see, or run more than
``MAX_RELATED_READS`` at once (more: ``rate_limited``, the console asks again).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from aiohttp import web

from ..approval_context import MAX_RELATED_READS
from ..deadline import Deadline
from ..errors import ProxyError
from ..identity import AdminPrincipal, Caller
from ..requests import RequestMeta, ToolCallRequest
from ..process.runtime import Runtime
from ..telemetry.tracing import TraceContext, new_request_id
from .http_edge import RUNTIME, json_response

CONSOLE_AGENT = "toolproxy-console"  # input.agent.id of a read run for an approver
TIMEOUT_S = 5.0  # the read's whole deadline (the tool's own timeout_ms applies within it)
_RUNNING = web.AppKey("related_reads", asyncio.Semaphore)


def install(app: web.Application) -> None:
    app[_RUNNING] = asyncio.Semaphore(MAX_RELATED_READS)
    app.router.add_get(r"/v1/approvals/{approval_id:apr_[0-9a-f]{1,64}}/related", related)


async def related(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    principal = await runtime.authenticator.authenticate_admin(request.headers)
    approval = await runtime.approvals.get(request.match_info["approval_id"], principal)
    declared = approval.get("related_read")
    if not declared:
        return json_response({"approval_id": approval["id"], "read": None})
    running = request.app[_RUNNING]
    if running.locked():
        raise ProxyError("rate_limited", "Too many related reads are running for approvers; ask again shortly.",
                         details={"limit": MAX_RELATED_READS}, phase="request")
    async with running:
        return json_response(await run_read(runtime, principal, approval, declared))


def approver_caller(principal: AdminPrincipal, tenant: str) -> Caller:
    """The approver as the pipeline's caller: their own token's authority, in the approval's tenant (a tenant's
    approver sees only its own tenant's approvals; a cross-tenant approver reads as a member of this one)."""
    return Caller(subject=principal.subject, tenant=tenant, roles=principal.roles, scopes=principal.scopes,
                  agent=CONSOLE_AGENT, source="admin", person=principal.person)


async def run_read(runtime: Runtime, principal: AdminPrincipal, approval: dict[str, Any],
                   declared: dict[str, Any]) -> dict[str, Any]:
    request_id = new_request_id()
    # Under the requester's flow labels: its arguments are the requester's (the agent's words), so its decision
    # sees what that agent saw, never the approver's clean context.
    meta = RequestMeta(request_id=request_id, trace=TraceContext(secrets.token_hex(16), secrets.token_hex(8)),
                       deadline=Deadline.after(TIMEOUT_S, margin_s=runtime.config.deadline.margin_ms / 1000.0),
                       flow_as=(str(approval.get("agent") or ""), str(approval.get("subject") or "")))
    call = ToolCallRequest(call_id="related-" + approval["id"], tool=declared["tool"], version=declared["version"],
                           arguments=declared["arguments"], meta=meta)
    result = await runtime.pipeline.execute(call, approver_caller(principal, approval["tenant"]))
    envelope = result.envelope
    error = envelope.error
    return {"approval_id": approval["id"], "read": declared, "request_id": request_id,
            "read_at_ms": int(time.time() * 1000), "subject": principal.subject, "tenant": approval["tenant"],
            "outcome": envelope.outcome, "permitted": error is None or error.code != "forbidden",
            "data": envelope.data if error is None else None,
            "error": {"code": error.code, "message": error.message} if error is not None else None}
