"""Reconciliation: turn UNKNOWN operations into facts, or hand them to a human.

Owns: the background task (one per proxy process) that (1) finds IN_PROGRESS
records whose lease ran out (the proxy that held them died) and makes writes
UNKNOWN, (2) queries each due UNKNOWN operation's status endpoint
(``GET`` with the idempotency key where the endpoint says ``{key}``, or as
its last path segment; read-only) with exponential
backoff inside a window, holding a per-key claim in Redis so one replica
works on one key at a time, (3) raises a takeover record when the window
runs out or the tool has no status endpoint, and (4) writes a
``reconciliation`` audit record for every transition it makes and a
``takeover`` record for every handover. (An operator's manual resolution of
an open operation is ``proxy/fronts/admin_api.py``'s.)

Status answers:
  ``{"state": "committed", "result": {...}}`` -> SUCCEEDED with that result (checked against outputSchema);
  ``{"state": "pending"}`` -> keep watching; ``{"state": "not_found"}`` -> FAILED_RETRYABLE (the same key may
  run again; the backend also deduplicates on it); ``{"state": "rejected", "error": {...}}`` -> FAILED_FINAL;
  ``{"state": "cancelled"}`` -> CANCELLED (the backend stopped the call and applied nothing);
  ``{"state": "partial", "committed": [...], "pending": [...]}`` -> keep watching while items are pending,
  a takeover when nothing is pending any more (part applied, part never will be: a person decides).
  A record that already holds applied items (a partial answer) cannot end ``rejected``, ``cancelled`` or
  ``not_found``: those are takeovers too.

Recovery checks the digest: when the status endpoint reports ``committed`` with a
result and the record holds what execution saw of it (the SHA-256 of a verified result, or of each item
a partial answer committed), the result must agree: the same digest, or every committed item found in
it unchanged. A mismatch is a takeover whose evidence carries both digests, never a success.
  Anything else (unreachable, 5xx, malformed) -> keep watching, as evidence ``unreachable``/``invalid_answer``.

Must never: re-execute an operation, send anything but the read-only status
query (with its own ``tool:status`` call token), trust a status answer's result without validating it, or pass backend
bodies, hostnames or exception text into evidence.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp

from ..adapters import partial_answer
from ..adapters.call_tokens import CallTokens
from ..audit import Auditor
from ..normalize import digest
from ..config import ReconcileConfig
from ..decode import schema_violations, strict_loads
from ..credentials import Credentials, OnBehalfOf
from ..errors import ProxyError, SideEffect
from ..idempotency import outcome_of
from ..locks import LockManager
from ..operation_views import takeover_record
from ..telemetry import spans
from ..telemetry.metrics import Metrics
from ..operations import BUCKETS, OperationStore, Record
from ..registry import Registry, ToolContract
from .. import store
from ..store import StoreError

log = logging.getLogger("toolproxy.reconcile")

MAX_STATUS_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Verdict:
    """What the status endpoint established, as values (a cancel of a running call reads them too); the
    operation record's JSON is made from them once, by ``outcome``."""

    verdict: str                        # SUCCEEDED | FAILED_RETRYABLE | FAILED_FINAL | CANCELLED | WATCH
    result: str                         # the toolproxy_reconciliations label
    evidence: Mapping[str, Any]
    side_effect: SideEffect | None = None  # None: nothing established (WATCH)
    data: Any = None                    # SUCCEEDED: the verified result
    error: ProxyError | None = None     # the failure the record keeps
    partial: Mapping[str, Any] | None = None  # the status endpoint's committed and pending items

    def outcome(self, tool: ToolContract, record: Record) -> dict[str, Any] | None:
        """The stored form of what was established (the record boundary), None when nothing was."""
        if self.side_effect is None:
            return None
        return outcome_of(data=self.data, error=self.error, side_effect=self.side_effect, tool=tool,
                          call_id=record.meta.get("call_id"), request_id=record.meta.get("request_id"))


class Reconciler:
    def __init__(self, *, store: OperationStore, registry: Registry, session: aiohttp.ClientSession,
                 services: Mapping[str, str], config: ReconcileConfig, metrics: Metrics, audit: Auditor,
                 max_json_depth: int, tokens: CallTokens, locks: LockManager | None = None,
                 credentials: Credentials | None = None) -> None:
        self._store = store
        self._credentials = credentials or Credentials()  # what the tool's backend wants (backend.auth)
        self._tokens = tokens
        self._locks = locks  # thaws what an operation froze once it settles
        self._max_json_depth = max_json_depth
        self._audit = audit
        self._registry = registry
        self._session = session
        self._services = dict(services)
        self._config = config
        self._metrics = metrics
        self._owner = uuid.uuid4().hex
        self._task: asyncio.Task[None] | None = None
        self._limit = asyncio.Semaphore(max(1, config.concurrency))
        self._store_down = False
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        if self._config.enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="toolproxy-reconciler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # The flag as well as the cancel: a library that swallows CancelledError must not keep us alive.
            self._stopping = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _loop(self) -> None:
        interval = self._config.scan_interval_ms / 1000.0
        while not self._stopping:
            try:
                await self.scan_once()
                if self._store_down:
                    log.info("reconciler: state store reachable again")
                self._store_down = False
            except StoreError:  # policy: retry: the sweep runs again next interval
                if not self._store_down:
                    log.warning("reconciler: state store unreachable; retrying every %.1fs", interval)
                self._store_down = True
            except Exception:
                log.exception("reconciler: scan failed")
            if not self._stopping:
                await asyncio.sleep(interval)

    # -- one pass ----------------------------------------------------------------
    async def scan_once(self) -> dict[str, int]:
        """Expire dead leases and reconcile every due key once. Returns what happened, counted (tests, logs).

        The due and expired indexes of every bucket are read in one pipelined round trip (cluster: one per
        master). Each bucket's keys live in one Cluster slot, so a bucket whose master is unreachable
        (mid-failover) is skipped this pass while the others are swept; the pass then raises the first Redis
        error so the loop reports the store as down."""
        counts: dict[str, int] = {}
        failed: list[Exception] = []
        due: list[str] = []
        expired_by_bucket, due_by_bucket = await self._store.sweep_candidates(self._config.batch_size)
        for bucket in BUCKETS:  # a bucket whose master failed is reported; the others are swept
            swept = await store.fault_as_value(self._sweep_bucket(expired_by_bucket[bucket], due_by_bucket[bucket],
                                                                  counts))
            if isinstance(swept, StoreError):
                failed.append(swept)
            else:
                due.extend(swept)
        results = await asyncio.gather(*(self._guarded(key) for key in due), return_exceptions=True)
        for result in results:
            if isinstance(result, StoreError):
                failed.append(result)
                result = "store_unavailable"
            elif isinstance(result, BaseException):
                raise result
            counts[result] = counts.get(result, 0) + 1
        if failed:
            counts["buckets_failed"] = len(failed)
            raise failed[0]
        return counts

    async def _sweep_bucket(self, expired: list[str] | Exception, due: list[str] | Exception,
                            counts: dict[str, int]) -> list[str]:
        """Expire one bucket's dead leases; its keys due for reconciliation (raises its master's fault)."""
        await self._expire_keys(_keys_or_raise(expired), counts)
        return _keys_or_raise(due)

    async def _expire_keys(self, keys: list[str], counts: dict[str, int]) -> None:
        for key in keys:
            answer = await self._store.expire(key, first_check_ms=self._config.backoff_initial_ms,
                                              window_ms=self._config.window_ms)
            if answer.status == "unknown":
                record = await self._store.get(key)
                self._metrics.unknown_outcomes.labels(self._tool_label(record)).inc()
                log.warning("operation %s: the proxy holding it died mid-call; outcome unknown", key)
                if record is not None:
                    if self._locks is not None:  # no other write on its resources until it settles
                        await self._locks.freeze_unknown(key, record.meta)
                    await audit_transition(self._audit, record, "IN_PROGRESS")
            counts["lease_" + answer.status] = counts.get("lease_" + answer.status, 0) + 1

    async def _guarded(self, key: str) -> str:
        async with self._limit:
            try:
                return await self.reconcile_key(key)
            except StoreError:  # policy: re-raise: the sweep loop owns the retry
                raise
            except Exception:
                log.exception("reconciler: %s failed", key)
                return "crashed"

    async def reconcile_key(self, key: str) -> str:
        """One attempt on one key if it is due and nobody else holds it; returns what happened."""
        claim = await self._store.claim(key, owner=self._owner, claim_ms=self._config.claim_ms)
        if claim.status != "claimed":
            return claim.status
        now_ms = claim.int(0)
        record = await self._store.get(key)
        if record is None or record.state != "UNKNOWN":
            return "settled"
        with spans.linked("reconcile", record.meta.get("traceparent"), {
                "gen_ai.tool.name": record.tool, "toolproxy.tool.version": record.tool_version,
                "toolproxy.idempotency.key_hash": spans.key_hash(key),
                "toolproxy.reconcile.attempt": record.reconcile_attempts + 1}) as traced:
            done = await self._reconcile(key, record, now_ms)
            traced.set({"toolproxy.reconcile.result": done})
            return done

    async def _reconcile(self, key: str, record: Record, now_ms: int) -> str:
        tool = self._contract(record)
        if tool is None:
            return await self._takeover(record, {"source": "proxy", "observed": "tool_not_in_registry"})
        if tool.status_endpoint is None or tool.status_endpoint.for_key(self._services, record.key) is None:
            return await self._takeover(record, {"source": "proxy", "observed": "no_status_endpoint"})
        verdict = await self.query_status(tool, record)
        self._metrics.reconciliations.labels(verdict.result).inc()
        if verdict.verdict == "TAKEOVER":
            return await self._takeover(record, verdict.evidence)
        if verdict.verdict == "WATCH":
            until = record.reconcile_until or now_ms
            if now_ms >= until:
                return await self._takeover(record, verdict.evidence)
            delay = min(self._config.backoff_max_ms, self._config.backoff_initial_ms * 2 ** record.reconcile_attempts)
            delay = max(1, min(delay, until - now_ms))
            await self._store.resolve(key, owner=self._owner, verdict="WATCH", outcome=None,
                                      evidence=verdict.evidence, delay_ms=delay)
            return "watching"
        answer = await self._store.resolve(key, owner=self._owner, verdict=verdict.verdict,
                                           outcome=verdict.outcome(tool, record), evidence=verdict.evidence,
                                           fingerprint=record.fingerprint)
        if answer.status != "ok":
            return answer.status
        log.info("operation %s reconciled: %s (%s)", key, verdict.verdict, verdict.result)
        if self._locks is not None:
            await self._locks.thaw_settled(key, record.meta)
        settled = await self._store.get(key)
        if settled is not None:
            await audit_transition(self._audit, settled, "UNKNOWN")
        return verdict.verdict.lower()

    async def _takeover(self, record: Record, evidence: Mapping[str, Any]) -> str:
        answer = await self._store.resolve(record.key, owner=self._owner, verdict="TAKEOVER", outcome=None,
                                           evidence={**evidence, "at_ms": _now_ms()})
        if answer.status != "ok":
            return answer.status
        self._metrics.reconciliations.labels("takeover").inc()
        self._metrics.takeovers.labels(self._tool_label(record)).inc()
        taken = await self._store.get(record.key)
        if taken is not None:
            takeover = takeover_record(taken)
            log.warning("operation %s needs a human takeover: tool %s, last evidence %s", record.key,
                        taken.tool, (takeover["last_evidence"] or {}).get("observed"))
            await self._audit.record("takeover", **audit_fields(taken), details=takeover)
        return "takeover"

    # -- the status endpoint -----------------------------------------------------
    async def query_status(self, tool: ToolContract, record: Record) -> Verdict:
        url = tool.status_endpoint.for_key(self._services, record.key) if tool.status_endpoint else None
        assert url is not None
        # The key also travels in the header the call itself carried it in, for backends that look there.
        assert tool.status_endpoint is not None
        timeout_s = self._config.status_timeout_ms / 1000.0
        token = self._tokens.for_operation(tool, tool.status_endpoint, scope="tool:status", key=record.key,
                                           tenant=record.tenant, subject=str(record.meta.get("subject", "")),
                                           agent=str(record.meta.get("agent", "")), version=record.tool_version,
                                           budget_s=timeout_s)
        headers = {"Accept": "application/json", "Idempotency-Key": record.key, "X-Toolproxy-Tenant": record.tenant,
                   "X-Toolproxy-Tool-Version": record.tool_version, "X-Request-Id": uuid.uuid4().hex,
                   "Txn-Token": token, **spans.outgoing()}
        evidence: dict[str, Any] = {"source": "status_endpoint", "at_ms": _now_ms()}
        auth = tool.backend.auth
        try:
            async with asyncio.timeout(timeout_s):
                if auth is not None:  # the backend's credential, as on the call (a token exchange needs the caller's
                    # token, which a background query has not: it keeps watching until a person takes over)
                    headers.update(await self._credentials.attach(
                        auth, audience=tool.backend_name, caller=OnBehalfOf(str(record.meta.get("subject", "")),
                                                                            record.tenant), wait_s=timeout_s))
                async with self._session.get(url, headers=headers, allow_redirects=False,
                                             ssl=self._credentials.tls(auth) or True) as response:
                    evidence["http_status"] = response.status
                    body = await response.content.read(MAX_STATUS_BYTES + 1)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return Verdict("WATCH", "error", {**evidence, "observed": "unreachable"})
        except ProxyError as exc:  # credential_unavailable: nothing was asked
            return Verdict("WATCH", "error", {**evidence, "observed": "credential_unavailable",
                                              "reason": exc.details.get("reason")})
        if response.status != 200 or len(body) > MAX_STATUS_BYTES:
            return Verdict("WATCH", "error", {**evidence, "observed": "invalid_answer"})
        try:
            answer = strict_loads(body, what="status answer", max_depth=self._max_json_depth)
        except ProxyError:
            answer = None
        return status_verdict(tool, record, answer, evidence)

    def _contract(self, record: Record) -> ToolContract | None:
        for tool in self._registry.all():  # retired versions too: the record names its exact contract
            if tool.name == record.tool and tool.version == record.tool_version:
                return tool
        return None

    def _tool_label(self, record: Record | None) -> str:
        if record is not None and self._contract(record) is not None:
            return record.tool
        return "unknown"


def digest_mismatch(record: Record, result: Any) -> dict[str, Any] | None:
    """Does a committed result reported by the status endpoint contradict what execution recorded?
    ``{"recorded_digest", "reported_digest"}`` when it does, None when it agrees or nothing was recorded.

    Recorded facts: the digest of a verified result (``evidence.result_digest`` of the stored outcome), or
    of each item a partial answer committed (``partial.committed_digests``): every such item must appear,
    unchanged, somewhere in the final result."""
    outcome = record.outcome or {}
    reported = digest(result)
    recorded = (outcome.get("evidence") or {}).get("result_digest")
    if isinstance(recorded, str):
        return None if recorded == reported else {"recorded_digest": recorded, "reported_digest": reported}
    items = (outcome.get("partial") or {}).get("committed_digests")
    if isinstance(items, list) and items:
        found = _digests_within(result)
        missing = [d for d in items if d not in found]
        if missing:
            return {"recorded_digest": missing[0], "reported_digest": reported,
                    "committed_items_missing": len(missing)}
    return None


def _digests_within(value: Any) -> set[str]:
    """The digest of every object and array inside ``value`` (itself included), and of every scalar item."""
    found: set[str] = set()
    stack = [value]
    while stack:
        current = stack.pop()
        found.add(digest(current) or "")
        if isinstance(current, dict):
            stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return found


async def audit_transition(audit: Auditor, record: Record, previous: str) -> None:
    """One ``reconciliation`` audit record: an operation left ``previous`` for its current state."""
    outcome = record.outcome or {}
    side = outcome.get("side_effect") or {}
    await audit.record("reconciliation", **audit_fields(record),
                       outcome={"SUCCEEDED": "succeeded", "UNKNOWN": "unknown",
                                "CANCELLED": "cancelled"}.get(record.state, "failed"),
                       error_code=(outcome.get("error") or {}).get("code") if record.state != "UNKNOWN" else None,
                       side_effect_committed=side.get("committed") if record.state != "UNKNOWN" else None,
                       details={"from": previous, "to": record.state, "evidence": record.evidence,
                                "reconciliations": record.reconcile_attempts})


def audit_fields(record: Record) -> dict[str, Any]:
    meta = record.meta
    return {"idempotency_key": record.key, "tool": record.tool or None, "tool_version": record.tool_version or None,
            "tenant": meta.get("tenant") or None, "subject": meta.get("subject") or None,
            "agent": meta.get("agent") or None, "args_hash": meta.get("args_hash") or None,
            "attempt": record.attempt or None}


def _safe_code(error: Any) -> str | None:
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and re.match(r"^[a-z][a-z0-9_]{0,63}$", code) else None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _keys_or_raise(read: list[str] | Exception) -> list[str]:
    if isinstance(read, Exception):
        raise read
    return read


def status_verdict(tool: ToolContract, record: Record, answer: Any, evidence: dict[str, Any]) -> Verdict:
    """What a status endpoint's answer (already read and parsed; None if it was not JSON) establishes about
    an operation: a pure function of the contract, the record and the answer."""
    state = answer.get("state") if isinstance(answer, dict) else None
    applied = (record.outcome or {}).get("partial")  # items a partial answer already committed
    if state == "partial":
        return _partial_verdict(answer, evidence)
    if applied and state in ("not_found", "cancelled", "rejected"):
        return Verdict("TAKEOVER", "partial", {**evidence, "observed": f"{state}_after_partial",
                                               "committed": len(applied.get("committed") or ())})
    if state == "pending":
        return Verdict("WATCH", "pending", {**evidence, "observed": "pending"})
    if state in ("not_found", "cancelled", "rejected"):
        return _not_applied_verdict(tool, state, answer, evidence)
    if state == "committed" and "result" in answer:
        return _committed_verdict(tool, record, answer["result"], evidence)
    return Verdict("WATCH", "error", {**evidence, "observed": "invalid_answer"})


def _partial_verdict(answer: Any, evidence: dict[str, Any]) -> Verdict:
    partial = partial_answer(answer)
    if partial is None:
        return Verdict("WATCH", "error", {**evidence, "observed": "invalid_answer"})
    counts = {"committed": len(partial["committed"]), "pending": len(partial["pending"])}
    if partial["pending"]:
        return Verdict("WATCH", "pending", {**evidence, "observed": "partial", **counts}, partial=partial)
    return Verdict("TAKEOVER", "partial", {**evidence, "observed": "partial_final", **counts}, partial=partial)


def _not_applied_verdict(tool: ToolContract, state: str, answer: Any, evidence: dict[str, Any]) -> Verdict:
    """not_found (may run again under the same key), cancelled, rejected (a definite failure)."""
    observed = {**evidence, "observed": state}
    if state == "not_found":
        error = ProxyError("dependency_unavailable", "The backend never applied this operation; it may run "
                           "again with the same key.", details={"tool": tool.name}, phase="reconcile")
        return Verdict("FAILED_RETRYABLE", "not_applied", observed, SideEffect(True, False), error=error)
    if state == "cancelled":
        error = ProxyError("cancelled", "The call was cancelled; the backend applied nothing.",
                           details={"tool": tool.name}, phase="reconcile", attempted=True, committed=False)
        return Verdict("CANCELLED", "cancelled", observed, SideEffect(True, False), error=error)
    code = _safe_code(answer.get("error"))
    error = ProxyError("business_rejected", "The backend rejected the request" + (f": {code}." if code else "."),
                       details={"tool": tool.name, **({"backend_code": code} if code else {})}, phase="reconcile")
    return Verdict("FAILED_FINAL", "rejected", observed, SideEffect(True, False), error=error)


def _committed_verdict(tool: ToolContract, record: Record, result: Any, evidence: dict[str, Any]) -> Verdict:
    """A committed answer counts only if its result fits the output schema and the digest recorded at
    execution (a contradiction is a takeover with both digests, never a success)."""
    if schema_violations(result, tool.output_validator):
        error = ProxyError("output_invalid", "The backend committed this operation but its recorded "
                           "result does not match the tool's output schema.",
                           details={"tool": tool.name}, phase="reconcile")
        return Verdict("FAILED_FINAL", "succeeded", {**evidence, "observed": "committed_invalid_result"},
                       SideEffect(True, True), error=error)
    mismatch = digest_mismatch(record, result)
    if mismatch is not None:
        return Verdict("TAKEOVER", "digest_mismatch", {**evidence, "observed": "result_digest_mismatch", **mismatch})
    return Verdict("SUCCEEDED", "succeeded", {**evidence, "observed": "committed"}, SideEffect(True, True),
                   data=result)
