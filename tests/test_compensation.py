"""Compensating committed effects (seed 004 "补偿动作不能伪装成数据库回滚"; docs/transactions.md).

reserve_inventory declares release_reservation as its compensation in the demo registry.
Real proxy, real OPA (policies/compensation.rego), real Redis, real demo backend, real JWTs.
"""

from __future__ import annotations

import asyncio

import pytest
from jsonschema import Draft202012Validator

from proxy.registry import load_schema

from proxy.operations import record_keys
from tests.support.audit import audit_records
from tests.support.records import alter_fields, read_fields

VIEW = Draft202012Validator(load_schema("operation-view.schema.json"), format_checker=Draft202012Validator.FORMAT_CHECKER)


def valid_view(view: dict) -> dict:
    errors = [(list(e.absolute_path), e.message) for e in VIEW.iter_errors(view)]
    assert not errors, f"operation view violates schema: {errors}"
    return view

RESERVE = {"sku": "sku_widget", "quantity": 3, "order_id": "ord_1001"}


@pytest.fixture
def stack(jwt_stack):
    return jwt_stack  # agent alice of acme, real JWTs, no reconciler


async def reserved(stack, header_key: str = "rsv-1") -> dict:
    status, env = await stack.call("reserve_inventory", RESERVE, headers={"Idempotency-Key": header_key})
    assert status == 200 and env["outcome"] == "succeeded", env
    assert stack.backend.inventory["sku_widget"] == {"available": 97, "reserved": 3}
    return env


async def compensate(stack, key: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return await stack.post(f"/v1/operations/{key}:compensate", {}, headers=headers)


def released(stack) -> int:
    return stack.backend.effect_counts().get("release_reservation", 0)


async def test_a_succeeded_operation_is_compensated_and_keeps_its_success(stack, capsys):
    env = await reserved(stack)
    _, before = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert valid_view(before)["reversal"] == "compensable" and before["compensation"] is None
    status, body = await compensate(stack, env["idempotency_key"])
    assert status == 200, body
    assert body["compensation"]["outcome"] == "succeeded" and body["compensation"]["tool"] == "release_reservation"
    assert body["compensation"]["data"]["reservation_id"] == env["data"]["reservation_id"]
    view = valid_view(body["operation"])
    assert view["state"] == "SUCCEEDED" and view["result"] == env["data"]  # the original success stands
    assert view["reversal"] == "compensated"
    assert view["compensation"]["status"] == "succeeded"
    assert view["compensation"]["key"] == body["compensation"]["idempotency_key"] != env["idempotency_key"]
    assert stack.backend.inventory["sku_widget"] == {"available": 100, "reserved": 0}
    _, seen = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert seen["reversal"] == "compensated"
    _, compensating = await stack.get(f"/v1/operations/{view['compensation']['key']}")
    assert compensating["state"] == "SUCCEEDED" and compensating["tool"] == "release_reservation"
    records = [r for r in audit_records(capsys.readouterr().out) if r["kind"] == "compensation"]
    assert [r["details"]["to"] for r in records] == ["requested", "succeeded"]


async def test_the_compensate_request_sent_twice_is_one_effect_at_the_backend(stack):
    env = await reserved(stack)
    (s1, first), (s2, second) = await asyncio.gather(compensate(stack, env["idempotency_key"]),
                                                     compensate(stack, env["idempotency_key"]))
    statuses = sorted([(s1, first["compensation"]["outcome"]), (s2, second["compensation"]["outcome"])])
    # One of them ran it; the other replayed it or found it running (operation_in_progress): never a second one.
    assert (200, "succeeded") in statuses, statuses
    status, third = await compensate(stack, env["idempotency_key"])
    assert status == 200 and third["compensation"]["replayed"] is True
    assert third["operation"]["reversal"] == "compensated"
    assert released(stack) == 1
    assert len([r for r in stack.backend.requests if r["tool"] == "release_reservation"]) == 1
    assert stack.backend.inventory["sku_widget"] == {"available": 100, "reserved": 0}


async def test_a_failed_compensation_keeps_the_partial_state_freezes_and_hands_over(stack, issuers, capsys):
    env = await reserved(stack)
    await stack.fault("release_reservation", "http_503_not_applied", count=1)
    status, body = await compensate(stack, env["idempotency_key"])
    assert status == 503 and body["compensation"]["outcome"] == "failed"
    view = valid_view(body["operation"])
    assert view["state"] == "SUCCEEDED" and view["reversal"] == "compensation_failed"
    assert view["compensation"]["status"] == "failed" and view["compensation"]["takeover"]["reason"] == \
        "compensation_failed"
    assert stack.backend.inventory["sku_widget"] == {"available": 97, "reserved": 3}  # the effect is still there
    # Frozen: no further compensation, even though the backend would work now.
    status, again = await compensate(stack, env["idempotency_key"])
    assert status == 409 and again["error"]["code"] == "operation_frozen"
    assert len([r for r in stack.backend.requests if r["tool"] == "release_reservation"]) == 1
    operator = issuers[1].token("olga", audience="toolproxy-admin", roles=["operator", "cross-tenant"], tenant=None, scope="")
    status, listing = await stack.admin("GET", "/v1/takeovers", operator)
    assert status == 200
    [entry] = [t for t in listing["takeovers"] if t["kind"] == "compensation_failed"]
    assert entry["idempotency_key"] == env["idempotency_key"] and entry["subject"] == "alice"
    assert entry["compensation"]["status"] == "failed" and entry["compensation"]["key"] == view["compensation"]["key"]
    assert entry["last_evidence"]["error_code"] == "dependency_unavailable"
    # A tenant's operators read its own takeover index (kept beside the fleet's): acme's sees it, globex's not.
    for tenant, expected in (("acme", [env["idempotency_key"]]), ("globex", [])):
        scoped = issuers[1].token("olga", audience="toolproxy-admin", roles=["operator"], tenant=tenant, scope="")
        status, listing = await stack.admin("GET", "/v1/takeovers", scoped)
        assert status == 200 and [t["idempotency_key"] for t in listing["takeovers"]
                                  if t["kind"] == "compensation_failed"] == expected
    kinds = [r["kind"] for r in audit_records(capsys.readouterr().out)]
    assert "takeover" in kinds
    assert stack.runtime.metrics.registry.get_sample_value("toolproxy_compensations_total",
                                                           {"result": "failed"}) == 1


async def test_refusals_outside_the_window_from_a_disallowed_state_or_without_a_declaration(stack):
    env = await reserved(stack)
    record = record_keys("toolproxy", env["idempotency_key"])[0]
    settled = int((await read_fields(stack.redis, record))["updated_at"])
    await alter_fields(stack.redis, record, updated_at=settled - 3601 * 1000)  # settled more than window_s ago
    status, body = await compensate(stack, env["idempotency_key"])
    assert status == 409 and body["error"]["code"] == "compensation_window_closed"
    _, view = await stack.get(f"/v1/operations/{env['idempotency_key']}")
    assert view["reversal"] == "cannot_be_compensated"
    # A rejected reservation (FAILED_FINAL) may not start a compensation.
    _, rejected = await stack.call("reserve_inventory", {**RESERVE, "quantity": 1000},
                                   headers={"Idempotency-Key": "too-many"})
    assert rejected["error"]["code"] == "business_rejected"
    status, body = await compensate(stack, rejected["idempotency_key"])
    assert status == 409 and body["error"]["code"] == "compensation_state_not_allowed"
    assert body["error"]["details"]["allowed_states"] == ["SUCCEEDED"]
    # A contract without a compensation: its effect cannot be undone by the proxy.
    _, refund = await stack.call("refund_order", {"order_id": "ord_1001", "amount": 10, "reason": "x"},
                                 headers={"Idempotency-Key": "refund-1"})
    status, body = await compensate(stack, refund["idempotency_key"])
    assert status == 409 and body["error"]["code"] == "not_compensable"
    _, view = await stack.get(f"/v1/operations/{refund['idempotency_key']}")
    assert view["reversal"] == "cannot_be_compensated"
    assert released(stack) == 0


async def test_opa_denies_compensation_to_a_caller_who_may_call_the_original(stack, issuers):
    stocker = issuers[0].token("sam", roles=["stocker"])  # may call reserve_inventory and release_reservation
    status, env = await stack.call("reserve_inventory", RESERVE, headers={"Idempotency-Key": "rsv-sam",
                                                                          "Authorization": f"Bearer {stocker}"})
    assert status == 200 and env["outcome"] == "succeeded"
    status, body = await compensate(stack, env["idempotency_key"], stocker)
    assert status == 403 and body["error"]["code"] == "forbidden"
    _, view = await stack.get(f"/v1/operations/{env['idempotency_key']}",
                              headers={"Authorization": f"Bearer {stocker}"})
    assert view["compensation"] is None and view["reversal"] == "compensable"
    assert released(stack) == 0
    # Another tenant cannot even see it.
    other = issuers[0].token("mallory", tenant="globex")
    status, body = await compensate(stack, env["idempotency_key"], other)
    assert status == 404 and body["error"]["code"] == "operation_not_found"


async def test_a_partially_succeeded_batch_offers_compensation_as_a_next_action(stack):
    status, body = await stack.batch([
        {"call_id": "reserve", "tool": "reserve_inventory", "arguments": RESERVE},
        {"call_id": "too_many", "tool": "reserve_inventory", "arguments": {**RESERVE, "sku": "sku_gadget",
                                                                          "quantity": 1000}}],
        headers={"Idempotency-Key": "batch-rsv"})
    assert status == 200 and body["status"] == "partially_succeeded"
    [offer] = [a for a in body["next_actions"] if a["resolution"] == "compensate"]
    reserve = body["results"][0]
    assert offer["call_id"] == "reserve" and offer["code"] == "compensation_available"
    assert offer["compensate"] == f"/v1/operations/{reserve['idempotency_key']}:compensate"
    status, done = await stack.post(offer["compensate"], {})
    assert status == 200 and done["operation"]["reversal"] == "compensated"


# -- check-registry: the declaration must fit both contracts -----------------------------------

PAIR = """
tools:
  - name: book_slot
    version: "1.0.0"
    description: Book a slot.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [room, count]
      properties:
        room: {{type: string}}
        count: {{type: integer}}
        note: {{type: string}}
    outputSchema:
      type: object
      required: [booking_id]
      properties:
        booking_id: {{type: string}}
        hint: {{type: string}}
    backend: {{type: http, url: "http://127.0.0.1:1/book"}}
    compensation:
      tool: cancel_booking
      version: "1.0.0"
      arguments: {mapping}
  - name: cancel_booking
    version: "1.0.0"
    description: Cancel a booking.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [booking_id, room]
      properties:
        booking_id: {{type: string}}
        room: {{type: string}}
        reason: {{enum: [compensation, customer]}}
    backend: {{type: http, url: "http://127.0.0.1:1/cancel"}}
"""


@pytest.mark.parametrize("mapping, problem", [
    ('{booking_id: /result/booking_id, room: /arguments/room, reason: {value: compensation}}', None),
    ('{booking_id: /result/hint, room: /arguments/room}', "may be absent"),
    ('{booking_id: /result/booking_id, room: /arguments/count}', "the compensating argument wants ['string']"),
    ('{booking_id: /result/booking_id}', "required argument 'room'"),
    ('{booking_id: /result/booking_id, room: /arguments/nope}', "is not declared"),
    ('{booking_id: /result/booking_id, room: /arguments/room, reason: {value: other}}', "constant does not match"),
    ('{booking_id: /result/booking_id, room: /arguments/room, reason: /arguments/room}', "outside the compensating"),
    ('{booking_id: /result/booking_id, room: /arguments/room, extra: /arguments/room}', "not a property"),
])
def test_check_registry_checks_a_compensation_against_both_contracts(tmp_path, capsys, mapping, problem):
    from proxy.cli import main as cli_main
    path = tmp_path / "pair.yaml"
    path.write_text(PAIR.format(mapping=mapping))
    code = cli_main(["check-registry", "--dev", str(path)])
    out, err = capsys.readouterr()
    if problem is None:
        assert code == 0 and "ok book_slot 1.0.0 (write, write, compensated by cancel_booking@1.0.0)" in out
    else:
        assert code == 1 and problem in err and "compensation" in err, err
