"""Authorize stage: may this normalized call run, now, for this caller?

Allow = IdentityValid AND ToolAllowed AND ResourceOwned AND ScopeSufficient
AND ApprovalSatisfied, recomputed at execution time for every call.

Owns: the order of the authorization steps — check a presented approval
(``approvals``), ask OPA once with it (``policy``), then either consume the
approval atomically (allow), open a new pending approval (require_approval)
or refuse (deny, noted in the recent-denials list the console shows) — and
what of the decision stays with the call for the audit trail. An approval already spent by this call's own operation (same binding,
same operation key) is still shown to OPA (as status "used"), so revoked
roles, tools or tenants still deny; when OPA allows, nothing is consumed and
the call is marked ``replay_only``: the idempotency stage may then only answer
from that operation's record, never reserve it for a new execution.
Must never: decide without OPA, show the policy's reasons to the model, let a
spent approval authorize a new execution, or let anything from the tool
arguments stand in for identity or approval.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from .approvals import MCP_APPROVAL_META, Approval, ApprovalOrigin, ApprovalStore, Standing, denial
from ..audit import PolicyFacts
from ..deadline import Deadline
from .denials import DenialLog
from ..envelope import iso
from ..errors import ProxyError
from ..identity import Caller
from ..normalize import NormalizedCall
from .client import Decision, PolicyClient, RequestFacts, build_input
from ..flow import FlowLedger
from ..registry import ToolContract

log = logging.getLogger("toolproxy.authorize")

# What the agent (and the model, in an MCP result's text) is told to do with an approval_required answer.
APPROVAL_REQUIRED = ("This call needs a person's approval; nothing was done. Once approved, send the same call "
                     "again (same arguments and key): it runs then, once. Sent before a decision, it waits on the "
                     "same approval. A client may name the approval: the X-Approval-Id header, or on MCP "
                     f"params._meta[\"{MCP_APPROVAL_META}\"] (details.approval_id).")


def explain_pointer(found_by: str) -> dict[str, str]:
    """Where a developer reads why a call was refused: the console's denials panel (approvers and operators,
    by request id) and the command that explains the decision from the recorded ones (decision or request
    id). Pointers only: the reasons stay with them."""
    return {"explain": f"toolproxy policy explain --decision-id {found_by} --redis <the proxy's redis.url>",
            "console": "/ui#denials (admin listener: Recent policy denials, by request id)"}


class QuotaGate(Protocol):
    """What the authorize stage needs of the quota stage: admit the call once the decision allows it, before an
    approval is spent (a call a quota refuses must not use up its approval). A ``ProxyError`` it raises is the
    call's answer. The pipeline's ``CallQuota`` is one."""

    async def admit(self, decision: Decision) -> None: ...


@dataclass(frozen=True)
class Authorization:
    """What the authorize stage established; kept on the call for the audit record."""

    decision: Decision | None
    approval_id: str | None = None   # consumed by this call, or created for it
    error: ProxyError | None = None
    replay_only: bool = False        # allowed only on an approval spent by this operation: never execute

    def audit_facts(self) -> PolicyFacts | None:
        """The decision as the call's audit record keeps it: result "error" when OPA could not decide,
        None when no decision was asked for (a presented approval was refused first)."""
        d = self.decision
        if d is not None:
            return PolicyFacts(d.result, d.reasons, d.decision_id, d.policy_revision, d.risk)
        failed = self.error is not None and self.error.phase == "authorize" and \
            self.error.code in {"policy_unavailable", "forbidden", "timeout_not_started"}
        return PolicyFacts("error") if failed else None


class Authorizer:
    def __init__(self, policy: PolicyClient, approvals: ApprovalStore, denials: DenialLog | None = None,
                 flow: FlowLedger | None = None) -> None:
        self._policy = policy
        self._flow = flow
        self._approvals = approvals
        self._denials = denials

    @property
    def policy(self) -> PolicyClient:
        """The policy client (the pipeline's ``tool_not_found`` hint asks it for the caller's listing)."""
        return self._policy

    async def authorize(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                        request: RequestFacts, *, approval_id: str | None,
                        deadline: Deadline, operation_key: str | None = None,
                        quota: QuotaGate | None = None,
                        origin: ApprovalOrigin | None = None) -> Authorization:
        """``quota`` admits the call once the decision allows and before an approval is spent (``QuotaGate``).
        ``origin`` is what a new pending approval shows the approver of the agent's request and key."""
        try:
            return await self._authorize(caller, tool, normalized, request, approval_id, deadline, operation_key,
                                         quota, origin)
        except ProxyError as error:
            return Authorization(decision=None, approval_id=approval_id, error=error)

    async def preflight(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                        request: RequestFacts, *, deadline: Deadline) -> ProxyError | None:
        """Would OPA allow this call outright, now? For an ``all_or_nothing`` batch, asked of every call
        before any runs: nothing is consumed, created or counted (the call, if it runs, is authorized
        again by ``authorize``). A call that needs an approval is not allowed outright: it is refused with
        ``approval_required`` (no approval is opened: run it on its own to ask for one)."""
        try:
            document = build_input("call", caller, request, catalog_digest=self._policy.catalog_digest, tool=tool,
                                   normalized=normalized, approval=None,
                                   flow=await self._flow_input(caller, tool, request, normalized))
            decision = await self._policy.decide(document, deadline=deadline,
                                                 record_view=tool.record_view)
        except ProxyError as error:
            return error.with_phase("authorize")
        if decision.allow:
            return None
        details = {k: v for k, v in (("decision_id", decision.decision_id),
                                     ("policy_revision", decision.policy_revision)) if v}
        if decision.require_approval:
            return ProxyError("approval_required", "This call needs a person's approval: an all_or_nothing batch "
                              "runs only calls the policy allows outright; send it on its own to ask for one.",
                              details={**details, "reason": "all_or_nothing", "risk": decision.risk},
                              phase="authorize")
        return ProxyError("forbidden", "The caller is not permitted to make this call.", details=details,
                          phase="authorize")

    async def _flow_input(self, caller: Caller, tool: ToolContract, request: RequestFacts,
                          normalized: NormalizedCall) -> dict[str, Any] | None:
        """``input.flow`` for a call whose decision may use it (proxy/flow.py), with the provenance of its sink
        arguments' values (proxy/provenance.py) when the contract names them; else None (not read)."""
        if self._flow is None or not (request.flow_as or self._flow.wanted(tool)):
            return None
        task = caller.task
        if request.flow_as is not None:  # a read run for someone else's request: under that requester's labels
            caller = replace(caller, agent=request.flow_as[0], subject=request.flow_as[1])
            task = None  # (the approver's task is not the requester's)
        state = await self._flow.read(caller, request.run_id, now_ms=int(time.time() * 1000), tool=tool,
                                      arguments=normalized.arguments, task=task)
        return state.policy_input()

    async def _authorize(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                         request: RequestFacts, approval_id: str | None, deadline: Deadline,
                         operation_key: str | None, quota: QuotaGate | None,
                         origin: ApprovalOrigin | None = None) -> Authorization:
        approval = None
        if approval_id is not None:
            approval = await self._approvals.presented(approval_id, caller, tool, normalized,
                                                       operation_key=operation_key)
        flow = await self._flow_input(caller, tool, request, normalized)

        async def decide() -> Decision:
            document = build_input("call", caller, request, catalog_digest=self._policy.catalog_digest, tool=tool,
                                   normalized=normalized,
                                   approval=approval.policy_input() if approval is not None else None, flow=flow)
            return await self._policy.decide(document, deadline=deadline, record_view=tool.record_view)

        decision = await decide()
        standing = None
        if decision.require_approval and approval_id is None:
            # The approval this very call asked for before (same arguments and key): re-sent, it waits on that
            # one, a denial sticks, and once approved (not yet spent) the call runs on it without the client
            # naming its id.
            standing = await self._approvals.standing(caller, tool, normalized, operation_key=operation_key)
            if standing is not None and standing.status == "approved":
                approval_id = standing.id
                approval = await self._approvals.presented(approval_id, caller, tool, normalized,
                                                           operation_key=operation_key)
                decision = await decide()
        # Opaque references for support and audit; the reasons never leave the proxy.
        details = {k: v for k, v in (("decision_id", decision.decision_id),
                                     ("policy_revision", decision.policy_revision)) if v}
        if decision.allow:
            return await self._allowed(caller, tool, normalized, request, decision, approval, approval_id,
                                       operation_key, quota)
        if decision.require_approval:
            return await self._approval_required(caller, tool, normalized, decision, standing, details, origin,
                                                 operation_key)
        return await self._denied(caller, tool, request, decision, approval_id, details)

    async def _allowed(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall, request: RequestFacts,
                       decision: Decision, approval: Approval | None, approval_id: str | None,
                       operation_key: str | None, quota: QuotaGate | None) -> Authorization:
        """An allowed call: within its quota, its approval (if any) spent here, single use."""
        if approval is not None and approval.replay_only:
            return Authorization(decision=decision, approval_id=approval_id, replay_only=True)
        if quota is not None:
            try:
                await quota.admit(decision)
            except ProxyError as error:
                return Authorization(decision=decision, approval_id=approval_id, error=error)
        if approval_id is not None:
            # Single use: a concurrent re-submission of the same approval loses here.
            await self._approvals.consume(approval_id, caller, tool, normalized,
                                          used_by=f"{request.request_id}:{secrets.token_hex(4)}",
                                          operation_key=operation_key)
        return Authorization(decision=decision, approval_id=approval_id)

    async def _approval_required(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                                 decision: Decision, standing: Standing | None, details: dict[str, Any],
                                 origin: ApprovalOrigin | None, operation_key: str | None) -> Authorization:
        """A call that needs an approval: the standing one's denial, else its pending request or a new one."""
        if standing is not None and standing.status == "denied":
            return Authorization(decision=decision, approval_id=standing.id,
                                 error=denial(standing.id, standing.reason))
        if standing is not None and standing.status == "pending":
            new_id, expires = standing.id, standing.expires_at_ms
        else:
            new_id, expires = await self._approvals.create(caller, tool, normalized, risk=decision.risk,
                                                           reasons=decision.reasons, origin=origin,
                                                           operation_key=operation_key)
        error = ProxyError("approval_required", APPROVAL_REQUIRED, details={
            **details, "approval_id": new_id, "expires_at": iso(expires / 1000), "risk": decision.risk,
            "send_approval_in": ["X-Approval-Id", f"_meta.{MCP_APPROVAL_META}"]}, phase="authorize")
        return Authorization(decision=decision, approval_id=new_id, error=error)

    async def _denied(self, caller: Caller, tool: ToolContract, request: RequestFacts, decision: Decision,
                      approval_id: str | None, details: dict[str, Any]) -> Authorization:
        """A call the policy denies: logged and recorded with its reasons; the caller learns only "forbidden"."""
        log.info("call denied by policy", extra={"request_id": request.request_id, "tool": tool.name,
                                                 "reasons": list(decision.reasons)})
        if self._denials is not None:
            await self._denials.record(tenant=caller.tenant, subject=caller.subject, tool=tool.name,
                                       tool_version=tool.version, reasons=decision.reasons,
                                       decision_id=decision.decision_id, policy_revision=decision.policy_revision,
                                       request_id=request.request_id, call_id=request.call_id,
                                       trace_id=request.trace_id)
        # Reasons stay in the audit trail (audit_facts); the model learns only "forbidden". The developer gets
        # where to look (the same ids an operator searches by), never the policy's reasons.
        error = ProxyError("forbidden", "The caller is not permitted to make this call.",
                           details={**details, **explain_pointer(decision.decision_id or request.request_id)},
                           phase="authorize")
        return Authorization(decision=decision, approval_id=approval_id, error=error)
