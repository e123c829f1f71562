"""Result envelopes without servers: shape, outcome from the side-effect facts, HTTP status (proxy/envelope.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from proxy import envelope
from proxy.errors import CATALOGUE, ProxyError, SideEffect
from proxy.idempotency import outcome_of, replayed_error
from proxy.registry import load_registry
from tests.unit import DEMO_REGISTRY, REPO

SCHEMA = Draft202012Validator(json.loads(Path(REPO / "schemas" / "result-envelope.schema.json").read_text()))


def build(**kwargs):
    return envelope.build(call_id="c1", request_id="req_1", tool="get_order", tool_version="1.0.0", **kwargs)


def test_a_success_carries_its_data_and_matches_the_schema():
    env = build(data={"order_id": "ord_1"}, side_effect=SideEffect(attempted=True, committed=True),
                idempotency_key="ik_" + "0" * 64)
    SCHEMA.validate(env)
    assert env["outcome"] == "succeeded" and env["error"] is None and env["data"] == {"order_id": "ord_1"}
    assert env["side_effect"] == {"attempted": True, "committed": True}
    assert envelope.http_status(env) == 200


@pytest.mark.parametrize("committed, outcome", [(False, "failed"), (None, "unknown"), (True, "failed")])
def test_the_outcome_follows_what_is_known_of_the_side_effect(committed, outcome):
    env = build(data={"leaked": True}, error=ProxyError("timeout_unknown", "t", attempted=True, committed=committed))
    SCHEMA.validate(env)
    assert env["outcome"] == outcome
    assert env["data"] is None  # an error never carries data
    assert env["side_effect"] == {"attempted": True, "committed": committed}


def test_cancelled_is_its_own_outcome():
    assert build(error=ProxyError("cancelled", "c"))["outcome"] == "cancelled"


def test_the_error_member_carries_the_catalogue_facts_and_status():
    env = build(error=ProxyError("forbidden", "no", phase="authorize", details={"reasons": ["x"]}))
    spec = CATALOGUE["forbidden"]
    assert env["error"] == {"code": "forbidden", "category": spec.category, "phase": "authorize",
                            "message": "no", "retryable": spec.retryable, "resolution": spec.resolution,
                            "expose_to_model": spec.expose_to_model, "expose_to_user": spec.expose_to_user,
                            "details": {"reasons": ["x"]}}
    assert envelope.http_status(env) == spec.http_status


def test_a_request_error_has_no_tool_version_and_defaults_its_phase():
    env = envelope.request_error(ProxyError("invalid_request", "bad"), "req_9")
    SCHEMA.validate(env)
    assert env["tool_version"] is None and env["error"]["phase"] == "request"


def test_timing_reports_stages_and_deadline_in_milliseconds():
    timing = envelope.Timing(deadline_ms=500)
    timing.stage("authorize", 0.002)
    timing.stage("authorize", 0.001)
    body = timing.to_json()
    assert body["stages_ms"] == {"authorize": 3.0} and body["deadline_ms"] == 500
    assert body["started_at"].endswith("Z") and body["duration_ms"] >= 0


def test_dumps_falls_back_for_integers_beyond_64_bits():
    assert envelope.dumps({"n": 2 ** 70}) == b'{"n":1180591620717411303424}'
    assert envelope.dumps({"s": "é"}) == '{"s":"é"}'.encode()


def test_the_envelope_value_is_frozen_and_serialised_only_at_the_edge():
    error = ProxyError("timeout_unknown", "t", attempted=True, committed=None, phase="execute")
    env = envelope.Envelope.of(call_id="c1", request_id="req_1", tool="adjust_counter", tool_version="1.0.0",
                               error=error, idempotency_key="ik_" + "1" * 64,
                               extra={"deprecation": {"deprecated_at": "2026-11-01", "sunset": "2027-01-01", "replaced_by": "2.0.0"}})
    assert (env.outcome, env.error_code, env.http_status) == ("unknown", "timeout_unknown",
                                                              CATALOGUE["timeout_unknown"].http_status)
    assert env.side_effect == SideEffect(attempted=True, committed=None)
    with pytest.raises(AttributeError):
        env.outcome = "succeeded"  # type: ignore[misc]
    body = env.as_replayed().to_json()
    SCHEMA.validate(body)
    assert list(body)[-2:] == ["deprecation", "replayed"] and body["replayed"] is True
    assert "replayed" not in env.to_json()  # as_replayed is a new value
    assert body["timing"] == env.to_json()["timing"]  # timing frozen when the envelope was built


# -- the envelope as a value through the record boundary --------------------------------------------------------

REFUND = load_registry([str(DEMO_REGISTRY)]).resolve("refund_order", None)


def stored(env: envelope.Envelope) -> dict:
    """The operation record's outcome, made from the envelope's values by the one function that writes it."""
    return json.loads(json.dumps(outcome_of(data=env.data, error=env.error, side_effect=env.side_effect, tool=REFUND,
                                            call_id=env.call_id, request_id=env.request_id)))


def replay(env: envelope.Envelope, record: dict) -> envelope.Envelope:
    """An envelope rebuilt from the record alone: its data or error (as ``replayed_error`` reads it back) and its
    side-effect facts."""
    error = replayed_error(record) if record["error"] else None
    return envelope.Envelope.of(call_id=env.call_id, request_id=env.request_id, tool=env.tool,
                                tool_version=record["tool_version"], data=record["data"], error=error,
                                side_effect=SideEffect(**record["side_effect"]), idempotency_key=env.idempotency_key,
                                timing=envelope.Timing()).as_replayed()


@pytest.mark.parametrize("kwargs", [
    {"data": {"refund_id": "rf_1", "amount": 100}, "side_effect": SideEffect(attempted=True, committed=True)},
    {"error": ProxyError("business_rejected", "no", phase="execute", attempted=True, committed=False,
                         details={"backend_code": "over_refund"})},
    {"error": ProxyError("timeout_unknown", "t", phase="execute", attempted=True, committed=None)},
], ids=["succeeded", "failed", "unknown"])
def test_an_envelope_survives_the_operation_record_and_comes_back_the_same_marked_replayed(kwargs):
    env = envelope.Envelope.of(call_id="c1", request_id="req_1", tool=REFUND.name, tool_version=REFUND.version,
                               idempotency_key="ik_" + "3" * 64, **kwargs)
    first, again = env.to_json(), replay(env, stored(env)).to_json()
    SCHEMA.validate(first)
    SCHEMA.validate(again)
    assert again.pop("replayed") is True
    assert {k: v for k, v in again.items() if k != "timing"} == {k: v for k, v in first.items() if k != "timing"}


def test_the_json_is_the_values_and_the_values_are_read_without_string_keys():
    env = envelope.Envelope.of(call_id="b", request_id="req_1", tool="get_order", tool_version="1.0.0",
                               error=ProxyError("cancelled", "blocked"), extra={"blocked_by": ["a"]})
    body = env.to_json()
    assert (env.blocked_by, env.deprecation, env.error_code) == (["a"], None, "cancelled")
    assert body["blocked_by"] == ["a"] and body["outcome"] == env.outcome == "cancelled"
    assert body["side_effect"] == env.side_effect.to_json() and body["timing"] == dict(env.timing)
    plain = envelope.Envelope.of(call_id="a", request_id="req_1", tool="get_order", tool_version="1.0.0", data=1)
    assert plain.blocked_by == () and "blocked_by" not in plain.to_json()


def test_a_reconciliation_verdict_is_stored_by_the_same_function_as_a_call():
    from proxy.operations import Record
    from proxy.transactions.reconcile import Verdict
    record = Record(key="ik_" + "4" * 64, state="UNKNOWN", attempt=1, token=1, is_write=True,
                    meta={"call_id": "c9", "request_id": "req_9"}, created_at=0, updated_at=0, retention_s=60)
    error = ProxyError("business_rejected", "no", phase="reconcile")
    verdict = Verdict("FAILED_FINAL", "rejected", {"observed": "rejected"}, SideEffect(True, False), error=error)
    assert verdict.outcome(REFUND, record) == outcome_of(error=error, side_effect=SideEffect(True, False), tool=REFUND,
                                                         call_id="c9", request_id="req_9")
    assert Verdict("WATCH", "pending", {"observed": "pending"}).outcome(REFUND, record) is None
