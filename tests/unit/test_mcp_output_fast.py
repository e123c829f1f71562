"""``mcp_wire._surely_conforms``: the SDK's check of a stateless result against the upstream's output
schema is skipped only when the compiled verdict says valid, for a schema the SDK cached from the upstream's
listing that is a valid Draft 2020-12 schema; everything else is left to the SDK (and its error)."""

from __future__ import annotations

from types import SimpleNamespace

from proxy.wire.mcp import _surely_conforms

SCHEMA = {"type": "object", "properties": {"key": {"type": "string"}, "value": {"type": "string"}},
          "required": ["key", "value"], "additionalProperties": False}


def session(schema):
    return SimpleNamespace(_tool_output_schemas={"lookup": schema})


def test_valid_content_for_a_compiled_2020_12_schema_is_not_checked_again():
    assert _surely_conforms(session(SCHEMA), "lookup", {"key": "k", "value": "v"})


def test_everything_else_is_left_to_the_sdk():
    assert not _surely_conforms(session(SCHEMA), "lookup", {"key": "k"})               # invalid: the SDK's error
    assert not _surely_conforms(session(SCHEMA), "lookup", {"key": 1, "value": "v"})
    assert not _surely_conforms(session(SCHEMA), "lookup", None)                        # no structured content
    assert not _surely_conforms(session(SCHEMA), "other", {"key": "k", "value": "v"})  # not listed: SDK refreshes
    assert not _surely_conforms(session(None), "lookup", {"key": "k", "value": "v"})    # no schema declared
    draft7 = {**SCHEMA, "$schema": "http://json-schema.org/draft-07/schema#"}
    assert not _surely_conforms(session(draft7), "lookup", {"key": "k", "value": "v"})
    assert not _surely_conforms(session({"type": 7}), "lookup", {"key": "k"})           # not a valid schema
    assert not _surely_conforms(session({"type": "object", "multipleOf": 2}), "lookup", {"key": "k"})


def test_a_new_schema_for_the_same_tool_gets_its_own_verdict():
    assert _surely_conforms(session(SCHEMA), "lookup", {"key": "k", "value": "v"})
    stricter = {**SCHEMA, "properties": {**SCHEMA["properties"], "value": {"type": "integer"}}}
    assert not _surely_conforms(session(stricter), "lookup", {"key": "k", "value": "v"})
