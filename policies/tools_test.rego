package toolproxy.tools_test

import data.toolproxy_test.fixtures

call(tool) := fixtures.call(tool, {}, [])

as_subject(inp, changes) := object.union(inp, {"subject": object.union(inp.subject, changes)})

test_wildcard_role_grants_catalog_tools if {
	fixtures.decide(call("get_order")).allow
}

test_tool_outside_catalog_is_denied if {
	d := fixtures.decide(call("not_a_tool"))
	not d.allow
	"tool_not_in_catalog" in d.reasons
}

test_role_without_the_tool_is_denied if {
	d := fixtures.decide(as_subject(call("adjust_counter"), {"roles": ["viewer"]}))
	d.reasons == ["tool_not_granted"]
}

test_unknown_role_grants_nothing if {
	d := fixtures.decide(as_subject(call("get_order"), {"roles": ["wizard"]}))
	d.reasons == ["tool_not_granted"]
}

test_directory_role_adds_to_token_roles if {
	d := fixtures.decide(as_subject(call("get_order"), {"id": "carol", "roles": []}))
	d.allow
}

test_directory_can_revoke_a_token_role if {
	d := fixtures.decide(as_subject(call("get_order"), {"id": "mallory"}))
	d.reasons == ["tool_not_granted"]
}

test_missing_mode_scope_is_denied if {
	d := fixtures.decide(as_subject(call("adjust_counter"), {"scopes": ["tools:read"]}))
	d.reasons == ["scope_insufficient"]
}

test_per_tool_scope_override if {
	inp := as_subject(fixtures.call("refund_order", {"amount": 10}, []), {"scopes": ["tools:write"]})
	fixtures.decide(inp).reasons == ["scope_insufficient"]
}

test_unknown_mode_needs_an_impossible_scope if {
	fixtures.decide(call("odd_mode")).reasons == ["scope_insufficient"]
}

test_never_for_agents_wins_over_a_wildcard if {
	d := fixtures.decide(call("run_shell"))
	"tool_never_for_agents" in d.reasons
	not d.require_approval
}

test_listing_shows_only_permitted_tools if {
	d := fixtures.decide(as_subject(
		fixtures.list_input(["get_order", "adjust_counter", "run_shell", "nope"]),
		{"roles": ["viewer"]},
	))
	d.allow
	d.visible_tools == ["get_order"]
}

test_listing_with_wildcard_and_scopes if {
	d := fixtures.decide(fixtures.list_input(["get_order", "adjust_counter", "run_shell", "delete_customer"]))
	d.visible_tools == ["adjust_counter", "delete_customer", "get_order"]
}

test_an_approvers_related_read_is_allowed_a_read_only if {
	approver := {"id": "amy", "roles": ["agent"], "source": "admin"}
	fixtures.decide(as_subject(call("get_order"), approver)).allow
	d := fixtures.decide(as_subject(call("adjust_counter"), approver))
	"admin_reads_only" in d.reasons
}
