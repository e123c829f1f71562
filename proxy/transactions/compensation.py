"""Compensation: undoing a committed effect by a new operation, never by pretending.

Owns: ``POST /v1/operations/{key}:compensate`` — the checks (the original is
this tenant's and this subject's, or OPA lets this caller read it, its contract declares a compensation, its state and time window
allow one, it is not frozen), OPA's ``compensate`` decision, the compensating
call run through the same ``Pipeline`` as its own operation under a key
derived from the original's (``Idempotency-Key: compensate:<original key>``,
so a repeated request is one effect at the backend), the original record's
compensation block (``requested`` -> ``succeeded`` | ``failed`` | ``unknown``;
the record itself keeps ``SUCCEEDED``), and, when the compensation fails, the
frozen operation and its takeover record for an operator (``GET /v1/takeovers``
on the admin listener). Every step is audited (``compensation``, ``takeover``)
and counted (``toolproxy_compensations_total``).

Must never: compensate a failed compensation (a person takes over), overwrite
the original's outcome, take the compensating arguments from anywhere but the
original's record and the contract's mapping, or run the compensating call
outside the pipeline.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace
from typing import Any, Mapping, Protocol

from .. import envelope
from ..envelope import Envelope
from ..audit import Auditor
from ..compensation_contract import build_arguments
from ..decode import decode_arguments
from ..errors import ProxyError
from ..identity import Caller
from ..integrity import IntegrityGuard
from ..idempotency import KEY_PATTERN, derive_key
from ..operation_views import checked_agent_view
from ..telemetry.metrics import Metrics
from ..normalize import normalize
from ..operations import OperationStore, Record
from ..requests import CallResult, RequestMeta, ToolCallRequest
from ..policy.client import PolicyClient, RequestFacts, build_input
from ..policy.operation_access import authorizer, is_own, original_facts
from ..registry import Registry
from ..store import key as store_key, redis_call, unavailable_on_fault

log = logging.getLogger("toolproxy.compensation")


class CallRunner(Protocol):
    """What compensation needs of the pipeline: run one call as its own operation (``Pipeline`` is one)."""

    async def execute(self, request: ToolCallRequest, caller: Caller) -> CallResult: ...

MAX_TAKEOVERS_LISTED = 500


class Compensations:
    def __init__(self, *, store: OperationStore, registry: Registry, pipeline: CallRunner, policy: PolicyClient,
                 audit: Auditor, metrics: Metrics, key_prefix: str, max_json_depth: int,
                 integrity: IntegrityGuard) -> None:
        self._store = store
        self._integrity = integrity
        self._registry = registry
        self._pipeline = pipeline
        self._policy = policy
        self._audit = audit
        self._metrics = metrics
        self._max_json_depth = max_json_depth
        self._prefix = key_prefix
        self._takeovers = store_key(key_prefix, "compensation-takeovers", "all")  # every tenant's

    def _tenant_takeovers(self, tenant: str) -> str:
        """One tenant's takeovers beside the fleet's index: a noisy tenant never pushes another's out of
        its operators' listing."""
        return store_key(self._prefix, "compensation-takeovers", tenant, "tenant")

    async def compensate(self, key: str, caller: Caller, meta: RequestMeta) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body): the original's view and the compensating call's envelope."""
        record = await self._record(key, caller.tenant)
        if not is_own(caller, record):
            # Another subject's operation: it does not exist for this caller unless OPA lets it read it; the
            # compensate decision below then asks again, with its own rule for other subjects.
            await authorizer(self._policy, caller, "read_operation",
                             RequestFacts(request_id=meta.request_id, run_id=meta.run_id,
                                          trace_id=meta.trace.trace_id), meta.deadline)(record)
        contract = self._registry.get(record.tool, record.tool_version)
        spec = contract.compensation if contract is not None else None
        block = record.compensation or {}
        self._check_compensable(record, spec, block)
        if not self._store.record_verified(record):  # a SUCCEEDED no key holder recorded is not undone
            raise await self._integrity.refused("outcome", key, phase="request", idempotency_key=key,
                                                tenant=caller.tenant, subject=caller.subject, agent=caller.agent)
        assert spec is not None
        target = self._registry.get(spec.tool, spec.version)
        arguments = build_arguments(spec, inputs=record.meta.get("compensation_inputs") or {},
                                    result=(record.outcome or {}).get("data"))
        if target is None or not target.callable or arguments is None:
            raise self._refused("not_compensable", "The compensation cannot be built for this operation (its "
                                "compensating contract is gone, or the record lacks the mapped values).", record)
        await self._authorize(caller, meta, record, spec, target, arguments)
        header = "compensate:" + key
        owner = str(record.meta.get("subject", ""))  # one compensation per original, whoever asks for it
        op = derive_key(tenant=caller.tenant, subject=caller.subject, tool=target.name, tool_version=target.version,
                        args_hash="", idempotency_key=header, run_id=None, key_subject=owner)
        assert op is not None
        if block.get("status") != "succeeded":
            block = await self._set(record, {"status": "requested", "key": op.key, "tool": target.name,
                                             "tool_version": target.version, "requested_by": caller.subject,
                                             "requested_at": envelope.iso(time.time())},
                                    ("none", "requested", "unknown"), caller)
        call = ToolCallRequest(call_id=f"compensate-{key[3:19]}", tool=target.name, version=target.version,
                               arguments=arguments,
                               meta=replace(meta, idempotency_key=header, run_id=None, plan_call_id=None,
                                            approval_id=None, wait_s=meta.wait_s, key_subject=owner))
        env = (await self._pipeline.execute(call, caller)).envelope
        status = _block_status(env)
        if status != block.get("status") and block.get("status") != "succeeded":
            block = await self._finish(record, {**block, "status": status, "outcome": env.outcome,
                                                "error_code": env.error_code}, caller, env)
        view = await checked_agent_view(self._store, await self._record(key, caller.tenant), self._registry,
                                        self._integrity)
        return env.http_status, {"operation": view, "compensation": env.to_json()}

    # -- steps ------------------------------------------------------------------
    def _check_compensable(self, record: Record, spec: Any, block: Mapping[str, Any]) -> None:
        """The contract declares a compensation, none failed before (frozen), the state allows one, and the
        window is open (a compensation already requested may go on after it closes)."""
        if spec is None:
            raise self._refused("not_compensable", "This operation's contract declares no compensation; its "
                                "effect cannot be undone by the proxy.", record)
        if block.get("status") == "failed":
            raise self._refused("operation_frozen", "A compensation of this operation failed; it is frozen "
                                "and an operator takes over. Nothing more is compensated automatically.", record,
                                compensation_key=block.get("key"))
        if record.state not in spec.from_states:
            raise self._refused("compensation_state_not_allowed", "This operation's state does not allow a "
                                "compensation.", record, allowed_states=list(spec.from_states))
        if not block and time.time() * 1000 > record.updated_at + spec.window_s * 1000:
            raise self._refused("compensation_window_closed", "The time window for compensating this "
                                "operation has passed; its effect stands.", record, window_s=spec.window_s)

    async def _record(self, key: str, tenant: str) -> Record:
        if not re.match(KEY_PATTERN, key):
            raise ProxyError("operation_not_found", "No such operation.", phase="request")
        with unavailable_on_fault("The idempotency store is unreachable.", phase="request"):
            record = await self._store.get(key)
        if record is None or record.tenant != tenant:
            raise ProxyError("operation_not_found", "No such operation.", phase="request")
        return record

    async def _authorize(self, caller: Caller, meta: RequestMeta, record: Record, spec: Any, target: Any,
                         arguments: Mapping[str, Any]) -> None:
        """OPA, action ``compensate``: may this caller undo this operation with this call?"""
        decoded = decode_arguments(arguments, target.input_validator, max_depth=self._max_json_depth)
        normalized = normalize(target, decoded)
        original = original_facts(record)
        document = build_input("compensate", caller, RequestFacts(request_id=meta.request_id, run_id=meta.run_id,
                                                                  trace_id=meta.trace.trace_id),
                               catalog_digest=self._policy.catalog_digest, tool=target, normalized=normalized,
                               original=original, compensation=spec.to_json())
        decision = await self._policy.decide(document, deadline=meta.deadline,
                                             record_view=target.record_view)
        if not decision.allow:
            self._metrics.child(self._metrics.compensations, "refused").inc()
            await self._audit.record("compensation", **_fields(record), subject=caller.subject, agent=caller.agent,
                                     details={"decision": decision.result, "reasons": list(decision.reasons),
                                              "decision_id": decision.decision_id})
            details = {k: v for k, v in (("decision_id", decision.decision_id),
                                         ("policy_revision", decision.policy_revision)) if v}
            raise ProxyError("forbidden", "The caller is not permitted to compensate this operation.",
                             details=details, phase="authorize")

    async def _set(self, record: Record, block: dict[str, Any], from_statuses: tuple[str, ...],
                   caller: Caller) -> dict[str, Any]:
        answer = await self._store.set_compensation(record.key, block=block, from_statuses=from_statuses,
                                                    state=record.state)
        if answer.status == "refused":
            current = _loads(answer.text(1))
            if current.get("status") == "failed":
                raise self._refused("operation_frozen", "A compensation of this operation failed; it is frozen "
                                    "and an operator takes over.", record, compensation_key=current.get("key"))
            return current
        if answer.status != "ok":
            raise self._refused("compensation_state_not_allowed", "This operation's state does not allow a "
                                "compensation.", record)
        self._metrics.child(self._metrics.compensations, "requested").inc()
        await self._audit.record("compensation", **_fields(record), subject=caller.subject, agent=caller.agent,
                                 details={"from": "none", "to": "requested", "compensation_key": block["key"]})
        return block

    async def _finish(self, record: Record, block: dict[str, Any], caller: Caller,
                      env: Envelope) -> dict[str, Any]:
        if block["status"] == "failed":
            block["takeover"] = {"reason": "compensation_failed", "at": envelope.iso(time.time()),
                                 "evidence": {"error_code": block.get("error_code"),
                                              "side_effect": env.side_effect.to_json(),
                                              "backend_code": env.error.details.get("backend_code")
                                              if env.error is not None else None}}
        answer = await self._store.set_compensation(record.key, block=block, from_statuses=("requested", "unknown"),
                                                    state=record.state)
        if answer.status != "ok":
            return _loads(answer.text(1))
        self._metrics.child(self._metrics.compensations, block["status"]).inc()
        await self._audit.record("compensation", **_fields(record), subject=caller.subject, agent=caller.agent,
                                 details={"from": "requested", "to": block["status"],
                                          "compensation_key": block["key"], "outcome": block.get("outcome")})
        if block["status"] == "failed":
            now = time.time()
            await redis_call(self._store.redis.zadd(self._takeovers, {record.key: now}))
            await redis_call(self._store.redis.zadd(self._tenant_takeovers(record.tenant), {record.key: now}))
            self._metrics.child(self._metrics.takeovers, record.tool).inc()
            log.warning("compensation of %s failed (%s); the operation is frozen for an operator", record.key,
                        block.get("error_code"))
            await self._audit.record("takeover", **_fields(record), details=takeover_entry(record, block))
        return block

    def _refused(self, code: str, message: str, record: Record, **details: Any) -> ProxyError:
        self._metrics.child(self._metrics.compensations, "refused").inc()
        return ProxyError(code, message, details={"idempotency_key": record.key, "state": record.state,
                                                  **details}, phase="request")

    # -- operators (admin listener) ----------------------------------------------------
    async def takeovers(self, *, tenant: str | None) -> list[dict[str, Any]]:
        """Frozen operations whose compensation failed, oldest first (one tenant's, unless None)."""
        index = self._takeovers if tenant is None else self._tenant_takeovers(tenant)
        keys = await redis_call(self._store.redis.zrange(index, 0, MAX_TAKEOVERS_LISTED - 1))
        entries = []
        for raw in keys:
            record = await self._store.get(raw.decode())
            if record is None:  # expired with its retention: nothing left to show
                await redis_call(self._store.redis.zrem(index, raw))
                continue
            if (tenant is None or record.tenant == tenant) and (record.compensation or {}).get("status") == "failed":
                entries.append(takeover_entry(record, record.compensation))
        return entries


def takeover_entry(record: Record, block: Mapping[str, Any]) -> dict[str, Any]:
    """What an operator needs to settle a failed compensation by hand: both keys, the target, the evidence."""
    meta = record.meta
    return {"kind": "compensation_failed", "idempotency_key": record.key, "tool": record.tool,
            "tool_version": record.tool_version, "tenant": record.tenant, "subject": meta.get("subject"),
            "agent": meta.get("agent"), "target": meta.get("target"), "state": record.state,
            "compensation": {k: block.get(k) for k in ("key", "tool", "tool_version", "status", "requested_by",
                                                        "requested_at", "error_code")},
            "last_evidence": (block.get("takeover") or {}).get("evidence"),
            "takeover_at": (block.get("takeover") or {}).get("at")}


def _block_status(env: Envelope) -> str:
    """succeeded | unknown | failed (it reached the backend and did not undo the effect) | requested (nothing
    was sent: refused before, busy, or still running elsewhere; asking again is safe)."""
    if env.outcome == "succeeded":
        return "succeeded"
    if not env.side_effect.attempted or env.error_code == "operation_in_progress":
        return "requested"
    if env.side_effect.committed is None:
        return "unknown"
    return "failed"


def _fields(record: Record) -> dict[str, Any]:
    return {"idempotency_key": record.key, "tool": record.tool or None, "tool_version": record.tool_version or None,
            "tenant": record.tenant or None}


def _loads(text: str) -> dict[str, Any]:
    return json.loads(text) if text else {}
