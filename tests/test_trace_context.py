"""Trace context and the trace receiver as a peer, without a trace backend (issue #33; the spans a real
backend receives are tests/test_traces.py's): with tracing off the agent's context still reaches the
backend and the status endpoint; a receiver that never answers costs spans, never calls."""

from __future__ import annotations

import asyncio
import secrets

from proxy.telemetry import spans as spans_module
from tests.support.stack import running_stack
from tests.support.waits import wait_until

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "customer said: MARKER-reason-4711"}


def parent() -> tuple[str, str, dict[str, str]]:
    """An agent's own trace: (trace id, its span id, the traceparent and tracestate headers)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "agent=7"}


async def test_a_trace_receiver_that_never_answers_costs_spans_not_calls(proxy_deps):
    """The receiver is a peer like any other: one that accepts connections and never answers is bounded by
    tracing.export_timeout_ms on the exporter's own thread, and the queue by tracing.max_queue_size."""
    held: list[asyncio.StreamWriter] = []

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(stall, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running_stack({**proxy_deps, "tracing.endpoint": f"http://127.0.0.1:{port}",
                                  "tracing.sampler": "always_on", "tracing.schedule_delay_ms": 10,
                                  "tracing.export_timeout_ms": 300, "tracing.max_queue_size": 8,
                                  "tracing.max_export_batch_size": 4}) as stack:
            for n in range(12):
                status, env = await stack.call("get_order", {"order_id": "ord_1001"})
                assert status == 200 and env["outcome"] == "succeeded", env
            await wait_until(lambda: held, timeout=10, what="the exporter to connect")
    finally:
        server.close()
        for writer in held:
            writer.close()


async def test_with_tracing_off_the_agents_context_still_reaches_the_backend_and_the_status_endpoint(proxy_deps):
    """No endpoint: no SDK, no spans; the agent's trace (tracestate too) goes on to the backend, and the later
    status query of an unknown outcome carries the call's trace."""
    trace_id, agent_span, headers = parent()
    async with running_stack({**proxy_deps, "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0}) as stack:
        assert spans_module.active() is None
        await stack.fault("refund_order", "drop_after_commit", count=1)
        status, env = await stack.call("refund_order", REFUND, headers={**headers, "Idempotency-Key": "off-1"})
        assert env["outcome"] == "unknown", env
        [sent] = [r["headers"] for r in stack.backend.requests if r["tool"] == "refund_order"]
        version, sent_trace, sent_span, flags = sent["traceparent"].split("-")
        assert (version, sent_trace, flags) == ("00", trace_id, "01") and sent_span != agent_span
        assert sent["tracestate"] == "agent=7"
        record = await stack.runtime.operations.get(env["idempotency_key"])
        assert record.meta["traceparent"] == headers["traceparent"]
        assert (await stack.runtime.reconciler.scan_once()).get("succeeded") == 1
        [query] = [r for r in stack.backend.status_requests if r["tool"] == "refund_order"]
        assert query["headers"]["traceparent"].split("-")[1] == trace_id
