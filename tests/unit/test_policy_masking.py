"""Decision records as data: what is masked and what an oversized record keeps (pure code; replay against
OPA is tests/test_policy_replay.py)."""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator

from proxy.policy.client import Decision
from proxy.policy.decisions import build_record, mask_input
from proxy.telemetry.record_view import CLEAR, EACH_VALUE_HIDDEN, ephemeral_key, fingerprint, view_from_schema
from tests.unit import REPO

KEY = ephemeral_key()

SCHEMA = Draft202012Validator(json.loads((REPO / "schemas" / "decision-record.schema.json").read_text()),
                              format_checker=Draft202012Validator.FORMAT_CHECKER)


def test_an_oversized_record_keeps_its_decision_and_says_its_input_was_dropped():
    decision = Decision(allow=True, require_approval=False, reasons=(), risk="read", policy_revision="r1")
    document = {"action": "call", "subject": {"id": "u", "tenant": "t"}, "arguments": {"blob": "x" * 5000}}
    small = build_record(document, decision, decision_path="toolproxy/decision", view=CLEAR, key=KEY,
                         max_bytes=1024)
    assert "input" not in small and small["input_omitted"] == "too_large"
    assert small["decision"]["result"] == "allow" and not list(SCHEMA.iter_errors(small))
    kept = build_record(document, decision, decision_path="toolproxy/decision", view=CLEAR, key=KEY,
                        max_bytes=65536)
    assert kept["input"] == document and not list(SCHEMA.iter_errors(kept))


def test_masking_lists_every_fingerprinted_path_and_leaves_what_the_contract_shows():
    document = {"action": "call", "arguments": {"reason": "x", "items": [{"pin": "1", "sku": "a"}],
                                                "api_token": "t", "amount": 5}}
    schema = {"type": "object", "properties": {
        "reason": {"type": "string"}, "amount": {"type": "integer"}, "api_token": {"type": "string"},
        "items": {"type": "array", "items": {"type": "object", "properties": {"pin": {"type": "string"},
                                                                           "sku": {"type": "string"}}}}}}
    view = view_from_schema(schema, shown=["items.sku"], hidden=["items.pin"])
    masked, paths = mask_input(document, view, KEY)
    assert masked["arguments"] == {"reason": fingerprint("x", KEY), "items": [{"pin": fingerprint("1", KEY),
                                                                                "sku": "a"}],
                                   "api_token": fingerprint("t", KEY), "amount": 5}
    assert sorted(paths) == [("arguments", "api_token"), ("arguments", "items", 0, "pin"), ("arguments", "reason")]
    assert document["arguments"]["reason"] == "x"


def test_a_decision_without_a_contract_view_keeps_no_argument_in_clear():
    masked, paths = mask_input({"action": "call", "arguments": {"n": 1, "s": "x"}}, EACH_VALUE_HIDDEN, KEY)
    assert masked["arguments"] == {"n": fingerprint(1, KEY), "s": fingerprint("x", KEY)}
    assert sorted(paths) == [("arguments", "n"), ("arguments", "s")]
