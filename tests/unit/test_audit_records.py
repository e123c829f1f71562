"""Call records without servers: the facts the pipeline hands over (``CallFacts``) and a typed envelope
become one record of schemas/audit-record.schema.json (proxy/audit.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from jsonschema import Draft202012Validator

from proxy.audit import Auditor, CallFacts, PolicyFacts
from proxy.config import Config
from proxy.deadline import Deadline
from proxy.envelope import Envelope, Timing
from proxy.errors import ProxyError, SideEffect
from proxy.identity import Caller
from proxy.telemetry import record_view
from proxy.telemetry.metrics import Metrics
from proxy.normalize import normalize
from proxy.batch.plan import PlannedCall, footprint
from tests.support.audit import fingerprinted
from proxy.registry import load_registry
from proxy.requests import RequestMeta, ToolCallRequest
from proxy.telemetry.tracing import accept_traceparent
from tests.unit import DEMO_REGISTRY, REPO

SCHEMA = Draft202012Validator(json.loads(Path(REPO / "schemas" / "audit-record.schema.json").read_text()))
REGISTRY = load_registry([str(DEMO_REGISTRY)])
REFUND = REGISTRY.resolve("refund_order", None)
CALLER = Caller(subject="alice", tenant="acme", roles=("support",), scopes=(), agent="agent-1", source="static")
ARGUMENTS = {"order_id": "ord_1001", "amount": 500, "reason": "damaged in transit"}


class ListSink:
    name = "list"

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write_now(self, line: str) -> bool:
        return False  # every record through ``write``, as a sink that must wait would

    async def write(self, line: str, *, durable: bool = False) -> None:
        self.records.append(json.loads(line))


def auditor() -> tuple[Auditor, ListSink]:
    sink = ListSink()
    return Auditor(Config().audit, [sink], Metrics()), sink


def request(call_id: str = "c1", tool: str = "refund_order") -> ToolCallRequest:
    meta = RequestMeta(request_id="req_1", trace=accept_traceparent(None), deadline=Deadline(None),
                       approval_id="apr_presented")
    return ToolCallRequest(call_id=call_id, tool=tool, version=None, arguments=ARGUMENTS, meta=meta)


def test_a_final_record_holds_the_facts_handed_over_and_the_envelope_and_matches_the_schema():
    timing = Timing(deadline_ms=2500)
    facts = CallFacts(request=request(), caller=CALLER, started_wall=timing.started_wall, deadline_ms=2500,
                      tool=REFUND, normalized=normalize(REFUND, ARGUMENTS), idempotency_key="ik_" + "2" * 64,
                      fencing_token=7, policy=PolicyFacts("allow", ("support may refund",), "d-1", "rev-1",
                                                           "financial"), attempt=2,
                      backend_request_id=None, result_hash=None)
    error = ProxyError("timeout_unknown", "t", attempted=True, committed=None, phase="execute",
                       details={"backend_request_id": "be-42"})
    env = Envelope.of(call_id="c1", request_id="req_1", tool=REFUND.name, tool_version=REFUND.version,
                      error=error, idempotency_key=facts.idempotency_key, timing=timing)
    audit, sink = auditor()
    assert asyncio.run(audit.call_final(facts, env)) is True
    [record] = sink.records
    SCHEMA.validate(record)
    assert record["kind"] == "tool_call" and record["outcome"] == "unknown" and record["error_code"] == "timeout_unknown"
    assert (record["side_effect_attempted"], record["side_effect_committed"]) == (True, None)  # null is a fact
    assert record["backend_request_id"] == "be-42"  # from the error's details when the adapter named none
    assert record["policy"] == {"result": "allow", "reasons": ["support may refund"], "decision_id": "d-1",
                                "policy_revision": "rev-1", "risk": "financial"}
    assert record["approval_id"] == "apr_presented" and record["attempt"] == 2 and record["fencing_token"] == 7
    assert fingerprinted(record["arguments"]["reason"]) and record["arguments"]["amount"] == 500
    assert record["finished_at"] == env.timing["finished_at"] and record["deadline_at"] > record["started_at"]


def test_a_call_that_failed_before_its_tool_was_known_still_gets_a_valid_record():
    facts = CallFacts(request=request(tool="no_such_tool"), caller=CALLER, started_wall=0.0, deadline_ms=None)
    env = Envelope.of(call_id="c1", request_id="req_1", tool="no_such_tool", tool_version=None,
                      error=ProxyError("tool_not_found", "no", phase="resolve"))
    audit, sink = auditor()
    asyncio.run(audit.call_final(facts, env))
    [record] = sink.records
    SCHEMA.validate(record)
    assert record["tool"] == "no_such_tool" and "policy" not in record and "deadline_at" not in record
    assert record["outcome"] == "failed" and record["side_effect_committed"] is False


def test_a_batch_call_never_started_is_recorded_with_its_blockers():
    call = PlannedCall("b", "get_order", {"order_id": "ord_1001"})
    fp = footprint(REGISTRY, call)
    timing = Timing(deadline_ms=1000)
    env = Envelope.of(call_id="b", request_id="req_1", tool="get_order", tool_version=fp.tool.version,
                      error=ProxyError("cancelled", "Not started.", phase="schedule"), timing=timing,
                      extra={"blocked_by": ["a"]})
    audit, sink = auditor()
    asyncio.run(audit.call_not_started(request("b", "get_order"), CALLER, fp, timing, env))
    [record] = sink.records
    SCHEMA.validate(record)
    assert record["blocked_by"] == ["a"] and record["outcome"] == "cancelled" and record["attempt"] == 0
    assert (record["side_effect_attempted"], record["side_effect_committed"]) == (False, False)


def test_a_writes_intent_and_final_records_keep_its_arguments_alike_from_one_record_view(monkeypatch):
    applied = []
    apply = record_view.apply
    monkeypatch.setattr(record_view, "apply", lambda *a, **k: applied.append(a[0]) or apply(*a, **k))
    timing = Timing(deadline_ms=2500)
    facts = CallFacts(request=request(), caller=CALLER, started_wall=timing.started_wall, deadline_ms=2500,
                      tool=REFUND, normalized=normalize(REFUND, ARGUMENTS), idempotency_key="ik_" + "3" * 64)
    env = Envelope.of(call_id="c1", request_id="req_1", tool=REFUND.name, tool_version=REFUND.version,
                      idempotency_key=facts.idempotency_key, timing=timing)
    audit, sink = auditor()
    asyncio.run(audit.call_intent(REFUND, lambda: facts))  # a write: fail-closed, so it has an intent record
    asyncio.run(audit.call_final(facts, env))
    intent, final = sink.records
    assert (intent["kind"], final["kind"]) == ("tool_call_intent", "tool_call")
    assert intent["arguments"] == final["arguments"] and fingerprinted(final["arguments"]["reason"])
    assert len(applied) == 1  # the record view ran once for the call's two records
    # another call with the same arguments (its own normalized form) gets a record view of its own
    asyncio.run(audit.call_final(dataclasses.replace(facts, normalized=normalize(REFUND, ARGUMENTS)), env))
    assert len(applied) == 2 and sink.records[2]["arguments"] == final["arguments"]
