"""Human approvals in Redis.

Owns: the approval record — bound to subject, tenant, tool, tool version,
``args_hash``, risk and expiry — its life cycle (pending -> approved | denied,
approved -> used once, by one operation key), the checks on a re-submission with ``X-Approval-Id``,
the atomic single-use consumption (Lua, one key, so it holds on Redis Cluster
and under concurrent re-submits), the approver's list/approve/deny, and the
approval metrics; and which approval a call already asked for (``standing``: one
per tenant, subject, tool, version, arguments and operation key), so a re-send
waits on the same approval, a denial sticks, and an approved one is found
without its id. Must never: let the requester approve their own call (by subject, or by the
configured person claim across the agent's and the admins' IdPs), let an
approval of one call authorize another (other arguments, tool, version,
subject or tenant), show an approver less than the whole call it binds (a
summary too large to show whole refuses the approval at creation), be used twice (a spent approval re-presented by the very
operation it was spent on is only ``replay_only``: it lets the duplicate see
that operation's recorded outcome, never run it again), store sensitive argument values in the
summary shown to approvers (only the fields a contract's ``approver_may_read`` names, apart, until the
approval is decided), or write the agent's own key into the audit log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, ContextManager, Mapping

import rfc8785

from ..approval_context import approver_copy
from ..audit import Auditor
from ..telemetry.redaction import reveal
from ..config import ApprovalsConfig
from ..errors import ProxyError
from ..identity import AdminPrincipal, Caller
from ..idempotency import OperationKey
from ..integrity import IntegrityGuard
from ..telemetry.metrics import Metrics
from ..normalize import NormalizedCall, digest
from ..registry import ToolContract
from ..requests import RequestMeta
from .. import store
from ..store import key, redis_call

log = logging.getLogger("toolproxy.approvals")

MCP_APPROVAL_META = "io.toolproxy/approval-id"  # where an MCP client re-sends a call with its approval (_meta)
RETAIN_AFTER_EXPIRY_MS = 3600 * 1000  # keep the record an hour past expiry so "expired" is reported as such
MAX_SPENT_REMEMBERED = 100_000  # approvals a process remembers having spent (each one a person's decision)

# Atomic on one slot. KEYS[1] the approval, KEYS[2] its spent mark (``approval-spent``: set when it is spent,
# kept until an hour past its expiry, so it outlives the approval's window of use). ARGV: now_ms, tenant,
# subject, tool, version, args_hash,
# consume ("1" marks it used), used_by, operation key ("" = none; recorded as used_for when consuming),
# then what Python read and verified (proxy/integrity.py): 10 status, 11 expires_at_ms, 12 approver,
# 13 the approval's MAC over the caller's binding with those three, 14 used_at_ms, 15 the spent mark's MAC
# over the caller's binding and this operation key, 16 the spent mark's MAC to write when consuming, 17 risk,
# 18 requester, 19 when the spent mark expires (ms).
# Returns a verdict or "ok". "replay_only": the approval was spent by exactly this operation (same binding,
# same operation key) — it may let the duplicate see that operation's outcome, never run anything.
# "changed": the record moved since Python read it (read again); "integrity" / "integrity_used": the fields
# are those Python expected but the stored MAC is not: a record no key holder wrote, never honoured;
# "restored": an unspent record whose spent mark exists: a copy written back after it was spent.
_CHECK = store.lua("approvals.check", """
local f = redis.call('HMGET', KEYS[1], 'status', 'tenant', 'subject', 'tool', 'tool_version', 'args_hash',
                     'expires_at_ms', 'used_at_ms', 'used_for', 'approver', 'mac', 'used_mac', 'risk', 'requester')
if not f[1] or f[2] ~= ARGV[2] then return 'not_found' end
if f[1] == 'pending' then return 'pending' end
if f[1] == 'denied' then return 'denied' end
local bound = f[3] == ARGV[3] and f[4] == ARGV[4] and f[5] == ARGV[5] and f[6] == ARGV[6]
local same = f[1] == ARGV[10] and f[7] == ARGV[11] and (f[10] or '') == ARGV[12] and (f[13] or '') == ARGV[17]
  and (f[14] or '') == ARGV[18]
if f[8] then
  if ARGV[7] ~= '1' and ARGV[9] ~= '' and f[9] == ARGV[9] and bound then
    if not same or f[8] ~= ARGV[14] then return 'changed' end
    if f[12] ~= ARGV[15] then return 'integrity_used' end
    return 'replay_only'
  end
  return 'used'
end
if f[1] == 'approved' and redis.call('GET', KEYS[2]) then return 'restored' end
if tonumber(f[7]) <= tonumber(ARGV[1]) then return 'expired' end
if not bound then return 'mismatch' end
if not same then return 'changed' end
if f[11] ~= ARGV[13] then return 'integrity' end
if ARGV[7] == '1' then
  redis.call('HSET', KEYS[1], 'used_at_ms', ARGV[1], 'used_by', ARGV[8], 'used_for', ARGV[9], 'used_mac', ARGV[16])
  redis.call('SET', KEYS[2], ARGV[9] ~= '' and ARGV[9] or '-')
  redis.call('PEXPIREAT', KEYS[2], ARGV[19])
end
return 'ok'
""")

# KEYS[1] the approval. ARGV: now_ms, new status, approver subject, approver tenant ("" = any), reason,
# approver person (admin_identity.person_claim; "" = the token lacks it), the pending record's MAC Python
# verified ("changed" if it moved since), the decision's MAC to write. A decided record drops ``revealed`` (the
# sensitive fields an approver could read while it waited). The record's ``requester`` is the
# person of the agent's token (identity.person_claim): the same person never decides on their own request,
# across the two IdPs. A record from before this field existed is checked by subject only.
_DECIDE = store.lua("approvals.decide", """
local f = redis.call('HMGET', KEYS[1], 'status', 'tenant', 'subject', 'expires_at_ms', 'requester', 'mac')
if not f[1] or (ARGV[4] ~= '' and f[2] ~= ARGV[4]) then return 'not_found' end
if f[3] == ARGV[3] then return 'self_approval' end
if f[5] then
  if f[5] == '' or ARGV[6] == '' then return 'person_unknown' end
  if f[5] == ARGV[6] then return 'self_approval' end
end
if f[1] ~= 'pending' then return 'not_pending' end
if tonumber(f[4]) <= tonumber(ARGV[1]) then return 'expired' end
if f[6] ~= ARGV[7] then return 'changed' end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'approver', ARGV[3], 'decided_at_ms', ARGV[1], 'decision_reason', ARGV[5],
           'mac', ARGV[8])
redis.call('HDEL', KEYS[1], 'revealed')
return 'ok'
""")

MAX_REASON_CHARS = 500  # an approver's note on a decision
SUMMARY_PARTS = ("arguments", "resources", "view", "related_read")  # what a stored summary may add to a view
# Everything an approval shows an approver, or runs for them, beyond its binding: covered by its MAC as one
# digest (``shown_digest``). ``revealed`` is not: it is sealed on its own (RecordMac.seal) and dropped once
# decided.
SHOWN_FIELDS = ("summary", "reasons", "agent", "created_at_ms", "request_id", "call_id", "operation_key",
                "caller_key", "caller_key_source", "decided_at_ms", "decision_reason")


def shown_digest(record: Mapping[str, Any]) -> str:
    """The digest of ``SHOWN_FIELDS`` as stored (strings; an absent field as "")."""
    return digest([str(record.get(name, "")) for name in SHOWN_FIELDS]) or ""


def _binding(approval_id: str, record: Mapping[str, str]) -> dict[str, Any]:
    """The MAC binding of a record as stored, under the id it was looked up by."""
    return {"approval_id": approval_id, "tenant": record.get("tenant", ""), "subject": record.get("subject", ""),
            "tool": record.get("tool", ""), "tool_version": record.get("tool_version", ""),
            "args_hash": record.get("args_hash", ""), "expires_at_ms": record.get("expires_at_ms", "")}


def approval_key(prefix: str, approval_id: str) -> str:
    """The id is the hash tag: every command on one approval touches one slot."""
    return key(prefix, "approval", approval_id)


def script_key_sets(prefix: str) -> dict[str, list[list[str]]]:
    """Key sets of the approval scripts (start-up check: each in one Cluster slot)."""
    approval_id = "apr_" + "0" * 24
    return {"approvals.check/decide": [[approval_key(prefix, approval_id), spent_key(prefix, approval_id)]]}


def spent_key(prefix: str, approval_id: str) -> str:
    """The spent mark of an approval: the approval's hash tag, so the check script touches one slot."""
    return key(prefix, "approval-spent", approval_id)


@dataclass(frozen=True)
class ApprovalOrigin:
    """The agent's request a pending approval came from, for the approver: its request and call ids, the key the
    agent itself sent (``caller_key``: its Idempotency-Key, X-Run-Id or tool-call id, as ``caller_key_source``
    names it) and the operation key derived from it. The approver sees all of them; the audit record of the
    approval carries the request and call ids and the operation key, never the agent's own key (like every call
    record: a caller-chosen value may carry business data)."""

    request_id: str
    call_id: str | None = None
    operation_key: str | None = None
    caller_key: str | None = None
    caller_key_source: str | None = None  # idempotency_key | run_id (OperationKey.source)

    def fields(self) -> dict[str, str]:
        return {name: value for name, value in (
            ("request_id", self.request_id), ("call_id", self.call_id), ("operation_key", self.operation_key),
            ("caller_key", self.caller_key), ("caller_key_source", self.caller_key_source)) if value}


def origin_of(meta: RequestMeta, call_id: Any, operation: OperationKey | None) -> ApprovalOrigin:
    """The origin of a call that may need an approval (a per-request key of a keyless write names no agent key)."""
    caller_key = None
    if operation is not None:
        caller_key = {"idempotency_key": meta.idempotency_key, "run_id": meta.run_id}.get(operation.source)
    return ApprovalOrigin(request_id=meta.request_id,
                          call_id=call_id if isinstance(call_id, str) and 0 < len(call_id) <= 256 else None,
                          operation_key=operation.key if operation is not None else None,
                          caller_key=caller_key, caller_key_source=operation.source if caller_key else None)


@dataclass(frozen=True)
class Standing:
    """The approval a call already asked for, as the record says now: ``pending``, ``denied`` (with the
    approver's reason) or ``approved`` (usable by this call: not spent, or spent by this very operation)."""

    id: str
    status: str
    reason: str = ""
    expires_at_ms: int = 0


@dataclass(frozen=True)
class Approval:
    id: str
    status: str
    subject: str
    tenant: str
    tool: str
    tool_version: str
    args_hash: str
    risk: str
    expires_at_ms: int
    approver: str | None
    replay_only: bool = False  # spent by this very operation: the call may only see its recorded outcome

    def policy_input(self) -> dict[str, Any]:
        """``input.approval`` for OPA (status "used" for a replay-only approval)."""
        return {"id": self.id, "status": "used" if self.replay_only else self.status, "subject": self.subject, "tenant": self.tenant,
                "tool": self.tool, "tool_version": self.tool_version, "args_hash": self.args_hash,
                "risk": self.risk, "approver": self.approver or "", "expires_at_ms": self.expires_at_ms}


def now_ms() -> int:
    return int(time.time() * 1000)


def approver_summary(tool: ToolContract, normalized: NormalizedCall, approval_id: str,
                     max_bytes: int, *, key: bytes) -> tuple[str, str | None]:
    """What an approver is shown (JSON): every argument the approval binds, in full, masked fields as per-field
    hashes keyed with ``key`` (proxy/telemetry/redaction.py ``reveal``), the resources, the contract's view of amounts and its
    related read (which read, with which arguments); and, apart (the record drops it once decided), the
    sensitive fields the contract lets an approver read in clear (``approver_may_read``). Nothing is ever cut:
    the two together larger than ``max_bytes`` refuse the approval (``approval_summary_too_large``) before
    anything is stored."""
    summary: dict[str, Any] = {"arguments": reveal(normalized.arguments, tool.sensitive_fields, approval_id, key=key),
                               "resources": [r.id for r in normalized.resources]}
    if tool.approval_view:  # the contract's units and currencies, shown beside the arguments
        summary["view"] = {name: {"unit": unit, "currency": currency} for name, unit, currency in tool.approval_view}
    read = tool.related_read
    read_arguments = read.build(normalized.arguments) if read is not None else None
    if read is not None and read_arguments is not None:
        summary["related_read"] = {"tool": read.tool, "version": read.version, "arguments": read_arguments}
    text = json.dumps(summary, ensure_ascii=False)
    clear = approver_copy(normalized.arguments, tool.approver_may_read, approval_id, key=key)
    revealed = json.dumps(clear, ensure_ascii=False) if clear else None
    size = len(text.encode("utf-8")) + len((revealed or "").encode("utf-8"))
    if size > max_bytes:
        raise ProxyError("approval_summary_too_large", "This call needs an approval, but its arguments are too "
                         "large to show an approver in full; nothing was done. Send smaller arguments.",
                         details={"summary_bytes": size, "limit_bytes": max_bytes}, phase="authorize")
    return text, revealed


def _store_faults() -> ContextManager[None]:
    return store.unavailable_on_fault("The approval store is unavailable; nothing was done.", phase="authorize")


def _refusal(verdict: str, approval_id: str) -> ProxyError:
    """What an approver is told when the decide script refused (the record moved, is gone, or is their own)."""
    if verdict == "not_found":
        return _not_found(approval_id)
    if verdict == "self_approval":
        return ProxyError("forbidden", "An approver cannot decide on their own request.",
                          details={"approval_id": approval_id, "reason": "self_approval"}, phase="approval")
    if verdict == "person_unknown":
        return ProxyError("forbidden", "The approver's or the requester's token lacks the identity claim the "
                          "self-approval check compares (identity.person_claim / admin_identity.person_claim).",
                          details={"approval_id": approval_id, "reason": "person_unknown"}, phase="approval")
    # "changed": it moved since it was read (another approver): no longer pending as read
    return ProxyError("approval_not_pending", "The approval is no longer waiting for a decision.",
                      details={"approval_id": approval_id, "reason": verdict}, phase="approval")


def denial(approval_id: str, approver_reason: str) -> ProxyError:
    """A person denied this call: the answer to it and to every re-send of it (same arguments and key) while
    the approval's record lives, with the approver's reason."""
    said = f": {approver_reason[:240]}" if approver_reason else " (no reason given)"
    return ProxyError("approval_mismatch", f"A person denied this call{said}. It will not run; ask the user "
                      "how to proceed.", details={"approval_id": approval_id, "reason": "denied",
                                                  **({"approver_reason": approver_reason} if approver_reason
                                                     else {})}, phase="authorize")


def _mismatch(reason: str, approval_id: str) -> ProxyError:
    messages = {
        "not_found": "The approval does not exist for this caller.",
        "denied": "The approval was denied.",
        "expired": "The approval has expired; ask for a new one.",
        "used": "The approval was already used; each approval authorizes one call.",
        "mismatch": "The approval was given for a different call (tool, version or arguments changed).",
    }
    return ProxyError("approval_mismatch", messages[reason], details={"approval_id": approval_id,
                                                                       "reason": reason}, phase="authorize")


class ApprovalStore:
    def __init__(self, redis: store.Client, config: ApprovalsConfig, metrics: Metrics,
                 prefix: str, audit: Auditor, integrity: IntegrityGuard, *, replica_acks: int = 0,
                 ack_timeout_ms: int = 200) -> None:
        self._redis = redis
        self._integrity = integrity
        self._mac = integrity.mac
        self._field_key = integrity.mac.derived_key("field-hash")  # masked fields' hashes: keyed, not SHA-256
        self._replica_acks = replica_acks  # WAIT after spending an approval, so a failover cannot un-spend it
        self._ack_timeout_ms = ack_timeout_ms
        self._audit = audit
        self._config = config
        self._metrics = metrics
        self._prefix = prefix
        self._check = store.script(redis, _CHECK)
        self._spent: dict[str, int] = {}  # approvals this process spent -> their expiry (ms): _spent_here
        self._decide = store.script(redis, _DECIDE)

    def _key(self, approval_id: str) -> str:
        return approval_key(self._prefix, approval_id)

    def _check_keys(self, approval_id: str) -> list[str]:
        return [self._key(approval_id), spent_key(self._prefix, approval_id)]

    def _spent_here(self, approval_id: str, expires_at_ms: str) -> None:
        """Remember an approval this process spent until it expires: a copy of it written back into Redis
        (with its spent mark deleted too) is still refused here, the sidecar its agent calls through."""
        now = now_ms()
        for gone in [i for i, until in self._spent.items() if until <= now]:
            del self._spent[gone]
        while len(self._spent) >= MAX_SPENT_REMEMBERED:
            self._spent.pop(next(iter(self._spent)))
        self._spent[approval_id] = int(expires_at_ms) if expires_at_ms.isdigit() else now + self._config.ttl_s * 1000

    def _pending_index(self, tenant: str | None = None) -> str:
        """Pending approvals (id -> expires_at_ms): the fleet's (``tenant`` None: a principal of every tenant,
        the gauge) or one tenant's, kept beside it, so one tenant's many approvals never push another's out of
        its approvers' listing."""
        return key(self._prefix, "approvals", "pending") if tenant is None else \
            key(self._prefix, "approvals-pending", tenant)

    def _subject_index(self, tenant: str, subject: str) -> str:
        """One subject's pending approvals in its tenant: what ``approvals.max_pending_per_subject`` counts."""
        return key(self._prefix, "approvals-pending", tenant, "subject", subject)

    def _decided_index(self, tenant: str | None = None) -> str:
        """The most recent decisions (id -> decided_at_ms), capped at ``approvals.max_list``: the console's
        "decided" panel, the fleet's or one tenant's. The records themselves expire with their approval."""
        return key(self._prefix, "approvals", "decided") if tenant is None else \
            key(self._prefix, "approvals-decided", tenant)

    async def _within_quota(self, caller: Caller) -> None:
        """Refuse a new approval when the caller's subject already has ``max_pending_per_subject`` waiting: one
        agent cannot flood its approvers (nor, by the tenant's own index, anyone else's)."""
        now, mine = now_ms(), self._subject_index(caller.tenant, caller.subject)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(mine, "-inf", now)
            pipe.zcount(mine, now, "+inf")
            _, waiting = await redis_call(pipe.execute())
        limit = self._config.max_pending_per_subject
        if int(waiting) >= limit:
            self._metrics.approvals.labels("refused").inc()
            raise ProxyError("rate_limited", f"{limit} approvals of this caller are already waiting for a decision; "
                             "nothing was done. Ask again once one is decided or has expired.",
                             details={"limit": limit, "pending": int(waiting)}, phase="authorize")

    # -- the agent side ---------------------------------------------------------------
    async def create(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall, *, risk: str,
                     reasons: tuple[str, ...], origin: ApprovalOrigin | None = None,
                     operation_key: str | None = None) -> tuple[str, int]:
        """A pending approval bound to exactly this call, and the one this call (its arguments and operation
        key) asked for from now on (``standing``); returns (id, expires_at_ms)."""
        with _store_faults():
            await self._within_quota(caller)
        approval_id = "apr_" + secrets.token_hex(12)
        created = now_ms()
        expires = created + self._config.ttl_s * 1000
        summary, revealed = approver_summary(tool, normalized, approval_id, self._config.max_summary_bytes,
                                             key=self._field_key)
        record = {"id": approval_id, "status": "pending", "subject": caller.subject, "requester": caller.person,
                  "tenant": caller.tenant,
                  "agent": caller.agent, "tool": tool.name, "tool_version": tool.version,
                  "args_hash": normalized.args_hash, "risk": risk, "reasons": json.dumps(list(reasons)),
                  "summary": summary, "created_at_ms": created, "expires_at_ms": expires,
                  **(origin.fields() if origin is not None else {}),
                  # Sealed while it waits (never in clear in Redis); the decision drops it.
                  **({"revealed": self._mac.seal("approval", approval_id, revealed)} if revealed else {})}
        record["mac"] = self._mac.approval(approval_id=approval_id, tenant=caller.tenant, subject=caller.subject,
                                           tool=tool.name, tool_version=tool.version,
                                           args_hash=normalized.args_hash, expires_at_ms=expires, risk=risk,
                                           requester=caller.person, status="pending",
                                           shown=shown_digest(record))
        with _store_faults():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._key(approval_id), mapping=record)
                pipe.pexpireat(self._key(approval_id), expires + RETAIN_AFTER_EXPIRY_MS)
                await redis_call(pipe.execute())
            async with self._redis.pipeline(transaction=False) as pipe:  # (other slots than the record's)
                for index in (self._pending_index(), self._pending_index(caller.tenant),
                              self._subject_index(caller.tenant, caller.subject)):
                    pipe.zadd(index, {approval_id: expires})
                await redis_call(pipe.execute())
            # (Another slot: a lost write only means the next re-send asks anew.)
            await redis_call(self._redis.set(self._asked_key(caller, tool, normalized, operation_key), approval_id,
                                             pxat=expires + RETAIN_AFTER_EXPIRY_MS))
        self._metrics.approvals.labels("created").inc()
        await self._update_pending_gauge()
        # The agent's own key stays out of the audit log (origin: the operation key stands for it there).
        joined = {"request_id": origin.request_id, "call_id": origin.call_id,
                  "idempotency_key": origin.operation_key} if origin is not None else {}
        await self._audit.record("approval", approval_id=approval_id, tool=tool.name, tool_version=tool.version,
                                 tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
                                 args_hash=normalized.args_hash, **{k: v for k, v in joined.items() if v},
                                 details={"state": "created", "risk": risk, "reasons": list(reasons),
                                          "expires_at_ms": expires})
        return approval_id, expires

    def _asked_key(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                   operation_key: str | None) -> str:
        """Where the approval a call asked for is found: by tenant, subject, tool, version, arguments and
        operation key (a per-request key never repeats, so such a call asks anew each time)."""
        digest = hashlib.sha256(rfc8785.dumps([caller.tenant, caller.subject, tool.name, tool.version,
                                               normalized.args_hash, operation_key or ""])).hexdigest()
        return key(self._prefix, "approval-asked", digest)

    async def standing(self, caller: Caller, tool: ToolContract, normalized: NormalizedCall, *,
                       operation_key: str | None = None) -> Standing | None:
        """The approval this call (same caller, tool, version, arguments and operation key) already asked for,
        if it still counts: pending, denied, or approved and not spent; None otherwise (never asked, expired,
        spent — a re-run needs a fresh approval; a duplicate that names the spent one sees its operation's
        outcome —, or a record that is not bound to this call)."""
        with _store_faults():
            raw = await redis_call(self._redis.get(self._asked_key(caller, tool, normalized, operation_key)))
        if raw is None:
            return None
        approval_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        verdict, record = await self._run_check(approval_id, caller, tool, normalized, consume=False,
                                                operation_key=operation_key)
        if verdict == "ok":  # approved and not spent: the script compared the binding and the MAC
            return Standing(approval_id, "approved")
        if verdict in ("pending", "denied") and self._bound(approval_id, record, caller, tool, normalized) \
                and int(record.get("expires_at_ms", "0")) > now_ms():
            return Standing(approval_id, verdict, record.get("decision_reason", ""), int(record["expires_at_ms"]))
        return None

    def _bound(self, approval_id: str, record: Mapping[str, str], caller: Caller, tool: ToolContract,
               normalized: NormalizedCall) -> bool:
        """Whether a pending or denied record (which the check script answers before comparing) is bound to
        this call and carries the MAC a key holder wrote for it."""
        if (record.get("tenant"), record.get("subject"), record.get("tool"), record.get("tool_version"),
                record.get("args_hash")) != (caller.tenant, caller.subject, tool.name, tool.version,
                                             normalized.args_hash):
            return False
        return self._mac.same(self._expected_mac(approval_id, record, caller, tool, normalized), record.get("mac"))

    def _expected_mac(self, approval_id: str, record: Mapping[str, str], caller: Caller, tool: ToolContract,
                      normalized: NormalizedCall) -> str:
        """The MAC a record bound to this call carries, given its status, approver, risk and requester."""
        return self._mac.approval(approval_id=approval_id, tenant=caller.tenant, subject=caller.subject,
                                  tool=tool.name, tool_version=tool.version, args_hash=normalized.args_hash,
                                  expires_at_ms=record.get("expires_at_ms", ""), risk=record.get("risk", ""),
                                  status=record.get("status", ""), approver=record.get("approver", ""),
                                  requester=record.get("requester", ""), shown=shown_digest(record))

    async def presented(self, approval_id: str, caller: Caller, tool: ToolContract,
                        normalized: NormalizedCall, *, operation_key: str | None = None) -> Approval:
        """The approval sent with X-Approval-Id, checked (not consumed) against this call. An approval
        already spent by this call's own operation comes back with ``replay_only`` set."""
        verdict, record = await self._run_check(approval_id, caller, tool, normalized, consume=False,
                                                operation_key=operation_key)
        if verdict == "pending":
            raise ProxyError("approval_required", "The approval is still waiting for a decision.",
                             details={"approval_id": approval_id}, phase="authorize")
        if verdict not in ("ok", "replay_only"):
            self._metrics.approvals.labels("expired" if verdict == "expired" else "mismatch").inc()
            if verdict == "denied" and self._bound(approval_id, record, caller, tool, normalized):
                raise denial(approval_id, record.get("decision_reason", ""))
            raise _mismatch(verdict, approval_id)
        # Every field below is one the check compared with this call, or one the approval's MAC covers.
        return Approval(id=approval_id, status=record["status"], subject=caller.subject,
                        tenant=caller.tenant, tool=tool.name, tool_version=tool.version,
                        args_hash=normalized.args_hash, risk=record.get("risk", ""),
                        expires_at_ms=int(record["expires_at_ms"]), approver=record.get("approver"),
                        replay_only=verdict == "replay_only")

    async def consume(self, approval_id: str, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                      *, used_by: str, operation_key: str | None = None) -> None:
        """Mark the approval used, atomically with all its checks: one call per approval. The operation
        key it was spent on is recorded (a duplicate of that operation may later see its outcome)."""
        verdict, _ = await self._run_check(approval_id, caller, tool, normalized, consume=True, used_by=used_by,
                                           operation_key=operation_key)
        if verdict != "ok":
            self._metrics.approvals.labels("mismatch").inc()
            raise _mismatch(verdict if verdict != "pending" else "mismatch", approval_id)
        self._metrics.approvals.labels("consumed").inc()
        await self._audit.record("approval", approval_id=approval_id, tool=tool.name, tool_version=tool.version,
                                 tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
                                 args_hash=normalized.args_hash, details={"state": "consumed"})

    async def _run_check(self, approval_id: str, caller: Caller, tool: ToolContract, normalized: NormalizedCall,
                         *, consume: bool, used_by: str = "",
                         operation_key: str | None = None) -> tuple[str, dict[str, str]]:
        """The check (and, with ``consume``, the spending) of one approval against this call: the record is
        read, the MACs this call expects are computed here, and the script compares them with the stored
        ones in the same atomic step that acts on the record (a record that moved in between is read again).
        Returns (verdict, the record as read)."""
        for _ in range(3):
            # Known spent here before the read, so an unspent record read after it is a copy written back. Asked
            # after the read, a concurrent call of this process that spent it meanwhile would make this
            # call's earlier, honest read look restored (an integrity refusal of a plain race).
            spent_before_read = approval_id in self._spent
            with _store_faults():
                record = await self._record(approval_id) or {}
            if spent_before_read and "used_at_ms" not in record and record.get("status") == "approved":
                verdict = "restored"  # spent here, unspent in Redis: written back, whatever Redis says now
                break
            args = self._check_args(approval_id, record, caller, tool, normalized, consume=consume,
                                    used_by=used_by, operation_key=operation_key)
            verdict = await self._send_check(approval_id, args, consume=consume)
            if verdict != "changed":
                break
        else:
            verdict = "mismatch"  # moving under every read: not something to honour
        if verdict == "ok" and consume:
            self._spent_here(approval_id, record.get("expires_at_ms", ""))
        if verdict in ("integrity", "integrity_used", "restored"):
            raise await self._integrity.refused(
                {"integrity": "approval", "integrity_used": "approval-used", "restored": "approval-spent"}[verdict],
                approval_id, phase="authorize",
                approval_id=approval_id, tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
                tool=tool.name, tool_version=tool.version, args_hash=normalized.args_hash)
        return verdict, record

    # -- the approver side (admin listener) --------------------------------------------
    async def list_pending(self, principal: AdminPrincipal) -> list[dict[str, Any]]:
        now, index = now_ms(), self._pending_index(principal.tenant)
        with _store_faults():
            await redis_call(self._redis.zremrangebyscore(index, "-inf", now))
            ids = await redis_call(self._redis.zrangebyscore(index, now, "+inf", start=0, num=self._config.max_list))
            records = [(i.decode(), await self._record(i.decode())) for i in ids]
        await self._update_pending_gauge()
        return await self._views([(i, r) for i, r in records
                                  if r and r.get("status") == "pending" and self._visible_to(principal, r)])

    async def count_pending(self, principal: AdminPrincipal) -> int | None:
        """How many approvals are pending in the fleet, for a principal of every tenant (the listing stops at
        ``approvals.max_list``); None for a tenant's principal (the index is shared, its count is not theirs)."""
        if principal.tenant is not None:
            return None
        with _store_faults():
            return int(await redis_call(self._redis.zcount(self._pending_index(), now_ms(), "+inf")))

    @property
    def list_limit(self) -> int:
        return self._config.max_list

    async def get(self, approval_id: str, principal: AdminPrincipal) -> dict[str, Any]:
        with _store_faults():
            record = await self._record(approval_id)
        if not record or not self._visible_to(principal, record):
            raise _not_found(approval_id)
        if not self._verified(approval_id, record):
            raise await self._integrity.refused("approval", approval_id, phase="approval", approval_id=approval_id)
        return self._view(approval_id, record)

    async def list_decided(self, principal: AdminPrincipal) -> list[dict[str, Any]]:
        """The most recent decisions (approved, denied, then used or expired), newest first."""
        with _store_faults():
            index = self._decided_index(principal.tenant)
            ids = await redis_call(self._redis.zrevrange(index, 0, self._config.max_list - 1))
            records = [(i.decode(), await self._record(i.decode())) for i in ids]
            gone = [i for i, r in records if r is None]
            if gone:
                await redis_call(self._redis.zrem(index, *gone))
        return await self._views([(i, r) for i, r in records if r and self._visible_to(principal, r)])

    async def decide(self, approval_id: str, principal: AdminPrincipal, *, approve: bool,
                     body: Any = None) -> dict[str, Any]:
        """Approve or deny; ``body`` is the optional ``{"reason": "<text>"}`` the approver gave."""
        reason = decision_reason(body)
        status = "approved" if approve else "denied"
        # No decision takes effect unaudited: the record comes first (audit_unavailable stops it).
        await self._audit.record("approval", critical=True, approval_id=approval_id,
                                 details={"state": status, "approver": principal.subject,
                                          "approver_tenant": principal.tenant,
                                          **({"reason": reason} if reason else {})})
        with _store_faults():
            record = await self._record(approval_id)
            decided_at = now_ms()
            decision_mac = await self._decision_mac(approval_id, record, principal, status, decided_at, reason)
            verdict = await redis_call(self._decide(keys=[self._key(approval_id)], args=[
                decided_at, status, principal.subject, principal.tenant or "", reason, principal.person,
                (record or {}).get("mac", ""), decision_mac]))
            verdict = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
            if verdict == "ok":
                tenant, subject = (record or {}).get("tenant", ""), (record or {}).get("subject", "")
                async with self._redis.pipeline(transaction=False) as pipe:
                    for index in (self._pending_index(), self._pending_index(tenant),
                                  self._subject_index(tenant, subject)):
                        pipe.zrem(index, approval_id)
                    for index in (self._decided_index(), self._decided_index(tenant)):
                        pipe.zadd(index, {approval_id: decided_at})
                        pipe.zremrangebyrank(index, 0, -self._config.max_list - 1)
                    await redis_call(pipe.execute())
        if verdict != "ok":
            await self._audit.record("approval", approval_id=approval_id,
                                     details={"state": "refused", "reason": verdict, "approver": principal.subject})
            raise _refusal(verdict, approval_id)
        self._metrics.approvals.labels(status).inc()
        await self._update_pending_gauge()
        log.info("approval %s %s by %s", approval_id, status, principal.subject)
        return await self.get(approval_id, principal)

    async def _decision_mac(self, approval_id: str, record: dict[str, str] | None, principal: AdminPrincipal,
                            status: str, decided_at: int, reason: str) -> str:
        """The MAC the decided record will carry, once the pending record's own MAC verified ("" when the record
        is not a pending one this approver may see: the script then refuses it)."""
        if record is None or record.get("status") != "pending" or not self._visible_to(principal, record):
            return ""
        if not self._verified(approval_id, record):
            # Only the id goes into the audit record: the other fields are what failed the check.
            raise await self._integrity.refused("approval", approval_id, phase="approval", approval_id=approval_id)
        decided = {**record, "decided_at_ms": str(decided_at), "decision_reason": reason}
        return self._mac.approval(**_binding(approval_id, record), risk=record.get("risk", ""),
                                  requester=record.get("requester", ""), status=status,
                                  approver=principal.subject, shown=shown_digest(decided))

    def _verified(self, approval_id: str, record: Mapping[str, str]) -> bool:
        """Whether ``record`` is one a key holder wrote for this id, in its status, with everything it shows."""
        return self._mac.same(self._mac.approval(
            **_binding(approval_id, record), risk=record.get("risk", ""), requester=record.get("requester", ""),
            status=record.get("status", ""), approver=record.get("approver", ""), shown=shown_digest(record)),
            record.get("mac"))

    async def _views(self, records: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
        """The views of listed records; a record whose MAC does not verify is left out, counted and audited."""
        views = []
        for approval_id, record in records:
            if self._verified(approval_id, record):
                views.append(self._view(approval_id, record))
            else:
                await self._integrity.refused("approval", approval_id, phase="approval", approval_id=approval_id)
        return views

    def _check_args(self, approval_id: str, record: dict[str, str], caller: Caller, tool: ToolContract,
                    normalized: NormalizedCall, *, consume: bool, used_by: str,
                    operation_key: str | None) -> list[Any]:
        """The check script's ARGV: this call's binding, the record's fields as read, and the MACs this call
        expects of them (and, to spend it, the spent mark's)."""
        now = now_ms()
        binding = {"approval_id": approval_id, "tenant": caller.tenant, "subject": caller.subject,
                   "tool": tool.name, "tool_version": tool.version, "args_hash": normalized.args_hash,
                   "expires_at_ms": record.get("expires_at_ms", "")}
        expected = self._expected_mac(approval_id, record, caller, tool, normalized)
        used_at = record.get("used_at_ms", "")
        expected_used = self._mac.approval_used(**binding, used_at_ms=used_at, used_for=operation_key or "")
        spend = self._mac.approval_used(**binding, used_at_ms=now, used_for=operation_key or "")
        return [now, caller.tenant, caller.subject, tool.name, tool.version, normalized.args_hash,
                "1" if consume else "0", used_by, operation_key or "", record.get("status", ""),
                record.get("expires_at_ms", ""), record.get("approver", ""), expected, used_at, expected_used,
                spend if consume else "", record.get("risk", ""), record.get("requester", ""),
                _mark_expiry(record)]

    async def _send_check(self, approval_id: str, args: list[Any], *, consume: bool) -> str:
        with _store_faults():
            if consume and self._replica_acks > 0:
                verdict, acked = await store.run_replicated(self._redis, self._check, self._check_keys(approval_id),
                                                            args, acks=self._replica_acks,
                                                            timeout_ms=self._ack_timeout_ms)
                if acked < self._replica_acks:
                    self._metrics.replica_ack_shortfall("approval")
            else:
                verdict = await redis_call(self._check(keys=self._check_keys(approval_id), args=args))
        return verdict.decode() if isinstance(verdict, bytes) else str(verdict)

    async def _record(self, approval_id: str) -> dict[str, str] | None:
        raw = await redis_call(self._redis.hgetall(self._key(approval_id)))
        return {k.decode(): v.decode() for k, v in raw.items()} if raw else None

    @staticmethod
    def _visible_to(principal: AdminPrincipal, record: Mapping[str, str]) -> bool:
        return principal.tenant is None or principal.tenant == record.get("tenant")

    def _view(self, approval_id: str, record: Mapping[str, str]) -> dict[str, Any]:
        """What an approver is shown of a record whose MAC verified (``_verified``): the summary's own parts
        first, every bound field after them (stored text never stands in for a bound field)."""
        expires = int(record["expires_at_ms"])
        status = record["status"]
        if status in {"pending", "approved"} and expires <= now_ms() and "used_at_ms" not in record:
            status = "expired"
        elif "used_at_ms" in record:
            status = "used"
        summary = json.loads(record.get("summary", "{}"))
        revealed = self._mac.unseal("approval", approval_id, record["revealed"]) if record.get("revealed") else None
        return {**{k: summary[k] for k in SUMMARY_PARTS if k in summary},
                "id": approval_id, "status": status, "subject": record["subject"], "tenant": record["tenant"],
                "tool": record["tool"], "tool_version": record["tool_version"], "risk": record["risk"],
                "args_hash": record["args_hash"], "reasons": json.loads(record.get("reasons", "[]")),
                "created_at_ms": int(record["created_at_ms"]), "expires_at_ms": expires,
                "approver": record.get("approver"), "decision_reason": record.get("decision_reason") or None,
                "decided_at_ms": int(record["decided_at_ms"]) if "decided_at_ms" in record else None,
                "request_id": record.get("request_id"), "call_id": record.get("call_id"),
                "caller_key": record.get("caller_key"), "caller_key_source": record.get("caller_key_source"),
                "operation_key": record.get("operation_key"), "agent": record.get("agent"),
                "revealed": json.loads(revealed) if revealed else None}

    async def refresh_gauges(self) -> None:
        """Re-read the pending count (called before each /metrics scrape: expiry and restarts show)."""
        await self._update_pending_gauge()

    async def _update_pending_gauge(self) -> None:
        # the gauge is refreshed on the next approval event or scrape
        with store.logged_on_fault(log, "could not refresh the pending approvals gauge", level=logging.DEBUG):
            count = await redis_call(self._redis.zcount(self._pending_index(), now_ms(), "+inf"))
            self._metrics.pending_approvals.set(count)


def _mark_expiry(record: Mapping[str, str]) -> int:
    """When an approval's spent mark expires: an hour past the approval's own expiry (after which no copy of it
    can be spent, its expiry being under its MAC)."""
    expires = record.get("expires_at_ms", "")
    return (int(expires) if expires.isdigit() else now_ms()) + RETAIN_AFTER_EXPIRY_MS


def decision_reason(body: Any) -> str:
    """The approver's reason from an optional ``{"reason": "<text>"}`` body ("" when none was given)."""
    if body is None:
        return ""
    if not isinstance(body, dict) or set(body) - {"reason"} or not isinstance(body.get("reason", ""), str) \
            or len(body.get("reason", "")) > MAX_REASON_CHARS:
        raise ProxyError("invalid_request", f"Send no body or {{reason: text of at most {MAX_REASON_CHARS} "
                         "characters}.", phase="request")
    return body.get("reason", "").strip()


def _not_found(approval_id: str) -> ProxyError:
    return ProxyError("approval_not_found", "No such approval.", details={"approval_id": approval_id},
                      phase="approval")
