"""Result envelopes without servers: shape, outcome from the side-effect facts, HTTP status (proxy/envelope.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from proxy import envelope
from proxy.errors import CATALOGUE, ProxyError, SideEffect
from tests.unit import REPO

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
