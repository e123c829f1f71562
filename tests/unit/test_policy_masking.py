"""Decision records as data: what is masked and what an oversized record keeps (pure code; replay against
OPA is tests/test_policy_replay.py)."""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator

from proxy.policy.client import Decision
from proxy.policy.decisions import build_record, mask_input
from proxy.telemetry.redaction import MASK
from tests.unit import REPO

SCHEMA = Draft202012Validator(json.loads((REPO / "schemas" / "decision-record.schema.json").read_text()),
                              format_checker=Draft202012Validator.FORMAT_CHECKER)


def test_an_oversized_record_keeps_its_decision_and_says_its_input_was_dropped():
    decision = Decision(allow=True, require_approval=False, reasons=(), risk="read", policy_revision="r1")
    document = {"action": "call", "subject": {"id": "u", "tenant": "t"}, "arguments": {"blob": "x" * 5000}}
    small = build_record(document, decision, decision_path="toolproxy/decision", sensitive_fields=(),
                         max_bytes=1024)
    assert "input" not in small and small["input_omitted"] == "too_large"
    assert small["decision"]["result"] == "allow" and not list(SCHEMA.iter_errors(small))
    kept = build_record(document, decision, decision_path="toolproxy/decision", sensitive_fields=(),
                        max_bytes=65536)
    assert kept["input"] == document and not list(SCHEMA.iter_errors(kept))


def test_masking_lists_every_masked_path_and_leaves_the_rest():
    document = {"action": "call", "arguments": {"reason": "x", "items": [{"pin": "1", "sku": "a"}],
                                                "api_token": "t", "amount": 5}}
    masked, paths = mask_input(document, ["reason", "items.pin"])
    assert masked["arguments"] == {"reason": MASK, "items": [{"pin": MASK, "sku": "a"}], "api_token": MASK,
                                   "amount": 5}
    assert paths == [("arguments", "reason"), ("arguments", "items", 0, "pin"), ("arguments", "api_token")]
    assert document["arguments"]["reason"] == "x"
