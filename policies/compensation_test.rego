package toolproxy.compensation_test

import data.toolproxy_test.fixtures

# Undo a refund_order operation by an adjust_counter call (the fixture catalog's tools).
compensate(subject_changes, original_changes) := object.union(fixtures.call("adjust_counter", {"delta": -1}, ["counter:c1"]), {
	"action": "compensate",
	"subject": object.union(fixtures.subject, subject_changes),
	"original": object.union(
		{"idempotency_key": "ik_1", "tool": "refund_order", "version": "1.0.0", "tenant": "acme", "subject": "alice", "state": "SUCCEEDED"},
		original_changes,
	),
	"compensation": {"tool": "adjust_counter", "version": "1.0.0", "required_scopes": ["tools:write"]},
})

test_a_role_that_grants_compensation_allows_it if {
	d := fixtures.decide(compensate({}, {}))
	d.allow
	d.reasons == []
}

test_a_named_grant_allows_compensating_that_tool if {
	fixtures.decide(compensate({"roles": ["refunds_desk"]}, {})).allow
}

test_calling_the_original_is_not_enough if {
	d := fixtures.decide(compensate({"roles": ["support"]}, {}))
	not d.allow
	d.reasons == ["compensation_not_granted"]
}

test_a_missing_required_scope_is_denied if {
	d := fixtures.decide(compensate({"scopes": ["tools:read"]}, {}))
	not d.allow
	"compensation_scope_insufficient" in d.reasons
}

test_another_tenants_operation_is_denied if {
	d := fixtures.decide(compensate({}, {"tenant": "globex"}))
	"compensation_other_tenant" in d.reasons
}

test_the_compensating_tool_must_be_callable if {
	d := fixtures.decide(compensate({"roles": ["viewer"]}, {}))
	"compensating_tool_not_permitted" in d.reasons
	"compensation_not_granted" in d.reasons
}

test_compensation_never_needs_an_approval if {
	d := fixtures.decide(compensate({}, {}))
	not d.require_approval
}
