"""An evaluation error in a decision is a deny, never "no match" (issue 31, part 3), with the real opa.

Two rules that err at run time, added to the shipped policies:
- a deny rule whose builtin fails on the call's arguments (``to_number("dup")``): without
  ``strict-builtin-errors`` OPA reads the failing expression as undefined, the deny rule silently does not
  match and the call is allowed; the proxy asks strictly, so OPA reports the error and the call is refused;
- a complete rule that produces two values for one input (``eval_conflict_error``).
Both are refused with ``forbidden`` / ``details.reason = policy_error`` (not retryable: asking again gives
the same error), nothing reaches the backend, ``toolproxy_opa_errors_total{reason="eval_error"}`` counts
them, and OPA stays "up". A call no erring rule touches is still allowed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support.servers import OpaServer
from tests.support.stack import REPO, running_stack

ERRING = '''package toolproxy.resource_access

# reason is a string: to_number("dup") fails at run time.
deny contains "refund_reason_too_high" if {
	input.action == "call"
	input.tool.name == "refund_order"
	to_number(input.arguments.reason) > 100
}
'''

CONFLICTING = '''package toolproxy.approvals

# risk is already the contract's ("read" for get_inventory): two values for one complete rule.
risk := "low" if input.tool.name == "get_inventory"
'''


def _errors(stack, reason: str) -> float:
    return stack.runtime.metrics.registry.get_sample_value("toolproxy_opa_errors_total", {"reason": reason}) or 0.0


async def test_a_rule_that_errs_at_run_time_denies_the_call(proxy_deps, tmp_path):
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "erring.rego").write_text(ERRING)
    (policies / "conflicting.rego").write_text(CONFLICTING)
    with OpaServer([policies, REPO / "examples" / "opa"]) as opa:
        async with running_stack({**proxy_deps, **opa.settings}) as stack:
            refund = {"order_id": "ord_1001", "amount": 100, "reason": "dup"}
            status, env = await stack.call("refund_order", refund, headers={"Idempotency-Key": "eval-error-1"})
            assert status == 403, env
            assert env["error"]["code"] == "forbidden"
            assert env["error"]["details"] == {"reason": "policy_error"}
            assert env["error"]["retryable"] is False
            assert env["side_effect"] == {"attempted": False, "committed": False}

            status, env = await stack.call("get_inventory", {"sku": "sku_100"})
            assert status == 403 and env["error"]["details"] == {"reason": "policy_error"}, env

            assert stack.backend.requests == []
            assert _errors(stack, "eval_error") == 2
            assert stack.runtime.metrics.registry.get_sample_value(
                "toolproxy_dependency_up", {"dependency": "opa"}) == 1

            status, env = await stack.call("get_order", {"order_id": "ord_1001"})
            assert status == 200, env  # no erring rule on this call: the policy still decides
            assert len(stack.backend.requests) == 1


def test_without_strict_builtin_errors_opa_would_have_allowed_it(proxy_deps, tmp_path):
    """The hazard the proxy's query avoids, shown on the same policy: asked the default way, OPA reads the
    failing builtin as "no match" and allows the refund."""
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "erring.rego").write_text(ERRING)
    with OpaServer([policies, REPO / "examples" / "opa"]) as opa:
        catalog = json.loads(json.dumps(_catalog()))
        opa.put_data("toolproxy/catalog", catalog)
        document = _refund_input(catalog["digest"])
        lenient = _ask(opa, "", document)
        assert lenient[0] == 200 and lenient[1]["result"]["allow"] is True
        strict = _ask(opa, "?strict-builtin-errors=true", document)
        assert strict[0] == 500
        assert [e["code"] for e in strict[1]["errors"]] == ["eval_builtin_error"]


def _catalog():
    from proxy.policy.client import catalog_document
    from proxy.registry import load_registry
    return catalog_document(load_registry([REPO / "examples" / "registry"]))


def _refund_input(digest: str) -> dict:
    from proxy.identity import Caller
    from proxy.normalize import normalize
    from proxy.policy.client import RequestFacts, build_input
    from proxy.registry import load_registry
    tool = load_registry([REPO / "examples" / "registry"]).resolve("refund_order", None)
    caller = Caller(subject="dev-user", tenant="acme", roles=("agent",), scopes=("tools:read", "tools:write"),
                    agent="dev-agent", source="static")
    return build_input("call", caller, RequestFacts(request_id="r1"), catalog_digest=digest, tool=tool,
                       normalized=normalize(tool, {"order_id": "ord_1001", "amount": 100, "reason": "dup"}))


def _ask(opa: OpaServer, query: str, document: dict) -> tuple[int, dict]:
    status, body = opa._request("POST", "/v1/data/toolproxy/decision" + query, json.dumps({"input": document}).encode())
    return status, body if isinstance(body, dict) else json.loads(body)


def test_replay_decides_an_erring_candidate_as_the_proxy_does(tmp_path):
    """A candidate policy whose rule errs on a recorded call replays as a deny (reason policy_error), the
    proxy's answer, not as the allow a lenient evaluation would show."""
    import subprocess
    import sys
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "erring.rego").write_text(ERRING)
    document = _refund_input(_catalog()["digest"])
    records = tmp_path / "decisions.jsonl"
    lines = [{"record": "toolproxy.decision.v1", "request_id": f"r{i}", "action": "call", "tool": "refund_order",
              "input": {**document, "arguments": {**document["arguments"], "reason": reason}}, "masked_paths": [],
              "decision": {"result": "allow", "allow": True, "require_approval": False, "reasons": []}}
             for i, reason in enumerate(["dup", "42"])]
    records.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "policy", "replay", "--records", str(records),
                           "--policy", str(policies), "--format", "json", "--fail-on", "allow->deny"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["replayed"] == 2
    assert report["transitions"] == {"allow->deny": {"refund_order": 1}}  # "dup" errs; "42" is a number
    assert report["reasons_added"] == {"policy_error": 1}


def test_explain_names_the_rule_that_erred(tmp_path):
    import subprocess
    import sys
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "erring.rego").write_text(ERRING)
    body = {"tool": "refund_order", "arguments": {"order_id": "ord_1001", "amount": 100, "reason": "dup"}}
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "policy", "explain", "--body", "-", "--policy",
                           str(policies), "--format", "json"], input=json.dumps(body), capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["result"] == "deny"
    assert result["decision"]["reasons"] == ["policy_error"]
    assert [(r["rule"], Path(r["location"]).name) for r in result["provenance"]["policy_error"]] == \
        [("evaluation error eval_builtin_error", "erring.rego:7")]
