"""Partly applied calls (issue 29 items 10 and 11; seed 003 §4-§5, seed 004 §5-§6), with real OPA,
Redis and the demo backend's multi-item ``send_notices``:

* the backend stops halfway (207 ``{"state": "partial", ...}``): the envelope is ``outcome: partial``
  with the committed and pending items and where to follow them; the record stays open and the
  reconciler settles the pending items from the status endpoint;
* recovery checks the digest: a committed result that no longer contains the items committed at
  execution is a takeover carrying both digests, never a success;
* a cancel that stops the call between two items ends ``partial`` (nothing pending: a person decides).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.stack import running_stack
from tests.support.waits import wait_until

NOTICES = {"recipients": ["usr_alice", "usr_bob", "usr_carol", "usr_dave"], "message": "maintenance at 9"}


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack({**proxy_deps, "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0}) as s:
        yield s


async def _halfway(stack, key, rest_after_ms=200):
    await stack.fault("send_notices", "stop_halfway", delay_ms=rest_after_ms, count=1)
    status, env = await stack.call("send_notices", NOTICES, headers={"Idempotency-Key": key})
    assert env["outcome"] == "partial", env
    return env


async def test_a_call_that_stops_halfway_is_partial_and_the_reconciler_settles_the_rest(stack):
    env = await _halfway(stack, "notices-1", rest_after_ms=2000)  # pending while the first pass looks
    key = env["idempotency_key"]
    partial = env["partial"]
    assert [i["recipient"] for i in partial["committed"]] == ["usr_alice", "usr_bob"]
    assert partial["pending"] == [{"recipient": "usr_carol"}, {"recipient": "usr_dave"}]
    assert partial["recovery"] == {"operation": f"/v1/operations/{key}", "resolution": "reconcile"}
    assert env["data"] is None and env["error"] is None
    assert env["side_effect"]["committed"] is True
    assert env["side_effect"]["summary"] == ("send_notices 1.0.0 partly applied on inbox:usr_alice, inbox:usr_bob, "
                                             "inbox:usr_carol, inbox:usr_dave: 2 item(s) committed, 2 pending")
    record = await stack.runtime.operations.get(key)
    assert record.state == "UNKNOWN" and record.outcome["partial"]["pending"] == partial["pending"]
    _, view = await stack.get(f"/v1/operations/{key}")
    assert view["state"] == "UNKNOWN" and view["partial"] == {"committed": partial["committed"],
                                                              "pending": partial["pending"]}
    # A duplicate is not run again while the rest is pending.
    _, again = await stack.call("send_notices", NOTICES, headers={"Idempotency-Key": "notices-1"})
    assert again["error"]["code"] == "operation_unknown" and len(stack.backend.requests) == 1
    counts = await stack.runtime.reconciler.scan_once()
    assert counts.get("watching") == 1, counts  # the status endpoint still says partial
    slot = ("send_notices", key)
    await wait_until(lambda: stack.backend.idempotency[slot]["state"] == "committed", timeout=20,
                     what="the backend to send the pending notices")
    counts = await stack.runtime.reconciler.scan_once()
    assert counts.get("succeeded") == 1, counts
    record = await stack.runtime.operations.get(key)
    assert record.state == "SUCCEEDED" and len(record.outcome["data"]["notices"]) == 4
    _, done = await stack.call("send_notices", NOTICES, headers={"Idempotency-Key": "notices-1"})
    assert done["outcome"] == "succeeded" and done["replayed"] is True
    assert [n["recipient"] for n in done["data"]["notices"]] == NOTICES["recipients"]
    assert len(stack.backend.notices) == 4 and len(stack.backend.requests) == 1  # each notice once


async def test_a_committed_result_that_contradicts_the_committed_items_is_a_takeover(stack):
    env = await _halfway(stack, "notices-2")
    key = env["idempotency_key"]
    slot = ("send_notices", key)
    await wait_until(lambda: stack.backend.idempotency[slot]["state"] == "committed", timeout=10,
                     what="the backend to send the pending notices")
    # The server's record is rewritten: the first notice's id is not the one the call committed.
    stack.backend.idempotency[slot]["body"]["notices"][0]["notice_id"] = "ntc_999999"
    counts = await stack.runtime.reconciler.scan_once()
    assert counts.get("takeover") == 1, counts
    record = await stack.runtime.operations.get(key)
    assert record.state == "NEEDS_TAKEOVER"
    evidence = record.evidence
    assert evidence["observed"] == "result_digest_mismatch"
    assert len(evidence["recorded_digest"]) == 64 and len(evidence["reported_digest"]) == 64
    assert evidence["recorded_digest"] != evidence["reported_digest"]
    _, view = await stack.get(f"/v1/operations/{key}")
    assert view["takeover"]["last_evidence"]["observed"] == "result_digest_mismatch"


async def test_a_cancel_between_two_items_ends_partial(stack):
    stack.backend.notice_delay_ms = 150
    call = asyncio.create_task(stack.call("send_notices", NOTICES, headers={"Idempotency-Key": "notices-3"}))
    await wait_until(lambda: stack.backend.notices, timeout=10, what="the first notice to be sent")
    key = next(r["headers"]["Idempotency-Key"] for r in stack.backend.requests if r["tool"] == "send_notices")
    status, view = await stack.post(f"/v1/operations/{key}:cancel", {})
    _, env = await call
    assert env["outcome"] == "partial", env
    sent = len(stack.backend.notices)
    assert 1 <= sent < 4 and len(env["partial"]["committed"]) == sent and env["partial"]["pending"] == []
    assert env["partial"]["recovery"]["resolution"] == "ask_user"
    assert stack.backend.cancel_requests  # the backend was asked to stop
    # Nothing is pending and part was applied: the reconciler hands it to a person, never "succeeded".
    counts = await stack.runtime.reconciler.scan_once()
    assert counts.get("takeover") == 1, counts
    record = await stack.runtime.operations.get(key)
    assert record.state == "NEEDS_TAKEOVER" and record.evidence["observed"] == "partial_final"


async def test_an_mcp_client_is_told_what_was_applied_and_what_is_pending(stack):
    """Over MCP a partial call has no result to conform to the outputSchema: it is an isError result whose
    text names the applied and pending items, with the envelope in ``_meta``."""
    from tests.test_mcp_front import CLIENT_META, modern_headers, post, rpc
    from tests.support.stack import mcp_envelope

    await stack.fault("send_notices", "stop_halfway", delay_ms=0, count=1)
    params = {"name": "send_notices", "arguments": NOTICES, "_meta": CLIENT_META}
    status, _, body = await post(stack, rpc("tools/call", params),
                                 {**modern_headers("tools/call", "send_notices"), "Idempotency-Key": "notices-mcp"})
    assert status == 200, body
    result = body["result"]
    envelope = mcp_envelope(result)
    assert envelope["outcome"] == "partial" and len(envelope["partial"]["pending"]) == 2
    text = result["content"][0]["text"]
    assert text.startswith("partial: 2 item(s) applied, 2 pending.") and "usr_alice" in text


async def test_a_cancel_the_status_endpoint_answers_partial_ends_partial(proxy_deps):
    """The call does not answer within the cancel's grace (a notice takes long to send): its stream is
    closed and the status endpoint, asked, says some notices are out and the rest pending. The cancel ends
    ``partial`` (the reconciler follows the rest), not ``cancelled`` nor a bare ``unknown``."""
    settings = {**proxy_deps, "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0,
                "cancellation.grace_ms": 50}
    async with running_stack(settings) as stack:
        stack.backend.notice_delay_ms = 1500
        call = asyncio.create_task(stack.call("send_notices", NOTICES, headers={"Idempotency-Key": "notices-4"}))
        await wait_until(lambda: stack.backend.notices, timeout=20, what="the first notice to be sent")
        key = next(r["headers"]["Idempotency-Key"] for r in stack.backend.requests if r["tool"] == "send_notices")
        await stack.post(f"/v1/operations/{key}:cancel", {})
        _, env = await call
        assert env["outcome"] == "partial", env
        assert [n["recipient"] for n in env["partial"]["committed"]] == ["usr_alice"]
        assert len(env["partial"]["pending"]) == 3 and env["partial"]["recovery"]["resolution"] == "reconcile"
        record = await stack.runtime.operations.get(key)
        assert record.state == "UNKNOWN"  # followed by the reconciler until nothing is pending
        # The backend stops at its next notice boundary: one notice was in flight, the rest never go out.
        await wait_until(lambda: stack.backend.idempotency[("send_notices", key)]["state"] == "partial",
                         timeout=20, what="the backend to stop")
        counts = await stack.runtime.reconciler.scan_once()
        assert counts.get("takeover") == 1, counts
        assert len(stack.backend.notices) == 2
