"""The quota gate the authorize stage runs once a decision allows (``QuotaGate``, proxy/policy/authorize.py), as
the pipeline gives it (``CallQuota``, proxy/pipeline.py): it admits one call against its limits, keeps the
ticket on the call and times the quota stage; its refusal is the call's answer. In-process, against the
admission script's contract played by tests/unit/test_quotas.py's fake."""

from __future__ import annotations

import pytest

from proxy.deadline import Deadline
from proxy.envelope import Timing
from proxy.errors import ProxyError
from proxy.pipeline import CallQuota, CallState
from proxy.policy.authorize import QuotaGate
from proxy.policy.decisions import Decision
from proxy.quotas import NO_TICKET
from proxy.requests import RequestMeta, ToolCallRequest
from proxy.telemetry.tracing import TraceContext
from tests.unit.test_quotas import CALLER, READ, AdmitContract, stage

ALLOW = Decision(allow=True, require_approval=False, reasons=(), risk="low")


def call_state() -> CallState:
    meta = RequestMeta(request_id="req-1", trace=TraceContext("a" * 32, "b" * 16), deadline=Deadline(None))
    return CallState(request=ToolCallRequest(call_id="c1", tool=READ.name, version=None, arguments={}, meta=meta),
                     caller=CALLER, timing=Timing())


async def test_an_admitted_call_keeps_its_ticket_and_the_stage_is_timed():
    redis, state = AdmitContract([1]), call_state()
    gate: QuotaGate = CallQuota(stage(redis), state, READ)
    await gate.admit(ALLOW)
    assert len(redis.admits) == 1
    assert state.quota.slot_limits == ("tenant",) and state.quota.member == redis.admits[0][1][0]
    assert "quota" in state.timing.stages


async def test_a_refusal_is_the_calls_answer_and_leaves_no_ticket():
    redis, state = AdmitContract([0, 1, 250]), call_state()
    with pytest.raises(ProxyError) as refused:
        await CallQuota(stage(redis), state, READ).admit(ALLOW)
    assert refused.value.code == "rate_limited" and refused.value.details["limit"] == "tenant"
    assert state.quota is NO_TICKET and "quota" in state.timing.stages
