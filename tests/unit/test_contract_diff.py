"""Contract diff without servers: breaking vs compatible changes (proxy/authoring/contract_diff.py)."""

from __future__ import annotations

import copy


from proxy.authoring.contract_diff import diff, same_version_breaks
from proxy.registry import load_registry
from tests.unit import DEMO_REGISTRY, dump_yaml, load_yaml

DEMO = load_yaml(DEMO_REGISTRY / "demo-tools.yaml")


def registry_with(tmp_path, name: str, change=None):
    doc = copy.deepcopy(DEMO)
    if change:
        change({t["name"]: t for t in doc["tools"]})
    path = tmp_path / name
    path.mkdir()
    (path / "tools.yaml").write_text(dump_yaml(doc))
    return load_registry([str(path)])


def lines(tmp_path, change):
    return [c.line() for c in diff(registry_with(tmp_path, "old"), registry_with(tmp_path, "new", change))]


def test_the_same_registry_has_no_changes(tmp_path):
    assert lines(tmp_path, None) == []


def test_a_description_change_is_compatible(tmp_path):
    def edit(tools):
        tools["get_order"]["description"] = "Read one order."
    changes = diff(registry_with(tmp_path, "old"), registry_with(tmp_path, "new", edit))
    assert changes and not any(c.breaking for c in changes)
    assert same_version_breaks(changes) == []


def test_a_new_required_argument_under_the_same_version_is_a_breaking_change(tmp_path):
    def edit(tools):
        schema = tools["get_order"]["inputSchema"]
        schema["properties"]["region"] = {"type": "string"}
        schema["required"] = [*schema.get("required", []), "region"]
        tools["refund_order"]["related_read"]["arguments"]["region"] = {"value": "eu"}  # else refused at load
    changes = diff(registry_with(tmp_path, "old"), registry_with(tmp_path, "new", edit))
    breaks = same_version_breaks(changes)
    assert breaks and all(c.tool == "get_order" for c in breaks)
    assert any("region" in c.what for c in breaks)


def test_read_becoming_write_is_breaking(tmp_path):
    def edit(tools):
        tools["get_inventory"]["mode"] = "write"
    changes = diff(registry_with(tmp_path, "old"), registry_with(tmp_path, "new", edit))
    assert any(c.breaking and c.tool == "get_inventory" for c in changes)


def test_hiding_an_output_field_from_the_model_is_breaking(tmp_path):
    def edit(tools):
        tools["get_order"]["output_filter"] = {"redact": ["/tenant"]}
    changes = diff(registry_with(tmp_path, "old"), registry_with(tmp_path, "new", edit))
    assert any(c.breaking and "model output" in c.what and "tenant" in c.what for c in changes), \
        [c.line() for c in changes]
    assert same_version_breaks(changes)


def test_a_narrower_output_limit_is_breaking(tmp_path):
    def edit(tools):
        tools["get_orders"]["output_limit"] = {"max_bytes": 1024, "truncate": True}
    changes = diff(registry_with(tmp_path, "old"), registry_with(tmp_path, "new", edit))
    assert any(c.breaking and "output_limit" in c.what for c in changes), [c.line() for c in changes]
