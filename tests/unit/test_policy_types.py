"""The pure parts of the typed policy check (proxy/authoring/policy_types.py): schemas for OPA, guards,
the scratch copy's way back to the author's lines."""

from __future__ import annotations

from proxy.authoring.policy_types import Annotated, field_types, guard_tools, opa_schema, rule_tools


def _ref(*path):
    return {"type": "ref", "value": [{"type": "var", "value": path[0]}] +
            [{"type": "string", "value": p} for p in path[1:]]}


def _op(name):
    parts = name.split(".")
    return {"type": "ref", "value": [{"type": "var", "value": parts[0]}] +
            [{"type": "string", "value": p} for p in parts[1:]]}


def _str(value):
    return {"type": "string", "value": value}


def test_opa_schema_drops_conditionals_reads_oneof_as_anyof_and_types_enums():
    schema = {"type": "object", "properties": {"channel": {"enum": ["email", "sms"]}, "n": {"const": 3},
                                               "mixed": {"enum": ["a", 1]}, "a": {"oneOf": [{"type": "null"}]},
                                               "b": {"allOf": [{"type": "string"}, {"minLength": 2}]}},
              "allOf": [{"if": {"properties": {"x": {"const": 1}}}, "then": {"required": ["y"]}}]}
    out = opa_schema(schema)
    assert "allOf" not in out
    assert out["properties"]["channel"] == {"enum": ["email", "sms"], "type": "string"}
    assert out["properties"]["n"] == {"const": 3, "type": "integer"}
    assert "type" not in out["properties"]["mixed"]
    assert out["properties"]["a"] == {"anyOf": [{"type": "null"}]}
    assert out["properties"]["b"] == {"allOf": [{"type": "string"}]}


def test_field_types_follow_unions_and_say_any_when_the_schema_does_not():
    tool = {"anyOf": [{"properties": {"amount": {"type": "integer"}}},
                      {"properties": {"amount": {"type": ["string", "null"]}, "note": {}}}]}
    assert field_types(tool, "amount") == {"integer", "string", "null"}
    assert field_types(tool, "note") == {"any"}
    assert field_types(tool, "missing") == set()


def test_a_rule_is_tied_to_the_tools_its_every_body_is_guarded_to():
    eq = {"terms": [_op("equal"), _ref("input", "tool", "name"), _str("refund_order")]}
    flipped = {"terms": [_op("equal"), _str("get_order"), _ref("input", "tool", "name")]}
    member = {"terms": [_op("internal.member_2"), _ref("input", "tool", "name"),
                        {"type": "set", "value": [_str("a"), _str("b")]}]}
    negated = {**eq, "negated": True}
    assert guard_tools([eq]) == {"refund_order"}
    assert guard_tools([flipped]) == {"get_order"}
    assert guard_tools([member]) == {"a", "b"}
    assert guard_tools([member, {"terms": [_op("equal"), _ref("input", "tool", "name"), _str("a")]}]) == {"a"}
    assert guard_tools([negated]) is None
    assert rule_tools({"body": [eq], "else": {"body": [member]}}) == {"refund_order", "a", "b"}
    assert rule_tools({"body": [eq], "else": {"body": []}}) is None  # an unguarded else: not tied


def test_the_scratch_copy_maps_every_row_back_to_the_authors_line():
    annotated = Annotated("package p\n\nallow if {\n\ttrue\n}\n")
    annotated.insert_before(3, ["", "# METADATA", "# schemas:", "#   - input.arguments: schema.tools.x"])
    text, rows = annotated.render()
    lines = text.split("\n")
    assert lines[6] == "allow if {" and rows[6] == 3
    assert rows[7] == 4  # "\ttrue"
    assert rows[:2] == [1, 2]
