"""The per-call decision check (proxy.policy.client.decision_ok) says exactly what the decision schema says."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from proxy.policy.client import decision_ok
from proxy.registry import load_schema

SCHEMA = Draft202012Validator(load_schema("opa-decision.schema.json"))
BASE = {"allow": True, "require_approval": False, "reasons": []}

DOCUMENTS = [
    BASE,
    {**BASE, "allow": False, "require_approval": True, "reasons": ["needs a person"]},
    {**BASE, "allow": True, "require_approval": True},           # both: refused by the schema's "not"
    {**BASE, "allow": 1},                                         # a number is not a boolean
    {**BASE, "require_approval": 0},
    {**BASE, "allow": None},
    {"allow": True, "require_approval": False},                   # reasons missing
    {"allow": True, "reasons": []},                               # require_approval missing
    {**BASE, "reasons": "one"},
    {**BASE, "reasons": ["a", 1]},
    {**BASE, "reasons": [None]},
    {**BASE, "risk": "high", "policy_revision": "r1", "catalog_current": True, "visible_tools": ["a"]},
    {**BASE, "risk": 3},
    {**BASE, "policy_revision": None},
    {**BASE, "catalog_current": "yes"},
    {**BASE, "catalog_current": 1},
    {**BASE, "visible_tools": {"a": 1}},
    {**BASE, "visible_tools": ["a", False]},
    {**BASE, "extra": {"anything": [1, 2]}},                      # unknown members are allowed
    [], "allow", None, 1,
]


@pytest.mark.parametrize("document", DOCUMENTS, ids=range(len(DOCUMENTS)))
def test_decision_check_agrees_with_the_schema(document):
    assert decision_ok(document) == SCHEMA.is_valid(document)
