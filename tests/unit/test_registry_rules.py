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
    assert "n" in tool.record_masked and "x" in tool.record_masked  # null or text: masked in records
    assert "k" not in tool.record_masked  # numbers only: kept
