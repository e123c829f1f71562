"""The registry's rules on plain files: strict schemas, resource templates, duplicates, retired tools
(pure registry code, no servers)."""

from __future__ import annotations

import textwrap

import pytest

from proxy.registry import RegistryError, load_registry
from tests.unit import REPO

DEMO_REGISTRY = REPO / "examples" / "registry"


TOOL = """
tools:
  - name: t1
    version: "1.0.0"
    description: test tool
    mode: read
    risk: read
    inputSchema: {type: object, additionalProperties: false, properties: {x: {type: string}}}
    outputSchema: {type: object}
    backend: {type: http, url: "http://127.0.0.1:1/t1"}
"""


def write(tmp_path, text, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_demo_registry_is_valid_and_has_the_required_tools():
    registry = load_registry([DEMO_REGISTRY])
    names = {t.name for t in registry.active()}
    assert {"get_order", "refund_order", "reserve_inventory", "send_email", "get_inventory"} <= names
    refund = registry.resolve("refund_order")
    assert (refund.mode, refund.risk) == ("write", "financial")
    assert [r.template for r in refund.resources] == ["order:{order_id}"]


def test_loose_input_schema_is_refused_with_file_tool_and_path(tmp_path):
    path = write(tmp_path, TOOL.replace("additionalProperties: false, ", ""))
    with pytest.raises(RegistryError) as info:
        load_registry([path])
    message = str(info.value)
    assert str(path) in message and "tool t1 at" in message and "$.tools[0].inputSchema" in message


def test_loose_schema_allowed_when_tool_says_strict_false(tmp_path):
    text = TOOL.replace("additionalProperties: false, ", "").replace("risk: read", "risk: read\n    strict: false")
    assert load_registry([write(tmp_path, text)]).resolve("t1").strict is False


def test_nested_loose_object_is_refused(tmp_path):
    text = TOOL.replace("properties: {x: {type: string}}", "properties: {x: {type: object}}")
    with pytest.raises(RegistryError, match=r"\$\.tools\[0\]\.inputSchema\.properties\.x"):
        load_registry([write(tmp_path, text)])


def test_schema_violation_in_registry_names_the_json_path(tmp_path):
    with pytest.raises(RegistryError, match=r"tool t1 at \$\.tools\[0\]\.mode"):
        load_registry([write(tmp_path, TOOL.replace("mode: read", "mode: sometimes"))])


def test_resource_placeholder_must_be_an_argument(tmp_path):
    text = TOOL.replace("risk: read", "risk: read\n    resources: [{template: 'order:{order_id}'}]")
    with pytest.raises(RegistryError, match="placeholder 'order_id'"):
        load_registry([write(tmp_path, text)])


def test_duplicate_tool_version_across_files_is_refused(tmp_path):
    a = write(tmp_path, TOOL, "a.yaml")
    write(tmp_path, TOOL, "b.yaml")
    with pytest.raises(RegistryError, match="also defined"):
        load_registry([tmp_path])
    assert a.exists()


def test_retired_tool_is_not_found(tmp_path):
    registry = load_registry([write(tmp_path, TOOL.replace("risk: read", "risk: read\n    status: retired"))])
    from proxy.errors import ProxyError
    with pytest.raises(ProxyError) as info:
        registry.resolve("t1")
    assert info.value.code == "tool_not_found"


def test_an_argument_typed_by_a_list_loads_and_records_show_it_only_when_every_type_is_a_scalar(tmp_path):
    text = TOOL.replace("properties: {x: {type: string}}",
                        "properties: {x: {type: string}, n: {type: [integer, 'null']}, k: {type: [integer, number]}}")
    tool = load_registry([write(tmp_path, text)]).resolve("t1")
    from proxy.telemetry.record_view import apply, ephemeral_key
    kept, masked = apply({"x": "text", "n": 3, "k": 1.5}, tool.record_view, ephemeral_key())
    assert masked == [("x",)]  # text: a fingerprint in records
    assert (kept["n"], kept["k"]) == (3, 1.5)  # numbers (or null) only: kept



NESTED = TOOL.replace("properties: {x: {type: string}}",
                      "properties: {x: {type: string}, m: {type: object, additionalProperties: false, "
                      "properties: {s: {type: string}, b: {type: string}}}}")


@pytest.mark.parametrize("extra, what", [
    ("safe_to_show: [m.nope]", "'nope' is not a property"),
    ("safe_to_show: [m.s]\n    sensitive_fields: [m.s]", "cannot also be safe to show"),
])
def test_safe_to_show_names_declared_paths_that_are_not_sensitive(tmp_path, extra, what):
    with pytest.raises(RegistryError, match=what):
        load_registry([write(tmp_path, NESTED + f"    {extra}\n")])


def test_a_dotted_safe_to_show_path_keeps_one_nested_text_in_clear(tmp_path):
    from proxy.telemetry.record_view import apply, ephemeral_key
    tool = load_registry([write(tmp_path, NESTED + "    safe_to_show: [m.s]\n")]).resolve("t1")
    kept, masked = apply({"x": "a", "m": {"s": "subject", "b": "body"}}, tool.record_view, ephemeral_key())
    assert kept["m"]["s"] == "subject" and masked == [("x",), ("m", "b")]

WRITE_WITH_READ = TOOL + """
  - name: w1
    version: "1.0.0"
    description: test write
    mode: write
    risk: write
    inputSchema: {type: object, additionalProperties: false, required: [x, v], properties: {x: {type: string},
                  v: {type: string}}}
    outputSchema: {type: object}
    resources: [{template: "thing:{x}", access: exclusive}]
    idempotency: {required: true}
    backend: {type: http, url: "http://127.0.0.1:1/w1"}
    state_guard: GUARD
"""
READ_STATE = "{tool: t1, version: '1.0.0', arguments: {x: /arguments/x}, state: /version}"


def test_a_state_guard_may_read_the_state_without_naming_an_argument(tmp_path):
    text = WRITE_WITH_READ.replace("GUARD", f"{{read: {READ_STATE}, if_match: true}}")
    write_tool = load_registry([write(tmp_path, text)]).resolve("w1")
    assert write_tool.state_guard is None and write_tool.state_read is not None
    assert (write_tool.state_at, write_tool.state_if_match) == ("/version", True)
    assert write_tool.state_read.expect == ()  # compared with what the decision saw, not with an argument
    with_argument = load_registry([write(tmp_path, WRITE_WITH_READ.replace(
        "GUARD", f"{{argument: v, read: {READ_STATE}}}"))]).resolve("w1")
    assert with_argument.state_at == "" and with_argument.state_read.expect == (("/version", "/arguments/v"),)


@pytest.mark.parametrize("guard, where", [
    ("{}", "state_guard"),  # neither an argument nor a read
    ("{argument: v, if_match: true}", "state_guard.if_match"),  # the argument is If-Match already
    (f"{{read: {READ_STATE}, if_match: true}}|mcp", "state_guard.if_match"),  # If-Match is HTTP
])
def test_a_state_guard_that_cannot_be_honoured_is_refused(tmp_path, guard, where):
    guard, _, backend = guard.partition("|")
    text = WRITE_WITH_READ.replace("GUARD", guard)
    if backend:
        text = text.replace('backend: {type: http, url: "http://127.0.0.1:1/w1"}',
                            'backend: {type: mcp, url: "http://127.0.0.1:1/mcp", tool: w1}')
    with pytest.raises(RegistryError, match=where.replace(".", r"\.")):
        load_registry([write(tmp_path, text)])
