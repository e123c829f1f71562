"""Envelope members of issue 29 without servers: evidence, truncated, partial, the side-effect summary
(proxy/envelope.py), the partial answer's shape (proxy/adapters) and recovery's digest check
(proxy/transactions/reconcile.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from jsonschema import Draft202012Validator

from proxy import envelope
from proxy.adapters import partial_answer
from proxy.normalize import digest
from proxy.errors import SideEffect
from proxy.transactions.reconcile import digest_mismatch
from tests.unit import REPO

SCHEMA = Draft202012Validator(json.loads((REPO / "schemas" / "result-envelope.schema.json").read_text()),
                              format_checker=Draft202012Validator.FORMAT_CHECKER)
KEYS = SimpleNamespace(resources=[SimpleNamespace(id="order:ord_1")])


def env(**kw):
    return envelope.Envelope.of(call_id="c1", request_id="r1", tool="refund_order", tool_version="1.0.0", **kw)


def test_a_committed_write_carries_evidence_and_a_summary_from_trusted_facts():
    evidence = {"backend_request_id": "req-9", "result_digest": "a" * 64, "server_time": "2026-12-01T10:00:00.000Z",
                "resource_keys": ["order:ord_1"]}
    body = envelope.with_summary(env(data={"x": 1}, side_effect=SideEffect(True, True), evidence=evidence), KEYS)
    out = body.to_json()
    SCHEMA.validate(out)
    assert out["evidence"] == evidence and "truncated" not in out
    assert out["side_effect"]["summary"] == "refund_order 1.0.0 committed on order:ord_1"


def test_a_read_and_a_failure_have_no_summary():
    read = envelope.with_summary(env(data={"x": 1}, side_effect=SideEffect(True, False)), KEYS).to_json()
    assert "summary" not in read["side_effect"] and "evidence" not in read


def test_partial_is_its_own_outcome_with_items_and_recovery():
    block = {"committed": [{"id": 1}], "pending": [{"id": 2}, {"id": 3}],
             "recovery": {"operation": "/v1/operations/ik_x", "resolution": "reconcile"}}
    out = envelope.with_summary(env(side_effect=SideEffect(True, True), partial=block), KEYS).to_json()
    SCHEMA.validate(out)
    assert out["outcome"] == "partial" and out["data"] is None and out["error"] is None
    assert out["side_effect"]["summary"].endswith("1 item(s) committed, 2 pending")
    truncated = env(data={"x": []}, side_effect=SideEffect(True, False), truncated=True).to_json()
    SCHEMA.validate(truncated)
    assert truncated["truncated"] is True


def test_a_partial_answer_has_two_bounded_lists_of_plain_items():
    assert partial_answer({"state": "partial", "committed": [{"a": 1}], "pending": ["b"]}) == \
        {"committed": [{"a": 1}], "pending": ["b"]}
    assert partial_answer({"state": "partial", "committed": [], "pending": [True]}) is None
    assert partial_answer({"state": "partial", "committed": [{}] * 1001, "pending": []}) is None
    assert partial_answer({"state": "committed", "committed": [], "pending": []}) is None


def test_recovery_compares_what_execution_recorded_with_what_the_status_endpoint_reports():
    result = {"notices": [{"id": "n1"}, {"id": "n2"}]}
    whole = SimpleNamespace(outcome={"evidence": {"result_digest": digest(result)}})
    assert digest_mismatch(whole, result) is None
    changed = {"notices": [{"id": "n1"}, {"id": "n9"}]}
    assert digest_mismatch(whole, changed) == {"recorded_digest": digest(result), "reported_digest": digest(changed)}
    partial = SimpleNamespace(outcome={"partial": {"committed_digests": [digest({"id": "n1"})]}})
    assert digest_mismatch(partial, result) is None  # the committed item is there, unchanged
    missing = digest_mismatch(partial, {"notices": [{"id": "n2"}]})
    assert missing["recorded_digest"] == digest({"id": "n1"}) and missing["committed_items_missing"] == 1
    assert digest_mismatch(SimpleNamespace(outcome={}), result) is None  # nothing recorded: nothing to compare
