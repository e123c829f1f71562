"""Pins of upstream MCP tools (proxy/drift.py) and the re-pin edit of a registry file (authoring/mcp_repin.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import rfc8785

from proxy.authoring.mcp_repin import Repin, edit, plan
from proxy.drift import (Quarantine, UpstreamTool, compare, definition_digest, digest, list_digest)
from proxy.errors import ProxyError
from proxy.registry import McpPin, load_file

NOTE = UpstreamTool("record_note", "Record a note.", {"type": "object", "properties": {"text": {"type": "string"}}},
                    None, {"readOnlyHint": False})
LOOKUP = UpstreamTool("lookup", None, {"type": "object"}, {"type": "object"}, {})


def registry_text(pin_block: str = "", flow: bool = False) -> str:
    backend = ('{type: mcp, url: "http://u/mcp", tool: record_note}' if flow else
               f"\n      type: mcp   # the notes server\n      url: http://u/mcp\n      tool: record_note{pin_block}")
    return f"""# reviewed by ops
tools:
  - name: record_note
    version: "1.0.0"
    description: Record a note (registry text).
    mode: read
    risk: read
    inputSchema: {{type: object, additionalProperties: false, properties: {{text: {{type: string}}}}}}
    backend: {backend}
"""


def contract(tmp_path: Path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return load_file(path)[0]


def test_digests_are_rfc8785_over_the_five_fields_and_the_sorted_names():
    expected = "sha256:" + hashlib.sha256(rfc8785.dumps({
        "name": "record_note", "description": "Record a note.",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
        "outputSchema": None, "annotations": {"readOnlyHint": False}})).hexdigest()
    assert definition_digest(NOTE) == expected
    reordered = UpstreamTool("record_note", "Record a note.", {"properties": {"text": {"type": "string"}},
                                                               "type": "object"}, None, {"readOnlyHint": False})
    assert definition_digest(reordered) == expected  # key order is not a change
    assert list_digest([NOTE, LOOKUP]) == list_digest([LOOKUP, NOTE]) == digest(["lookup", "record_note"])
    assert definition_digest(UpstreamTool("x", None, {"maximum": 2 ** 60}, None, {})) == "sha256:unrepresentable"


def test_compare_names_each_kind_of_drift(tmp_path):
    pinned = McpPin(definition_digest(NOTE), list_digest([NOTE, LOOKUP]))
    text = registry_text(f"\n      pin: {{definition: \"{pinned.definition}\", tool_list: \"{pinned.tool_list}\"}}")
    tool = contract(tmp_path, text)
    assert tool.backend.pin == pinned
    assert compare([tool], [NOTE, LOOKUP]) == [(tool, None)]
    changed = UpstreamTool("record_note", "Record a note and bcc it.", NOTE.input_schema, None, NOTE.annotations)
    ((_, drift),) = compare([tool], [changed, LOOKUP], baseline=[NOTE, LOOKUP])
    assert drift.kind == "definition" and '-  "description": "Record a note.",' in drift.diff
    ((_, drift),) = compare([tool], [changed, LOOKUP])  # no baseline: against the registry's view
    assert "registry record_note 1.0.0" in drift.diff and "Record a note (registry text)." in drift.diff
    ((_, drift),) = compare([tool], [LOOKUP])
    assert drift.kind == "removed"
    added = UpstreamTool("record_note_v2", None, {}, None, {})
    ((_, drift),) = compare([tool], [NOTE, LOOKUP, added], baseline=[NOTE, LOOKUP])
    assert (drift.kind, drift.diff) == ("tool_list", "+ record_note_v2")
    huge = UpstreamTool("record_note", "x\n" * 5000, NOTE.input_schema, None, {})
    ((_, drift),) = compare([tool], [huge, LOOKUP])
    assert len(drift.diff.split("\n")) <= 121  # bounded: the upstream writes what is diffed


def test_the_quarantine_refuses_drifted_and_unverified_and_keeps_drifts_through_failed_checks(tmp_path):
    pinned = McpPin(definition_digest(NOTE), list_digest([NOTE]))
    tool = contract(tmp_path, registry_text(
        f"\n      pin: {{definition: \"{pinned.definition}\", tool_list: \"{pinned.tool_list}\"}}"))
    quarantine = Quarantine()
    with pytest.raises(ProxyError) as refused:
        quarantine.check(tool)
    assert refused.value.code == "dependency_unavailable" and refused.value.details["reason"] == "pins_unverified"
    assert quarantine.hides(tool)
    fresh, cleared = quarantine.record("u", compare([tool], [NOTE]))
    assert (fresh, cleared) == ([], []) and not quarantine.hides(tool)
    quarantine.check(tool)
    quarantine.unverified("u")  # a failed check: verified becomes unverified
    assert quarantine.hides(tool)
    changed = UpstreamTool("record_note", "changed", NOTE.input_schema, None, NOTE.annotations)
    fresh, _ = quarantine.record("u", compare([tool], [changed]))
    assert [drift.kind for _, drift in fresh] == ["definition"]
    assert quarantine.record("u", compare([tool], [changed]))[0] == []  # the same drift is not new
    quarantine.unverified("u")  # an upstream cannot lift a quarantine by refusing to be listed
    with pytest.raises(ProxyError) as refused:
        quarantine.check(tool)
    assert refused.value.code == "contract_drift" and refused.value.details["drift"] == "definition"
    assert refused.value.spec.http_status == 409 and not refused.value.retryable
    Quarantine(serve_unverified=True).check(tool)  # never checked, and the operator chose to serve: no error
    # The upstream changes back: still quarantined, now acknowledgeable.
    _, returned = quarantine.record("u", compare([tool], [NOTE]))
    assert returned == [tool]
    with pytest.raises(ProxyError) as refused:
        quarantine.check(tool)
    assert refused.value.code == "contract_drift"
    assert quarantine.acknowledge("record_note") == [("record_note", tool.version)]
    quarantine.check(tool)
    quarantine.record("u", compare([tool], [changed]))
    with pytest.raises(ProxyError) as refused:
        quarantine.acknowledge("record_note")  # a live drift needs a re-pin
    assert refused.value.details["still_drifted"] == [tool.version]


def test_repin_edits_only_the_pin_values_and_keeps_comments(tmp_path):
    old = McpPin("sha256:" + "0" * 64, "sha256:" + "1" * 64)
    for text in (registry_text(f"\n      pin:\n        definition: \"{old.definition}\"\n"
                               f"        tool_list: {old.tool_list}"),
                 registry_text(), registry_text(flow=True)):
        tool = contract(tmp_path, text)
        (repin,) = plan([(0, tool)], [NOTE, LOOKUP])
        assert repin.new == McpPin(definition_digest(NOTE), list_digest([NOTE, LOOKUP]))
        edited = edit(text, [repin])
        assert edited.startswith("# reviewed by ops\n") and "Record a note (registry text)." in edited
        if "the notes server" in text:
            assert "# the notes server" in edited
        again = contract(tmp_path, edited)
        assert again.backend.pin == repin.new and again.description == tool.description
        assert again.input_schema == tool.input_schema
    gone = plan([(0, contract(tmp_path, registry_text()))], [LOOKUP])
    assert gone[0].new is None and edit(registry_text(), gone) == registry_text()
    assert isinstance(gone[0], Repin)


def test_a_repin_is_a_compatible_change_named_as_such(tmp_path):
    from proxy.authoring.contract_diff import diff
    from proxy.registry import Registry
    old = McpPin("sha256:" + "0" * 64, "sha256:" + "1" * 64)
    before = contract(tmp_path, registry_text(f"\n      pin: {{definition: \"{old.definition}\", "
                                              f"tool_list: \"{old.tool_list}\"}}"))
    (repin,) = plan([(0, before)], [NOTE])
    after = contract(tmp_path, edit(registry_text(f"\n      pin: {{definition: \"{old.definition}\", "
                                                  f"tool_list: \"{old.tool_list}\"}}"), [repin]))
    lines = [change.line() for change in diff(Registry([before]), Registry([after]))]
    assert any("backend.pin changed" in line for line in lines) and not any("BREAKING" in line for line in lines)
    assert not any(line.endswith("backend changed") for line in lines)
