"""What a status endpoint's answer establishes about an operation whose outcome was unknown, as a pure
function of the contract, the record and the answer (proxy/transactions/reconcile.py: status_verdict;
seed 004 section 5). The HTTP side (timeouts, sizes, a real status endpoint) is tests/test_unknown_calls.py."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.normalize import digest
from proxy.operations import Record
from proxy.registry import load_registry
from proxy.transactions.reconcile import status_verdict
from tests.unit import REPO

TOOL = next(t for t in load_registry([REPO / "examples" / "registry"]).all()
            if t.status_endpoint is not None and t.is_write and t.name == "refund_order")
RESULT = {"refund_id": "rf_1", "order_id": "ord_1001", "amount": 500, "status": "completed", "refundable_remaining": 0}
EVIDENCE = {"source": "status_endpoint", "at_ms": 1}


def record(outcome: dict[str, Any] | None = None) -> Record:
    return Record(key="k" * 64, state="UNKNOWN", attempt=1, token=1, is_write=True, meta={"tenant": "acme"},
                  created_at=0, updated_at=0, retention_s=60, outcome=outcome)


def verdict_of(answer: Any, outcome: dict[str, Any] | None = None):
    return status_verdict(TOOL, record(outcome), answer, EVIDENCE)


def valid_result() -> Any:
    return dict(RESULT)  # fits refund_order's outputSchema (the demo registry)


@pytest.mark.parametrize("answer, verdict, observed", [
    ({"state": "pending"}, "WATCH", "pending"),
    ({"state": "not_found"}, "FAILED_RETRYABLE", "not_found"),
    ({"state": "cancelled"}, "CANCELLED", "cancelled"),
    ({"state": "rejected", "error": {"code": "order_closed"}}, "FAILED_FINAL", "rejected"),
    ({"state": "committed"}, "WATCH", "invalid_answer"),          # committed without its result
    ({"state": "maybe"}, "WATCH", "invalid_answer"),
    (None, "WATCH", "invalid_answer"),                             # not JSON
    (["committed"], "WATCH", "invalid_answer"),
])
def test_each_state_of_the_answer_maps_to_one_verdict(answer, verdict, observed):
    found = verdict_of(answer)
    assert (found.verdict, found.evidence["observed"]) == (verdict, observed)
    assert found.evidence["source"] == "status_endpoint"


def test_not_applied_answers_establish_nothing_committed():
    for state in ("not_found", "cancelled", "rejected"):
        found = verdict_of({"state": state})
        assert found.side_effect is not None and found.side_effect.committed is False
        assert found.error is not None and found.error.phase == "reconcile"
    rejected = verdict_of({"state": "rejected", "error": {"code": "order_closed", "message": "host db-7 said no"}})
    assert rejected.error.code == "business_rejected" and rejected.error.details["backend_code"] == "order_closed"
    assert "db-7" not in rejected.error.message  # the backend's text never passes


def test_a_committed_result_is_a_success_only_when_it_agrees_with_what_execution_recorded():
    result = valid_result()
    assert verdict_of({"state": "committed", "result": result}).verdict == "SUCCEEDED"
    agreeing = {"evidence": {"result_digest": digest(result)}}
    found = verdict_of({"state": "committed", "result": result}, agreeing)
    assert found.verdict == "SUCCEEDED" and found.data == result and found.side_effect.committed is True
    contradicting = {"evidence": {"result_digest": "0" * 64}}
    found = verdict_of({"state": "committed", "result": result}, contradicting)
    assert found.verdict == "TAKEOVER" and found.result == "digest_mismatch"
    assert found.evidence["recorded_digest"] == "0" * 64 and found.evidence["reported_digest"] == digest(result)


def test_a_committed_result_outside_the_output_schema_is_a_final_failure_with_the_effect_committed():
    found = verdict_of({"state": "committed", "result": {"unexpected": True}})
    assert found.verdict == "FAILED_FINAL" and found.error.code == "output_invalid"
    assert found.side_effect.committed is True


def test_after_a_partial_answer_a_not_applied_state_is_a_takeover_never_a_retry():
    applied = {"partial": {"committed": [{"id": "a"}], "committed_digests": []}}
    for state in ("not_found", "cancelled", "rejected"):
        found = verdict_of({"state": state}, applied)
        assert (found.verdict, found.evidence["observed"]) == ("TAKEOVER", f"{state}_after_partial")


def test_a_partial_answer_is_watched_while_items_are_pending_and_handed_over_when_none_are():
    pending = verdict_of({"state": "partial", "committed": [{"id": "a"}], "pending": [{"id": "b"}]})
    assert (pending.verdict, pending.evidence["pending"]) == ("WATCH", 1) and pending.partial is not None
    final = verdict_of({"state": "partial", "committed": [{"id": "a"}], "pending": []})
    assert (final.verdict, final.evidence["observed"]) == ("TAKEOVER", "partial_final")
    assert verdict_of({"state": "partial", "committed": "nope"}).evidence["observed"] == "invalid_answer"
