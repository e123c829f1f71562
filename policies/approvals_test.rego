package toolproxy.approvals_test

import data.toolproxy_test.fixtures

refund(amount) := fixtures.call("refund_order", {"order_id": "ord_1", "amount": amount}, ["order:ord_1"])

with_approval(inp, changes) := object.union(inp, {"approval": fixtures.approval(changes)})

test_refund_below_threshold_is_allowed if {
	d := fixtures.decide(refund(5000))
	d.allow
	d.risk == "financial"
}

test_refund_above_threshold_requires_approval if {
	d := fixtures.decide(refund(5001))
	not d.allow
	d.require_approval
	d.reasons == ["amount_over_threshold"]
	d.risk == "financial"
}

test_tenant_threshold_overrides_the_default if {
	inp := refund(100)
	globex := object.union(inp, {
		"subject": object.union(inp.subject, {"tenant": "globex"}),
		"resources": [{"id": "order:ord_9", "kind": "order", "access": "exclusive"}],
	})
	fixtures.decide(globex).require_approval
}

test_financial_tool_without_threshold_always_requires_approval if {
	d := fixtures.decide(fixtures.call("transfer_funds", {"amount": 1}, []))
	d.reasons == ["financial_without_threshold"]
	d.require_approval
}

test_destructive_tool_requires_approval if {
	d := fixtures.decide(fixtures.call("delete_customer", {}, []))
	d.require_approval
	d.reasons == ["risk_destructive"]
}

test_matching_approval_allows if {
	fixtures.decide(with_approval(refund(6000), {})).allow
}

test_approval_for_other_arguments_is_denied if {
	d := fixtures.decide(with_approval(refund(6000), {"args_hash": "hash-2"}))
	not d.allow
	not d.require_approval
	d.reasons == ["approval_invalid"]
}

test_self_approval_is_denied if {
	fixtures.decide(with_approval(refund(6000), {"approver": "alice"})).reasons == ["approval_invalid"]
}

test_expired_approval_is_denied if {
	fixtures.decide(with_approval(refund(6000), {"expires_at_ms": 1})).reasons == ["approval_invalid"]
}

test_pending_approval_is_denied if {
	fixtures.decide(with_approval(refund(6000), {"status": "pending"})).reasons == ["approval_invalid"]
}

test_approval_for_another_tool_version_is_denied if {
	fixtures.decide(with_approval(refund(6000), {"tool_version": "0.9.0"})).reasons == ["approval_invalid"]
}

test_approval_cannot_lift_a_denial if {
	inp := with_approval(fixtures.call("refund_order", {"order_id": "ord_9", "amount": 6000}, ["order:ord_9"]), {})
	fixtures.decide(inp).reasons == ["resource_not_owned:order:ord_9"]
}

test_approval_spent_by_this_operation_allows_even_after_expiry if {
	fixtures.decide(with_approval(refund(6000), {"status": "used", "expires_at_ms": 1})).allow
}

test_spent_approval_keeps_its_binding if {
	fixtures.decide(with_approval(refund(6000), {"status": "used", "args_hash": "hash-2"})).reasons == ["approval_invalid"]
}
