"""What an operation record leaves out of a call's outcome and meta, and reads back (proxy/outcome_forms.py,
``operations._stored_meta``/``_read_meta``): every left-out field comes back exactly, a field that differs
from its derivation is kept, and a record written before (a full outcome) is read as it is."""

from __future__ import annotations

from dataclasses import replace

from proxy.envelope import effect_summary
from proxy.normalize import digest
from proxy.operations import _read_meta, _stored_meta
from proxy.outcome_forms import DERIVED, OutcomeContext, compact, expand

CTX = OutcomeContext(state="SUCCEEDED", tool="adjust_counter", tool_version="1.0.0", call_id="call_1",
                     request_id="r1", resources=("counter:ctr_a",))
DATA = {"counter": "ctr_a", "value": 3}


def committed() -> dict:
    return {"data": DATA, "error": None, "call_id": "call_1", "request_id": "r1", "tool_version": "1.0.0",
            "side_effect": {"attempted": True, "committed": True,
                            "summary": effect_summary("adjust_counter", "1.0.0", ["counter:ctr_a"])},
            "evidence": {"backend_request_id": "b1", "server_time": "t", "resource_keys": ["counter:ctr_a"],
                         "result_digest": digest(DATA)}}


def test_a_committed_write_keeps_only_its_data_and_the_backends_evidence():
    stored = compact(committed(), CTX)
    assert stored == {"data": DATA, "evidence": {"backend_request_id": "b1", "server_time": "t"},
                      DERIVED: "crveskd"}
    assert expand(stored, CTX) == committed()


def test_a_value_that_differs_from_its_derivation_is_kept():
    outcome = committed()
    outcome["call_id"] = "another"
    outcome["evidence"]["result_digest"] = "0" * 64       # not the digest of the data
    outcome["evidence"]["resource_keys"] = ["counter:other"]
    outcome["side_effect"]["summary"] = "written by hand"
    stored = compact(outcome, CTX)
    assert stored["call_id"] == "another" and stored["side_effect"] == outcome["side_effect"]
    assert stored["evidence"]["result_digest"] == "0" * 64 and stored["evidence"]["resource_keys"] == ["counter:other"]
    assert expand(stored, CTX) == outcome


def test_a_failure_keeps_its_error_and_side_effect():
    outcome = {"data": None, "error": {"code": "backend_error", "message": "m"}, "call_id": "call_1",
               "request_id": "r1", "tool_version": "1.0.0", "side_effect": {"attempted": True, "committed": False}}
    ctx = replace(CTX, state="FAILED_FINAL")
    stored = compact(outcome, ctx)
    assert stored["error"] == outcome["error"] and stored["side_effect"] == outcome["side_effect"]
    assert expand(stored, ctx) == outcome


def test_an_earlier_full_outcome_and_a_resolution_without_a_digest_read_back_unchanged():
    assert expand(committed(), CTX) == committed()
    resolved = {"data": DATA, "error": None, "side_effect": {"attempted": True, "committed": True},
                "evidence": {"source": "status_endpoint"}}
    assert expand(resolved, CTX) == resolved  # nothing invented: no digest, no call id


def test_the_meta_leaves_out_what_its_target_derives():
    arguments = {"counter": "ctr_a", "delta": 1}
    meta = {"tenant": "acme", "args_hash": digest(arguments), "marks": ["counter:ctr_a"],
            "target": {"arguments": arguments, "resources": ["counter:ctr_a"], "args_hash": digest(arguments)}}
    stored = _stored_meta(meta)
    assert "args_hash" not in stored and "args_hash" not in stored["target"] and stored["marks"] is True
    assert "tenant" not in stored  # the record's own field (``_record`` puts it back)
    assert {"tenant": "acme", **_read_meta(dict(stored))} == meta


def test_redacted_arguments_keep_their_hash_and_other_marks_stay_a_list():
    meta = {"tenant": "acme", "args_hash": "a" * 64, "marks": ["lock:x"],
            "target": {"arguments": {"card": "[redacted]"}, "resources": ["card:1"], "args_hash": "a" * 64}}
    stored = _stored_meta(meta)
    assert stored["args_hash"] == "a" * 64 and stored["marks"] == ["lock:x"]
    assert {"tenant": "acme", **_read_meta(dict(stored))} == meta
