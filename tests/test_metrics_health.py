"""Ops listener: /metrics after a scripted scenario, /healthz, /readyz and dependency health."""

from __future__ import annotations

import pytest

from tests.support.metrics import counter_deltas, sample, samples, scrape_text
from tests.support.stack import running_stack
from tests.support.modes import all_redis_modes

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}


async def test_scenario_increments_exactly_the_expected_counters(redis_url, opa_server):
    async with running_stack({"redis.url": redis_url, **opa_server.settings,
                              "reconcile.enabled": False, "reconcile.backoff_initial_ms": 0}) as stack:
        before = samples(await scrape_text(stack))
        assert before[sample("toolproxy_open_unknowns")] == 0

        assert (await stack.call("get_order", {"order_id": "ord_1001"}))[0] == 200
        assert (await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "k1"}))[0] == 200
        assert (await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "k1"}))[1]["replayed"] is True
        assert (await stack.call("refund_order", {**REFUND, "amount": "100"}))[1]["error"]["code"] == \
            "schema_violation"
        await stack.fault("refund_order", "drop_after_commit", count=1)
        status, unknown = await stack.call("refund_order", REFUND, call_id="call_unknown",
                                           headers={"Idempotency-Key": "k2"})
        assert unknown["error"]["code"] == "timeout_unknown"
        status, denied = await stack.call("get_order", {"order_id": "ord_2001"})  # another tenant's order
        assert denied["error"]["code"] == "forbidden"

        after = samples(await scrape_text(stack))
        calls = "toolproxy_calls_total"
        stages = "toolproxy_stage_duration_seconds_count"
        durations = "toolproxy_call_duration_seconds_count"
        assert counter_deltas(before, after) == {
            sample(calls, tool="get_order", outcome="succeeded", code="none"): 1,
            sample(calls, tool="refund_order", outcome="succeeded", code="none"): 2,  # new + replayed
            sample(calls, tool="refund_order", outcome="failed", code="schema_violation"): 1,
            sample(calls, tool="refund_order", outcome="unknown", code="timeout_unknown"): 1,
            sample(calls, tool="get_order", outcome="failed", code="forbidden"): 1,
            sample("toolproxy_unknown_outcomes_total", tool="refund_order"): 1,
            # every call that resolved a contract, by version and status (the schema violation did too)
            sample("toolproxy_tool_version_calls_total", tool="get_order", version="1.0.0", status="active"): 2,
            sample("toolproxy_tool_version_calls_total", tool="refund_order", version="1.0.0", status="active"): 4,
            sample("toolproxy_policy_decisions_total", result="allow"): 4,
            sample("toolproxy_policy_decisions_total", result="deny"): 1,
            sample("toolproxy_policy_denials_total", tool="get_order", reason="resource_not_owned"): 1,
            sample("toolproxy_opa_request_duration_seconds_count"): 5,
            sample("toolproxy_idempotency_results_total", result="new"): 2,
            sample("toolproxy_idempotency_results_total", result="replayed"): 1,
            sample(durations, tool="get_order", outcome="succeeded"): 1,
            sample(durations, tool="get_order", outcome="failed"): 1,
            sample(durations, tool="refund_order", outcome="succeeded"): 2,
            sample(durations, tool="refund_order", outcome="failed"): 1,
            sample(durations, tool="refund_order", outcome="unknown"): 1,
            sample(stages, stage="resolve"): 6,
            sample(stages, stage="decode"): 6,
            sample(stages, stage="normalize"): 5,
            sample(stages, stage="idempotency"): 5,
            sample(stages, stage="authorize"): 5,
            sample(stages, stage="quota"): 4,     # every allowed decision passes the quota stage
            sample(stages, stage="lock"): 3,  # after the replay's stop; get_order locks nothing
            sample("toolproxy_lock_wait_seconds_count", mode="exclusive"): 2,  # the two refunds' order locks
            sample(stages, stage="audit"): 3,     # the replay stops before it
            sample(stages, stage="execute"): 3,
            sample(stages, stage="verify"): 2,
            sample(stages, stage="commit"): 6,
        }
        assert after[sample("toolproxy_open_unknowns")] == 1
        assert after[sample("toolproxy_oldest_open_unknown_age_seconds")] >= 0
        assert after[sample("toolproxy_dependency_up", dependency="redis")] == 1
        assert after[sample("toolproxy_dependency_up", dependency="opa")] == 1

        # The reconciler resolves the operation (the status endpoint says committed): the gauge comes down.
        await stack.runtime.reconciler.scan_once()
        final = samples(await scrape_text(stack))
        assert final[sample("toolproxy_open_unknowns")] == 0
        assert counter_deltas(after, final) == {
            sample("toolproxy_reconciliations_total", result="succeeded"): 1}


async def test_open_unknowns_survive_a_restart(redis_url, proxy_deps):
    async with running_stack({**proxy_deps, "reconcile.enabled": False}) as stack:
        # A write without an operation record (no key, not required): the call-level index counts it.
        # (Operations with a record: tests/test_idempotency.py.)
        await stack.fault("adjust_counter", "drop_after_commit")
        await stack.call("adjust_counter", {"counter": "ctr_demo", "delta": 1})
        assert samples(await scrape_text(stack))[sample("toolproxy_open_unknowns")] == 1
    async with running_stack(proxy_deps) as fresh:  # a new process: new, empty Metrics
        values = samples(await scrape_text(fresh))
        assert values[sample("toolproxy_open_unknowns")] == 1
        assert values[sample("toolproxy_oldest_open_unknown_age_seconds")] > 0


async def test_labels_never_carry_tenant_subject_or_ids(redis_url):
    async with running_stack({"redis.url": redis_url, "identity.static_tenant": "tenant-zeta",
                              "identity.static_subject": "subject-omega"}) as stack:
        await stack.call("get_order", {"order_id": "ord_1001"}, call_id="call-lbl")
        await stack.call("no_such_tool_xyz", {})
        text = await scrape_text(stack)
    for forbidden in ("tenant-zeta", "subject-omega", "ord_1001", "call-lbl", "no_such_tool_xyz"):
        assert forbidden not in text
    assert 'tool="unknown"' in text


async def test_stage_buckets_resolve_sub_millisecond_overhead(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        await stack.call("get_order", {"order_id": "ord_1001"})
        values = samples(await scrape_text(stack))
    decode_fast = values[sample("toolproxy_stage_duration_seconds_bucket", stage="decode", le="0.001")]
    assert decode_fast == 1  # decoding one small call takes well under a millisecond
    assert sample("toolproxy_stage_duration_seconds_bucket", stage="decode", le="5e-05") in values


async def test_healthz_is_alive_even_when_dependencies_are_down():
    async with running_stack({"redis.url": "redis://127.0.0.1:9/0", "opa.url": "http://127.0.0.1:9"}) as stack:
        async with stack.session.get(stack.ops_url + "/healthz") as response:
            assert response.status == 200 and (await response.json())["status"] == "ok"
        async with stack.session.get(stack.ops_url + "/readyz") as response:
            body = await response.json()
        assert response.status == 503
        assert body == {"status": "not_ready", "checks": {"opa": False, "redis": False, "redis_policy": False,
                                                      "registry": True}}
        values = samples(await scrape_text(stack))
        assert values[sample("toolproxy_dependency_up", dependency="opa")] == 0
        assert values[sample("toolproxy_dependency_up", dependency="redis")] == 0


@all_redis_modes
async def test_readyz_with_real_opa_and_redis(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        async with stack.session.get(stack.ops_url + "/readyz") as response:
            body = await response.json()
        assert response.status == 200, body
        assert body == {"status": "ready", "checks": {"opa": True, "redis": True, "redis_policy": True,
                                                  "registry": True}}


async def test_readyz_notices_redis_going_away(redis_server, opa_server):
    if not redis_server.running:
        redis_server.start()
    async with running_stack({"redis.url": redis_server.url, **opa_server.settings}) as stack:
        health = stack.runtime.health
        assert (await health.readiness()).ready
        redis_server.stop()
        try:
            readiness = await health.readiness(use_cache=False)
            assert not readiness.ready and readiness.checks["redis"] is False
            assert stack.runtime.metrics.registry.get_sample_value(
                "toolproxy_dependency_up", {"dependency": "redis"}) == 0
        finally:
            redis_server.start()


async def test_openmetrics_is_served_when_asked(redis_url):
    async with running_stack({"redis.url": redis_url}) as stack:
        async with stack.session.get(stack.ops_url + "/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as r:
            text = await r.text()
    assert r.headers["Content-Type"].startswith("application/openmetrics-text")
    assert text.rstrip().endswith("# EOF")


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz"])
async def test_ops_endpoints_are_not_on_the_agent_listener(path):
    async with running_stack() as stack:
        async with stack.session.get(stack.proxy_url + path) as response:
            assert response.status == 404


async def test_pending_approvals_gauge_is_read_at_scrape_time(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        status, env = await stack.call("delete_customer", {"customer_id": "cus_1002"},
                                       headers={"Idempotency-Key": "del-1"})
        assert env["error"]["code"] == "approval_required"
        assert samples(await scrape_text(stack))[sample("toolproxy_pending_approvals")] == 1
    async with running_stack(proxy_deps) as fresh:  # a restarted proxy: no approval event since
        assert samples(await scrape_text(fresh))[sample("toolproxy_pending_approvals")] == 1


async def test_requests_refused_before_a_call_are_counted_by_code(proxy_deps):
    async with running_stack({**proxy_deps, "listen.max_body_bytes": 4096}) as stack:
        before = samples(await scrape_text(stack))
        await stack.post("/v1/tool-calls", None, raw=b'{"call_id": ')
        await stack.post("/v1/tool-calls", {"call_id": "c1", "tool": "get_order"})
        await stack.call("get_order", {"order_id": "ord_" + "x" * 8000})
        async with stack.session.get(stack.proxy_url + "/v9/nothing") as response:
            assert response.status == 404
        async with stack.session.get(stack.admin_url + "/v1/approvals") as response:
            assert response.status == 401  # no approver token
        after = samples(await scrape_text(stack))
    errors = "toolproxy_request_errors_total"
    assert counter_deltas(before, after) == {
        sample(errors, code="invalid_json"): 1, sample(errors, code="invalid_request"): 1,
        sample(errors, code="payload_too_large"): 1, sample(errors, code="route_not_found"): 1,
        sample(errors, code="unauthorized"): 1}
