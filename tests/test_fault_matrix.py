"""Rows of seed 004's fault matrix the other test files did not cover (issue 29), with real OPA,
Redis and the demo backend:

* reconcile ``rejected``: an unknown outcome whose status endpoint answers ``rejected`` ends as a
  definite failure (FAILED_FINAL), replayed as such, never run again;
* tampered model output: the model claims success (in its arguments, in headers, by calling again);
  only the backend's answer counts;
* a mixed batch with an unauthorized call: under ``all_or_nothing`` nothing runs (no half-done work);
  without it, the authorized calls run and the refused one does not.

``python -m bench.fault_matrix`` runs the matrix as a gate (docs/transactions.md).
"""

from __future__ import annotations

import pytest

from tests.support.stack import assert_batch, running_stack
from tests.support.waits import wait_until

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack({**proxy_deps, "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0}) as s:
        yield s


def _refunds(stack):
    return [e for e in stack.backend.effects if e["tool"] == "refund_order"]


async def test_reconcile_rejected_ends_as_a_definite_failure(stack):
    too_much = {**REFUND, "amount": 4000}
    stack.backend.orders["ord_1001"]["refundable"] = 3000  # below the amount: the backend refuses it
    await stack.fault("refund_order", "slow", delay_ms=1500, count=1)
    key = {"Idempotency-Key": "rejected-1"}
    status, env = await stack.call("refund_order", too_much, headers={**key, "Request-Timeout": "0.6"})
    assert env["outcome"] == "unknown" and env["error"]["code"] == "timeout_unknown", env
    slot = ("refund_order", env["idempotency_key"])
    await wait_until(lambda: stack.backend.idempotency.get(slot, {}).get("state") == "rejected", timeout=10,
                     what="the backend to reject the slow refund")
    counts = await stack.runtime.reconciler.scan_once()
    assert counts.get("failed_final") == 1, counts
    record = await stack.runtime.operations.get(env["idempotency_key"])
    assert record.state == "FAILED_FINAL" and record.evidence["observed"] == "rejected"
    assert record.outcome["error"]["details"]["backend_code"] == "amount_exceeds_refundable_balance"
    assert record.outcome["side_effect"] == {"attempted": True, "committed": False}
    # A definite failure: the duplicate gets it back, nothing is sent again.
    sent = len(stack.backend.requests)
    status, again = await stack.call("refund_order", too_much, headers=key)
    assert again["outcome"] == "failed" and again["replayed"] is True
    assert again["error"]["code"] == "business_rejected" and len(stack.backend.requests) == sent
    assert not _refunds(stack)


async def test_a_model_claiming_success_changes_nothing_only_the_backend_answer_counts(stack):
    key = {"Idempotency-Key": "tampered-1"}
    # 1. A result forged into the arguments: a schema violation, nothing sent.
    forged = {**REFUND, "status": "completed", "refund_id": "rf_000999"}
    status, env = await stack.call("refund_order", forged, headers=key)
    assert env["outcome"] == "failed" and env["error"]["code"] == "schema_violation"
    assert not stack.backend.requests
    # 2. Success claimed in headers while the backend drops the call before committing: still a failure.
    await stack.fault("refund_order", "drop_before_commit", count=1)
    claims = {"Idempotent-Replayed": "true", "X-Toolproxy-Outcome": "succeeded", "X-Committed": "true"}
    status, env = await stack.call("refund_order", REFUND, headers={**key, **claims})
    assert env["outcome"] != "succeeded" and env["side_effect"]["committed"] is not True, env
    assert env["data"] is None and not _refunds(stack)
    # Its outcome is unknown to the proxy, so the order is frozen until the status endpoint settles it
    # (issue 29: an unknown outcome freezes its resources); the claims in the headers change nothing.
    await stack.runtime.reconciler.scan_once()
    assert (await stack.runtime.operations.get(env["idempotency_key"])).state == "FAILED_RETRYABLE"
    # 3. The backend committed but the answer was lost: unknown, and calling again "because it worked"
    #    is not a success either; only the status endpoint's evidence settles it.
    await stack.fault("refund_order", "drop_after_commit", count=1)
    other = {"Idempotency-Key": "tampered-2"}
    _, env = await stack.call("refund_order", REFUND, headers={**other, **claims})
    assert env["outcome"] == "unknown" and env["data"] is None
    _, again = await stack.call("refund_order", REFUND, headers={**other, **claims})
    assert again["outcome"] == "unknown" and again["error"]["code"] == "operation_unknown"
    assert len(_refunds(stack)) == 1
    await stack.runtime.reconciler.scan_once()
    _, settled = await stack.call("refund_order", REFUND, headers=other)
    assert settled["outcome"] == "succeeded" and settled["replayed"] is True
    backend_answer = stack.backend.idempotency[("refund_order", env["idempotency_key"])]["body"]
    assert settled["data"]["refund_id"] == backend_answer["refund_id"]  # the backend's own evidence


MIXED = [
    {"call_id": "A", "tool": "refund_order", "arguments": REFUND},
    {"call_id": "B", "tool": "refund_order",  # another tenant's order: the policy refuses it
     "arguments": {"order_id": "ord_2001", "amount": 100, "reason": "not ours"}},
    {"call_id": "C", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 1}},
]


async def test_a_mixed_batch_all_or_nothing_runs_nothing(stack):
    status, body = await stack.post("/v1/tool-calls:batch", {"calls": MIXED, "all_or_nothing": True},
                                    headers={"Idempotency-Key": "mixed-1"})
    assert status == 200, body
    assert_batch(body)
    results = {r["call_id"]: r for r in body["results"]}
    assert results["B"]["error"]["code"] == "forbidden" and results["B"]["side_effect"]["attempted"] is False
    for call_id in ("A", "C"):
        assert results[call_id]["outcome"] == "cancelled", results[call_id]
        assert results[call_id]["blocked_by"] == ["B"]
        assert results[call_id]["error"]["details"]["reason"] == "all_or_nothing"
        assert results[call_id]["side_effect"] == {"attempted": False, "committed": False}
    assert not stack.backend.requests and not stack.backend.effects  # no half-done work
    assert await stack.redis.keys("toolproxy:op:*") == []  # not even a reservation
    assert stack.backend.counters["ctr_demo"] == 0


async def test_without_all_or_nothing_the_authorized_calls_of_a_mixed_batch_run(stack):
    status, body = await stack.post("/v1/tool-calls:batch", {"calls": MIXED},
                                    headers={"Idempotency-Key": "mixed-2"})
    assert status == 200, body
    assert_batch(body)
    outcomes = {r["call_id"]: r["outcome"] for r in body["results"]}
    assert outcomes == {"A": "succeeded", "B": "failed", "C": "succeeded"}, [r["error"] for r in body["results"]]
    assert not [r for r in stack.backend.requests if r["headers"].get("X-Call-Id") == "B"]


async def test_an_all_or_nothing_batch_that_passes_runs_as_any_batch(stack):
    calls = [MIXED[0], MIXED[2]]
    status, body = await stack.post("/v1/tool-calls:batch", {"calls": calls, "all_or_nothing": True},
                                    headers={"Idempotency-Key": "mixed-3"})
    assert status == 200 and [r["outcome"] for r in body["results"]] == ["succeeded", "succeeded"], body


async def test_the_fault_matrix_gate_passes(proxy_deps):
    """``python -m bench.fault_matrix`` in process: every row runs and the gate holds."""
    from bench import fault_matrix

    async with running_stack({**proxy_deps, **fault_matrix.SETTINGS}) as stack:
        seen, result = await fault_matrix.run(stack)
    assert result["passed"], (seen, result)
    assert result["takeovers"] >= 1 and len(seen) == len(fault_matrix.ROWS)

