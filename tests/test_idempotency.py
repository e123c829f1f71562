"""Idempotency stage end to end: proxy -> real Redis -> real demo backend that counts its effects.

The background reconciler is off here (``reconcile.enabled: false``); tests
that need reconciliation call ``scan_once()`` so every step is deterministic.
"""

from __future__ import annotations

from typing import Any

import asyncio
import time

import pytest

from proxy.idempotency import derive_key
from tests.support.metrics import sample, samples, scrape_text
from tests.support.stack import running_stack
from tests.support.waits import wait_until as wait_for
from tests.support.modes import all_redis_modes
from tests.support.audit import fingerprinted

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}
KEY = {"Idempotency-Key": "refund-ord_1001-1"}


def settings(deps, **extra):
    """Real OPA and Redis (``proxy_deps``), the background reconciler off."""
    return {**deps, "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0, **extra}


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack(settings(proxy_deps)) as s:
        s.auto_key = False  # this file says which identity each call carries
        yield s


async def open_unknowns(stack) -> float:
    """The gauge as Prometheus scrapes it (read from Redis at scrape time)."""
    return samples(await scrape_text(stack))[sample("toolproxy_open_unknowns")]


def refunds(stack) -> int:
    return stack.backend.effect_counts().get("refund_order", 0)


# -- key derivation --------------------------------------------------------------


# -- the state machine through the API ---------------------------------------------

async def test_write_without_stable_identity_is_refused_before_anything_is_sent(stack):
    stack.auto_key = False  # this call carries no key
    status, env = await stack.call("refund_order", REFUND)
    assert status == 428
    assert env["error"]["code"] == "idempotency_key_required"
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert stack.backend.requests == []


async def test_missing_identity_is_refused_before_an_approval_is_created(stack):
    stack.auto_key = False  # the first call carries no key
    status, env = await stack.call("refund_order", {**REFUND, "amount": 6000})  # needs an approval
    assert status == 428 and env["error"]["code"] == "idempotency_key_required"
    assert stack.runtime.metrics.registry.get_sample_value("toolproxy_approvals_total", {"state": "created"}) \
        in (None, 0.0)
    status, env = await stack.call("refund_order", {**REFUND, "amount": 6000}, headers=KEY)
    assert env["error"]["code"] == "approval_required"
    status, _ = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert status == 404  # no record is created for a call that is not authorized (yet)


@all_redis_modes
async def test_duplicate_of_a_success_is_replayed_without_calling_the_backend(stack):
    status, first = await stack.call("refund_order", REFUND, headers=KEY, call_id="call_a")
    assert status == 200 and first["outcome"] == "succeeded"
    key = first["idempotency_key"]
    assert stack.backend.requests[-1]["headers"]["Idempotency-Key"] == key  # backend can deduplicate too
    async with stack.session.post(stack.proxy_url + "/v1/tool-calls", headers=KEY,
                                  json={"call_id": "call_b", "tool": "refund_order", "arguments": REFUND}) as resp:
        again = await resp.json()
        assert resp.status == 200
        assert resp.headers["Idempotent-Replayed"] == "true"
    assert again["replayed"] is True
    assert again["data"] == first["data"] and again["call_id"] == "call_b"
    assert again["side_effect"] == first["side_effect"] and again["side_effect"]["committed"] is True
    assert refunds(stack) == 1 and len(stack.backend.requests) == 1
    assert "replayed" not in first


async def test_key_order_and_call_id_do_not_change_the_operation(stack):
    await stack.call("refund_order", REFUND, headers=KEY, call_id="c1")
    reordered = '{"reason":"duplicate charge","amount":100,"order_id":"ord_1001"}'
    status, env = await stack.call("refund_order", reordered, headers=KEY, call_id="c2")
    assert env.get("replayed") is True and refunds(stack) == 1


@all_redis_modes
async def test_same_key_with_other_arguments_is_a_conflict_and_runs_nothing(stack):
    await stack.call("refund_order", REFUND, headers=KEY)
    status, env = await stack.call("refund_order", {**REFUND, "amount": 200}, headers=KEY)
    assert status == 422
    assert env["error"]["code"] == "idempotency_conflict"
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert refunds(stack) == 1 and len(stack.backend.requests) == 1


async def test_run_id_deduplicates_identical_calls_and_keeps_different_ones_apart(stack):
    run = {"X-Run-Id": "run_42.turn_1"}
    _, a = await stack.call("refund_order", REFUND, headers=run)
    _, b = await stack.call("refund_order", REFUND, headers=run)
    _, c = await stack.call("refund_order", {**REFUND, "amount": 50}, headers=run)
    assert b["replayed"] is True and b["data"] == a["data"]
    assert c["outcome"] == "succeeded" and c["idempotency_key"] != a["idempotency_key"]
    assert refunds(stack) == 2


async def test_tenants_using_the_same_header_do_not_collide(proxy_deps):
    async with running_stack(settings(proxy_deps)) as acme, \
            running_stack(settings(proxy_deps, **{"identity.static_tenant": "globex"})) as globex:
        reserve = {"sku": "sku_widget", "quantity": 1}
        _, a = await acme.call("reserve_inventory", {**reserve, "order_id": "ord_1001"}, headers=KEY)
        _, g = await globex.call("reserve_inventory", {**reserve, "order_id": "ord_2001"}, headers=KEY)
        assert a["outcome"] == "succeeded" and g["outcome"] == "succeeded"
        assert a["idempotency_key"] != g["idempotency_key"]
        # Own tenant only: globex cannot see acme's operation.
        status, body = await globex.get(f"/v1/operations/{a['idempotency_key']}")
        assert status == 404 and body["error"]["code"] == "operation_not_found"
        status, body = await acme.get(f"/v1/operations/{a['idempotency_key']}")
        assert status == 200 and body["state"] == "SUCCEEDED" and body["result"] == a["data"]


@all_redis_modes
async def test_a_running_duplicate_is_in_progress_or_waited_for(stack):
    await stack.fault("refund_order", "slow", delay_ms=400, count=1)
    first = asyncio.create_task(stack.call("refund_order", REFUND, headers=KEY))
    await wait_for(lambda: stack.backend.requests, what="the first call to reach the backend")
    status, busy = await stack.call("refund_order", REFUND, headers=KEY)
    assert status == 409
    assert busy["error"]["code"] == "operation_in_progress"
    assert busy["error"]["retryable"] is True and busy["error"]["resolution"] == "poll"
    status, waited = await stack.call("refund_order", REFUND, headers={**KEY, "Prefer": "wait=5"})
    _, original = await first
    assert status == 200 and waited["replayed"] is True
    assert waited["data"] == original["data"]
    assert refunds(stack) == 1 and len(stack.backend.requests) == 1


async def test_not_applied_failure_may_run_again_with_the_same_key(stack):
    await stack.fault("refund_order", "http_503_not_applied", count=1)
    status, env = await stack.call("refund_order", REFUND, headers=KEY)
    assert env["error"]["code"] == "dependency_unavailable" and env["side_effect"]["committed"] is False
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "FAILED_RETRYABLE" and record["attempt"] == 1
    status, env = await stack.call("refund_order", REFUND, headers=KEY)
    assert status == 200 and "replayed" not in env
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "SUCCEEDED" and record["attempt"] == 2
    assert refunds(stack) == 1


async def test_retry_budget_exhausted_is_final(proxy_deps):
    async with running_stack(settings(proxy_deps, **{"idempotency.max_attempts": 2})) as stack:
        await stack.fault("refund_order", "http_503_not_applied")
        for _ in range(2):
            _, env = await stack.call("refund_order", REFUND, headers=KEY)
            assert env["error"]["code"] == "dependency_unavailable"
        status, env = await stack.call("refund_order", REFUND, headers=KEY)
        assert status == 409 and env["error"]["code"] == "operation_failed"
        assert len(stack.backend.requests) == 2
        _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
        assert record["state"] == "FAILED_FINAL"


async def test_definite_business_refusal_is_replayed_not_retried(stack):
    too_much = {**REFUND, "order_id": "ord_1003"}  # fully refunded already: the backend refuses
    status, first = await stack.call("refund_order", too_much, headers=KEY)
    assert status == 422 and first["error"]["code"] == "business_rejected"
    status, again = await stack.call("refund_order", too_much, headers=KEY)
    assert status == 422 and again["replayed"] is True
    assert again["error"]["code"] == "business_rejected"
    assert again["error"]["details"]["backend_code"] == "amount_exceeds_refundable_balance"
    assert len(stack.backend.requests) == 1


async def test_nothing_sent_releases_the_key(stack):
    status, env = await stack.call("refund_order", REFUND, headers={**KEY, "Request-Timeout": "0"})
    assert env["error"]["code"] == "timeout_not_started"
    status, body = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert status == 404  # back to ABSENT: no half-written record
    status, env = await stack.call("refund_order", REFUND, headers=KEY)
    assert status == 200 and refunds(stack) == 1


async def test_reads_run_without_a_record(stack):
    _, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers=KEY)
    assert env["outcome"] == "succeeded" and env["idempotency_key"] is None
    assert await stack.redis.keys("toolproxy:op:*") == []


# -- unknown outcomes and reconciliation ----------------------------------------------

@all_redis_modes
async def test_commit_then_drop_is_unknown_then_reconciled_to_the_original_result(stack):
    await stack.fault("refund_order", "drop_after_commit", count=1)
    status, env = await stack.call("refund_order", REFUND, headers=KEY)
    assert env["error"]["code"] == "timeout_unknown" and env["outcome"] == "unknown"
    key = env["idempotency_key"]
    metrics = stack.runtime.metrics
    assert metrics.unknown_outcomes.labels("refund_order")._value.get() == 1

    # Before reconciliation: never re-executed, the caller is told to reconcile.
    status, again = await stack.call("refund_order", REFUND, headers=KEY)
    assert status == 409 and again["error"]["code"] == "operation_unknown"
    assert again["error"]["resolution"] == "reconcile" and again["outcome"] == "unknown"
    assert metrics.unknown_outcomes.labels("refund_order")._value.get() == 1  # not a new unknown
    _, record = await stack.get(f"/v1/operations/{key}")
    assert record["state"] == "UNKNOWN" and record["reconciliation"]["attempts"] == 0

    await stack.runtime.reconciler.scan_once()
    _, record = await stack.get(f"/v1/operations/{key}")
    assert record["state"] == "SUCCEEDED"
    assert record["evidence"]["source"] == "status_endpoint" and record["evidence"]["observed"] == "committed"
    original = stack.backend.effects[0]
    status, replay = await stack.call("refund_order", REFUND, headers=KEY)
    assert status == 200 and replay["replayed"] is True
    assert replay["data"]["refund_id"].startswith("rf_") and replay["data"]["amount"] == original["args"]["amount"]
    assert replay["data"] == record["result"]
    assert refunds(stack) == 1
    assert metrics.reconciliations.labels("succeeded")._value.get() == 1
    assert await open_unknowns(stack) == 0


@all_redis_modes
async def test_never_received_is_reconciled_to_retryable_and_runs_once(stack):
    await stack.fault("refund_order", "drop_before_commit", count=1)
    _, env = await stack.call("refund_order", REFUND, headers=KEY)
    assert env["error"]["code"] == "timeout_unknown"
    await stack.runtime.reconciler.scan_once()
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "FAILED_RETRYABLE" and record["evidence"]["observed"] == "not_found"
    status, env = await stack.call("refund_order", REFUND, headers=KEY)
    assert status == 200 and "replayed" not in env
    assert refunds(stack) == 1


async def test_pending_is_watched_with_backoff_until_committed(proxy_deps):
    async with running_stack(settings(proxy_deps, **{"reconcile.backoff_initial_ms": 1})) as stack:
        await stack.fault("refund_order", "slow", delay_ms=600, count=1)
        _, env = await stack.call("refund_order", REFUND, headers={**KEY, "Request-Timeout": "0.2"})
        assert env["error"]["code"] == "timeout_unknown"
        key = env["idempotency_key"]
        counts = await stack.runtime.reconciler.scan_once()
        assert counts.get("watching") == 1
        _, record = await stack.get(f"/v1/operations/{key}")
        assert record["state"] == "UNKNOWN" and record["evidence"]["observed"] == "pending"
        assert record["reconciliation"]["attempts"] == 1
        await wait_for(lambda: refunds(stack) == 1, what="the slow refund to commit")
        deadline = time.monotonic() + 5
        while record["state"] == "UNKNOWN" and time.monotonic() < deadline:
            await stack.runtime.reconciler.scan_once()
            _, record = await stack.get(f"/v1/operations/{key}")
            await asyncio.sleep(0.005)
        assert record["state"] == "SUCCEEDED" and refunds(stack) == 1


@all_redis_modes
async def test_no_status_endpoint_needs_a_takeover_with_a_complete_record(stack):
    await stack.fault("adjust_counter", "drop_after_commit", count=1)
    _, env = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 5}, headers=KEY,
                              call_id="call_ctr")
    assert env["error"]["code"] == "timeout_unknown"
    key = env["idempotency_key"]
    await stack.runtime.reconciler.scan_once()
    _, record = await stack.get(f"/v1/operations/{key}")
    assert record["state"] == "NEEDS_TAKEOVER"
    takeover = record["takeover"]
    assert takeover["idempotency_key"] == key and takeover["tool"] == "adjust_counter"
    assert takeover["target"]["resources"] == ["counter:ctr_demo"]
    assert takeover["target"]["arguments"] == {"counter": "ctr_demo", "delta": 5}
    assert takeover["last_evidence"]["observed"] == "no_status_endpoint"
    assert takeover["attempts"] == {"executions": 1, "reconciliations": 1}
    assert takeover["original_error"] == "timeout_unknown" and takeover["call_id"] == "call_ctr"
    assert all(takeover[f] for f in ("tenant", "subject", "created_at", "unknown_since", "takeover_at"))
    metrics = stack.runtime.metrics
    assert metrics.takeovers.labels("adjust_counter")._value.get() == 1
    assert await open_unknowns(stack) == 1
    status, again = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 5}, headers=KEY)
    assert again["error"]["code"] == "operation_unknown" and again["error"]["details"]["state"] == "NEEDS_TAKEOVER"
    assert stack.backend.effect_counts()["adjust_counter"] == 1


async def test_window_passing_with_pending_answers_needs_a_takeover(proxy_deps):
    overrides = settings(proxy_deps, **{"reconcile.window_ms": 300, "reconcile.backoff_initial_ms": 1})
    async with running_stack(overrides) as stack:
        await stack.fault("refund_order", "slow", delay_ms=3000, count=1)
        _, env = await stack.call("refund_order", {**REFUND, "reason": "card 4111 1111"},
                                  headers={**KEY, "Request-Timeout": "0.2"})
        key = env["idempotency_key"]
        deadline = time.monotonic() + 5
        record = {"state": "UNKNOWN"}
        while record["state"] == "UNKNOWN" and time.monotonic() < deadline:
            await stack.runtime.reconciler.scan_once()
            _, record = await stack.get(f"/v1/operations/{key}")
            await asyncio.sleep(0.01)
        assert record["state"] == "NEEDS_TAKEOVER"
        takeover = record["takeover"]
        assert takeover["last_evidence"]["observed"] == "pending"
        assert takeover["attempts"]["reconciliations"] >= 2
        assert fingerprinted(takeover["target"]["arguments"]["reason"])  # sensitive_fields
        assert "4111" not in str(record)


@all_redis_modes
async def test_lease_expiry_under_in_progress_is_unknown_on_next_access(stack):
    """A proxy that died mid-call leaves IN_PROGRESS behind; its lease running out means UNKNOWN."""
    op = derive_key(tenant="acme", subject="dev-user", tool="refund_order", tool_version="1.0.0",
                    args_hash=_args_hash(REFUND), idempotency_key=KEY["Idempotency-Key"], run_id=None)
    store = stack.runtime.operations
    started = await store.begin(op.key, fingerprint=op.fingerprint, nonce="dead-proxy", lease_ms=1,
                                retention_s=60, is_write=True, max_attempts=5, meta={"tenant": "acme",
                                "subject": "dev-user", "tool": "refund_order", "tool_version": "1.0.0"},
                                first_check_ms=0, window_ms=60000)
    assert started.status == "new"
    lease_until = (await store.get(op.key)).lease_until
    deadline = time.monotonic() + 2
    while await _redis_now_ms(stack) <= lease_until:  # the 1 ms lease runs out (by Redis time)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    status, env = await stack.call("refund_order", REFUND, headers=KEY)
    assert status == 409 and env["error"]["code"] == "operation_unknown"
    assert stack.runtime.metrics.unknown_outcomes.labels("refund_order")._value.get() == 1
    assert stack.backend.requests == []
    await stack.runtime.reconciler.scan_once()  # the status endpoint never saw it: not_found
    _, record = await stack.get(f"/v1/operations/{op.key}")
    assert record["state"] == "FAILED_RETRYABLE"


async def _redis_now_ms(stack) -> int:
    seconds, micros = await stack.redis.time()
    return seconds * 1000 + micros // 1000


def _args_hash(arguments):
    from proxy.normalize import canonical_json, sha256_hex
    return sha256_hex(canonical_json(arguments))


# -- Redis unavailable -----------------------------------------------------------------

def unreachable(mode: str) -> dict[str, Any]:
    """Settings of a Redis of the mode that nobody answers (free ports)."""
    from tests.support.servers import free_port
    if mode == "sentinel":
        return {"redis.mode": "sentinel", "redis.sentinels": [f"127.0.0.1:{free_port()}" for _ in range(3)],
                "redis.replica_ack_timeout_ms": 100}
    if mode == "cluster":
        return {"redis.mode": "cluster", "redis.cluster_nodes": [f"127.0.0.1:{free_port()}" for _ in range(2)],
                "redis.replica_ack_timeout_ms": 100}
    return {"redis.url": f"redis://127.0.0.1:{free_port()}/0"}


@pytest.mark.parametrize("mode", ["standalone", "sentinel", "cluster"])
async def test_redis_down_fails_writes_closed_and_lets_plain_reads_through(opa_server, mode):
    async with running_stack({**opa_server.settings, **unreachable(mode), "redis.timeout_ms": 200,
                              "reconcile.enabled": False}) as stack:
        async with stack.session.get(stack.ops_url + "/readyz") as response:
            assert response.status == 503 and (await response.json())["checks"]["redis"] is False
        status, env = await stack.call("refund_order", REFUND, headers=KEY)
        assert status == 503 and env["error"]["code"] == "dependency_unavailable"
        assert env["error"]["details"] == {"dependency": "state_store"}
        assert env["side_effect"] == {"attempted": False, "committed": False}
        assert stack.backend.requests == []
        status, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert status == 200
        status, body = await stack.get("/v1/operations/ik_" + "0" * 64)
        assert status == 503 and body["error"]["code"] == "dependency_unavailable"


READ_ONCE = """
tools:
  - name: lookup_order_once
    version: "1.0.0"
    description: A metered read that must not be repeated.
    mode: read
    risk: read
    inputSchema: {type: object, additionalProperties: false, required: [order_id],
                  properties: {order_id: {type: string}}}
    outputSchema: {type: object}
    idempotency: {required: true}
    backend: {type: http, service: demo, path: /tools/get_order}
"""


@pytest.mark.parametrize("policy,expected", [("proceed", 200), ("fail_closed", 503)])
async def test_read_policy_when_redis_is_down(proxy_deps, tmp_path, policy, expected):
    from tests.support.servers import free_port
    from tests.support.stack import DEMO_REGISTRY
    (tmp_path / "read.yaml").write_text(READ_ONCE)
    async with running_stack({**proxy_deps, "redis.url": f"redis://127.0.0.1:{free_port()}/0",
                              "redis.timeout_ms": 200,
                              "reconcile.enabled": False, "idempotency.read_policy": policy,
                              "registry.paths": [str(DEMO_REGISTRY), str(tmp_path / "read.yaml")]}) as stack:
        status, env = await stack.call("lookup_order_once", {"order_id": "ord_1001"}, headers=KEY)
        assert status == expected
        assert len(stack.backend.requests) == (1 if policy == "proceed" else 0)
        assert stack.runtime.metrics.idempotency_results.labels("skipped")._value.get() == \
            (1 if policy == "proceed" else 0)


async def test_record_survives_a_redis_restart_with_aof(proxy_deps, tmp_path):
    from tests.support.servers import RedisServer
    server = RedisServer(data_dir=tmp_path, extra_args=["--appendonly", "yes", "--appendfsync", "always"])
    server.start()
    try:
        async with running_stack(settings({**proxy_deps, "redis.url": server.url})) as stack:
            _, first = await stack.call("refund_order", REFUND, headers=KEY)
            server.stop()
            server.start()
            # The pooled connection died with the server: the first write may fail closed, then the same key works.
            for _ in range(3):
                status, again = await stack.call("refund_order", REFUND, headers=KEY)
                if again["error"] is None or again["error"]["code"] != "dependency_unavailable":
                    break
            assert status == 200 and again["replayed"] is True and again["data"] == first["data"]
            assert refunds(stack) == 1
    finally:
        server.stop()


# -- the store's guarantees ---------------------------------------------------------------

async def test_only_the_current_execution_can_record_and_a_repeated_script_call_is_harmless(stack):
    store = stack.runtime.operations
    key = "ik_" + "a" * 64
    args = dict(fingerprint="fp", lease_ms=60000, retention_s=60, is_write=True, max_attempts=5,
                meta={"tenant": "acme"}, first_check_ms=0, window_ms=60000)
    first = await store.begin(key, nonce="n1", **args)
    repeated = await store.begin(key, nonce="n1", **args)  # the same request after a lost reply
    assert (first.status, first.int(0)) == ("new", 1) and (repeated.status, repeated.int(0)) == ("new", 1)
    other = await store.begin(key, nonce="n2", **args)
    assert other.status == "in_progress"
    stale = await store.commit(key, token=7, target="SUCCEEDED", outcome={"data": 1}, evidence={},
                               first_check_ms=0, window_ms=60000)
    assert stale.status == "stale" and (await store.get(key)).state == "IN_PROGRESS"
    ok = await store.commit(key, token=1, target="SUCCEEDED", outcome={"data": 1}, evidence={},
                            first_check_ms=0, window_ms=60000)
    assert ok.status == "ok"
    record = await store.get(key)
    assert record.state == "SUCCEEDED" and record.lease_until is None
    assert 0 < await stack.redis.pttl(f"toolproxy:op:{{opa}}:{key}") <= 60000


@all_redis_modes
async def test_one_reconciler_per_key(stack):
    store = stack.runtime.operations
    key = "ik_" + "b" * 64
    await store.begin(key, fingerprint="fp", nonce="n", lease_ms=60000, retention_s=60, is_write=True,
                      max_attempts=5, meta={"tenant": "acme"}, first_check_ms=0, window_ms=60000)
    await store.commit(key, token=1, target="UNKNOWN", outcome=None, evidence={}, first_check_ms=0,
                       window_ms=60000)
    assert (await store.open_stats())[0] == 1
    assert (await store.claim(key, owner="replica-a", claim_ms=60000)).status == "claimed"
    assert (await store.claim(key, owner="replica-b", claim_ms=60000)).status == "busy"
    lost = await store.resolve(key, owner="replica-b", verdict="SUCCEEDED", outcome={"data": 1}, evidence={})
    assert lost.status == "lost" and (await store.get(key)).state == "UNKNOWN"
    done = await store.resolve(key, owner="replica-a", verdict="SUCCEEDED", outcome={"data": 1}, evidence={})
    assert done.status == "ok" and (await store.open_stats())[0] == 0


# -- operator resolution ------------------------------------------------------------------

async def test_operator_resolution_bodies_are_checked(stack):
    """The resolve logic at module level; the admin route with real operator tokens: test_operations_admin.py."""
    from proxy.errors import ProxyError
    from proxy.identity import AdminPrincipal
    from proxy.fronts.admin_api import resolve_operation
    await stack.fault("adjust_counter", "drop_after_commit", count=1)
    _, env = await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 5}, headers=KEY)
    await stack.runtime.reconciler.scan_once()
    runtime = stack.runtime
    operator = AdminPrincipal(subject="ops-alice", tenant=None, roles=("operator",), scopes=())

    async def resolve(key, body):
        return await resolve_operation(runtime.operations, runtime.registry, runtime.metrics, runtime.audit,
                                       key, operator, body)

    bad = [{"outcome": "maybe", "evidence": "x"}, {"outcome": "committed", "evidence": ""},
           {"outcome": "committed", "evidence": "x", "extra": 1},
           {"outcome": "not_applied", "evidence": "x", "result": {}},
           {"outcome": "committed", "evidence": "x", "result": {"counter": "ctr_demo"}}]  # breaks outputSchema
    for body in bad:
        with pytest.raises(ProxyError) as refused:
            await resolve(env["idempotency_key"], body)
        assert refused.value.code == "invalid_request", body
    for key in ("ik_" + "f" * 64, "not-a-key"):
        with pytest.raises(ProxyError) as missing:
            await resolve(key, {"outcome": "not_applied", "evidence": "x"})
        assert missing.value.code == "operation_not_found"
    _, record = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert record["state"] == "NEEDS_TAKEOVER"  # nothing changed


async def test_open_unknowns_gauge_comes_from_redis_across_restarts(proxy_deps):
    async with running_stack(settings(proxy_deps)) as stack:
        await stack.fault("adjust_counter", "drop_after_commit", count=1)
        await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1}, headers=KEY)
    async with running_stack(settings(proxy_deps)) as restarted:  # a new process: fresh metrics, same Redis
        values = samples(await scrape_text(restarted))
        assert values[sample("toolproxy_open_unknowns")] == 1
        assert values[sample("toolproxy_oldest_open_unknown_age_seconds")] > 0
        # Counted from the operation record's own index, not from the index of calls without a record.
        assert await restarted.redis.zcard("toolproxy:unknowns:{index}") == 0
