"""The fault matrix as a gate: ``python -m bench.fault_matrix``.

Runs each row against an in-process proxy with a real OPA, a real Redis and the demo backend (the
same parts as the tests), then prints one line per row and the gate ("重复副作用数为零、
未知状态可收敛、越权写入为零和人工接管信息完整"):

* duplicate effects = 0: no idempotency key (no key and item, for a multi-item tool) applied twice;
* every unknown converged: after reconciliation no operation is left UNKNOWN (settled, or handed over);
* unauthorized writes = 0: no refused call reached the backend, no effect on another tenant's resource;
* every takeover complete: each NEEDS_TAKEOVER record names its key, tool, tenant, target and last evidence.

Exit status 0 when the gate holds, 1 otherwise. Rows are in ``ROWS``; each returns what it observed.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from typing import Any, Awaitable, Callable

from bench.servers import real_dependencies
from proxy.operation_views import takeover_record
from tests.support.stack import Stack, running_stack

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "fault matrix"}
Row = Callable[[Stack], Awaitable[str]]


async def _settle(stack: Stack, passes: int = 40) -> None:
    """Reconcile until nothing is due (bounded: ``passes`` sweeps, 50 ms apart)."""
    for _ in range(passes):
        counts = await stack.runtime.reconciler.scan_once()
        if not any(k in counts for k in ("watching", "crashed")) and not await _unknown(stack):
            return
        await asyncio.sleep(0.05)


async def _unknown(stack: Stack) -> list[str]:
    keys = await stack.runtime.operations.open_keys(1000)
    records = [await stack.runtime.operations.get(k) for k in keys]
    return [r.key for r in records if r is not None and r.state == "UNKNOWN"]


async def same_key_at_once(stack: Stack) -> str:
    await stack.fault("refund_order", "slow", delay_ms=100, count=1)
    key = {"Idempotency-Key": "fm-concurrent"}
    answers = await asyncio.gather(*(stack.call("refund_order", REFUND, headers=key) for _ in range(4)))
    return "outcomes " + ",".join(sorted(env.get("error", {}) and env["error"]["code"] or env["outcome"]
                                         for _, env in answers))


async def same_key_other_arguments(stack: Stack) -> str:
    key = {"Idempotency-Key": "fm-conflict"}
    await stack.call("refund_order", REFUND, headers=key)
    _, env = await stack.call("refund_order", {**REFUND, "amount": 200}, headers=key)
    return env["error"]["code"]


async def timeout_before_accept(stack: Stack) -> str:
    await stack.fault("refund_order", "drop_before_commit", count=1)
    key = {"Idempotency-Key": "fm-before"}
    _, first = await stack.call("refund_order", {**REFUND, "amount": 101}, headers=key)
    await _settle(stack)  # the status endpoint: never accepted (not_found), so the same key may run again
    _, again = await stack.call("refund_order", {**REFUND, "amount": 101}, headers=key)
    return f"{first['outcome']} -> not found -> same key re-sent: {again['outcome']}"


async def timeout_during_commit(stack: Stack) -> str:
    await stack.fault("refund_order", "slow", delay_ms=1000, count=1)
    _, env = await stack.call("refund_order", {**REFUND, "amount": 102},
                              headers={"Idempotency-Key": "fm-during", "Request-Timeout": "0.4"})
    await asyncio.sleep(0.8)
    await _settle(stack)
    record = await stack.runtime.operations.get(env["idempotency_key"])
    return f"{env['outcome']} -> {record.state} (observed, not re-sent)"


async def timeout_after_commit(stack: Stack) -> str:
    await stack.fault("refund_order", "drop_after_commit", count=1)
    _, env = await stack.call("refund_order", {**REFUND, "amount": 103}, headers={"Idempotency-Key": "fm-after"})
    await _settle(stack)
    _, again = await stack.call("refund_order", {**REFUND, "amount": 103}, headers={"Idempotency-Key": "fm-after"})
    return f"{env['outcome']} -> {again['outcome']} with the original refund id (replayed)"


async def status_rejected(stack: Stack) -> str:
    stack.backend.orders["ord_1002"]["refundable"] = 10
    await stack.fault("refund_order", "slow", delay_ms=1000, count=1)
    _, env = await stack.call("refund_order", {"order_id": "ord_1002", "amount": 500, "reason": "x"},
                              headers={"Idempotency-Key": "fm-rejected", "Request-Timeout": "0.4"})
    await asyncio.sleep(0.8)
    await _settle(stack)
    return f"{env['outcome']} -> {(await stack.runtime.operations.get(env['idempotency_key'])).state}"


async def forged_tenant(stack: Stack) -> str:
    _, env = await stack.call("refund_order", {**REFUND, "tenant_id": "globex"},
                              headers={"Idempotency-Key": "fm-forged", "X-Call-Id": "fm-refused-1"},
                              call_id="fm-refused-1")
    return env["error"]["code"]


async def foreign_resource(stack: Stack) -> str:
    _, env = await stack.call("refund_order", {"order_id": "ord_2001", "amount": 100, "reason": "not ours"},
                              headers={"Idempotency-Key": "fm-foreign"}, call_id="fm-refused-2")
    return env["error"]["code"]


async def mixed_batch(stack: Stack) -> str:
    calls = [{"call_id": "fm-ok", "tool": "adjust_counter", "arguments": {"counter": "ctr_demo", "delta": 1}},
             {"call_id": "fm-refused-3", "tool": "refund_order",
              "arguments": {"order_id": "ord_2001", "amount": 1, "reason": "x"}}]
    _, body = await stack.post("/v1/tool-calls:batch", {"calls": calls, "all_or_nothing": True},
                               headers={"Idempotency-Key": "fm-batch"})
    return "all_or_nothing: " + ",".join(r["outcome"] for r in body["results"])


async def transfer_race(stack: Stack) -> str:
    await stack.fault("transfer_project", "slow", delay_ms=1000, count=1)
    call = asyncio.create_task(stack.call(
        "transfer_project", {"project_id": "prj_1001", "to_owner": "bob", "expected_owner": "dev-user"},
        headers={"Idempotency-Key": "fm-race"}))
    for _ in range(200):
        if any(r["tool"] == "transfer_project" for r in stack.backend.requests):
            break
        await asyncio.sleep(0.01)
    stack.backend.projects["prj_1001"]["owner"] = "mallory"
    _, env = await call
    return f"{env['outcome']} ({env['error']['details'].get('backend_code')})"


async def tampered_model_output(stack: Stack) -> str:
    await stack.fault("send_email", "drop_before_commit", count=1)
    _, env = await stack.call("send_email", {"to": "a@example.com", "subject": "s", "body": "b"},
                              headers={"Idempotency-Key": "fm-tampered", "X-Toolproxy-Outcome": "succeeded",
                                       "Idempotent-Replayed": "true"})
    return f"model claims success, proxy says {env['outcome']}"


async def no_status_endpoint(stack: Stack) -> str:
    await stack.fault("adjust_counter", "drop_after_commit", count=1)
    _, env = await stack.call("adjust_counter", {"counter": "ctr_race", "delta": 5},
                              headers={"Idempotency-Key": "fm-takeover"})
    await _settle(stack)
    return f"{env['outcome']} -> {(await stack.runtime.operations.get(env['idempotency_key'])).state}"


async def stopped_halfway(stack: Stack) -> str:
    await stack.fault("send_notices", "stop_halfway", delay_ms=100, count=1)
    _, env = await stack.call("send_notices", {"recipients": ["usr_a", "usr_b", "usr_c", "usr_d"], "message": "m"},
                              headers={"Idempotency-Key": "fm-partial"})
    await asyncio.sleep(0.2)
    await _settle(stack)
    return f"{env['outcome']} -> {(await stack.runtime.operations.get(env['idempotency_key'])).state}"


ROWS: list[tuple[str, Row]] = [
    ("two workers, one key, at once", same_key_at_once),
    ("one key, other arguments", same_key_other_arguments),
    ("timeout before accept", timeout_before_accept),
    ("timeout during commit", timeout_during_commit),
    ("timeout after commit", timeout_after_commit),
    ("status endpoint: rejected", status_rejected),
    ("forged tenant in arguments", forged_tenant),
    ("another tenant's resource", foreign_resource),
    ("batch with an unauthorized call", mixed_batch),
    ("resource changed after the decision", transfer_race),
    ("tampered model output", tampered_model_output),
    ("unknown without a status endpoint", no_status_endpoint),
    ("stopped halfway (partial)", stopped_halfway),
]


async def gate(stack: Stack) -> dict[str, Any]:
    effects = stack.backend.effects
    per_key = Counter((e["tool"], e["idempotency_key"], e["args"].get("recipients") and None) for e in effects
                      if e["tool"] != "send_notices")
    duplicates = sum(n - 1 for n in per_key.values() if n > 1)
    notices = Counter((n["recipient"], n["message"]) for n in stack.backend.notices)
    duplicates += sum(n - 1 for n in notices.values() if n > 1)
    refused_sent = [r for r in stack.backend.requests if (r["headers"].get("X-Call-Id") or "").startswith("fm-refused")]
    foreign = [e for e in effects if e["args"].get("order_id") == "ord_2001"]
    takeovers = []
    for key in await stack.runtime.operations.open_keys(1000):
        record = await stack.runtime.operations.get(key)
        if record is not None and record.state == "NEEDS_TAKEOVER":
            takeovers.append(takeover_record(record))
    incomplete = [t for t in takeovers if not all(t.get(f) for f in ("idempotency_key", "tool", "tenant", "target",
                                                                      "last_evidence"))]
    return {"duplicate_effects": duplicates, "unknown_left": len(await _unknown(stack)),
            "unauthorized_writes": len(refused_sent) + len(foreign), "takeovers": len(takeovers),
            "takeovers_incomplete": len(incomplete)}


SETTINGS = {"reconcile.enabled": False, "reconcile.backoff_initial_ms": 0, "reconcile.window_ms": 2000}


async def run(stack: Stack) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Every row against ``stack`` (a proxy with ``SETTINGS``), then the gate's counts."""
    seen = []
    for name, row in ROWS:
        try:
            seen.append((name, await asyncio.wait_for(row(stack), 30)))
        except Exception as exc:  # a row that breaks is reported, and fails the gate below
            seen.append((name, f"ERROR {type(exc).__name__}: {exc}"))
    await _settle(stack)
    result = await gate(stack)
    result["errors"] = sum(1 for _, text in seen if text.startswith("ERROR"))
    result["passed"] = (result["duplicate_effects"] == 0 and result["unknown_left"] == 0
                        and result["unauthorized_writes"] == 0 and result["takeovers_incomplete"] == 0
                        and result["errors"] == 0)
    return seen, result


async def main() -> int:
    with real_dependencies() as deps:
        async with running_stack({**deps, **SETTINGS}) as stack:
            seen, result = await run(stack)
    for name, text in seen:
        print(f"  {name:<40} {text}")
    ok = result["passed"]
    print(f"gate: duplicate effects {result['duplicate_effects']}, unknown left {result['unknown_left']}, "
          f"unauthorized writes {result['unauthorized_writes']}, takeovers complete "
          f"{result['takeovers'] - result['takeovers_incomplete']}/{result['takeovers']} -> "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
