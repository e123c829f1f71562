"""`toolproxy policy check` and `toolproxy policy explain` against the real opa binary (issue 18)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from proxy.registry import load_registry

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "policy-check"
TOOLPROXY = [sys.executable, "-m", "proxy.cli", "policy"]


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TOOLPROXY, *args], capture_output=True, text=True, timeout=120, cwd=REPO, input=stdin)


def test_check_passes_on_the_demo_policy_data_and_registry():
    done = _run("check", "--policy", "policies", "--data", "examples/opa", "--registry", "examples/registry")
    assert done.returncode == 0, done.stdout + done.stderr
    tools = len({t.name for t in load_registry([REPO / "examples" / "registry"]).all()})
    assert done.stdout.startswith(
        f"ok: opa check --strict, opa fmt, Rego typed by the registry, policy data schema, policy data vs registry "
        f"({tools} tools)")


def test_check_flags_every_kind_of_inconsistency_with_file_and_path():
    done = _run("check", "--policy", str(FIXTURE / "policies"), "--data", str(FIXTURE / "data"),
                "--registry", str(FIXTURE / "registry.yaml"), "--format", "json")
    assert done.returncode == 1, done.stderr
    problems = json.loads(done.stdout)["problems"]
    found = {(p["kind"], Path(p["file"]).name, p["path"]) for p in problems}
    assert found == {
        ("opa_check", "rules.rego", "line 3"),
        ("opa_fmt", "rules.rego", "-"),
        ("opa_type_check", "rules.rego", "line 5"),  # input.user: the input contract has no "user"
        ("role_grants_unknown_tool", "data.json", "toolproxy.roles.clerk.tools[3]"),
        ("role_compensates_unknown_tool", "data.json", "toolproxy.roles.clerk.compensate[0]"),
        ("role_operates_unknown_tool", "data.json", "toolproxy.roles.clerk.operate_others[1]"),
        ("tool_not_granted", "registry.yaml", "tools[name=audit_report]"),
        ("financial_without_threshold", "data.json", "toolproxy.settings.approval.thresholds.pay_invoice"),
        ("financial_without_limit", "data.json", "toolproxy.settings.limits.max_amount.pay_invoice"),
        ("destructive_without_approval", "data.json", "toolproxy.settings.approval.always_for_risks"),
        ("argument_not_in_schema", "data.json", "toolproxy.settings.approval.thresholds.transfer_funds.argument"),
        ("setting_for_unknown_tool", "data.json", "toolproxy.settings.approval.thresholds.wire_money"),
        ("setting_for_unknown_tool", "data.json", "toolproxy.settings.scopes.tools.ghost_tool"),
        ("setting_for_unknown_tool", "data.json", "toolproxy.settings.never_for_agents[0]"),
        ("ownership_invalid", "data.json", "toolproxy.resource_kinds.account.ownership"),
        ("policy_data_schema", "data.json", "toolproxy.resource_kinds.account.ownership"),  # the schema's enum
        ("resource_kind_without_ownership", "registry.yaml", "tools[name=pay_invoice].resources[0].template"),
    }
    assert len(problems) == len(found)


def test_explain_names_the_rule_behind_each_reason_of_a_denied_call():
    body = {"tool": "refund_order", "arguments": {"order_id": "ord_2001", "amount": 2000000, "reason": "x"}}
    done = _run("explain", "--body", "-", "--roles", "viewer", "--scopes", "tools:read", "--format", "json",
                stdin=json.dumps(body))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["result"] == "deny"
    assert result["input"]["subject"]["roles"] == ["viewer"]
    assert result["input"]["resources"] == [{"id": "order:ord_2001", "kind": "order", "access": "exclusive"}]
    named = {reason: [(r["rule"], r["location"]) for r in rules] for reason, rules in result["provenance"].items()}
    assert named == {
        "amount_over_limit": [("toolproxy.limits.deny", "policies/limits.rego:16")],
        "resource_not_owned:order:ord_2001": [("toolproxy.resource_access.deny", "policies/resources.rego:39")],
        "scope_insufficient": [("toolproxy.tools.deny", "policies/tools.rego:64")],
        "tool_not_granted": [("toolproxy.tools.deny", "policies/tools.rego:59")],
    }
    text = _run("explain", "--body", "-", "--roles", "viewer", "--scopes", "tools:read", stdin=json.dumps(body))
    assert 'deny contains sprintf("resource_not_owned:%s", [resource.id]) if {' in text.stdout


def test_explain_by_request_id_uses_the_recorded_input(tmp_path):
    body = {"tool": "get_order", "arguments": {"order_id": "ord_2001"}}
    first = json.loads(_run("explain", "--body", "-", "--format", "json", stdin=json.dumps(body)).stdout)
    record = {"record": "toolproxy.decision.v1", "request_id": "req-42", "input": first["input"],
              "masked_paths": [], "decision": {"result": "deny", "reasons": ["resource_not_owned:order:ord_2001"]}}
    (tmp_path / "d.jsonl").write_text(json.dumps(record) + "\n")
    done = _run("explain", "--decision-id", "req-42", "--records", str(tmp_path / "d.jsonl"))
    assert done.returncode == 0, done.stderr
    assert "reason resource_not_owned:order:ord_2001" in done.stdout
    assert "toolproxy.resource_access.deny  policies/resources.rego:39" in done.stdout
    missing = _run("explain", "--decision-id", "nope", "--records", str(tmp_path / "d.jsonl"))
    assert missing.returncode == 2 and "no decision record" in missing.stderr


def test_explain_refuses_a_call_that_would_not_reach_the_policy():
    done = _run("explain", "--body", "-", stdin=json.dumps({"tool": "get_order", "arguments": {"order_id": 7}}))
    assert done.returncode == 2
    assert "would not reach the policy: schema_violation" in done.stderr


def test_explain_says_which_rules_applied_to_a_listing_and_to_a_call(tmp_path):
    listing = json.loads(_run("explain", "--list", "--roles", "viewer", "--scopes", "tools:read",
                              "--format", "json").stdout)
    assert listing["input"]["action"] == "list"
    rules = listing["rules"]
    assert rules["applied"] == "listing"
    assert rules["listed"] == listing["decision"]["visible_tools"]
    assert rules["hidden"]["refund_order"] == ["scope_insufficient", "tool_not_granted"]
    assert [(r["rule"], r["location"]) for r in listing["provenance"]["tool_not_granted"]] == \
        [("toolproxy.listing.hidden", "policies/listing.rego:29")]

    # A listing rule hides a tool the call rules still admit: the call's explanation says both.
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["settings"]["listing"] = {"hidden": ["get_inventory"]}
    (tmp_path / "data.json").write_text(json.dumps(data))
    body = json.dumps({"tool": "get_inventory", "arguments": {"sku": "sku_100"}})
    call = json.loads(_run("explain", "--body", "-", "--data", str(tmp_path / "data.json"), "--format", "json",
                           stdin=body).stdout)
    assert call["result"] == "allow"
    assert call["rules"]["applied"] == "call"
    assert call["rules"]["listing"] == {"tool": "get_inventory", "listed": False, "hidden_because": ["listing_hidden"],
                                        "rules": "data.toolproxy.listing.visible"}
    text = _run("explain", "--body", "-", "--data", str(tmp_path / "data.json"), stdin=body).stdout
    assert 'rules applied: the call rules (data.toolproxy.decision), action "call"' in text
    assert "listing: get_inventory is hidden from this caller's listing: listing_hidden" in text
