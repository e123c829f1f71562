"""Operation keys bound to the business intent on every front (tenant, subject, tool, normalized arguments
and the business request id ``X-Run-Id``), never to a transport id: the same refund asked for again by a
re-planned OpenAI turn (new ``tool_call.id``) or in another MCP session (new session, new JSON-RPC id)
refunds once, counted at the demo backend. A write without a business request id is refused, saying how
to send one, on the OpenAI front as on the JSON API and MCP."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.support.stack import mcp_envelope, running_stack
from tests.test_openai_front import assistant, chat_call, envelopes

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}


def refunds(stack: Any) -> int:
    return stack.backend.effect_counts().get("refund_order", 0)


async def test_a_refund_replanned_in_a_later_openai_turn_refunds_once(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        run = {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}  # the runner's task id, the same on every turn
        status, first = await stack.post("/v1/openai/tool-calls",
                                          assistant(chat_call("call_a1", "refund_order", REFUND)), headers=run)
        assert status == 200, first
        done = envelopes(first)[0]
        assert done["outcome"] == "succeeded", done
        # The model re-plans: another turn, a new tool_call id, the arguments in another order.
        replanned = assistant(chat_call("call_b7", "refund_order", json.dumps(dict(reversed(REFUND.items())))))
        status, second = await stack.post("/v1/openai/tool-calls", replanned, headers=run)
        again = envelopes(second)[0]
        assert again["outcome"] == "succeeded" and again.get("replayed") is True, again
        assert again["idempotency_key"] == done["idempotency_key"] and again["call_id"] == "call_b7"
        assert refunds(stack) == 1
        # Another business request (a new task id) is another operation.
        status, third = await stack.post("/v1/openai/tool-calls", replanned,
                                         headers={"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"})
        other = envelopes(third)[0]
        assert other["outcome"] == "succeeded" and other["idempotency_key"] != done["idempotency_key"]
        assert refunds(stack) == 2


async def test_a_keyless_openai_write_is_refused_and_told_how_to_send_a_business_request_id(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        status, response = await stack.post("/v1/openai/tool-calls",
                                            assistant(chat_call("call_k1", "refund_order", REFUND),
                                                      chat_call("call_k2", "get_order", {"order_id": "ord_1001"})))
        assert status == 200, response
        refused, read = envelopes(response)
        assert refused["error"]["code"] == "idempotency_key_required", refused
        assert "X-Run-Id" in refused["error"]["message"] and "io.toolproxy/run-id" in refused["error"]["message"]
        assert refused["error"]["details"]["send_one_of"][0] == "X-Run-Id"
        assert read["outcome"] == "succeeded"  # a read needs no key
        assert refunds(stack) == 0


async def sdk_refund(stack: Any, *, headers: dict[str, str], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """One refund through the Python ``mcp`` SDK client, in a session of its own: the refund's confirmation,
    or the envelope of an isError result."""
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0))
    async with Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http), mode="legacy") as client:
        result = await client.call_tool("refund_order", REFUND, meta=meta)
    return mcp_envelope(result) if result.is_error else result.structured_content


async def test_a_refund_sent_again_in_another_mcp_session_refunds_once(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        # X-Run-Id set once on the SDK client's transport: two sessions, two JSON-RPC ids, one operation.
        run = {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}
        first = await sdk_refund(stack, headers=run)
        second = await sdk_refund(stack, headers=run)
        assert first["refund_id"].startswith("rf_") and second == first  # the replay: the same confirmation
        assert refunds(stack) == 1
        # A client that cannot set headers sends the business request id in the call's _meta.
        meta = {"io.toolproxy/run-id": f"task-{uuid.uuid4().hex[:8]}"}
        third = await sdk_refund(stack, headers={}, meta=meta)
        fourth = await sdk_refund(stack, headers={}, meta=meta)
        assert fourth == third and third["refund_id"] != first["refund_id"]
        assert refunds(stack) == 2
        # Neither: refused, saying how to send one.
        keyless = await sdk_refund(stack, headers={})
        assert keyless["error"]["code"] == "idempotency_key_required" and refunds(stack) == 2
