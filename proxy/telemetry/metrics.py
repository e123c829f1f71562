"""Prometheus metrics: every ``toolproxy_*`` series, in one registry per runtime.

Owns: the names, labels and buckets of every metric (the SRE contract; the
metrics reference in docs/observability.md and the alert rules depend on these names). Stages receive the
``Metrics`` object and record into it. Must never: use a label whose values
are unbounded (tenant, subject, key, resource id, call id), or register into
the global default registry.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Sub-millisecond resolution at the bottom: proxy overhead is measured in
# tens of microseconds; backend calls in seconds.
STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.calls = Counter("toolproxy_calls", "Tool calls by tool, outcome and error code (code is 'none' on success)",
                             ["tool", "outcome", "code"], registry=r)
        self.tool_version_calls = Counter(
            "toolproxy_tool_version_calls", "Tool calls by contract version and the version's status (active, "
            "deprecated): who still uses an old version", ["tool", "version", "status"], registry=r)
        self.credential_tokens = Counter("toolproxy_credential_tokens",
                                         "Token endpoint answers by credential, kind and result (issued, or why "
                                         "none: timeout, unreachable, refused, invalid_answer, answer_too_large; "
                                         "MCP upstreams also resource_mismatch, grant_required)",
                                         ["credential", "kind", "result"], registry=r)
        self.registry_reloads = Counter("toolproxy_registry_reloads",
                                        "Registry reloads by result (applied; refused: the new files failed "
                                        "validation and the previous registry stays)", ["result"], registry=r)
        self.call_duration = Histogram("toolproxy_call_duration_seconds", "End-to-end duration of a tool call",
                                       ["tool", "outcome"], buckets=CALL_BUCKETS, registry=r)
        self.stage_duration = Histogram(
            "toolproxy_stage_duration_seconds",
            "Duration of one pipeline stage (resolve, decode, normalize, idempotency, authorize, quota, lock, "
            "audit, execute, verify, commit)", ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.policy_decisions = Counter("toolproxy_policy_decisions",
                                        "OPA decisions by result (allow, deny, require_approval, error)",
                                        ["result"], registry=r)
        self.policy_denials = Counter("toolproxy_policy_denials",
                                      "Tool calls OPA denied, by tool and reason code (a policy reason up to its "
                                      "first ':', so resource ids never become labels; 'other' if not a code)",
                                      ["tool", "reason"], registry=r)
        self.opa_duration = Histogram("toolproxy_opa_request_duration_seconds", "Latency of OPA decision queries",
                                      buckets=STAGE_BUCKETS, registry=r)
        self.opa_errors = Counter("toolproxy_opa_errors", "OPA queries that failed (timeout, unreachable, "
                                  "http_error, eval_error, undefined, bad_decision)", ["reason"], registry=r)
        self.idempotency_results = Counter(
            "toolproxy_idempotency_results",
            "Idempotency lookups by result (new, replayed, in_progress, conflict, retry, unknown, failed_final, "
            "skipped: a read ran without a record because Redis was unreachable)",
            ["result"], registry=r)
        self.unknown_outcomes = Counter("toolproxy_unknown_outcomes", "Calls whose side effect became unknown",
                                        ["tool"], registry=r)
        self.open_unknowns = Gauge("toolproxy_open_unknowns",
                                   "Operations currently in UNKNOWN or awaiting takeover (read from the Redis "
                                   "index at scrape time, so right across restarts)", registry=r)
        self.operation_records = Gauge("toolproxy_operation_records",
                                       "Operation records held in Redis (read at scrape time from per-bucket "
                                       "counts by the hour each record's retention ends: a record that expired "
                                       "in the current hour counts until the hour ends)", registry=r)
        self.oldest_open_unknown_age = Gauge("toolproxy_oldest_open_unknown_age_seconds",
                                             "Age of the oldest operation still in UNKNOWN (0 when none)",
                                             registry=r)
        self.reconciliations = Counter("toolproxy_reconciliations",
                                       "Reconciliation attempts by result (succeeded, not_applied, pending, "
                                       "rejected, error, takeover, operator)", ["result"], registry=r)
        self.takeovers = Counter("toolproxy_takeovers", "Operations handed over to a human", ["tool"], registry=r)
        self.lock_wait = Histogram("toolproxy_lock_wait_seconds", "Time spent waiting for resource locks",
                                   ["mode"], buckets=STAGE_BUCKETS, registry=r)
        self.lock_timeouts = Counter("toolproxy_lock_timeouts", "Lock waits that ran out of deadline",
                                     ["tool"], registry=r)
        self.lock_lost = Counter("toolproxy_lock_lost", "Calls whose lock lease could not be renewed",
                                 ["tool"], registry=r)
        self.frozen_refusals = Counter("toolproxy_frozen_refusals", "Writes refused because a resource is frozen "
                                       "by an operation whose outcome is unknown (operation_unknown)",
                                       ["tool"], registry=r)
        # A freeze's blast radius, read from the lock hashes at scrape time (no tenant or resource label:
        # GET /v1/freezes names them for operators).
        self.frozen_resources = Gauge("toolproxy_frozen_resources",
                                      "Resources frozen by an operation whose outcome is unknown (no write runs "
                                      "there until it is reconciled or an operator resolves it)", registry=r)
        self.oldest_freeze_age = Gauge("toolproxy_oldest_freeze_age_seconds",
                                       "Age of the oldest freeze mark (0 when nothing is frozen)", registry=r)
        self.approvals = Counter("toolproxy_approvals",
                                 "Approval events by state (created, approved, denied, expired, consumed, mismatch, "
                                 "refused: over approvals.max_pending_per_subject)",
                                 ["state"], registry=r)
        self.pending_approvals = Gauge("toolproxy_pending_approvals", "Approvals waiting for a decision",
                                       registry=r)
        self.dependency_up = Gauge("toolproxy_dependency_up", "1 if the dependency (opa, redis) answered its last "
                                   "readiness check, 0 if not",
                                   ["dependency"], registry=r)
        self.request_errors = Counter("toolproxy_request_errors",
                                      "Requests refused before a tool call was formed (malformed body, unauthorized, "
                                      "unknown route, admin API refusals), by error code", ["code"], registry=r)
        self.audit_failures = Counter("toolproxy_audit_write_failures", "Audit records a sink failed to write",
                                      ["sink"], registry=r)
        self.audit_queued = Counter("toolproxy_audit_queued_records",
                                    "Audit records that found their sink busy (stdout: the pipe full) and waited in "
                                    "its bounded queue: back-pressure from the log pipeline", ["sink"], registry=r)
        self.audit_dropped = Counter("toolproxy_audit_dropped_records",
                                     "Audit records dropped because the sink's bounded queue was full (nobody reads "
                                     "stdout)", ["sink"], registry=r)
        self.decision_record_failures = Counter("toolproxy_decision_record_failures",
                                                "Decision records a sink failed to write", ["sink"], registry=r)
        self.integrity_failures = Counter(
            "toolproxy_integrity_failures", "Stored records refused because their MAC did not verify (forged, "
            "altered, or written before records carried one) or because an approval was written back after it "
            "was spent, by record (approval, approval-used, approval-spent, outcome)",
            ["record"], registry=r)
        self.replica_ack_shortfalls = Counter(
            "toolproxy_redis_replica_ack_shortfalls", "Replicated writes (a reservation or a committed outcome) "
            "that fewer replicas than redis.min_replica_acks acknowledged within redis.replica_ack_timeout_ms, by "
            "transition (begin, commit, expire, resolve, operator, approval)", ["transition"], registry=r)
        self.redis_evicted_keys = Counter(
            "toolproxy_redis_evicted_keys", "Keys Redis evicted, summed over its masters (growth of evicted_keys "
            "in INFO stats, read at each readiness check and scrape): any of them may have been an operation "
            "record, an approval or a lock. Stays 0 unless redis.accept_eviction lets the proxy run on an "
            "evicting maxmemory-policy", registry=r)
        self.redis_evicting_masters = Gauge(
            "toolproxy_redis_evicting_masters", "Redis masters whose maxmemory-policy may evict keys (anything but "
            "noeviction, or unreadable) at the last readiness check", registry=r)
        self.quota_decisions = Counter(
            "toolproxy_quota_decisions", "Quota checks by limit name (tenant, subject, class:<c>, tool:<t>, "
            "backend:<b>, fleet) and result (allowed, limited, waited: a batch call waited for it, skipped: Redis "
            "unreachable and the limit fails open, unavailable: Redis unreachable and it fails closed)",
            ["limit", "result"], registry=r)
        self.quota_in_flight = Gauge("toolproxy_quota_in_flight", "Calls of this process holding a slot of a "
                                     "concurrency quota, by limit name", ["limit"], registry=r)
        self.breaker_open = Gauge("toolproxy_breaker_open", "1 while a backend service's circuit breaker is open "
                                  "or half-open (closes only when a probe succeeds)", ["backend"], registry=r)
        self.backend_paused = Gauge("toolproxy_backend_paused", "1 while a backend service is paused by its own "
                                    "Retry-After (429/503)", ["backend"], registry=r)
        self.backpressure_events = Counter("toolproxy_backpressure_events", "Back-pressure events by backend "
                                           "service: paused, opened, closed, probe, refused (a call not sent)",
                                           ["backend", "event"], registry=r)
        self.mcp_relayed = Counter(
            "toolproxy_mcp_relayed_requests", "Requests an MCP upstream sent back during a call (sampling, "
            "elicitation), by method and result (answered, client_error, not_declared, too_large, too_many, timeout, "
            "closed)",
            ["method", "result"], registry=r)
        self.mcp_log_messages = Counter(
            "toolproxy_mcp_log_messages", "Log messages (notifications/message) an MCP upstream sent during an /mcp "
            "call, by result (relayed, below_level, too_large, invalid, not_requested)", ["result"], registry=r)
        self.mcp_sse_dropped = Counter(
            "toolproxy_mcp_sse_dropped", "Notifications for an /mcp call's SSE stream dropped because "
            "mcp.sse_queue_max were already waiting to be written, by kind (progress, log)", ["kind"], registry=r)
        self.mcp_refusals = Counter(
            "toolproxy_mcp_refusals", "/mcp requests refused at the edge by a cap, by reason (batch_too_large, "
            "too_many_sessions, too_many_owner_sessions)", ["reason"], registry=r)
        self.batch_calls = Counter("toolproxy_batches", "Batches by status (succeeded, partially_succeeded, "
                                   "uncertain, failed, invalid_plan)", ["status"], registry=r)
        self.cancellations = Counter("toolproxy_cancellations", "Cancel requests by result (requested, cancelled, "
                                     "completed, unknown, failed, refused)", ["result"], registry=r)
        self.compensations = Counter("toolproxy_compensations", "Compensations by result (requested, succeeded, "
                                     "failed, unknown, refused)", ["result"], registry=r)
        self.contract_drift = Counter(
            "toolproxy_contract_drift", "Pinned MCP tools found drifted from their pins (backend.pin), by registry "
            "tool and kind (definition, removed, tool_list); counted when a drift is first seen", ["tool", "kind"],
            registry=r)
        self.pinned_tools = Gauge("toolproxy_mcp_pinned_tools", "Pinned MCP tool contracts by state after the latest "
                                  "checks (verified, drifted: quarantined, unverified)", ["state"], registry=r)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, resolved once per label set: the hot path records several series per
        call, and ``labels()`` re-validates and takes a lock every time. Label values are bounded (see
        above), so this cache is too."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def replica_ack_shortfall(self, transition: str) -> None:
        self.child(self.replica_ack_shortfalls, transition).inc()
