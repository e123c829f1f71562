"""Tests of the demo tool backend (examples/demo_backend.py) and demo registry.

They pin the backend contract the proxy's HTTP adapter relies on: results,
business refusals, idempotent replay, the status endpoint, fencing, and every
fault mode a client can observe. They talk HTTP to a real aiohttp server.
"""

from __future__ import annotations

import asyncio
import json
import json as _json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import pytest_asyncio

from examples.demo_backend import TOOLS, DemoState, create_app, start_demo_backend
from tests.support.calltokens import session_keys
from tests.unit.test_demo_registry import CONTRACTS, GOOD_ARGS

ROOT = Path(__file__).resolve().parent.parent

# One valid argument set per tool (acme tenant data).


def output_errors(tool: str, result: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(CONTRACTS[tool]["outputSchema"])
    return [e.message for e in validator.iter_errors(result)]


@pytest.fixture
def state() -> DemoState:
    return DemoState()


class SignedClient:
    """The test client, with the Txn-Token the proxy would send on every tool, status and cancel request
    (for the tenant in ``X-Toolproxy-Tenant``, acme by default). Refusals: tests/walkaround/."""

    def __init__(self, client: Any) -> None:
        self._client = client

    async def post(self, path: str, *, json: Any = None, data: bytes | None = None,
                   headers: dict[str, str] | None = None, **kw: Any) -> Any:
        body = data if data is not None else (b"" if json is None else _json.dumps(json).encode())
        signed = session_keys().headers_for("POST", path, body, headers,
                                            tenant=(headers or {}).get("X-Toolproxy-Tenant", "acme"))
        if json is not None:
            signed.setdefault("Content-Type", "application/json")
        return await self._client.post(path, data=body, headers=signed, **kw)

    async def get(self, path: str, *, headers: dict[str, str] | None = None, **kw: Any) -> Any:
        return await self._client.get(path, headers=session_keys().headers_for("GET", path, b"", headers), **kw)

    def __getattr__(self, name: str) -> Any:  # the control API takes no token
        return getattr(self._client, name)


@pytest_asyncio.fixture
async def client(aiohttp_client, state):
    return SignedClient(await aiohttp_client(create_app(state, keys=session_keys().jwks)))


async def call(client, tool: str, args: dict[str, Any] | None = None, *, key: str | None = None,
               token: int | None = None, tenant: str | None = "acme", **kw: Any):
    headers = {"X-Call-Id": f"call-{tool}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if token is not None:
        headers["X-Fencing-Token"] = str(token)
    if tenant is not None:
        headers["X-Toolproxy-Tenant"] = tenant
    return await client.post(f"/tools/{tool}", json=GOOD_ARGS[tool] if args is None else args,
                             headers=headers, **kw)


async def set_fault(client, tool: str, mode: str, **kw: Any) -> None:
    resp = await client.post("/_control/faults", json={"tool": tool, "mode": mode, **kw})
    assert resp.status == 200, await resp.text()


# --------------------------------------------------------------------------- registry


# --------------------------------------------------------------------------- tools


@pytest.mark.asyncio
async def test_every_tool_answers_with_a_result_matching_its_output_schema(client, state):
    for name in CONTRACTS:
        resp = await call(client, name, key=f"k-{name}")
        assert resp.status == 200, (name, await resp.text())
        assert output_errors(name, await resp.json()) == [], name
    writes = [n for n in CONTRACTS if TOOLS[n].writes]
    assert state.effect_counts() == {n: 1 for n in writes}
    assert {iv.tool for iv in state.intervals} == set(CONTRACTS)
    assert all(iv.end >= iv.start for iv in state.intervals)


@pytest.mark.asyncio
async def test_a_cancelled_report_applies_nothing_and_says_so(client, state):
    running = asyncio.ensure_future(call(client, "generate_report", {"title": "long", "duration_ms": 5000},
                                         key="rep-1"))
    for _ in range(500):  # bounded: the report is pending within a few polls
        if (await (await client.get("/status/generate_report/rep-1")).json())["state"] == "pending":
            break
        await asyncio.sleep(0.01)
    resp = await client.post("/cancel/generate_report/rep-1")
    assert resp.status == 202 and (await resp.json()) == {"state": "cancelling"}
    answer = await running
    assert answer.status == 409
    assert (await answer.json())["error"] == {"code": "cancelled", "applied": False,
                                              "message": "the report was cancelled before it was written"}
    assert await (await client.get("/status/generate_report/rep-1")).json() == {"state": "cancelled"}
    assert state.effects == [] and state.reports == {}
    resp = await client.post("/cancel/generate_report/rep-1")
    assert resp.status == 200 and (await resp.json()) == {"state": "cancelled"}
    resp = await client.post("/cancel/generate_report/nope")
    assert resp.status == 404
    assert len(state.cancel_requests) == 3


@pytest.mark.asyncio
async def test_a_reservation_is_released_once(client, state):
    resp = await call(client, "release_reservation", key="rel-1")
    assert resp.status == 200 and state.inventory["sku_gizmo"] == {"available": 1, "reserved": 0}
    resp = await call(client, "release_reservation", key="rel-2")
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "already_released"
    assert state.effect_counts() == {"release_reservation": 1}


@pytest.mark.asyncio
async def test_get_order_happy_path(client):
    resp = await call(client, "get_order")
    assert resp.status == 200
    assert await resp.json() == {"order_id": "ord_1001", "tenant": "acme", "status": "partially_refunded",
                                 "total": 10000, "refundable": 8000, "currency": "USD"}


@pytest.mark.asyncio
async def test_orders_of_another_tenant_are_not_found(client):
    resp = await call(client, "get_order", {"order_id": "ord_2001"}, tenant="acme")
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "order_not_found"


@pytest.mark.asyncio
async def test_refund_over_balance_is_refused_with_a_code(client, state):
    resp = await call(client, "refund_order", {"order_id": "ord_1001", "amount": 8001, "reason": "x"}, key="r1")
    assert resp.status == 422
    error = (await resp.json())["error"]
    assert error["code"] == "amount_exceeds_refundable_balance"
    assert error["field"] == "amount"
    assert state.orders["ord_1001"]["refundable"] == 8000
    assert state.effects == []
    status = await (await client.get("/status/refund_order/r1")).json()
    assert status == {"state": "rejected", "error": error}


@pytest.mark.asyncio
async def test_backend_refuses_malformed_arguments(client, state):
    for args in ({"order_id": "ord_1001", "amount": "500", "reason": "x"},
                 {"order_id": "ord_1001", "amount": 5, "reason": "x", "is_admin": True},
                 {"order_id": "ord_1001", "amount": 5}):
        resp = await call(client, "refund_order", args)
        assert resp.status == 422
        assert (await resp.json())["error"]["code"] == "invalid_arguments"
    assert state.effects == []


@pytest.mark.asyncio
async def test_insufficient_inventory_is_409(client, state):
    resp = await call(client, "reserve_inventory", {"sku": "sku_gadget", "quantity": 6, "order_id": "ord_1001"})
    assert resp.status == 409
    assert (await resp.json())["error"]["code"] == "insufficient_inventory"
    assert state.inventory["sku_gadget"] == {"available": 5, "reserved": 0}


# --------------------------------------------------------------------------- idempotency and status


@pytest.mark.asyncio
async def test_idempotent_replay_has_one_effect(client, state):
    first = await call(client, "refund_order", key="idem-1")
    second = await call(client, "refund_order", key="idem-1")
    assert first.status == second.status == 200
    assert await first.json() == await second.json()
    assert second.headers["Idempotent-Replayed"] == "true"
    assert state.effect_counts() == {"refund_order": 1}
    assert state.orders["ord_1001"]["refundable"] == 7500


@pytest.mark.asyncio
async def test_same_key_with_other_arguments_is_refused(client, state):
    await call(client, "refund_order", key="idem-2")
    resp = await call(client, "refund_order", {"order_id": "ord_1001", "amount": 501, "reason": "damaged"},
                      key="idem-2")
    assert resp.status == 422
    assert (await resp.json())["error"]["code"] == "idempotency_key_reused"
    assert state.effect_counts() == {"refund_order": 1}


@pytest.mark.asyncio
async def test_status_endpoint(client):
    resp = await call(client, "refund_order", key="st-1")
    result = await resp.json()
    assert await (await client.get("/status/refund_order/st-1")).json() == {"state": "committed", "result": result}
    assert await (await client.get("/status/refund_order/unknown")).json() == {"state": "not_found"}
    # Keys are per tool.
    assert await (await client.get("/status/send_email/st-1")).json() == {"state": "not_found"}
    assert (await client.get("/status/no_such_tool/st-1")).status == 404


@pytest.mark.asyncio
async def test_status_is_pending_while_a_request_is_held(client, state):
    await set_fault(client, "refund_order", "slow", delay_ms=300, count=1)
    task = asyncio.create_task(call(client, "refund_order", key="st-2"))
    await asyncio.sleep(0.1)
    assert await (await client.get("/status/refund_order/st-2")).json() == {"state": "pending"}
    duplicate = await call(client, "refund_order", key="st-2")
    assert duplicate.status == 409
    assert (await duplicate.json())["error"]["code"] == "idempotency_key_in_progress"
    assert (await task).status == 200
    assert (await (await client.get("/status/refund_order/st-2")).json())["state"] == "committed"
    assert state.effect_counts() == {"refund_order": 1}


# --------------------------------------------------------------------------- fencing


@pytest.mark.asyncio
async def test_stale_fencing_token_is_rejected(client, state):
    assert (await call(client, "refund_order", key="f1", token=7)).status == 200
    resp = await call(client, "refund_order", {"order_id": "ord_1001", "amount": 100, "reason": "x"},
                      key="f2", token=6)
    assert resp.status == 409
    error = (await resp.json())["error"]
    assert error["code"] == "stale_fencing_token"
    assert error["applied"] is False
    assert state.effect_counts() == {"refund_order": 1}
    assert state.fencing == {"order:ord_1001": 7}
    assert await (await client.get("/status/refund_order/f2")).json() == {"state": "not_found"}
    # Same or newer token, or none, is accepted; other resources are independent.
    assert (await call(client, "refund_order", {"order_id": "ord_1001", "amount": 1, "reason": "x"},
                       key="f3", token=7)).status == 200
    assert (await call(client, "refund_order", {"order_id": "ord_1002", "amount": 1, "reason": "x"},
                       key="f4", token=1)).status == 200
    assert (await call(client, "refund_order", {"order_id": "ord_1001", "amount": 1, "reason": "x"},
                       key="f5")).status == 200


@pytest.mark.asyncio
async def test_fencing_is_checked_at_write_time(client, state):
    """A holder whose lock expired mid-operation is refused when it writes."""
    state.counter_delay_ms = 200
    old = asyncio.create_task(call(client, "adjust_counter", {"counter": "ctr_demo", "delta": 1}, token=1))
    await asyncio.sleep(0.05)
    state.counter_delay_ms = 0
    new = await call(client, "adjust_counter", {"counter": "ctr_demo", "delta": 10}, token=2)
    assert new.status == 200
    old_resp = await old
    assert old_resp.status == 409
    assert (await old_resp.json())["error"]["code"] == "stale_fencing_token"
    assert state.counters["ctr_demo"] == 10


@pytest.mark.asyncio
async def test_a_fencing_header_the_token_does_not_carry_is_refused(client, state):
    """The fence is the token's: a header that says anything else (here one the token lacks) is refused."""
    resp = await client.post("/tools/refund_order", json=GOOD_ARGS["refund_order"],
                             headers={"X-Fencing-Token": "-1"})
    assert resp.status == 401
    assert (await resp.json())["error"]["reason"] == "header_mismatch"
    assert state.effects == []


# --------------------------------------------------------------------------- faults


@pytest.mark.asyncio
async def test_fault_slow(client, state):
    await set_fault(client, "get_order", "slow", delay_ms=200, count=1)
    started = time.monotonic()
    assert (await call(client, "get_order")).status == 200
    assert time.monotonic() - started >= 0.2
    started = time.monotonic()
    assert (await call(client, "get_order")).status == 200  # count used up
    assert time.monotonic() - started < 0.2
    assert (await (await client.get("/_control/faults")).json()) == {"faults": []}


@pytest.mark.asyncio
async def test_fault_slow_commits_even_if_the_client_gave_up(client, state):
    """The timeout_unknown case: the caller timed out, the backend still commits."""
    await set_fault(client, "refund_order", "slow", delay_ms=300, count=1)
    with pytest.raises(asyncio.TimeoutError):
        await call(client, "refund_order", key="late-1", timeout=aiohttp.ClientTimeout(total=0.1))
    assert await (await client.get("/status/refund_order/late-1")).json() == {"state": "pending"}
    assert state.effects == []
    await asyncio.sleep(0.35)
    assert (await (await client.get("/status/refund_order/late-1")).json())["state"] == "committed"
    assert state.effect_counts() == {"refund_order": 1}


@pytest.mark.asyncio
async def test_fault_bad_output_applies_the_effect_and_breaks_the_schema(client, state):
    await set_fault(client, "refund_order", "bad_output")
    resp = await call(client, "refund_order", key="bad-1")
    assert resp.status == 200
    body = await resp.json()
    assert body["refund_id"].startswith("rf_")
    assert output_errors("refund_order", body) != []
    assert state.effect_counts() == {"refund_order": 1}
    # Every tool's bad output violates its schema.
    await set_fault(client, "*", "bad_output")
    for name in CONTRACTS:
        resp = await call(client, name, key=f"bad-{name}")
        assert resp.status == 200
        assert output_errors(name, await resp.json()) != [], name


@pytest.mark.asyncio
async def test_fault_http_429_has_retry_after(client, state):
    await set_fault(client, "*", "http_429", count=1)
    resp = await call(client, "refund_order", key="rl-1")
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"]["code"] == "rate_limited"
    assert state.effects == []
    assert await (await client.get("/status/refund_order/rl-1")).json() == {"state": "not_found"}
    assert (await call(client, "refund_order", key="rl-1")).status == 200


@pytest.mark.asyncio
async def test_fault_http_5xx(client, state):
    await set_fault(client, "refund_order", "http_503_not_applied", count=1)
    resp = await call(client, "refund_order", key="5xx-1")
    assert resp.status == 503
    assert (await resp.json())["error"]["applied"] is False
    await set_fault(client, "refund_order", "http_500", count=1)
    resp = await call(client, "refund_order", key="5xx-1")
    assert resp.status == 500
    assert "applied" not in (await resp.json())["error"]
    assert state.effects == []


@pytest.mark.asyncio
async def test_fault_drop_after_commit_applies_the_effect(client, state):
    await set_fault(client, "refund_order", "drop_after_commit", count=1)
    with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                        aiohttp.ClientOSError)):
        resp = await call(client, "refund_order", key="drop-1")
        await resp.read()
    assert state.effect_counts() == {"refund_order": 1}
    status = await (await client.get("/status/refund_order/drop-1")).json()
    assert status["state"] == "committed"
    assert status["result"]["refundable_remaining"] == 7500
    # The retry with the same key replays, no second effect.
    replay = await call(client, "refund_order", key="drop-1")
    assert await replay.json() == status["result"]
    assert state.effect_counts() == {"refund_order": 1}


@pytest.mark.asyncio
async def test_fault_drop_before_commit_applies_nothing(client, state):
    await set_fault(client, "refund_order", "drop_before_commit", count=1)
    with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                        aiohttp.ClientOSError)):
        resp = await call(client, "refund_order", key="drop-2")
        await resp.read()
    assert state.effects == []
    assert await (await client.get("/status/refund_order/drop-2")).json() == {"state": "not_found"}


@pytest.mark.asyncio
async def test_fault_stall_times_out_and_applies_nothing(client, state):
    await set_fault(client, "refund_order", "stall", count=1)
    with pytest.raises(asyncio.TimeoutError):
        await call(client, "refund_order", key="stall-1", timeout=aiohttp.ClientTimeout(total=0.3))
    # The backend notices the disconnect, forgets the key and records the interval.
    for _ in range(50):
        if any(iv.tool == "refund_order" for iv in state.intervals):
            break
        await asyncio.sleep(0.02)
    assert [iv.tool for iv in state.intervals] == ["refund_order"]
    assert state.effects == []
    assert await (await client.get("/status/refund_order/stall-1")).json() == {"state": "not_found"}


@pytest.mark.asyncio
async def test_fault_control_api_validation_and_clear(client, state):
    bad = [{"tool": "nope", "mode": "slow"}, {"tool": "*", "mode": "nope"},
           {"tool": "*", "mode": "slow", "delay_ms": -1}, {"tool": "*", "mode": "slow", "count": 0},
           {"tool": "*", "mode": "crash"}]
    for body in bad:
        assert (await client.post("/_control/faults", json=body)).status == 400, body
    await set_fault(client, "*", "http_500")
    assert (await client.delete("/_control/faults")).status == 200
    assert (await call(client, "get_order")).status == 200


@pytest.mark.asyncio
async def test_control_state_and_reset(client, state):
    await call(client, "refund_order", key="cs-1")
    await call(client, "adjust_counter")
    snap = await (await client.get("/_control/state")).json()
    assert snap["effects_by_tool"] == {"refund_order": 1, "adjust_counter": 1}
    assert snap["counters"]["ctr_demo"] == 3
    assert snap["orders"]["ord_1001"]["refundable"] == 7500
    assert len(snap["intervals"]) == 2
    assert (await client.post("/_control/reset")).status == 200
    assert state.effects == [] and state.intervals == [] and state.counters["ctr_demo"] == 0
    assert state.orders["ord_1001"]["refundable"] == 8000
    assert (await client.get("/healthz")).status == 200


# --------------------------------------------------------------------------- the race the proxy must prevent


@pytest.mark.asyncio
async def test_adjust_counter_loses_updates_without_locks(client, state):
    state.counter_delay_ms = 20
    responses = await asyncio.gather(*(
        call(client, "adjust_counter", {"counter": "ctr_race", "delta": 1}) for _ in range(20)))
    assert all(r.status == 200 for r in responses)
    assert len(state.effects) == 20
    assert state.counters["ctr_race"] < 20  # lost updates: the race exists


@pytest.mark.asyncio
async def test_adjust_counter_serialized_is_exact(client, state):
    for _ in range(5):
        await call(client, "adjust_counter", {"counter": "ctr_race", "delta": 1})
    assert state.counters["ctr_race"] == 5


# --------------------------------------------------------------------------- ways to run it


@pytest.mark.asyncio
async def test_start_demo_backend_helper():
    runner, base_url, state = await start_demo_backend(keys=session_keys().jwks)
    try:
        body = b'{"sku":"sku_widget"}'
        headers = session_keys().headers_for("POST", "/tools/get_inventory", body, {"Content-Type": "application/json"})
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base_url}/tools/get_inventory", data=body, headers=headers) as resp:
                assert resp.status == 200
                assert await resp.json() == {"sku": "sku_widget", "available": 100, "reserved": 0}
        assert [iv.tool for iv in state.intervals] == ["get_inventory"]
    finally:
        await runner.cleanup()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.asyncio
async def test_crash_fault_exits_the_process():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "examples.demo_backend", "--port", str(port), "--allow-crash",
                             "--jwks-file", str(session_keys().jwks_file)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(f"{base_url}/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("demo backend did not start")
            async with session.post(f"{base_url}/_control/faults", json={"tool": "*", "mode": "crash"}) as resp:
                assert resp.status == 200
            with pytest.raises(aiohttp.ClientError):
                body = b'{"order_id":"ord_1001"}'
                async with session.post(f"{base_url}/tools/get_order", data=body,
                                        headers=session_keys().headers_for("POST", "/tools/get_order", body)) as resp:
                    await resp.read()
        assert proc.wait(timeout=5) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
