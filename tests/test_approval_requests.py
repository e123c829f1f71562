"""Approvals an agent can finish from any client, one per request, against real OPA, Redis and MCP clients.

* An MCP client finishes an approval without headers: it names the approval in the call's
  ``params._meta["io.toolproxy/approval-id"]`` (the Python ``mcp`` SDK client, and the Inspector CLI's
  ``--tool-metadata``), or simply sends the same call again once it is approved. The text the model reads
  says so.
* One pending approval per request: the same call, key and arguments sent again gets the same approval, not
  a new one; a denial sticks for that key and those arguments and carries the approver's reason.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.support.node import run, tool
from tests.support.stack import mcp_envelope, running_stack
from tests.support.tokens import jwt_overrides

BIG_REFUND = {"order_id": "ord_1001", "amount": 6000, "reason": "customer complaint"}  # over the threshold
APPROVAL_META = "io.toolproxy/approval-id"


@pytest.fixture
async def stack(proxy_deps, issuers):
    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin)}) as s:
        s.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        s.auto_key = False  # each test names its key or run
        yield s


@pytest.fixture
def approver(issuers):
    _, admin = issuers
    return admin.token("bob", audience="toolproxy-admin", roles=["approver", "cross-tenant"], tenant=None, scope="")


def refunds(stack: Any) -> int:
    return stack.backend.effect_counts().get("refund_order", 0)


def created(stack: Any) -> float:
    return stack.runtime.metrics.registry.get_sample_value("toolproxy_approvals_total", {"state": "created"}) or 0


async def pending_ids(stack: Any, approver: str) -> list[str]:
    status, listing = await stack.admin("GET", "/v1/approvals", approver)
    assert status == 200, listing
    return [a["id"] for a in listing["approvals"]]


async def sdk_call(stack: Any, headers: dict[str, str], meta: dict[str, Any] | None = None) -> Any:
    """One refund through the Python ``mcp`` SDK client, in a session of its own."""
    http = httpx2.AsyncClient(headers={**stack.headers, **headers}, timeout=httpx2.Timeout(30.0))
    async with Client(streamable_http_client(stack.proxy_url + "/mcp", http_client=http), mode="legacy") as client:
        return await client.call_tool("refund_order", BIG_REFUND, meta=meta)


async def test_the_mcp_sdk_client_finishes_an_approval_by_naming_it_in_meta(stack, approver):
    run_id = {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}
    asked = await sdk_call(stack, run_id)
    envelope = mcp_envelope(asked)
    assert envelope["error"]["code"] == "approval_required"
    approval_id = envelope["error"]["details"]["approval_id"]
    text = asked.content[0].text  # what the model reads says how to finish it over MCP
    assert text.startswith("approval_required: ") and f'params._meta["{APPROVAL_META}"]' in text
    assert "send the same call again" in text
    # Sent again before a decision (another session): the same approval, still waiting.
    again = mcp_envelope(await sdk_call(stack, run_id))
    assert again["error"]["code"] == "approval_required" and again["error"]["details"]["approval_id"] == approval_id
    assert await pending_ids(stack, approver) == [approval_id] and created(stack) == 1
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    done = await sdk_call(stack, run_id, meta={APPROVAL_META: approval_id})
    assert done.is_error is False and done.structured_content["amount"] == 6000, done
    assert refunds(stack) == 1
    # The same call once more: the same operation, replayed; the spent approval runs nothing again.
    replayed = await sdk_call(stack, run_id, meta={APPROVAL_META: approval_id})
    assert replayed.is_error is False and replayed.structured_content == done.structured_content
    assert refunds(stack) == 1 and created(stack) == 1


async def test_a_client_that_sends_nothing_extra_finishes_an_approval_by_sending_the_call_again(stack, approver):
    run_id = {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}
    approval_id = mcp_envelope(await sdk_call(stack, run_id))["error"]["details"]["approval_id"]
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    done = await sdk_call(stack, run_id)  # no _meta, no header: the call this approval was asked for
    assert done.is_error is False, done
    assert refunds(stack) == 1
    # Another business request (a new run id) with the same arguments asks anew.
    other = mcp_envelope(await sdk_call(stack, {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}))
    assert other["error"]["code"] == "approval_required"
    assert other["error"]["details"]["approval_id"] != approval_id and refunds(stack) == 1


async def test_the_inspector_cli_finishes_an_approval_with_tool_metadata(stack, approver, tmp_path):
    base = [tool("mcp-inspector"), "--cli", stack.proxy_url + "/mcp", "--transport", "http",
            "--header", f"Authorization: {stack.headers['Authorization']}",
            f"X-Run-Id: task-{uuid.uuid4().hex[:8]}",
            "--method", "tools/call", "--tool-name", "refund_order",
            "--tool-arg", *[f"{k}={v}" for k, v in BIG_REFUND.items()]]
    env = {"MCP_CATALOG_PATH": str(tmp_path / "catalog.json"), "HOME": str(tmp_path)}
    code, out, err = await run(*base, env=env, timeout_s=90)
    assert code == 5, (out[-2000:], err[-2000:])  # an isError result
    approval_id = mcp_envelope(json.loads(out))["error"]["details"]["approval_id"]
    assert (await stack.admin("POST", f"/v1/approvals/{approval_id}/approve", approver))[0] == 200
    code, out, err = await run(*base, "--tool-metadata", f"{APPROVAL_META}={approval_id}", env=env, timeout_s=90)
    assert code == 0, (out[-2000:], err[-2000:])
    assert json.loads(out)["structuredContent"]["amount"] == 6000
    assert refunds(stack) == 1


async def test_one_pending_approval_per_request_and_a_denial_sticks_with_its_reason(stack, approver):
    key = {"Idempotency-Key": f"refund-{uuid.uuid4().hex[:8]}"}
    answers = [(await stack.call("refund_order", BIG_REFUND, headers=key))[1] for _ in range(3)]
    ids = {a["error"]["details"]["approval_id"] for a in answers}
    assert [a["error"]["code"] for a in answers] == ["approval_required"] * 3 and len(ids) == 1
    [approval_id] = ids
    assert await pending_ids(stack, approver) == [approval_id] and created(stack) == 1
    # Other arguments under another key are another request: another approval.
    _, other = await stack.call("refund_order", {**BIG_REFUND, "amount": 7000},
                                headers={"Idempotency-Key": f"refund-{uuid.uuid4().hex[:8]}"})
    assert other["error"]["details"]["approval_id"] != approval_id and created(stack) == 2
    async with stack.session.post(stack.admin_url + f"/v1/approvals/{approval_id}/deny",
                                  headers={"Authorization": f"Bearer {approver}"},
                                  json={"reason": "The order was already refunded by phone."}) as response:
        status, body = response.status, await response.json()
    assert status == 200 and body["status"] == "denied", body
    for _ in range(2):  # re-sent after the denial: the denial, with the approver's reason; no new approval
        status, denied = await stack.call("refund_order", BIG_REFUND, headers=key)
        assert status == 403 and denied["error"]["code"] == "approval_mismatch", denied
        assert denied["error"]["details"] == {**denied["error"]["details"], "approval_id": approval_id,
                                              "reason": "denied",
                                              "approver_reason": "The order was already refunded by phone."}
        assert "already refunded by phone" in denied["error"]["message"]
    # Naming the denied approval says the same.
    _, named = await stack.call("refund_order", BIG_REFUND, headers={**key, "X-Approval-Id": approval_id})
    assert named["error"]["details"]["approver_reason"] == "The order was already refunded by phone."
    assert created(stack) == 2 and refunds(stack) == 0
