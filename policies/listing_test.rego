package toolproxy.listing_test

import data.toolproxy_test.fixtures

listing(inp, settings) := {"visible": v, "hidden": h} if {
	v := data.toolproxy.listing.visible with input as inp
		with data.toolproxy.catalog as fixtures.catalog
		with data.toolproxy.roles as fixtures.roles
		with data.toolproxy.subjects as fixtures.subjects
		with data.toolproxy.settings as object.union(fixtures.settings, settings)
	h := data.toolproxy.listing.hidden with input as inp
		with data.toolproxy.catalog as fixtures.catalog
		with data.toolproxy.roles as fixtures.roles
		with data.toolproxy.subjects as fixtures.subjects
		with data.toolproxy.settings as object.union(fixtures.settings, settings)
}

test_hidden_tools_say_why if {
	inp := object.union(fixtures.list_input(["get_order", "run_shell", "nope"]), {"subject": {"scopes": ["tools:read"]}})
	l := listing(inp, {})
	l.visible == {"get_order"}
	l.hidden == {"run_shell": {"scope_insufficient", "tool_never_for_agents"}, "nope": {"tool_not_in_catalog"}}
}

test_a_listing_rule_hides_a_tool_the_call_rules_still_admit if {
	l := listing(fixtures.list_input(["get_order", "adjust_counter"]), {"listing": {"hidden": ["adjust_counter"]}})
	l.visible == {"get_order"}
	l.hidden == {"adjust_counter": {"listing_hidden"}}

	# The same caller calling it: the call rules decide, and admit it.
	d := fixtures.decide(fixtures.call("adjust_counter", {"counter": "ctr_1", "delta": 1}, ["counter:ctr_1"])) with data.toolproxy.settings as object.union(fixtures.settings, {"listing": {"hidden": ["adjust_counter"]}})
	d.allow
}

test_listing_is_not_a_call if {
	d := fixtures.decide(fixtures.list_input(["get_order"]))
	not d.risk
	d.visible_tools == ["get_order"]
}
