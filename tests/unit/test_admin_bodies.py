"""The operator API's request bodies against their JSON Schemas (schemas/, read without Python)."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from proxy.errors import ProxyError
from proxy.fronts.ingress import validate_body
from tests.unit import REPO


@pytest.mark.parametrize("path", sorted((REPO / "schemas").glob("*.schema.json")), ids=lambda p: p.name)
def test_every_schema_is_a_valid_draft_2020_12_schema(path):
    Draft202012Validator.check_schema(json.loads(path.read_text()))


@pytest.mark.parametrize("body, ok", [
    ({"outcome": "committed", "evidence": "row present", "result": {"value": 5}}, True),
    ({"outcome": "not_applied", "evidence": "no row"}, True),
    ({"outcome": "rejected", "evidence": "x"}, True),
    ({"outcome": "maybe", "evidence": "x"}, False),
    ({"outcome": "committed", "evidence": "   "}, False),
    ({"outcome": "committed", "evidence": "x" * 2001}, False),
    ({"outcome": "not_applied", "evidence": "x", "result": {}}, False),
    ({"outcome": "committed", "evidence": "x", "extra": 1}, False),
    ({"evidence": "x"}, False),
    ([], False),
])
def test_operation_resolution_bodies(body, ok):
    check("operation-resolution.schema.json", body, ok)


@pytest.mark.parametrize("body, ok", [
    ({"request_id": "req_1", "call_id": "c", "outcome": "committed", "evidence": "x"}, True),
    ({"request_id": "req_1", "call_id": "c", "outcome": "rejected", "evidence": "x"}, False),
    ({"request_id": "req_1", "call_id": "c", "outcome": "committed", "evidence": " "}, False),
    ({"request_id": "req_1", "call_id": 7, "outcome": "committed", "evidence": "x"}, False),
    ({"request_id": "req_1", "outcome": "committed", "evidence": "x"}, False),
])
def test_unknown_call_settlement_bodies(body, ok):
    check("unknown-call-settlement.schema.json", body, ok)


def check(schema: str, body, ok: bool) -> None:
    if ok:
        validate_body(body, schema)
        return
    with pytest.raises(ProxyError) as refused:
        validate_body(body, schema)
    assert refused.value.code == "invalid_request" and refused.value.details["violations"]
