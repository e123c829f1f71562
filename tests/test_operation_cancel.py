"""Cancelling operations, batches and MCP calls (seed 003 section 5; docs/transactions.md).

Real proxy, real OPA, real Redis, real demo backend (its cancellable generate_report and
its cancel endpoint); agents authenticate with real signed JWTs.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from proxy.registry import load_schema

from tests.support.audit import audit_records
from tests.support.mcp_upstream import registry_yaml, running_upstream
from tests.support.stack import DEMO_REGISTRY, assert_envelope, mcp_envelope, running_stack
from tests.support.tokens import jwt_overrides

VIEW = Draft202012Validator(load_schema("operation-view.schema.json"), format_checker=Draft202012Validator.FORMAT_CHECKER)


def valid_view(view: dict) -> dict:
    errors = [(list(e.absolute_path), e.message) for e in VIEW.iter_errors(view)]
    assert not errors, f"operation view violates schema: {errors}"
    return view
from tests.support.waits import wait_until

REPORT = {"title": "quarterly", "duration_ms": 8000}


@pytest.fixture
def settings(proxy_deps, issuers) -> dict[str, Any]:
    return {**proxy_deps, **jwt_overrides(*issuers), "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0,
            "cancellation.grace_ms": 1500}


@pytest.fixture
async def stack(settings, issuers):
    async with running_stack(settings) as s:
        s.headers["Authorization"] = f"Bearer {issuers[0].token('alice')}"
        yield s


def at_backend(stack, tool: str, count: int = 1) -> None:
    return len([r for r in stack.backend.requests if r["tool"] == tool]) >= count


async def cancel(stack, header_key: str, tool: str, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return await stack.post(f"/v1/operations/{header_key}:cancel?tool={tool}", {}, headers=headers)


def cancellations(stack, result: str) -> float:
    return stack.runtime.metrics.registry.get_sample_value("toolproxy_cancellations_total",
                                                           {"result": result}) or 0.0


async def test_a_sent_call_with_a_cancel_endpoint_ends_cancelled_and_a_second_cancel_gets_the_same_answer(stack,
                                                                                                       capsys):
    call = asyncio.create_task(stack.call("generate_report", REPORT, headers={"Idempotency-Key": "rep-1"}))
    await wait_until(lambda: at_backend(stack, "generate_report"), what="the report at the backend")
    status, view = await cancel(stack, "rep-1", "generate_report")
    assert status == 200, view
    assert valid_view(view)["state"] == "CANCELLED" and view["reversal"] == "rolled_back"
    assert view["side_effect"] == {"attempted": True, "committed": False}
    assert view["cancellation"]["requested_by"] == "alice"
    _, env = await call
    assert env["outcome"] == "cancelled" and env["error"]["code"] == "cancelled"
    assert env["side_effect"] == {"attempted": True, "committed": False}
    evidence = env["error"]["details"]["cancellation"]
    assert evidence["cancel_endpoint"] == "accepted" and evidence["evidence"] == "backend_answer"
    assert stack.backend.reports == {} and stack.backend.effect_counts() == {}
    # Again: the same answer, and no second cancel request to the backend.
    status, again = await cancel(stack, "rep-1", "generate_report")
    assert status == 200 and again["state"] == "CANCELLED" and again["idempotency_key"] == view["idempotency_key"]
    assert len(stack.backend.cancel_requests) == 1
    assert stack.backend.cancel_requests[0]["header_key"] == view["idempotency_key"]
    # The same call sent again is answered from the record: it stays cancelled, nothing runs.
    _, replay = await stack.call("generate_report", REPORT, headers={"Idempotency-Key": "rep-1"})
    assert replay["error"]["code"] == "cancelled" and replay["replayed"] is True
    assert len([r for r in stack.backend.requests if r["tool"] == "generate_report"]) == 1
    assert cancellations(stack, "requested") == 1 and cancellations(stack, "cancelled") == 1
    records = [r for r in audit_records(capsys.readouterr().out) if r["kind"] == "cancellation"]
    assert [r["details"]["to"] for r in records] == ["CANCELLING", "cancelled"]
    assert not [k async for k in stack.redis.scan_iter(match="toolproxy:lock:*")]


async def test_a_call_not_yet_sent_is_cancelled_without_side_effect(stack):
    await stack.fault("adjust_counter", "slow", delay_ms=1500, count=1)
    holder = asyncio.create_task(stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1},
                                            headers={"Idempotency-Key": "holder"}))
    await wait_until(lambda: at_backend(stack, "adjust_counter"), what="the holder at the backend")
    waiting = asyncio.create_task(stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 2},
                                             headers={"Idempotency-Key": "waiter"}))

    async def reserved() -> bool:
        return len([k async for k in stack.redis.scan_iter(match="toolproxy:op:{*}:*")]) == 2
    await wait_until(reserved, what="the waiter's reservation")
    status, view = await cancel(stack, "waiter", "adjust_counter")
    assert status == 200 and valid_view(view)["state"] == "CANCELLED" and view["reversal"] == "not_applied"
    assert view["side_effect"] == {"attempted": False, "committed": False}
    _, env = await waiting
    assert env["outcome"] == "cancelled" and env["side_effect"] == {"attempted": False, "committed": False}
    assert env["error"]["details"]["cancellation"]["observed"] == "not_sent"
    _, first = await holder
    assert first["outcome"] == "succeeded"
    assert len([r for r in stack.backend.requests if r["tool"] == "adjust_counter"]) == 1
    assert stack.backend.counters["ctr_demo"] == 1


async def test_a_sent_call_that_completes_anyway_is_succeeded(stack):
    await stack.fault("refund_order", "slow", delay_ms=400, count=1)  # no cancel endpoint; answers within the grace
    call = asyncio.create_task(stack.call("refund_order", {"order_id": "ord_1001", "amount": 100, "reason": "x"},
                                          headers={"Idempotency-Key": "refund-1"}))
    await wait_until(lambda: at_backend(stack, "refund_order"), what="the refund at the backend")
    status, view = await cancel(stack, "refund-1", "refund_order")
    assert status == 200 and valid_view(view)["state"] == "SUCCEEDED" and view["reversal"] == "cannot_be_compensated"
    _, env = await call
    assert env["outcome"] == "succeeded" and env["data"]["amount"] == 100
    assert stack.backend.effect_counts() == {"refund_order": 1}
    assert cancellations(stack, "completed") == 1


async def test_no_status_endpoint_and_no_answer_is_unknown_and_reconciled_as_today(stack):
    await stack.fault("adjust_counter", "stall", count=1)  # never answers, applies nothing; no status endpoint
    call = asyncio.create_task(stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 3},
                                          headers={"Idempotency-Key": "stalled"}))
    await wait_until(lambda: at_backend(stack, "adjust_counter"), what="the call at the backend")
    status, view = await cancel(stack, "stalled", "adjust_counter")
    assert status == 200 and valid_view(view)["state"] == "UNKNOWN", view
    _, env = await call
    assert env["outcome"] == "unknown" and env["error"]["code"] == "cancel_unconfirmed"
    assert env["side_effect"] == {"attempted": True, "committed": None}
    assert env["error"]["details"]["cancellation"]["stream"] == "closed"
    assert (await stack.runtime.reconciler.scan_once()).get("takeover") == 1  # no status endpoint: a person
    assert cancellations(stack, "unknown") == 1


async def test_cancel_refusals_have_stable_codes(stack, issuers):
    _, done = await stack.call("refund_order", {"order_id": "ord_1001", "amount": 10, "reason": "x"},
                               headers={"Idempotency-Key": "done-1"})
    status, body = await cancel(stack, "done-1", "refund_order")
    assert status == 409 and body["error"]["code"] == "operation_not_cancellable"
    assert body["error"]["details"]["state"] == "SUCCEEDED"
    status, body = await stack.post(f"/v1/operations/{done['idempotency_key']}:cancel", {})
    assert status == 409 and body["error"]["code"] == "operation_not_cancellable"
    status, body = await stack.post("/v1/operations/ik_" + "0" * 64 + ":cancel", {})
    assert status == 404 and body["error"]["code"] == "operation_not_found"
    other = issuers[0].token("mallory", tenant="globex")
    status, body = await stack.post(f"/v1/operations/{done['idempotency_key']}:cancel", {},
                                    headers={"Authorization": f"Bearer {other}"})
    assert status == 404 and body["error"]["code"] == "operation_not_found"  # another tenant's key does not exist
    status, body = await stack.post("/v1/batches/no-such-batch:cancel", {})
    assert status == 404 and body["error"]["code"] == "batch_not_found"


async def test_cancelling_a_running_batch_cancels_the_running_step_and_blocks_the_queued_one(stack):
    calls = [{"call_id": "report", "tool": "generate_report", "arguments": REPORT},
             {"call_id": "after", "tool": "get_inventory", "arguments": {"sku": "sku_widget"},
              "depends_on": ["report"]}]
    batch = asyncio.create_task(stack.batch(calls, headers={"X-Request-Id": "batch-1", "Idempotency-Key": "b-1"}))
    await wait_until(lambda: at_backend(stack, "generate_report"), what="the batch's report at the backend")
    status, answer = await stack.post("/v1/batches/batch-1:cancel", {})
    assert status == 200 and answer["status"] == "cancelled", answer
    by_id = {r["call_id"]: r for r in answer["results"]}
    assert by_id["report"]["outcome"] == "cancelled" and by_id["after"]["blocked_by"] == ["report"]
    status, body = await batch
    assert status == 200 and body["batch_id"] == "batch-1"
    report, after = body["results"]
    assert report["outcome"] == "cancelled" and report["side_effect"] == {"attempted": True, "committed": False}
    assert after["outcome"] == "cancelled" and after["blocked_by"] == ["report"]
    assert after["side_effect"] == {"attempted": False, "committed": False}
    assert [r["tool"] for r in stack.backend.requests] == ["generate_report"]
    assert len(stack.backend.cancel_requests) == 1
    status, again = await stack.post("/v1/batches/batch-1:cancel", {})  # after the end: the same answer
    assert status == 200 and again == answer


async def test_mcp_notifications_cancelled_stops_a_sent_call_by_the_same_rules(stack):
    async def rpc(body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json",
                                               "Accept": "application/json, text/event-stream",
                                               **stack.headers, **headers}) as response:
            text = await response.text()
            return response.status, json.loads(text) if response.content_type == "application/json" else text

    async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(
            {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"}}}).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                     **stack.headers}) as response:
        session = {"Mcp-Session-Id": response.headers["Mcp-Session-Id"], "MCP-Protocol-Version": "2025-06-18"}
    call = asyncio.create_task(rpc({"jsonrpc": "2.0", "id": "r1", "method": "tools/call",
                                    "params": {"name": "generate_report", "arguments": REPORT}},
                                   {**session, "Accept": "application/json", "Idempotency-Key": "mcp-rep"}))
    await wait_until(lambda: at_backend(stack, "generate_report"), what="the MCP call at the backend")
    status, _ = await rpc({"jsonrpc": "2.0", "method": "notifications/cancelled",
                           "params": {"requestId": "r1", "reason": "user stopped"}}, session)
    assert status == 202
    status, answer = await call
    envelope = mcp_envelope(answer["result"])
    assert envelope["outcome"] == "cancelled" and envelope["side_effect"] == {"attempted": True, "committed": False}
    assert envelope["error"]["details"]["cancellation"]["source"] == "mcp"
    assert len(stack.backend.cancel_requests) == 1 and stack.backend.reports == {}
    _, view = await stack.get(f"/v1/operations/{envelope['idempotency_key']}")
    assert view["state"] == "CANCELLED" and view["reversal"] == "rolled_back"
    assert_envelope(envelope)


async def test_a_sent_call_to_an_mcp_upstream_is_cancelled_there_with_notifications_cancelled(proxy_deps, tmp_path):
    """A session (legacy) upstream gets notifications/cancelled for the abandoned request."""
    async with running_upstream() as upstream:
        registry = tmp_path / "upstream-tools.yaml"
        registry.write_text(registry_yaml(upstream.url))
        async with running_stack({**proxy_deps, "registry.paths": [str(DEMO_REGISTRY), str(registry)],
                                  "reconcile.enabled": False, "mcp.upstream_mode": "legacy"}) as stack:
            call = asyncio.create_task(stack.call("up_slow_write", {"seconds": 4},
                                                  headers={"Idempotency-Key": "up-1"}))
            await wait_until(lambda: upstream.state.count("slow_write") == 1, what="the call at the upstream")
            status, view = await stack.post("/v1/operations/up-1:cancel?tool=up_slow_write", {})
            assert status == 200 and view["state"] == "UNKNOWN"  # no status endpoint: never assumed undone
            _, env = await call
            assert env["error"]["code"] == "cancel_unconfirmed"
            assert env["error"]["details"]["cancellation"]["told"] == "notifications/cancelled"
            await wait_until(lambda: upstream.state.count("slow_write_cancelled") == 1,
                             what="the upstream to see notifications/cancelled")


async def test_a_cancel_that_reaches_another_replica_stops_the_call_where_it_runs(stack, settings):
    async with running_stack(settings, share=stack) as other:
        other.headers.update(stack.headers)
        await wait_until(lambda: other.runtime.pipeline.cancellations.listening.is_set() and
                         stack.runtime.pipeline.cancellations.listening.is_set(), what="both replicas listening")
        call = asyncio.create_task(stack.call("generate_report", REPORT, headers={"Idempotency-Key": "rep-x"}))
        await wait_until(lambda: at_backend(stack, "generate_report"), what="the report at the backend")
        status, view = await cancel(other, "rep-x", "generate_report")
        assert status == 200 and valid_view(view)["state"] == "CANCELLED", view
        _, env = await call
        assert env["outcome"] == "cancelled" and env["side_effect"] == {"attempted": True, "committed": False}
        assert len(stack.backend.cancel_requests) == 1 and stack.backend.reports == {}
