"""Audit records: redaction, one record per call, sinks, and the failure policy."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as redis_async

from proxy.telemetry.redaction import MASK
from proxy.errors import ProxyError
from tests.support.audit import audit_records, fingerprinted
from tests.support.stack import UNLOCKED_COUNTER, extra_tools, running_stack

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "customer says card 4111 1111 1111 1111 was charged twice"}
TRACE = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
COUNTER = {"counter": "ctr_demo", "delta": 1}  # a write whose contract does not require a key


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack(proxy_deps) as s:
        s.auto_key = True  # writes need a stable operation identity (issue 4)
        yield s


async def test_a_successful_write_has_an_intent_and_a_final_record(stack, capsys):
    status, env = await stack.call("refund_order", REFUND, call_id="call_r1",
                                   headers={"traceparent": TRACE, "X-Run-Id": "run-7", "X-Request-Id": "req-r1",
                                            "Request-Timeout": "5"})
    assert status == 200
    records = audit_records(capsys.readouterr().out)
    assert [r["kind"] for r in records] == ["tool_call_intent", "tool_call"]
    intent, final = records
    for record in records:
        assert record["request_id"] == env["request_id"] == "req-r1"
        assert record["trace_id"] == "ab" * 16
        assert record["call_id"] == "call_r1" and record["run_id"] == "run-7"
        assert (record["tool"], record["tool_version"]) == ("refund_order", "1.0.0")
        assert (record["tenant"], record["subject"], record["agent"]) == ("acme", "dev-user", "dev-agent")
        assert {k: v for k, v in record["arguments"].items() if k != "reason"} == {"order_id": "ord_1001", "amount": 100}
        assert fingerprinted(record["arguments"]["reason"])  # the contract's sensitive field
        assert record["schema_version"].startswith("sha256:")
        assert record["attempt"] == 1 and "deadline_at" in record
    assert intent["args_hash"] == final["args_hash"]
    # The lock's fencing token: the same one the backend was given.
    fencing = int(stack.backend.requests[-1]["headers"]["X-Fencing-Token"])
    assert intent["fencing_token"] == final["fencing_token"] == fencing
    assert "outcome" not in intent
    assert final["outcome"] == "succeeded" and final["side_effect_committed"] is True
    assert "error_code" not in final
    assert len(final["result_hash"]) == 64 and len(final["resources_hash"]) == 64
    assert "card 4111" not in json.dumps(records)


async def test_a_read_is_one_record_and_failures_carry_their_code(stack, capsys):
    await stack.call("get_order", {"order_id": "ord_1001"})
    await stack.call("refund_order", {**REFUND, "amount": "100"})
    records = audit_records(capsys.readouterr().out)
    assert [(r["kind"], r["tool"], r["outcome"], r.get("error_code")) for r in records] == [
        ("tool_call", "get_order", "succeeded", None),
        ("tool_call", "refund_order", "failed", "schema_violation")]
    assert records[1]["side_effect_committed"] is False
    assert "arguments" not in records[1]  # not decoded: nothing trustworthy to show


async def test_unknown_outcome_is_recorded_as_null_committed(stack, capsys):
    await stack.fault("refund_order", "drop_after_commit")
    status, env = await stack.call("refund_order", REFUND)
    final = audit_records(capsys.readouterr().out)[-1]
    assert final["outcome"] == "unknown" and final["error_code"] == "timeout_unknown"
    assert final["side_effect_committed"] is None


async def test_an_unknown_tool_name_is_recorded_without_breaking_the_record(stack, capsys):
    await stack.call("drop_database", {"x": 1})
    [record] = audit_records(capsys.readouterr().out)
    assert record["tool"] == "drop_database" and record["error_code"] == "tool_not_found"
    assert "tool_version" not in record


async def test_other_stages_record_their_events(stack, capsys):
    audit = stack.runtime.audit
    assert await audit.record("approval", approval_id="apr-1", tool="refund_order", tenant="acme",
                              subject="approver-1", details={"state": "approved", "token": "sekrit"})
    assert await audit.record("takeover", idempotency_key="k1", tool="refund_order",
                              details={"last_evidence": "status endpoint said pending", "note": "y" * 1000})
    approval, takeover = audit_records(capsys.readouterr().out)
    assert approval["details"] == {"state": "approved", "token": MASK}
    assert takeover["details"]["note"].endswith("[truncated: 1000 chars]")
    with pytest.raises(ValueError):
        await audit.record("approval", password="x", details={})
    with pytest.raises(ValueError):
        await audit.record("whatever", details={})


async def test_redis_stream_sink_is_bounded(redis_url, proxy_deps):
    async with running_stack({**proxy_deps, "audit.sinks": ["stdout", "redis"],
                              "audit.stream_maxlen": 10}) as stack:
        for i in range(3):
            await stack.call("get_order", {"order_id": "ord_1001"}, call_id=f"c{i}")
        client = redis_async.Redis.from_url(redis_url)
        try:
            key = stack.runtime.audit.sinks[1].key
            entries = await client.xrange(key)
            assert [json.loads(fields[b"record"])["call_id"] for _, fields in entries] == ["c0", "c1", "c2"]
            audit_records([fields[b"record"].decode() for _, fields in entries])
            for _ in range(300):
                await stack.runtime.audit.record("reconciliation", idempotency_key="k", details={"to": "unknown"})
            # MAXLEN ~ trims whole stream nodes (100 entries each): bounded, not exact.
            assert await client.xlen(key) <= 10 + 100
        finally:
            await client.aclose()


async def break_audit_stream(stack) -> None:
    """The redis sink fails while the state store works: its stream key holds a string (XADD: WRONGTYPE)."""
    [sink] = stack.runtime.audit.sinks
    await stack.redis.set(sink.key, "not a stream")


async def test_dead_sink_stops_a_write_before_its_side_effect(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, "audit.sinks": ["redis"],
                              **extra_tools(tmp_path, UNLOCKED_COUNTER)}) as stack:
        await break_audit_stream(stack)
        status, env = await stack.call("bump_counter", COUNTER)
        assert status == 503 and env["error"]["code"] == "audit_unavailable"
        assert env["error"]["phase"] == "audit"
        assert env["side_effect"] == {"attempted": False, "committed": False}
        assert env["error"]["resolution"] == "retry_same_key"
        assert stack.backend.effect_counts().get("adjust_counter", 0) == 0
        assert stack.backend.requests == []
        # Reads are fail-open by default: the call goes on, the failure is counted.
        status, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert status == 200
        failures = stack.runtime.metrics.registry.get_sample_value("toolproxy_audit_write_failures_total",
                                                                   {"sink": "redis"})
        assert failures == 3  # the write's intent and final record, the read's record


async def test_fail_open_writes_go_on_and_fail_closed_reads_stop(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, "audit.sinks": ["redis"], "audit.on_failure_write": "fail_open",
                              "audit.on_failure_read": "fail_closed", **extra_tools(tmp_path, UNLOCKED_COUNTER)}) as stack:
        await break_audit_stream(stack)
        status, env = await stack.call("bump_counter", COUNTER)
        assert status == 200 and stack.backend.effect_counts()["adjust_counter"] == 1
        status, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert env["error"]["code"] == "audit_unavailable"
        assert [r["tool"] for r in stack.backend.requests] == ["adjust_counter"]


async def test_critical_records_raise_when_the_sink_is_down():
    async with running_stack({"redis.url": "redis://127.0.0.1:9/0", "audit.sinks": ["redis"]}) as stack:
        with pytest.raises(ProxyError) as caught:
            await stack.runtime.audit.record("approval", critical=True, approval_id="a1", details={"state": "x"})
        assert caught.value.code == "audit_unavailable" and caught.value.committed is False


async def test_a_call_that_needs_approval_names_the_approval_it_created(proxy_deps, capsys):
    async with running_stack(proxy_deps) as stack:
        status, env = await stack.call("delete_customer", {"customer_id": "cus_1002"},
                                       headers={"Idempotency-Key": "del-1"})
    assert env["error"]["code"] == "approval_required"
    records = audit_records(capsys.readouterr().out)
    created = [r for r in records if r["kind"] == "approval"]
    [call] = [r for r in records if r["kind"] == "tool_call"]
    assert created and created[0]["approval_id"] == env["error"]["details"]["approval_id"]
    assert call["approval_id"] == env["error"]["details"]["approval_id"]
    assert call["policy"]["result"] == "require_approval" and call["error_code"] == "approval_required"


def _sent(stack, call_id: str) -> list[dict]:
    return [r for r in stack.backend.requests if r["headers"].get("X-Call-Id") == call_id]


async def test_a_batch_call_cancelled_behind_a_failed_dependency_has_its_own_record(stack, capsys):
    await stack.fault("refund_order", "http_503_not_applied", count=1)
    calls = [{"call_id": "A", "tool": "refund_order", "arguments": REFUND},
             {"call_id": "B", "tool": "send_confirmation", "arguments": {"order_id": "ord_1001", "channel": "sms"},
              "depends_on": [{"call_id": "A", "failure_policy": "block"}]}]
    status, body = await stack.batch(calls, headers={"traceparent": TRACE, "X-Run-Id": "run-9",
                                                     "X-Request-Id": "req-b1", "Idempotency-Key": "audit-b1"})
    assert status == 200 and [env["outcome"] for env in body["results"]] == ["failed", "cancelled"]
    records = audit_records(capsys.readouterr().out)
    finals = {r["call_id"]: r for r in records if r["kind"] == "tool_call"}
    assert set(finals) == {"A", "B"}  # one final record per requested call
    b = finals["B"]
    assert (b["outcome"], b["error_code"], b["blocked_by"]) == ("cancelled", "cancelled", ["A"])
    assert (b["side_effect_attempted"], b["side_effect_committed"], b["attempt"]) == (False, False, 0)
    assert (b["request_id"], b["trace_id"], b["run_id"]) == ("req-b1", "ab" * 16, "run-9")
    assert (b["tool"], b["tool_version"]) == ("send_confirmation", "1.0.0")
    assert (b["tenant"], b["subject"], b["agent"]) == ("acme", "dev-user", "dev-agent")
    assert len(b["args_hash"]) == 64 and b["arguments"] == {"order_id": "ord_1001", "channel": "sms"}
    assert finals["A"]["side_effect_attempted"] is True and "blocked_by" not in finals["A"]
    assert not any(r["kind"] == "tool_call_intent" and r["call_id"] == "B" for r in records)
    assert _sent(stack, "B") == [] and _sent(stack, "A")


async def test_a_batch_call_the_deadline_never_reached_has_its_own_record(stack, capsys):
    await stack.fault("get_order", "slow", delay_ms=1000, count=1)
    calls = [{"call_id": "slow", "tool": "get_order", "arguments": {"order_id": "ord_1001"}},
             {"call_id": "late", "tool": "refund_order", "arguments": REFUND,
              "depends_on": [{"call_id": "slow", "failure_policy": "continue"}]}]
    status, body = await stack.batch(calls, headers={"Request-Timeout": "0.4", "Idempotency-Key": "audit-b2"})
    assert status == 200 and body["results"][1]["error"]["code"] == "timeout_not_started"
    records = audit_records(capsys.readouterr().out)
    [late] = [r for r in records if r["kind"] == "tool_call" and r["call_id"] == "late"]
    assert (late["outcome"], late["error_code"]) == ("failed", "timeout_not_started")
    assert (late["side_effect_attempted"], late["side_effect_committed"]) == (False, False)
    assert "blocked_by" not in late and "deadline_at" in late
    assert fingerprinted(late["arguments"]["reason"])  # the contract's sensitive field, as for any call
    assert _sent(stack, "late") == []


async def test_a_dead_sink_does_not_fail_a_batch_for_a_call_that_never_started(opa_server, tmp_path):
    dead = "redis://127.0.0.1:9/0"
    async with running_stack({"redis.url": dead, **opa_server.settings, "audit.sinks": ["redis"],
                              "audit.on_failure_read": "fail_open", "audit.on_failure_write": "fail_closed",
                              **extra_tools(tmp_path, UNLOCKED_COUNTER)}) as stack:
        calls = [{"call_id": "x", "tool": "no_such_tool", "arguments": {}},
                 {"call_id": "y", "tool": "bump_counter", "arguments": COUNTER, "depends_on": ["x"]}]
        status, body = await stack.batch(calls)
        assert status == 200
        assert [env["error"]["code"] for env in body["results"]] == ["tool_not_found", "cancelled"]
        failures = stack.runtime.metrics.registry.get_sample_value("toolproxy_audit_write_failures_total",
                                                                   {"sink": "redis"})
        assert failures == 2  # x's final record and y's never-started record, both counted
        assert stack.backend.requests == []
