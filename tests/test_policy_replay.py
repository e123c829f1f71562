"""Decision records from real calls, replayed against candidate policies with a scratch opa (issue 18)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from tests.support.audit import fingerprinted
from proxy.policy.client import Decision
from proxy.authoring.policy_replay import read_stream
from tests.support.stack import running_stack

REPO = Path(__file__).resolve().parent.parent
TOOLPROXY = [sys.executable, "-m", "proxy.cli"]
STREAM = "toolproxy:decisions:{stream}"
SCHEMA = Draft202012Validator(json.loads((REPO / "schemas" / "decision-record.schema.json").read_text()),
                              format_checker=Draft202012Validator.FORMAT_CHECKER)

# The mix the acceptance asks for: allowed reads, a denied foreign-tenant read, refunds under and over
# acme's approval threshold (5000 cents in examples/opa/data.json).
CALLS = [
    ("get_order", {"order_id": "ord_1001"}, 200),
    ("get_order", {"order_id": "ord_1002"}, 200),
    ("get_orders", {"order_ids": ["ord_1001", "ord_1003"]}, 200),
    ("get_order", {"order_id": "ord_2001"}, 403),          # globex's order: denied
    ("get_orders", {"order_ids": ["ord_1001", "ord_2001"]}, 403),
    ("refund_order", {"order_id": "ord_1001", "amount": 1500, "reason": "card 4111 charged twice"}, 200),
    ("refund_order", {"order_id": "ord_1002", "amount": 2500, "reason": "late delivery"}, 200),
    ("refund_order", {"order_id": "ord_1003", "amount": 6000, "reason": "damaged"}, 403),  # approval required
]

CARD_RULE = """package toolproxy.fraud

# Candidate: refuse refunds whose free-text reason mentions a card (reads a masked argument).
deny contains "reason_mentions_card" if contains(input.arguments.reason, "card")
"""


@pytest.fixture
async def recorded(proxy_deps, tmp_path):
    """Decision records of CALLS made through the proxy, exported as JSON lines (what a log pipeline holds)."""
    # A generous sink timeout: on a loaded machine a 200 ms XADD bound drops records (counted, never fatal).
    async with running_stack({**proxy_deps, "decisions.enabled": True, "decisions.timeout_ms": 5000}) as stack:
        stack.auto_key = True
        for tool, arguments, status in CALLS:
            got, body = await stack.call(tool, arguments)
            assert got == status, body
        records, skipped = await read_stream(proxy_deps["redis.url"], STREAM)
    assert skipped == 0 and len(records) == len(CALLS)
    path = tmp_path / "decisions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"record":"toolproxy.audit.v1"}\n')
    return records, path


def _replay(records: Path, *extra: str, policy: Path = REPO / "policies", data: Path = REPO / "examples" / "opa"):
    done = subprocess.run([*TOOLPROXY, "policy", "replay", "--records", str(records), "--policy", str(policy),
                           "--data", str(data), "--registry", str(REPO / "examples" / "registry"), *extra],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    return done


async def test_records_hold_the_exact_input_masked_with_the_decision(recorded):
    records, _ = recorded
    by_result = {}
    for record in records:
        assert not list(SCHEMA.iter_errors(record)), record
        by_result.setdefault(record["decision"]["result"], []).append(record)
        # The test OPA runs without decision logs, so it hands out no decision ids; the request id links
        # a record to its audit record either way.
        assert record["request_id"] and record["policy_revision"] == "demo-1" and "decision_id" not in record
        assert record["input"]["subject"] == {"id": "dev-user", "tenant": "acme", "roles": ["agent"],
                                              "scopes": ["tools:read", "tools:write"], "source": "static"}
    assert {k: len(v) for k, v in by_result.items()} == {"allow": 5, "deny": 2, "require_approval": 1}
    refunds = [r for r in records if r["tool"] == "refund_order"]
    assert all(r["masked_paths"] == [["arguments", "reason"]] for r in refunds)
    assert all(fingerprinted(r["input"]["arguments"]["reason"]) for r in refunds)
    assert "4111" not in json.dumps(records)
    denied = [r for r in records if r["decision"]["result"] == "deny"]
    assert {tuple(r["decision"]["reasons"]) for r in denied} == {("resource_not_owned:order:ord_2001",)}


async def test_the_same_policy_changes_nothing(recorded):
    _, path = recorded
    done = _replay(path, "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["records"], report["replayed"], report["changed"]) == (8, 8, 0)
    assert report["not_replayable"] == {} and report["skipped_lines"] == 1


async def test_a_lower_refund_threshold_turns_exactly_the_small_refunds_into_approvals(recorded, tmp_path):
    _, path = recorded
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["settings"]["approval"]["thresholds"]["refund_order"]["default"] = 1000
    (tmp_path / "candidate").mkdir()
    (tmp_path / "candidate" / "data.json").write_text(json.dumps(data))
    done = _replay(path, "--format", "json", data=tmp_path / "candidate")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["changed"] == 2
    assert report["transitions"] == {"allow->require_approval": {"refund_order": 2}}
    assert report["reasons_added"] == {"amount_over_threshold": 2}
    examples = report["examples"]["allow->require_approval"]
    assert sorted(e["arguments"]["amount"] for e in examples) == [1500, 2500]
    assert all(fingerprinted(e["arguments"]["reason"]) for e in examples)
    text = _replay(path, data=tmp_path / "candidate")
    assert re.search(r"^allow->require_approval +refund_order +2$", text.stdout, re.M), text.stdout


async def test_a_candidate_reading_a_masked_argument_cannot_replay_those_records(recorded, tmp_path):
    _, path = recorded
    candidate = tmp_path / "policies"
    shutil.copytree(REPO / "policies", candidate)
    (candidate / "fraud.rego").write_text(CARD_RULE)
    decision = (candidate / "decision.rego").read_text()
    wired = re.sub(r"^(reasons := .*)$", r"\1 | data.toolproxy.fraud.deny", decision, count=1, flags=re.M)
    assert wired != decision
    (candidate / "decision.rego").write_text(wired)
    done = _replay(path, "--format", "json", policy=candidate)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["not_replayable"] == {"reads_masked:arguments.reason": {"refund_order": 3}}
    assert (report["replayed"], report["changed"]) == (5, 0)


async def test_fail_on_deny_to_allow_gates_a_candidate_that_opens_a_hole(recorded, tmp_path):
    _, path = recorded
    data = json.loads((REPO / "examples" / "opa" / "data.json").read_text())
    data["toolproxy"]["resource_kinds"]["order"]["ownership"] = "shared"  # the hole: any tenant's orders
    (tmp_path / "hole").mkdir()
    (tmp_path / "hole" / "data.json").write_text(json.dumps(data))
    done = _replay(path, "--fail-on", "deny->allow", data=tmp_path / "hole")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "deny->allow" in done.stdout and "FAIL: deny->allow (2)" in done.stdout
    safe = _replay(path, "--fail-on", "deny->allow")
    assert safe.returncode == 0, safe.stdout + safe.stderr


FUNCTION_RULES = """package toolproxy.fraud

# Reads the masked argument inside functions: partial evaluation of deny cannot answer, the trace does.
mentions_card(args) if contains(args.reason, "card")

email_mentions_card(tool) if {
	tool == "send_email"
	contains(input.arguments.reason, "card")
}

deny contains "reason_mentions_card" if mentions_card(input.arguments)
"""


def _candidate_with(tmp_path: Path, rules: str) -> Path:
    candidate = tmp_path / "policies"
    shutil.copytree(REPO / "policies", candidate)
    (candidate / "fraud.rego").write_text(rules)
    decision = (candidate / "decision.rego").read_text()
    wired = re.sub(r"^(reasons := .*)$", r"\1 | data.toolproxy.fraud.deny", decision, count=1, flags=re.M)
    (candidate / "decision.rego").write_text(wired)
    return candidate


async def test_reads_through_functions_are_settled_by_the_trace(recorded, tmp_path):
    _, path = recorded
    reads = _replay(path, "--format", "json", policy=_candidate_with(tmp_path / "a", FUNCTION_RULES))
    assert reads.returncode == 0, reads.stderr
    assert json.loads(reads.stdout)["not_replayable"] == {"reads_masked:arguments.reason": {"refund_order": 3}}
    # Only send_email calls would read it: the trace shows the refunds never do, so they replay.
    guarded = FUNCTION_RULES.replace("if mentions_card(input.arguments)", "if email_mentions_card(input.tool.name)")
    skips = _replay(path, "--format", "json", policy=_candidate_with(tmp_path / "b", guarded))
    assert skips.returncode == 0, skips.stderr
    report = json.loads(skips.stdout)
    assert (report["not_replayable"], report["replayed"], report["changed"]) == ({}, 8, 0)


def test_the_projection_keeps_every_path_the_policy_may_read(tmp_path):
    from proxy.authoring.policy_reads import all_patterns, policy_reads, project
    from proxy.authoring.policy_scratch import find_opa
    (tmp_path / "p.rego").write_text(
        "package p\n\nimport input.subject as who\n\n"
        "allow if who.tenant == \"acme\"\n\n"
        "limit_hit if input.arguments[data.p.argument] > 5\n\n"
        "first_kind := input.resources[0].kind\n")
    patterns = all_patterns(policy_reads(str(tmp_path), find_opa()))
    document = {"subject": {"id": "u", "tenant": "acme"}, "request": {"request_id": "r1"},
                "arguments": {"amount": 3, "note": "n"}, "resources": [{"kind": "order", "id": "order:1"}, {"kind": "x"}]}
    assert project(document, patterns) == {"subject": {"id": "u", "tenant": "acme"},
                                            "arguments": {"amount": 3, "note": "n"},
                                            "resources": [{"kind": "order"}, None]}


async def test_a_failing_decision_sink_is_counted_and_never_raises():
    import socket

    import redis.asyncio as redis_async

    from proxy.config import DecisionsConfig
    from proxy.policy.decisions import DecisionRecorder, DecisionStreamSink
    from proxy.telemetry.metrics import Metrics
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = redis_async.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    metrics = Metrics()
    recorder = DecisionRecorder(DecisionsConfig(enabled=True, timeout_ms=300),
                                [DecisionStreamSink(client, "k", 10, 60)], metrics, "toolproxy/decision")
    decision = Decision(allow=True, require_approval=False, reasons=(), risk="read")
    await recorder.record({"action": "call", "arguments": {}}, decision)
    assert metrics.decision_record_failures.labels("redis")._value.get() == 1
    await client.aclose()
