"""What of a result the model sees (proxy/output_filter.py): allow-lists, redaction, the advertised
schema, truncation, and the registry's checks of a filter against the outputSchema."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator

from proxy import output_filter
from proxy.errors import ProxyError
from proxy.output_filter import OutputPolicy, parse_pointer
from proxy.registry import RegistryError, load_registry
from tests.unit import DEMO_REGISTRY

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["account", "echo", "items"],
    "properties": {
        "account": {"type": "string"}, "echo": {"type": "string"},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["id", "secret"],
            "properties": {"id": {"type": "string"}, "secret": {"type": "string"}}}},
    },
}
DATA = {"account": "acct_a", "echo": "pw", "items": [{"id": "a", "secret": "s1"}, {"id": "b", "secret": "s2"}]}


def policy(**raw):
    return output_filter.policy_from_registry(raw.get("filter"), raw.get("limit"))


def test_expose_keeps_only_the_listed_fields_and_the_schema_says_so():
    p = policy(filter={"expose": ["/account", "/items/*/id"]})
    view = output_filter.visible(p, DATA)
    assert view == {"account": "acct_a", "items": [{"id": "a"}, {"id": "b"}]}
    assert DATA["items"][0]["secret"] == "s1"  # the full result is untouched (the record keeps it)
    schema = output_filter.visible_schema(p, SCHEMA)
    assert set(schema["properties"]) == {"account", "items"} and schema["required"] == ["account", "items"]
    assert schema["properties"]["items"]["items"]["required"] == ["id"]
    Draft202012Validator(schema).validate(view)


def test_redact_removes_the_listed_fields_everywhere_and_from_required():
    p = policy(filter={"redact": ["/echo", "/items/*/secret"]})
    view = output_filter.visible(p, DATA)
    assert view == {"account": "acct_a", "items": [{"id": "a"}, {"id": "b"}]}
    schema = output_filter.visible_schema(p, SCHEMA)
    assert "echo" not in schema["properties"] and "echo" not in schema["required"]
    Draft202012Validator(schema).validate(view)


def test_pointers_unescape_as_rfc_6901():
    assert parse_pointer("/a~1b/~0c/*") == ("a/b", "~c", "*")


def test_an_oversized_view_is_truncated_only_where_the_contract_allows_it():
    big = {"account": "acct_a", "echo": "x", "items": [{"id": str(i), "secret": "s" * 20} for i in range(50)]}
    p = policy(limit={"max_bytes": 400, "truncate": True})
    view, truncated = output_filter.fit(p, big, tool="t", is_write=False)
    assert truncated and 0 < len(view["items"]) < 50 and len(big["items"]) == 50
    assert view["items"] == big["items"][:len(view["items"])]  # shortened from the end, in order
    from proxy.wire import json_bytes
    assert len(json_bytes(view)) <= 400
    assert "minItems" not in output_filter.visible_schema(p, SCHEMA)["properties"]["items"]
    strict = policy(limit={"max_bytes": 400})
    with pytest.raises(ProxyError) as refused:
        output_filter.fit(strict, big, tool="t", is_write=True)
    assert refused.value.code == "output_invalid" and refused.value.committed is True
    assert output_filter.fit(strict, {"account": "a"}, tool="t", is_write=False) == ({"account": "a"}, False)


def test_a_view_that_cannot_fit_even_without_arrays_is_output_invalid():
    p = OutputPolicy(max_bytes=20, truncate=True)
    with pytest.raises(ProxyError) as refused:
        output_filter.fit(p, {"account": "a" * 100}, tool="t", is_write=False)
    assert refused.value.code == "output_invalid" and refused.value.committed is False


def test_a_pointer_must_follow_the_declared_output_schema():
    assert output_filter.problems(policy(filter={"expose": ["/account", "/items/*/id"]}), SCHEMA) == []
    assert output_filter.problems(policy(filter={"redact": ["/nope"]}), SCHEMA)
    assert output_filter.problems(policy(filter={"redact": ["/account/*"]}), SCHEMA)
    assert output_filter.problems(policy(filter={"redact": ["/echo"]}), {})  # no outputSchema: nothing to follow


def test_the_registry_refuses_a_filter_off_the_schema_and_the_demo_declares_one(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("""
tools:
  - name: t
    version: "1.0.0"
    description: d
    mode: read
    risk: read
    inputSchema: {type: object, additionalProperties: false, properties: {}}
    outputSchema: {type: object, properties: {a: {type: string}}}
    output_filter: {redact: [/b]}
    backend: {type: http, url: "http://127.0.0.1:1/t"}
""")
    with pytest.raises(RegistryError, match="output_filter"):
        load_registry([bad])
    refund = load_registry([DEMO_REGISTRY]).get("refund_order", "1.0.0")
    assert refund.output_policy.expose is not None  # a write that returns only its confirmation
    listed = refund.listing()["outputSchema"]
    assert "refundable_remaining" not in listed["properties"] and "refundable_remaining" not in listed["required"]
