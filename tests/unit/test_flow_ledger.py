"""proxy/flow.py's pure parts: the scope keys, the window filter and the input.flow document."""

from __future__ import annotations

import pytest
import redis.asyncio as redis_async
from redis.crc import key_slot

from proxy.flow import FlowLedger, FlowState, Seen, parse_scope
from proxy.identity import Caller

pytestmark = pytest.mark.unit

ALICE = Caller(subject="alice", tenant="acme", roles=(), scopes=(), agent="agent-1", source="jwt")


def ledger(read_for: str = "external_sinks") -> FlowLedger:
    return FlowLedger(redis_async.Redis(), prefix="toolproxy", window_s=60, read_for=read_for)


def test_the_principal_scope_does_not_depend_on_the_run_id_and_both_share_one_slot():
    one, run_one = ledger().keys(ALICE, "run-1")
    two, run_two = ledger().keys(ALICE, "run-2")
    assert one == two and run_one != run_two  # a fresh run id cannot reset the principal scope
    assert ledger().keys(ALICE, None) == [one]
    assert len({key_slot(k.encode()) for k in (one, run_one, run_two)}) == 1
    other_agent = ledger().keys(Caller("alice", "acme", (), (), "agent-2", "jwt"), None)[0]
    other_subject = ledger().keys(Caller("bob", "acme", (), (), "agent-1", "jwt"), None)[0]
    other_tenant = ledger().keys(Caller("alice", "globex", (), (), "agent-1", "jwt"), None)[0]
    assert len({one, other_agent, other_subject, other_tenant}) == 4
    assert one.startswith("toolproxy:flow:{acme}:")


def test_the_window_drops_old_entries_and_unknown_fields_are_never_trusted():
    raw = [b"private/get_user_preferences", b"1000", b"untrusted/fetch_page", b"100",
           b"bogus/tool", b"1000", b"secret/", b"1000", b"private/x", b"not-a-number"]
    assert parse_scope(raw, now_ms=1500, window_ms=1000) == (Seen("private", "get_user_preferences", 1000),)
    assert [s.label for s in parse_scope(raw, now_ms=1050, window_ms=1000)] == ["private", "untrusted"]


def test_a_label_names_the_call_that_brought_it_in_a_field_beside_its_time():
    raw = [b"untrusted/fetch_page", b"1000", b"untrusted/fetch_page@", b"call-7", b"private/get_prefs", b"900"]
    assert parse_scope(raw, now_ms=1500, window_ms=1000) == (Seen("private", "get_prefs", 900, ""),
                                                             Seen("untrusted", "fetch_page", 1000, "call-7"))
    state = FlowState(principal=parse_scope(raw, now_ms=1500, window_ms=1000), run=None, window_s=1)
    assert state.policy_input()["principal"]["seen"][1]["call_id"] == "call-7"
    assert "call_id" not in state.policy_input()["principal"]["seen"][0]


def test_input_flow_is_the_union_of_both_scopes():
    state = FlowState(principal=(Seen("private", "get_user_preferences", 0),),
                      run=(Seen("untrusted", "fetch_page", 1000),), window_s=60)
    document = state.policy_input()
    assert document["labels"] == ["private", "untrusted"] and document["window_s"] == 60
    assert document["principal"] == {"labels": ["private"], "seen": [
        {"label": "private", "tool": "get_user_preferences", "at": "1970-01-01T00:00:00.000Z"}]}
    assert document["run"]["seen"][0]["at"] == "1970-01-01T00:00:01.000Z"
    assert FlowState(principal=(), run=None, window_s=60).policy_input()["run"] is None


def test_only_external_sinks_are_read_unless_configured():
    from proxy.registry import load_registry
    from tests.unit import REPO
    registry = load_registry([REPO / "examples" / "registry"])
    wanted = {t.name for t in registry.active() if ledger().wanted(t)}
    assert wanted == {"fetch_page", "send_email"}
    assert all(ledger("every_call").wanted(t) for t in registry.active())


@pytest.mark.parametrize("flow, message", [
    ("{produces: [privat]}", "at $.tools[0].flow.produces[0]: 'privat' is not one of ['private', 'untrusted', 'secret']"),
    ("{sink: outside}", "at $.tools[0].flow.sink: 'outside' is not one of ['internal', 'external']"),
    ("{produces: [private, private]}", "at $.tools[0].flow.produces: ['private', 'private'] has non-unique elements"),
])
def test_unknown_labels_and_sinks_are_refused_in_one_line(tmp_path, flow, message):
    from proxy.registry import RegistryError, load_registry
    path = tmp_path / "tools.yaml"
    path.write_text(f"""tools:
  - name: leaky
    version: "1.0.0"
    description: x
    mode: read
    risk: read
    inputSchema: {{type: object, additionalProperties: false}}
    flow: {flow}
    backend: {{type: http, url: "http://backend.test/leaky"}}
""")
    with pytest.raises(RegistryError) as caught:
        load_registry([path])
    assert str(caught.value) == f"{path}: tool leaky {message}" and "\n" not in str(caught.value)


def test_registry_diff_names_flow_changes_and_stricter_ones_break():
    from dataclasses import replace

    from proxy.authoring.contract_diff import compare
    from proxy.registry import load_registry
    from tests.unit import REPO
    prefs = load_registry([REPO / "examples" / "registry"]).default("get_user_preferences")
    stricter = replace(prefs, flow_produces=("private", "secret"), flow_sink="external")
    assert sorted((c.breaking, c.what) for c in compare(prefs, stricter)) == [
        (True, "flow.produces adds secret"), (True, "flow.sink internal -> external")]
    assert sorted((c.breaking, c.what) for c in compare(stricter, prefs)) == [
        (False, "flow.produces drops secret"), (False, "flow.sink external -> internal")]
