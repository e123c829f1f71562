"""OpenTelemetry traces, read back from a real trace backend (issue #33).

A Jaeger (tests/support/traces.py) receives the proxy's OTLP/HTTP export; every test reads its traces back
through Jaeger's query API and checks the span tree and the attributes: a read, a write, a denied call,
an approval-required call, a batch and an MCP call; the agent's traceparent continuing into the backend's
request; no argument value or secret in any attribute; the histogram's exemplar naming a trace Jaeger
holds; a reconciliation linked to the unknown call it settles. (Trace context with tracing off, and a
receiver that never answers: tests/test_trace_context.py.)
"""

from __future__ import annotations

import json
import re
import secrets

import pytest

from proxy.telemetry import spans as spans_module
from tests.support.audit import audit_records
from tests.support.stack import running_stack
from tests.support.traces import JaegerServer, Span, jaeger_binary, render, tree
from tests.support.waits import wait_until

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "customer said: MARKER-reason-4711"}
BIG_REFUND = {"order_id": "ord_1001", "amount": 6000, "reason": "MARKER-big-4712"}


@pytest.fixture(scope="module")
def jaeger():
    server = JaegerServer(jaeger_binary())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def traced(proxy_deps, jaeger, **extra) -> dict:
    return {**proxy_deps, "tracing.endpoint": jaeger.otlp_url, "tracing.sampler": "always_on",
            "tracing.schedule_delay_ms": 50, "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0, **extra}


@pytest.fixture
async def stack(proxy_deps, jaeger):
    """Stages as child spans (``tracing.stages: spans``): the span tree the tests below read."""
    async with running_stack(traced(proxy_deps, jaeger, **{"tracing.stages": "spans"})) as s:
        yield s


@pytest.fixture
async def default_stack(proxy_deps, jaeger):
    """The default ``tracing.stages: events``: one span per call, its stages as events."""
    async with running_stack(traced(proxy_deps, jaeger)) as s:
        yield s


async def test_by_default_a_call_is_one_span_with_its_stages_as_timed_events(default_stack, jaeger):
    trace_id, agent_span, headers = parent()
    status, env = await default_stack.call("get_order", {"order_id": "ord_1001"}, call_id="call_ev",
                                           headers=headers)
    assert status == 200 and env["outcome"] == "succeeded"
    found = await fetch(jaeger, trace_id, at_least=1, names=("execute_tool get_order",))
    [call] = found  # no child span at all
    assert call.parent_id == agent_span and call.tags["toolproxy.outcome"] == "succeeded"
    stages = {e["event"]: e for e in call.events}
    assert {"authorize", "quota", "idempotency", "execute", "verify", "commit"} <= set(stages), call.events
    assert all(float(e["toolproxy.stage.duration_ms"]) >= 0 for e in stages.values())
    assert "error.type" not in stages["execute"]
    # The backend's request continues the agent's trace under the call span itself.
    [sent] = [r["headers"] for r in default_stack.backend.requests if r["tool"] == "get_order"]
    assert sent["traceparent"] == f"00-{trace_id}-{call.span_id}-01"
    # A denial's decision stage carries its error; nothing was sent.
    trace_id, _, headers = parent()
    status, env = await default_stack.call("get_order", {"order_id": "ord_2001"}, headers=headers)
    assert status == 403
    [denied] = await fetch(jaeger, trace_id, at_least=1, names=("execute_tool get_order",))
    names = [e["event"] for e in denied.events]
    assert "authorize" in names and "execute" not in names, names
    assert_clean(found + [denied])


def parent() -> tuple[str, str, dict[str, str]]:
    """An agent's own trace: (trace id, its span id, the traceparent header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "agent=7"}


async def fetch(jaeger: JaegerServer, trace_id: str, *, at_least: int, names: tuple[str, ...] = ()) -> list[Span]:
    """The trace once Jaeger holds ``at_least`` spans of it (and the named ones): the proxy flushes first."""
    tracing = spans_module.active()
    assert tracing is not None
    found: list[Span] = []

    def ready() -> bool:
        tracing.force_flush(2000)
        found[:] = jaeger.trace(trace_id)
        have = {s.name for s in found}
        return len(found) >= at_least and all(n in have for n in names)

    await wait_until(ready, timeout=20, what=f"trace {trace_id} in Jaeger", interval=0.1)
    return found


def one(spans: list[Span], name: str) -> Span:
    matches = [s for s in spans if s.name == name]
    assert len(matches) == 1, (name, [s.name for s in spans])
    return matches[0]


def children(spans: list[Span], of: Span) -> set[str]:
    return {s.name for s in tree(spans).get(of.span_id, [])}


def assert_clean(spans: list[Span], *secrets_: str) -> None:
    """No argument value, key or credential in any exported attribute or event."""
    text = json.dumps([[s.name, s.tags, s.events] for s in spans])
    for value in ("MARKER", "Bearer", "Txn-Token", *secrets_):
        assert value not in text, value


async def test_a_read_call_is_one_execute_tool_span_under_the_agents_span(stack, jaeger):
    trace_id, agent_span, headers = parent()
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, call_id="call_read", headers=headers)
    assert status == 200 and env["outcome"] == "succeeded"
    found = await fetch(jaeger, trace_id, at_least=5, names=("execute_tool get_order", "commit"))
    call = one(found, "execute_tool get_order")
    assert call.parent_id == agent_span and call.service == "toolproxy"
    assert {"authorize", "idempotency", "execute", "verify", "commit"} <= children(found, call)
    tags = call.tags
    assert tags["gen_ai.operation.name"] == "execute_tool" and tags["gen_ai.tool.name"] == "get_order"
    assert tags["gen_ai.tool.call.id"] == "call_read" and tags["toolproxy.outcome"] == "succeeded"
    assert tags["toolproxy.decision"] == "allow" and tags["toolproxy.tool.mode"] == "read"
    assert "toolproxy.error.code" not in tags and "error.type" not in tags
    quota = one(found, "quota")
    assert quota.parent_id == one(found, "authorize").span_id  # the quota runs inside the decision
    # The backend's request continues the agent's trace under the execute span, tracestate and all.
    [sent] = [r["headers"] for r in stack.backend.requests if r["tool"] == "get_order"]
    assert sent["traceparent"] == f"00-{trace_id}-{one(found, 'execute').span_id}-01"
    assert sent["tracestate"] == "agent=7"
    assert_clean(found)


async def test_a_write_has_its_lock_span_and_only_the_hash_of_its_key(stack, jaeger):
    trace_id, _, headers = parent()
    key = "refund-key-" + secrets.token_hex(4)
    status, env = await stack.call("refund_order", REFUND, call_id="call_write",
                                   headers={**headers, "Idempotency-Key": key})
    assert status == 200, env
    found = await fetch(jaeger, trace_id, at_least=7, names=("execute_tool refund_order", "commit", "lock"))
    call = one(found, "execute_tool refund_order")
    assert {"authorize", "idempotency", "lock", "audit", "execute", "verify", "commit"} <= children(found, call)
    assert call.tags["toolproxy.tool.mode"] == "write" and call.tags["toolproxy.side_effect.committed"] == "true"
    assert call.tags["toolproxy.idempotency.key_hash"] == spans_module.key_hash(env["idempotency_key"])
    assert_clean(found, key, env["idempotency_key"])


async def test_a_denied_call_carries_the_decision_its_reasons_and_the_error(stack, jaeger, capsys):
    trace_id, _, headers = parent()
    status, env = await stack.call("get_order", {"order_id": "ord_2001"}, headers=headers)
    assert status == 403 and env["error"]["code"] == "forbidden"
    found = await fetch(jaeger, trace_id, at_least=2, names=("execute_tool get_order",))
    call = one(found, "execute_tool get_order")
    tags = call.tags
    assert tags["toolproxy.decision"] == "deny" and tags["toolproxy.outcome"] == "failed"
    assert tags["toolproxy.error.code"] == tags["error.type"] == "forbidden"
    assert tags["toolproxy.phase"] == "authorize" and tags["toolproxy.policy.revision"]
    reasons = json.loads(tags["toolproxy.policy.reasons"]) if isinstance(tags["toolproxy.policy.reasons"], str) \
        else tags["toolproxy.policy.reasons"]
    assert reasons and all(":" not in r for r in reasons)
    assert "execute" not in children(found, call)  # nothing was sent
    # The audit record names the same trace.
    records = audit_records(capsys.readouterr().out)
    assert any(r.get("trace_id") == trace_id and r["kind"] == "tool_call" for r in records), records[-3:]
    assert_clean(found)


async def test_an_approval_required_call_says_so_on_its_span(stack, jaeger):
    trace_id, _, headers = parent()
    status, env = await stack.call("refund_order", BIG_REFUND, headers=headers)
    assert status == 403 and env["error"]["code"] == "approval_required"
    found = await fetch(jaeger, trace_id, at_least=2, names=("execute_tool refund_order",))
    tags = one(found, "execute_tool refund_order").tags
    assert tags["toolproxy.decision"] == "require_approval" and tags["toolproxy.error.code"] == "approval_required"
    assert tags["toolproxy.approval.id"] == env["error"]["details"]["approval_id"]
    assert_clean(found)


async def test_a_batch_is_the_parent_of_its_calls(stack, jaeger):
    trace_id, agent_span, headers = parent()
    status, body = await stack.batch([
        {"call_id": "a", "tool": "get_order", "arguments": {"order_id": "ord_1001"}},
        {"call_id": "b", "tool": "get_inventory", "arguments": {"sku": "sku_widget"}}], headers=headers)
    assert status == 200, body
    found = await fetch(jaeger, trace_id, at_least=3,
                        names=("batch", "execute_tool get_order", "execute_tool get_inventory"))
    batch = one(found, "batch")
    assert batch.parent_id == agent_span and batch.tags["toolproxy.batch.calls"] == 2
    assert batch.tags["toolproxy.batch.status"] == body["status"]
    assert children(found, batch) == {"execute_tool get_order", "execute_tool get_inventory"}


async def test_an_mcp_call_is_a_tools_call_server_span_with_the_mcp_attributes(stack, jaeger):
    trace_id, agent_span, headers = parent()
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": "get_order", "arguments": {"order_id": "ord_1001"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {},
                  "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
                  "traceparent": headers["traceparent"]}}}
    async with stack.session.post(stack.proxy_url + "/mcp", data=json.dumps(body), headers={
            "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call", "Mcp-Name": "get_order"}) as answer:
        assert answer.status == 200, await answer.text()
    found = await fetch(jaeger, trace_id, at_least=3, names=("tools/call get_order", "execute_tool get_order"))
    server = one(found, "tools/call get_order")
    assert server.parent_id == agent_span  # the context came in params._meta, as the MCP conventions say
    assert server.tags["mcp.method.name"] == "tools/call" and server.tags["mcp.protocol.version"] == "2026-07-28"
    assert server.tags["gen_ai.tool.name"] == "get_order" and server.tags["span.kind"] == "server"
    assert children(found, server) == {"execute_tool get_order"}


async def test_the_histogram_exemplar_names_a_trace_jaeger_holds(stack, jaeger):
    status, env = await stack.call("get_order", {"order_id": "ord_1001"})  # no traceparent: a root trace
    assert status == 200
    async with stack.session.get(stack.ops_url + "/metrics",
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as answer:
        assert answer.headers["Content-Type"].startswith("application/openmetrics-text")
        text = await answer.text()
    exemplars = re.findall(r'^toolproxy_call_duration_seconds_bucket\{[^}]*tool="get_order"[^}]*\} \S+ '
                           r'# \{[^}]*trace_id="([0-9a-f]{32})"', text, re.M)
    assert exemplars, text[:2000]
    found = await fetch(jaeger, exemplars[-1], at_least=1, names=("execute_tool get_order",))
    assert one(found, "execute_tool get_order").parent_id is None  # the proxy started this trace


async def test_a_reconciliation_is_its_own_trace_linked_to_the_unknown_call(stack, jaeger):
    trace_id, _, headers = parent()
    await stack.fault("refund_order", "drop_after_commit", count=1)
    status, env = await stack.call("refund_order", REFUND, headers={**headers, "Idempotency-Key": "traced-unknown"})
    assert env["outcome"] == "unknown" and env["error"]["code"] == "timeout_unknown", env
    found = await fetch(jaeger, trace_id, at_least=2, names=("execute_tool refund_order",))
    call = one(found, "execute_tool refund_order")
    assert call.tags["toolproxy.outcome"] == "unknown" and call.tags["error.type"] == "timeout_unknown"
    counts = await stack.runtime.reconciler.scan_once()
    assert counts.get("succeeded") == 1, counts
    [query] = [r for r in stack.backend.status_requests if r["tool"] == "refund_order"]
    status_parent = query["headers"]["traceparent"]
    reconcile_trace = status_parent.split("-")[1]
    assert reconcile_trace != trace_id  # its own trace, linked
    settled = await fetch(jaeger, reconcile_trace, at_least=1, names=("reconcile",))
    span = one(settled, "reconcile")
    assert (trace_id, call.span_id) in span.links
    assert span.tags["toolproxy.reconcile.result"] == "succeeded" and span.tags["gen_ai.tool.name"] == "refund_order"
    print(f"\ntrace {trace_id}:\n{render(found)}\ntrace {reconcile_trace}:\n{render(settled)}")  # docs
    record = await stack.runtime.operations.get(env["idempotency_key"])
    assert record.meta["traceparent"] == f"00-{trace_id}-{call.span_id}-01"
    assert_clean(found + settled, "traced-unknown")

