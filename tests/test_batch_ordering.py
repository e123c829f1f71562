"""Batches state their order or are refused, on every front that takes one (seed 001: "if the order is not
certain, do not pick one and claim the result is correct"): an MCP JSON-RPC batch runs as one plan on the
batch scheduler, like ``POST /v1/tool-calls:batch``, so two writes on one counter are refused before either
runs; a call that cannot be decoded fails with its own envelope and takes part in no pair. Effects are
counted at the demo backend."""

from __future__ import annotations

import uuid
from typing import Any

from tests.support.stack import mcp_envelope, running_stack
from tests.test_hostile_mcp import call, raw, session_of

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}
BAD_EMAIL = {"to": "ann@example.com", "subject": "Refund", "body": "Done.", "cc": "boss@example.com"}


def run_id() -> dict[str, str]:
    return {"X-Run-Id": f"task-{uuid.uuid4().hex[:8]}"}


def effects(stack: Any, tool: str) -> int:
    return stack.backend.effect_counts().get(tool, 0)


def by_id(answers: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    return {answer["id"]: answer for answer in answers}


def code(answer: dict[str, Any]) -> str:
    result = answer["result"]
    return mcp_envelope(result)["error"]["code"] if result["isError"] else "succeeded"


async def test_two_writes_on_one_counter_in_an_mcp_batch_are_refused_before_either_runs(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        session = {**await session_of(stack), **run_id()}
        batch = [call(1, "adjust_counter", {"counter": "ctr_mb", "delta": 1}),
                 call(2, "adjust_counter", {"counter": "ctr_mb", "delta": 10}),
                 call(3, "get_order", {"order_id": "ord_1001"})]
        status, _, answers = await raw(stack, batch, session)
        assert status == 200, answers
        answers = by_id(answers)
        assert [code(answers[i]) for i in (1, 2, 3)] == ["invalid_plan"] * 3  # none of the batch's calls ran
        refusal = mcp_envelope(answers[1]["result"])
        assert refusal["error"]["details"]["problems"] == [
            {"problem": "unordered_writes", "calls": [1, 2], "resources": ["counter:ctr_mb"]}]
        assert "one at a time" in answers[1]["result"]["content"][0]["text"]
        assert refusal["side_effect"] == {"attempted": False, "committed": False}
        assert effects(stack, "adjust_counter") == 0
        # Sent one at a time, in the order meant, both apply.
        for rpc_id, delta in ((4, 1), (5, 10)):
            status, _, answer = await raw(stack, call(rpc_id, "adjust_counter", {"counter": "ctr_mb", "delta": delta}),
                                          session)
            assert answer["result"]["isError"] is False
        assert answer["result"]["structuredContent"] == {"counter": "ctr_mb", "value": 11}
        assert effects(stack, "adjust_counter") == 2


async def test_an_mcp_batch_runs_unrelated_writes_and_reads_and_an_undecodable_call_fails_alone(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        session = {**await session_of(stack), **run_id()}
        batch = [call("refund", "refund_order", REFUND),
                 call("mail", "send_email", BAD_EMAIL),                                 # an unknown argument
                 call("a", "adjust_counter", {"counter": "ctr_mc", "delta": 1}),
                 call("b", "adjust_counter", {"counter": "ctr_mc", "delta": "10"}),     # not an integer
                 call("other", "adjust_counter", {"counter": "ctr_md", "delta": 2}),
                 {"jsonrpc": "2.0", "id": "ping", "method": "ping"}]
        status, _, answers = await raw(stack, batch, session)
        assert status == 200, answers
        answers = by_id(answers)
        assert {i: code(answers[i]) for i in ("refund", "mail", "a", "b", "other")} == {
            "refund": "succeeded", "mail": "schema_violation", "a": "succeeded", "b": "schema_violation",
            "other": "succeeded"}
        assert answers["ping"]["result"] == {}
        assert effects(stack, "refund_order") == 1 and effects(stack, "send_email") == 0
        assert effects(stack, "adjust_counter") == 2


async def test_each_mcp_batch_call_carries_its_own_key_in_meta(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        session = await session_of(stack)

        def keyed(rpc_id: Any, counter: str, key: str) -> dict[str, Any]:
            member = call(rpc_id, "adjust_counter", {"counter": counter, "delta": 1})
            member["params"]["_meta"] = {"io.toolproxy/idempotency-key": key}
            return member

        batch = [keyed(1, "ctr_me", "bump-e"), keyed(2, "ctr_mf", "bump-f")]
        status, _, first = await raw(stack, batch, session)
        status, _, again = await raw(stack, [keyed(3, "ctr_me", "bump-e"), keyed(4, "ctr_mf", "bump-f")], session)
        assert status == 200 and all(code(a) == "succeeded" for a in first + again), (first, again)
        assert effects(stack, "adjust_counter") == 2  # the second batch replayed both
        status, _, keyless = await raw(stack, [call(5, "adjust_counter", {"counter": "ctr_me", "delta": 1})], session)
        assert code(keyless[0]) == "idempotency_key_required" and effects(stack, "adjust_counter") == 2


async def test_the_batch_api_lets_an_undecodable_call_fail_alone(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        status, body = await stack.batch([
            {"call_id": "refund", "tool": "refund_order", "arguments": REFUND},
            {"call_id": "mail", "tool": "send_email", "arguments": BAD_EMAIL},
            {"call_id": "a", "tool": "adjust_counter", "arguments": {"counter": "ctr_ja", "delta": 1}},
            {"call_id": "b", "tool": "adjust_counter", "arguments": {"counter": "ctr_ja", "delta": "10"}}])
        assert status == 200, body
        outcomes = {r["call_id"]: r["error"]["code"] if r["error"] else r["outcome"] for r in body["results"]}
        assert outcomes == {"refund": "succeeded", "mail": "schema_violation", "a": "succeeded",
                            "b": "schema_violation"}
        assert effects(stack, "refund_order") == 1 and effects(stack, "adjust_counter") == 1
