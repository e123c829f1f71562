"""Contract versions as data: lifecycle fields, which version a name resolves to, and the registry diff's
verdicts (pure registry code, no servers; the running proxy's side is tests/test_contract_versions.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main as cli_main
from proxy.errors import ProxyError
from proxy.registry import RegistryError, load_registry
from proxy.versions import deprecation_headers
from tests.unit import REPO, dump_yaml, load_yaml

DEMO_REGISTRY = REPO / "examples" / "registry"


DEMO_TOOLS = load_yaml(DEMO_REGISTRY / "demo-tools.yaml")["tools"]


def contract(name: str, version: str, **changes: Any) -> dict[str, Any]:
    """A demo contract under another version (same backend), with fields changed."""
    tool = copy.deepcopy(next(t for t in DEMO_TOOLS if t["name"] == name))
    tool.update(version=version, **changes)
    return tool


def write_tools(path: Path, tools: list[dict[str, Any]]) -> Path:
    path.write_text(dump_yaml({"tools": tools}, sort_keys=False))
    return path


DEPRECATED_V1 = {"status": "deprecated", "deprecated_at": "2026-11-01", "sunset": "2027-03-31",
                 "replaced_by": "2.0.0"}


def test_deprecated_version_resolves_with_its_dates_and_the_default_moves_on(tmp_path):
    path = tmp_path / "r.yaml"
    # unquoted YAML dates are read as dates; the loader keeps their ISO text
    path.write_text(dump_yaml({"tools": [contract("adjust_counter", "1.0.0", **DEPRECATED_V1),
                                              contract("adjust_counter", "2.0.0")]})
                    .replace("'2027-03-31'", "2027-03-31"))
    registry = load_registry([path])
    assert registry.resolve("adjust_counter").version == "2.0.0"
    old = registry.resolve("adjust_counter", "1.0.0")
    assert (old.status, old.sunset, old.replaced_by) == ("deprecated", "2027-03-31", "2.0.0")
    assert deprecation_headers(old) == {"Deprecation": "@1793491200", "Sunset": "Wed, 31 Mar 2027 00:00:00 GMT"}
    assert deprecation_headers(registry.resolve("adjust_counter")) == {}
    assert [t.version for t in registry.active() if t.name == "adjust_counter"] == ["2.0.0"]


def test_only_deprecated_versions_left_the_newest_deprecated_is_the_default(tmp_path):
    path = write_tools(tmp_path / "r.yaml", [contract("adjust_counter", "1.0.0", status="deprecated",
                                                      deprecated_at="2026-11-01")])
    assert load_registry([path]).resolve("adjust_counter").version == "1.0.0"


def test_retired_version_is_tool_not_found_with_reason_and_successor(tmp_path):
    path = write_tools(tmp_path / "r.yaml", [contract("adjust_counter", "1.0.0", status="retired",
                                                      replaced_by="2.0.0"),
                                             contract("adjust_counter", "2.0.0")])
    with pytest.raises(ProxyError) as info:
        load_registry([path]).resolve("adjust_counter", "1.0.0")
    assert info.value.code == "tool_not_found"
    assert info.value.details == {"tool": "adjust_counter", "version": "1.0.0", "reason": "retired",
                                  "replaced_by": "2.0.0"}


@pytest.mark.parametrize("fields, message", [
    ({"status": "deprecated"}, "'deprecated_at' is a required property"),
    ({"status": "deprecated", "deprecated_at": "2026-11-01", "replaced_by": "9.0.0"}, "replaced_by '9.0.0'"),
    ({"status": "sunsetting"}, "$.tools[0].status"),
    ({"sunset": "31.03.2027"}, "$.tools[0].sunset"),
])
def test_bad_lifecycle_fields_are_refused_with_the_field_named(tmp_path, fields, message):
    path = write_tools(tmp_path / "r.yaml", [contract("adjust_counter", "1.0.0", **fields)])
    with pytest.raises(RegistryError) as info:
        load_registry([path])
    assert message in str(info.value)


def _diff_pair(tmp_path: Path, new_tool: dict[str, Any]) -> tuple[Path, Path]:
    old = write_tools(tmp_path / "old.yaml", [contract("get_order", "1.0.0")])
    new = write_tools(tmp_path / "new.yaml", [new_tool])
    return old, new


def _schema_with(base: dict[str, Any], edit) -> dict[str, Any]:
    schema = copy.deepcopy(base)
    edit(schema)
    return schema


GET_ORDER = contract("get_order", "1.0.0")


@pytest.mark.parametrize("changes, expected", [
    ({"inputSchema": _schema_with(GET_ORDER["inputSchema"], lambda s: (
        s["properties"].update(note={"type": "string"}), s["required"].append("note")))},
     "BREAKING   get_order@1.0.0: input $.note: now required"),
    ({"inputSchema": _schema_with(GET_ORDER["inputSchema"], lambda s: s["properties"]["order_id"].update(
        type="integer"))}, "BREAKING   get_order@1.0.0: input $.order_id: type string -> integer"),
    ({"outputSchema": _schema_with(GET_ORDER["outputSchema"], lambda s: (
        s["properties"].pop("status"), s["required"].remove("status")))},
     "BREAKING   get_order@1.0.0: output $.status: removed"),
    ({"mode": "write"}, "BREAKING   get_order@1.0.0: mode read -> write"),
    ({"risk": "financial"}, "BREAKING   get_order@1.0.0: risk read -> financial"),
    ({"resources": [*GET_ORDER.get("resources", []), {"template": "ledger:{order_id}", "access": "shared"}]},
     "BREAKING   get_order@1.0.0: new resource template ledger:{order_id}"),
    ({"description": "reworded"}, "compatible get_order@1.0.0: description changed"),
    ({"inputSchema": _schema_with(GET_ORDER["inputSchema"], lambda s: s["properties"].update(
        note={"type": "string"}))}, "compatible get_order@1.0.0: input $.note: added"),
])
def test_registry_diff_classifies_each_change(tmp_path, capsys, changes, expected):
    old, new = _diff_pair(tmp_path, contract("get_order", "1.0.0", **changes))
    assert cli_main(["registry", "diff", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert expected in out, out
    breaking = expected.startswith("BREAKING")
    assert cli_main(["check-registry", str(new), "--previous", str(old)]) == (3 if breaking else 0)
    err = capsys.readouterr().err
    assert ("refused: BREAKING" in err) is breaking


def test_a_narrowed_enum_breaks_and_a_widened_one_does_not(tmp_path, capsys):
    base = contract("get_order", "1.0.0", inputSchema={
        "type": "object", "additionalProperties": False, "required": ["order_id"],
        "properties": {"order_id": {"type": "string"}, "view": {"enum": ["short", "full"]}}})
    narrowed = copy.deepcopy(base)
    narrowed["inputSchema"]["properties"]["view"]["enum"] = ["short"]
    widened = copy.deepcopy(base)
    widened["inputSchema"]["properties"]["view"]["enum"] = ["short", "full", "raw"]
    old = write_tools(tmp_path / "old.yaml", [base])
    for name, tool, code in (("narrow", narrowed, 3), ("wide", widened, 0)):
        new = write_tools(tmp_path / f"{name}.yaml", [tool])
        assert cli_main(["check-registry", str(new), "--previous", str(old)]) == code
    assert "BREAKING   get_order@1.0.0: input $.view: enum changed" in capsys.readouterr().err


def test_a_breaking_change_under_a_new_version_passes_the_gate_and_is_reported(tmp_path, capsys):
    old = write_tools(tmp_path / "old.yaml", [contract("get_order", "1.0.0")])
    new = write_tools(tmp_path / "new.yaml", [contract("get_order", "1.0.0"),
                                              contract("get_order", "2.0.0", mode="write")])
    assert cli_main(["check-registry", "--dev", str(new), "--previous", str(old)]) == 0
    assert cli_main(["registry", "diff", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "compatible get_order@2.0.0 (against 1.0.0): new version" in out
    assert "BREAKING   get_order@2.0.0 (against 1.0.0): mode read -> write" in out
