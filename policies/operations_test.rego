package toolproxy.operations_test

import data.toolproxy_test.fixtures

# alice (role agent) acts on an operation of refund_order that bob started.
act(action, subject_changes, original_changes) := {
	"action": action,
	"subject": object.union(fixtures.subject, subject_changes),
	"agent": {"id": "agent-1"},
	"catalog_digest": "digest-1",
	"request": {"request_id": "r1", "call_id": null, "run_id": null, "trace_id": "t1"},
	"original": object.union(
		{"idempotency_key": "ik_1", "tool": "refund_order", "version": "1.0.0", "tenant": "acme", "subject": "bob", "state": "IN_PROGRESS"},
		original_changes,
	),
}

test_another_subjects_operation_is_refused_without_a_grant if {
	every action in ["cancel", "read_operation"] {
		d := fixtures.decide(act(action, {}, {}))
		not d.allow
		d.reasons == ["operation_other_subject"]
	}
}

test_the_own_subjects_operation_is_allowed if {
	every action in ["cancel", "read_operation"] {
		d := fixtures.decide(act(action, {}, {"subject": "alice"}))
		d.allow
		d.reasons == []
	}
}

test_an_operator_role_may_act_on_others_operations if {
	every action in ["cancel", "read_operation"] {
		fixtures.decide(act(action, {"roles": ["shift_lead"]}, {})).allow
	}
}

test_a_named_grant_covers_only_that_tool if {
	fixtures.decide(act("cancel", {"roles": ["refunds_desk"]}, {})).allow
	d := fixtures.decide(act("cancel", {"roles": ["refunds_desk"]}, {"tool": "transfer_funds"}))
	d.reasons == ["operation_other_subject"]
}

test_another_tenants_operation_is_refused_even_to_an_operator if {
	d := fixtures.decide(act("read_operation", {"roles": ["shift_lead"]}, {"tenant": "globex"}))
	not d.allow
	d.reasons == ["operation_other_tenant"]
}

test_a_revoked_operator_role_no_longer_grants if {
	d := fixtures.decide(act("cancel", {"id": "mallory", "roles": ["shift_lead"]}, {}))
	d.allow # mallory's directory revokes only "agent"
	d2 := fixtures.decide(act("cancel", {"id": "mallory", "roles": ["agent"]}, {}))
	d2.reasons == ["operation_other_subject"]
}

test_compensating_another_subjects_operation_needs_the_grant_too if {
	inp := object.union(fixtures.call("adjust_counter", {"delta": -1}, ["counter:c1"]), {
		"action": "compensate",
		"original": {"idempotency_key": "ik_1", "tool": "refund_order", "version": "1.0.0", "tenant": "acme", "subject": "bob", "state": "SUCCEEDED"},
		"compensation": {"tool": "adjust_counter", "version": "1.0.0", "required_scopes": ["tools:write"]},
	})
	d := fixtures.decide(inp)
	not d.allow
	d.reasons == ["operation_other_subject"]
	fixtures.decide(object.union(inp, {"subject": object.union(fixtures.subject, {"roles": ["agent", "shift_lead"]})})).allow
}
