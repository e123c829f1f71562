package toolproxy.flow_test

import data.toolproxy_test.fixtures

scope(labels) := {"labels": labels, "seen": [{"label": l, "tool": "a_tool", "at": "2026-12-01T18:00:00.000Z"} | some l in labels]}

# input.flow as the proxy sends it: the principal scope, and the run scope when a run id came.
flow(principal, run) := {
	"labels": sort({l | some l in array.concat(principal, run)}),
	"principal": scope(principal),
	"run": scope(run),
	"window_s": 86400,
}

send := fixtures.call("send_email", {"to": "x@example.com", "subject": "s", "body": "b"}, ["mailbox:x@example.com"])

send_after(principal, run) := object.union(send, {"flow": flow(principal, run)})

with_setting(mode) := object.union(fixtures.settings, {"flow": {"private_to_external": mode}})

decide_with(inp, settings) := d if {
	d := data.toolproxy.decision with input as inp
		with data.toolproxy.catalog as fixtures.catalog
		with data.toolproxy.roles as fixtures.roles
		with data.toolproxy.subjects as fixtures.subjects
		with data.toolproxy.resource_kinds as object.union(fixtures.resource_kinds, {"mailbox": {"ownership": "shared"}})
		with data.toolproxy.resources as fixtures.resources
		with data.toolproxy.settings as settings
		with data.toolproxy.meta as {"revision": "test-rev"}
}

test_external_sink_in_a_clean_context_is_allowed if {
	d := decide_with(send_after([], []), fixtures.settings)
	d.allow
}

test_private_alone_or_untrusted_alone_is_allowed if {
	decide_with(send_after(["private"], []), fixtures.settings).allow
	decide_with(send_after(["untrusted"], ["untrusted"]), fixtures.settings).allow
}

test_private_and_untrusted_then_external_needs_approval_by_default if {
	d := decide_with(send_after(["private", "untrusted"], []), fixtures.settings)
	not d.allow
	d.require_approval
	d.reasons == ["flow_private_to_external"]
}

# The run scope alone also counts (a label recorded under this run only, e.g. before the principal scope
# expired); a fresh run id still carries the principal scope, which the model cannot reset.
test_labels_of_either_scope_count if {
	decide_with(send_after(["private"], ["untrusted"]), fixtures.settings).require_approval
	decide_with(send_after(["private", "untrusted"], []), fixtures.settings).require_approval
}

test_data_may_deny_instead if {
	d := decide_with(send_after(["private", "untrusted"], []), with_setting("deny"))
	not d.allow
	not d.require_approval
	d.reasons == ["flow_private_to_external"]
}

test_an_approval_satisfies_the_flow_rule if {
	inp := object.union(send_after(["private", "untrusted"], []), {"approval": fixtures.approval({"tool": "send_email"})})
	decide_with(inp, fixtures.settings).allow
}

test_internal_sink_is_not_concerned if {
	inp := object.union(fixtures.call("get_user_preferences", {"user_ref": "usr_1"}, []), {"flow": flow(["private", "untrusted"], [])})
	decide_with(inp, fixtures.settings).allow
}

test_external_sink_without_flow_context_needs_approval if {
	d := decide_with(send, fixtures.settings)
	d.require_approval
	d.reasons == ["flow_context_missing"]
}

test_secret_alone_does_not_trigger_the_rule if {
	decide_with(send_after(["secret", "untrusted"], []), fixtures.settings).allow
}
