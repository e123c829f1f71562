"""The proxy keeps nothing per call (issue 32): a leak check by ``gc`` object counts, not by time.

The proxy runs in this process (``running_stack``) against real OPA, Redis and the demo backend. Rounds of
the same mixed calls (a JSON read, a JSON write under a fresh key, an OpenAI-shaped read, an MCP read)
run after warm-up rounds; between rounds the demo backend forgets what it stored (its idempotency
answers, counters) and ``gc.collect()`` runs. Objects that live per call, per operation key or per
request id would make every round leave more behind than the one before; what the process builds once
(pools, caches of the registry's schemas, lazily imported modules) is built in the warm-up rounds.
"""

from __future__ import annotations

import gc
import json
import math

import pytest

from proxy.batch.scheduler import FINISHED_BATCHES_KEPT
from tests.support.stack import running_stack

ROUNDS_CALLS = 100  # iterations per round; four calls each
MODERN = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2026-07-28",
          "Mcp-Method": "tools/call", "Mcp-Name": "get_order"}
CLIENT_META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
               "io.modelcontextprotocol/clientCapabilities": {},
               "io.modelcontextprotocol/clientInfo": {"name": "leak-check", "version": "0"}}


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack(proxy_deps) as s:
        yield s


async def one_round(stack, tag: str) -> None:
    for i in range(ROUNDS_CALLS):
        status, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert status == 200 and env["outcome"] == "succeeded", env
        status, env = await stack.call("adjust_counter", {"counter": f"ctr_{tag}{i}", "delta": 1},
                                       headers={"Idempotency-Key": f"leak-{tag}-{i}"})
        assert status == 200 and env["outcome"] == "succeeded", env
        status, body = await stack.post("/v1/openai/tool-calls", {"tool_calls": [{
            "id": f"call_{i}", "type": "function",
            "function": {"name": "get_order", "arguments": json.dumps({"order_id": "ord_1001"})}}]})
        assert status == 200, body
        status, body = await stack.post("/mcp", {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
            "name": "get_order", "arguments": {"order_id": "ord_1001"}, "_meta": CLIENT_META}}, headers=MODERN)
        assert status == 200 and body["result"]["isError"] is False, body


def objects_now(stack) -> int:
    stack.backend.reset()  # the backend's own per-key answers are not the proxy's
    gc.collect()
    return len(gc.get_objects())


async def test_repeated_calls_leave_no_objects_behind(stack):
    # Warm-up: what is built once is built here, and the bounded keeps fill up (the scheduler keeps the last
    # FINISHED_BATCHES_KEPT batches, one per OpenAI-shaped call, for a late cancel).
    for n in range(math.ceil(FINISHED_BATCHES_KEPT / ROUNDS_CALLS) + 1):
        await one_round(stack, f"warm{n}")
    counts = [objects_now(stack)]
    for n in range(3):
        await one_round(stack, f"r{n}")
        counts.append(objects_now(stack))
    growth = [b - a for a, b in zip(counts, counts[1:])]
    print(f"gc objects after each round: {counts} (growth {growth})")
    # A leak of one object per iteration (four calls) grows every round by ROUNDS_CALLS or more. A round's count
    # also moves by what happens to be alive when it is taken (in flight, a background sweep, or, in a whole
    # suite's process, what other tests left to the collector), once rather than every round: so at least one
    # round must grow by less than a leak would.
    assert min(growth) < ROUNDS_CALLS, counts
