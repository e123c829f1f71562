"""End to end through the agent JSON API: proxy -> real demo backend over HTTP."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.stack import running_stack

REFUND = {"order_id": "ord_1001", "amount": 100, "reason": "duplicate charge"}


@pytest.fixture
async def stack(proxy_deps):
    async with running_stack(proxy_deps) as s:
        s.auto_key = True  # write tools require a stable operation identity (tests/test_idempotency.py)
        yield s


async def test_get_order_succeeds_with_backend_data(stack):
    status, env = await stack.call("get_order", {"order_id": "ord_1001"})
    assert status == 200
    assert env["outcome"] == "succeeded"
    assert env["data"]["order_id"] == "ord_1001"
    assert env["data"]["refundable"] == stack.backend.orders["ord_1001"]["refundable"]
    assert env["side_effect"] == {"attempted": True, "committed": False}
    assert env["tool_version"] == "1.0.0"


async def test_arguments_as_json_string_are_accepted(stack):
    status, env = await stack.call("get_order", json.dumps({"order_id": "ord_1001"}))
    assert status == 200 and env["outcome"] == "succeeded"


async def test_string_amount_is_a_schema_violation_not_coerced(stack):
    status, env = await stack.call("refund_order", {**REFUND, "amount": "100"})
    assert status == 422
    assert env["error"]["code"] == "schema_violation"
    assert [v["path"] for v in env["error"]["details"]["violations"]] == ["amount"]
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert stack.backend.effect_counts().get("refund_order", 0) == 0


async def test_truncated_json_arguments_are_invalid_json_with_position(stack):
    status, env = await stack.call("refund_order", '{"order_id":')
    assert status == 400
    assert env["error"]["code"] == "invalid_json"
    assert env["error"]["details"]["position"] == 12
    assert env["error"]["resolution"] == "repair_arguments"


@pytest.mark.parametrize("raw", ['{"order_id":"ord_1","order_id":"ord_2"}', '{"amount": NaN}',
                                 '{"order_id":"ord_1"} {}', "{'order_id': 'ord_1'}"])
async def test_lenient_json_is_refused(stack, raw):
    status, env = await stack.call("get_order", raw)
    assert env["error"]["code"] == "invalid_json", raw


@pytest.mark.parametrize("raw", ["[1, 2]", '"ord_1"', "42", "null"])
async def test_non_object_arguments_are_invalid_arguments(stack, raw):
    status, env = await stack.call("get_order", raw)
    assert status == 422
    assert env["error"]["code"] == "invalid_arguments"


async def test_unknown_field_is_rejected_with_its_path(stack):
    status, env = await stack.call("refund_order", {**REFUND, "is_admin": True})
    assert env["error"]["code"] == "schema_violation"
    assert {"path": "is_admin", "keyword": "additionalProperties",
            "message": "unknown field is not allowed"} in env["error"]["details"]["violations"]


async def test_every_violation_is_listed_sorted(stack):
    status, env = await stack.call("refund_order", {"order_id": 7, "amount": 0, "zzz": 1, "aaa": 2})
    paths = [v["path"] for v in env["error"]["details"]["violations"]]
    assert paths == sorted(paths)
    assert {"aaa", "amount", "order_id", "reason", "zzz"} <= set(paths)


async def test_unknown_tool_is_tool_not_found(stack):
    status, env = await stack.call("drop_database", {})
    assert status == 404
    assert env["error"]["code"] == "tool_not_found"
    assert env["error"]["resolution"] == "refresh_tools"


async def test_unknown_version_is_tool_not_found(stack):
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, version="9.9.9")
    assert env["error"]["code"] == "tool_not_found"


async def test_refund_above_balance_is_business_rejected(stack):
    # ord_1003 is fully refunded: a small amount (no approval needed) still exceeds its balance.
    status, env = await stack.call("refund_order", {**REFUND, "order_id": "ord_1003"})
    assert status == 422
    assert env["error"]["code"] == "business_rejected"
    assert env["error"]["details"]["backend_code"] == "amount_exceeds_refundable_balance"
    assert env["error"]["retryable"] is False
    assert env["side_effect"] == {"attempted": True, "committed": False}


async def test_successful_refund_reports_committed_effect(stack):
    before = stack.backend.orders["ord_1001"]["refundable"]
    status, env = await stack.call("refund_order", REFUND)
    assert status == 200, env
    assert env["side_effect"] == {"attempted": True, "committed": True,
                                  "summary": "refund_order 1.0.0 committed on order:ord_1001"}
    assert stack.backend.orders["ord_1001"]["refundable"] == before - 100


async def test_stalled_write_is_timeout_unknown_within_the_deadline(stack):
    await stack.fault("refund_order", "stall")
    started = time.monotonic()
    status, env = await stack.call("refund_order", REFUND, headers={"Request-Timeout": "0.5"})
    elapsed = time.monotonic() - started
    assert env["error"]["code"] == "timeout_unknown"
    assert env["outcome"] == "unknown"
    assert env["error"]["retryable"] is False and env["error"]["resolution"] == "reconcile"
    assert env["side_effect"] == {"attempted": True, "committed": None}
    assert elapsed < 0.5 + 0.25  # the caller's deadline plus a small margin


async def test_absolute_deadline_header_bounds_the_call(stack):
    await stack.fault("refund_order", "stall")
    deadline_ms = int((time.time() + 0.4) * 1000)
    started = time.monotonic()
    status, env = await stack.call("refund_order", REFUND, headers={"X-Request-Deadline": str(deadline_ms)})
    assert env["error"]["code"] == "timeout_unknown"
    assert time.monotonic() - started < 0.4 + 0.25


async def test_stalled_read_is_a_retryable_timeout(stack):
    await stack.fault("get_order", "stall")
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, headers={"Request-Timeout": "0.3"})
    assert env["error"]["code"] == "timeout"
    assert env["error"]["retryable"] is True
    assert env["side_effect"]["committed"] is False


async def test_expired_deadline_is_timeout_not_started(stack):
    status, env = await stack.call("refund_order", REFUND, headers={"Request-Timeout": "0"})
    assert env["error"]["code"] == "timeout_not_started"
    assert env["side_effect"] == {"attempted": False, "committed": False}
    assert env["error"]["resolution"] == "retry_same_key"
    assert stack.backend.effect_counts().get("refund_order", 0) == 0


async def test_drop_after_commit_is_unknown_and_the_effect_happened(stack):
    await stack.fault("refund_order", "drop_after_commit")
    status, env = await stack.call("refund_order", REFUND)
    assert env["error"]["code"] == "timeout_unknown"
    assert env["side_effect"]["committed"] is None
    assert stack.backend.effect_counts()["refund_order"] == 1


async def test_bad_output_shape_is_output_invalid_and_withheld(stack):
    await stack.fault("get_order", "bad_output")
    status, env = await stack.call("get_order", {"order_id": "ord_1001"})
    assert status == 502
    assert env["error"]["code"] == "output_invalid"
    assert env["data"] is None
    assert "violations" in env["error"]["details"]
    assert "message" not in env["error"]["details"]["violations"][0]


async def test_rate_limit_carries_retry_after(stack):
    await stack.fault("get_order", "http_429")
    status, env = await stack.call("get_order", {"order_id": "ord_1001"})
    assert status == 429
    assert env["error"]["code"] == "rate_limited"
    assert env["error"]["details"]["retry_after_s"] == 3


async def test_5xx_on_write_never_claims_not_applied(stack):
    await stack.fault("refund_order", "http_500")
    status, env = await stack.call("refund_order", REFUND)
    assert env["error"]["code"] == "upstream_error_unknown"
    assert env["side_effect"]["committed"] is None
    assert env["outcome"] == "unknown"


async def test_5xx_with_proof_of_nothing_applied_is_retryable(stack):
    await stack.fault("refund_order", "http_503_not_applied")
    status, env = await stack.call("refund_order", REFUND)
    assert env["error"]["code"] == "dependency_unavailable"
    assert env["side_effect"]["committed"] is False
    assert env["error"]["retryable"] is True


async def test_backend_down_is_dependency_unavailable_not_attempted(proxy_deps):
    async with running_stack({**proxy_deps, "backends.services": {"demo": "http://127.0.0.1:9"}}) as stack:
        status, env = await stack.call("refund_order", REFUND, headers={"Idempotency-Key": "k1"})
    assert status == 503
    assert env["error"]["code"] == "dependency_unavailable"
    assert env["side_effect"] == {"attempted": False, "committed": False}


async def test_backend_receives_trusted_headers_and_budget(stack):
    status, env = await stack.call("get_order", {"order_id": "ord_1001"}, call_id="call_hdr",
                                   headers={"Request-Timeout": "2",
                                            "traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    seen = stack.backend.requests[-1]["headers"]
    assert seen["X-Call-Id"] == "call_hdr"
    assert seen["traceparent"].startswith("00-" + "ab" * 16 + "-")
    assert not seen["traceparent"].endswith("cd" * 8 + "-01")  # a child span, not the caller's
    assert 0 < int(seen["X-Request-Timeout-Ms"]) <= 2000
    assert seen["X-Toolproxy-Tenant"] == "acme"


async def test_timed_out_request_leaves_no_open_connection(stack):
    await stack.fault("get_order", "stall")
    await stack.call("get_order", {"order_id": "ord_1001"}, headers={"Request-Timeout": "0.2"})
    connector = stack.runtime.session.connector
    assert connector is not None
    # aiohttp closes (not pools) a connection whose response was abandoned. (The
    # pool also keeps the OPA connection alive: only the backend's count here.)
    backend_port = int(stack.backend_url.rsplit(":", 1)[1])
    assert sum(len(v) for k, v in connector._conns.items() if k.port == backend_port) == 0
