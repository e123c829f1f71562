"""A contract's approver context without servers: the related read and the fields an approver may read
(proxy/approval_context.py, the registry's checks, redaction.select and the approver's summary)."""

from __future__ import annotations

import copy
import json

import pytest

from proxy.approval_context import approver_copy
from proxy.normalize import normalize
from proxy.policy.approvals import ApprovalOrigin, approver_summary, origin_of
from proxy.registry import RegistryError, load_registry
from proxy.requests import RequestMeta
from proxy.deadline import Deadline
from proxy.idempotency import derive_key
from proxy.telemetry.redaction import redact, select
from proxy.telemetry.tracing import TraceContext
from tests.unit import DEMO_REGISTRY, dump_yaml, load_yaml

DEMO = load_yaml(DEMO_REGISTRY / "demo-tools.yaml")
REFUND = {"order_id": "ord_1003", "amount": 6000, "reason": "duplicate charge"}


KEY = b"k" * 32  # the proxy derives it from its record MAC key (RecordMac.derived_key)

def registry_with(tmp_path, change):
    doc = copy.deepcopy(DEMO)
    change({t["name"]: t for t in doc["tools"]})
    (tmp_path / "tools.yaml").write_text(dump_yaml(doc))
    return load_registry([str(tmp_path)])


def refused(tmp_path, change) -> str:
    with pytest.raises(RegistryError) as info:
        registry_with(tmp_path, change)
    return str(info.value)


def test_the_demo_refund_declares_its_order_and_lets_an_approver_read_the_reason():
    refund = load_registry([DEMO_REGISTRY]).get("refund_order", "1.0.0")
    assert (refund.related_read.tool, refund.related_read.version) == ("get_order", "1.0.0")
    assert refund.related_read.build(REFUND) == {"order_id": "ord_1003"}
    assert refund.approver_may_read == ("reason",)


@pytest.mark.parametrize("change, problem", [
    (lambda t: t["refund_order"]["related_read"].update(tool="adjust_counter"),
     "adjust_counter@1.0.0 is a write, not a read"),
    (lambda t: t["refund_order"]["related_read"].update(tool="fetch_page", arguments={"url": "/arguments/order_id"}),
     "fetch_page@1.0.0 is an external sink"),  # opening the approval would have sent the agent's words out
    (lambda t: t["refund_order"]["related_read"].update(tool="no_such_tool"),
     "no_such_tool@1.0.0 is not another callable contract"),
    (lambda t: t["refund_order"]["related_read"].update(arguments={"order_id": "/arguments/reason"}),
     "/arguments/reason is a sensitive field"),
    (lambda t: t["refund_order"]["related_read"].update(arguments={}),
     "required argument 'order_id' of the related read tool is not mapped"),
    (lambda t: t["refund_order"]["related_read"].update(arguments={"order_id": "/arguments/amount"}),
     "is ['integer'], the related read argument wants ['string']"),
    (lambda t: t["refund_order"]["related_read"].update(arguments={"order_id": "/arguments/nope"}),
     "is not declared"),
    (lambda t: t["refund_order"]["related_read"].update(arguments={"order_id": "/result/order_id"}),
     "$.tools["),  # the schema admits /arguments/... pointers only
    (lambda t: t["refund_order"].update(approver_may_read=["amount"]),
     "'amount' is not one of sensitive_fields"),
    (lambda t: t["refund_order"].update(sensitive_fields=["reason", "api_token"], approver_may_read=["api_token"]),
     "looks like a credential"),
])
def test_a_declaration_that_does_not_fit_is_refused_at_load(tmp_path, change, problem):
    message = refused(tmp_path, change)
    assert problem in message and "refund_order" in message, message


def test_a_constant_argument_of_the_read_is_checked_against_its_schema(tmp_path):
    def bad(tools):
        tools["refund_order"]["related_read"]["arguments"]["order_id"] = {"value": "not an order id"}
    assert "the constant does not match the related read argument's schema" in refused(tmp_path, bad)

    def good(tools):
        tools["refund_order"]["related_read"]["arguments"]["order_id"] = {"value": "ord_1001"}
    read = registry_with(tmp_path, good).get("refund_order", "1.0.0").related_read
    assert read.build(REFUND) == {"order_id": "ord_1001"}


def test_select_keeps_only_the_named_fields_in_their_shape_and_credentials_hashed():
    arguments = {"reason": "dup", "amount": 1, "lines": [{"note": "a", "sku": "x"}, {"sku": "y"}],
                 "meta": {"comment": {"text": "hi", "api_key": "k"}}}
    picked = select(arguments, ["reason", "lines.note", "meta.comment"], "salt", key=KEY)
    assert picked["reason"] == "dup" and picked["lines"] == [{"note": "a"}, {}]
    assert picked["meta"]["comment"]["text"] == "hi"
    assert picked["meta"]["comment"]["api_key"].startswith("[redacted hmac-sha256:")
    assert select(arguments, ["absent"], "salt", key=KEY) == {}
    assert approver_copy(arguments, (), "salt", key=KEY) is None


def test_the_summary_shows_the_read_and_keeps_the_readable_field_apart_from_the_masked_arguments():
    refund = load_registry([DEMO_REGISTRY]).get("refund_order", "1.0.0")
    normalized = normalize(refund, dict(REFUND))
    text, revealed = approver_summary(refund, normalized, "apr_1", 10_000, key=KEY)
    summary = json.loads(text)
    assert summary["arguments"]["reason"].startswith("[redacted hmac-sha256:")
    assert "duplicate charge" not in text
    assert summary["related_read"] == {"tool": "get_order", "version": "1.0.0", "arguments": {"order_id": "ord_1003"}}
    assert json.loads(revealed) == {"reason": "duplicate charge"}
    # what the audit log keeps of the same arguments
    assert redact(normalized.arguments, refund.sensitive_fields, 1000)["reason"] == "[redacted]"


def test_the_readable_field_counts_against_the_summary_bound():
    refund = load_registry([DEMO_REGISTRY]).get("refund_order", "1.0.0")
    normalized = normalize(refund, {**REFUND, "reason": "x" * 200})
    text, revealed = approver_summary(refund, normalized, "apr_1", 10_000, key=KEY)
    bound = len(text.encode()) + len(revealed.encode())
    approver_summary(refund, normalized, "apr_1", bound, key=KEY)
    with pytest.raises(Exception) as info:
        approver_summary(refund, normalized, "apr_1", bound - 1, key=KEY)
    assert getattr(info.value, "code", None) == "approval_summary_too_large"


def meta(**headers) -> RequestMeta:
    return RequestMeta(request_id="req-1", trace=TraceContext("a" * 32, "b" * 16), deadline=Deadline(None), **headers)


def test_the_origin_names_the_agents_own_key_and_where_it_came_from():
    def op(**ids):
        return derive_key(tenant="acme", subject="u", tool="t", tool_version="1.0.0", args_hash="h",
                          idempotency_key=ids.get("idempotency_key"), run_id=ids.get("run_id"))
    keyed = origin_of(meta(idempotency_key="refund-42"), "c1", op(idempotency_key="refund-42"))
    assert keyed == ApprovalOrigin(request_id="req-1", call_id="c1", operation_key=keyed.operation_key,
                                   caller_key="refund-42", caller_key_source="idempotency_key")
    assert keyed.operation_key.startswith("ik_")
    run = origin_of(meta(run_id="run-7"), "c1", op(run_id="run-7"))
    assert (run.caller_key, run.caller_key_source) == ("run-7", "run_id")
    none = origin_of(meta(), {"odd": "call id"}, None)
    assert none.fields() == {"request_id": "req-1"}
