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

# Tools naming the arguments that aim them: an external sink, and an internal write guarding its integrity.
catalog := object.union(fixtures.catalog, {"tools": {
	"send_message": {"1.0.0": {"name": "send_message", "version": "1.0.0", "mode": "write", "risk": "write", "flow": {"produces": [], "sink": "external", "sink_arguments": ["/recipients"], "trusted_source": false}}},
	"delete_file": {"1.0.0": {"name": "delete_file", "version": "1.0.0", "mode": "write", "risk": "write", "flow": {"produces": [], "sink": "internal", "sink_arguments": ["/file_id"], "trusted_source": false, "integrity": "destructive"}}},
	"rename_file": {"1.0.0": {"name": "rename_file", "version": "1.0.0", "mode": "write", "risk": "write", "flow": {"produces": [], "sink": "internal", "sink_arguments": ["/file_id"], "trusted_source": false}}},
	"post_message": {"1.0.0": {"name": "post_message", "version": "1.0.0", "mode": "write", "risk": "write", "flow": {"produces": [], "sink": "internal", "sink_arguments": ["/channel"], "payload_arguments": ["/body"], "trusted_source": false, "integrity": "state_changing"}}},
	"update_payment": {"1.0.0": {"name": "update_payment", "version": "1.0.0", "mode": "write", "risk": "write", "flow": {"produces": [], "sink": "external", "sink_arguments": ["/recipient"], "payload_arguments": ["/subject"], "trusted_source": false}}},
}})

decide_with(inp, settings) := d if {
	d := data.toolproxy.decision with input as inp
		with data.toolproxy.catalog as catalog
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

# ---- argument provenance -------------------------------------------------------------------------------

entry(argument, seen, sources) := {
	"argument": argument, "seen": seen, "trusted": seen == "trusted",
	"trusted_by": [x | seen == "trusted"; x := "task_context"],
	"untrusted_sources": [{"tool": t, "call_id": c, "at": "2026-12-01T18:00:00.000Z"} | some [t, c] in sources],
}

with_provenance(tool, arguments, labels, entries) := object.union(fixtures.call(tool, arguments, []), {"flow": object.union(flow(labels, []), {"provenance": entries})})

flow_setting(name, mode) := object.union(fixtures.settings, {"flow": {name: mode}})

poisoned_send := with_provenance("send_message", {"recipients": ["mallory@evil.example", "bob@corp.example"]}, ["untrusted"], [
	entry("/recipients/0", "untrusted", [["read_inbox", "call-7"], ["fetch_page", "call-3"]]),
	entry("/recipients/1", "trusted", []),
])

test_a_target_seen_only_in_untrusted_output_needs_approval_naming_argument_source_and_rule if {
	d := decide_with(poisoned_send, fixtures.settings)
	not d.allow
	d.require_approval
	d.reasons == ["flow_untrusted_target /recipients/0 from read_inbox call call-7"]
}

test_untrusted_alone_is_enough_no_private_needed if {
	inp := with_provenance("send_message", {"recipients": ["x@evil.example"]}, ["untrusted"], [entry("/recipients/0", "untrusted", [["get_reviews", "c1"]])])
	decide_with(inp, fixtures.settings).require_approval
}

test_data_may_refuse_untrusted_targets_or_turn_the_rule_off if {
	d := decide_with(poisoned_send, flow_setting("untrusted_target", "deny"))
	not d.allow
	not d.require_approval
	d.reasons == ["flow_untrusted_target /recipients/0 from read_inbox call call-7"]
	decide_with(poisoned_send, flow_setting("untrusted_target", "off")).allow
}

test_trusted_and_unseen_targets_pass_by_default if {
	inp := with_provenance("send_message", {"recipients": ["bob@corp.example", "new@corp.example"]}, ["untrusted"], [
		entry("/recipients/0", "trusted", [["read_inbox", "call-7"]]),
		entry("/recipients/1", "unseen", []),
	])
	decide_with(inp, fixtures.settings).allow
}

test_unseen_targets_after_untrusted_output_may_need_approval if {
	inp := with_provenance("send_message", {"recipients": ["new@corp.example"]}, ["untrusted"], [entry("/recipients/0", "unseen", [])])
	d := decide_with(inp, flow_setting("unseen_target", "approval"))
	d.require_approval
	d.reasons == ["flow_unseen_target /recipients/0 after untrusted output of a_tool"]
	clean := with_provenance("send_message", {"recipients": ["new@corp.example"]}, [], [entry("/recipients/0", "unseen", [])])
	decide_with(clean, flow_setting("unseen_target", "approval")).allow
}

test_an_integrity_write_inside_the_company_is_guarded_like_a_sink if {
	inp := with_provenance("delete_file", {"file_id": "13"}, ["untrusted"], [entry("/file_id", "untrusted", [["read_file", "call-2"]])])
	d := decide_with(inp, fixtures.settings)
	d.require_approval
	d.reasons == ["flow_untrusted_target /file_id from read_file call call-2"]
}

test_an_internal_write_without_integrity_is_not_concerned if {
	inp := with_provenance("rename_file", {"file_id": "13"}, ["untrusted"], [entry("/file_id", "untrusted", [["read_file", "call-2"]])])
	decide_with(inp, fixtures.settings).allow
}

test_a_guarded_write_without_its_provenance_or_flow_context_needs_approval if {
	d := decide_with(fixtures.call("delete_file", {"file_id": "13"}, []), fixtures.settings)
	d.reasons == ["flow_context_missing"]
	d.require_approval
	no_provenance := object.union(fixtures.call("delete_file", {"file_id": "13"}, []), {"flow": flow([], [])})
	decide_with(no_provenance, fixtures.settings).reasons == ["flow_provenance_missing"]
}

test_both_flow_rules_name_themselves if {
	inp := object.union(poisoned_send, {"flow": object.union(poisoned_send.flow, {"labels": ["private", "untrusted"]})})
	d := decide_with(inp, fixtures.settings)
	d.reasons == ["flow_private_to_external", "flow_untrusted_target /recipients/0 from read_inbox call call-7"]
}

test_an_approval_satisfies_the_provenance_rule if {
	inp := object.union(poisoned_send, {"approval": fixtures.approval({"tool": "send_message"})})
	decide_with(inp, fixtures.settings).allow
}

test_trusted_targets_may_spare_the_label_rule if {
	named := with_provenance("send_message", {"recipients": ["bob@corp.example"]}, ["private", "untrusted"], [entry("/recipients/0", "trusted", [])])
	d := decide_with(named, fixtures.settings)
	d.reasons == ["flow_private_to_external"]
	decide_with(named, flow_setting("trusted_targets", "named")).allow
	decide_with(named, flow_setting("trusted_targets", "trusted")).allow
}

test_a_target_from_the_users_records_is_spared_only_with_trusted if {
	records := object.union(entry("/recipients/0", "trusted", []), {"trusted_by": ["tool:get_contacts"]})
	inp := with_provenance("send_message", {"recipients": ["bob@corp.example"]}, ["private", "untrusted"], [records])
	decide_with(inp, flow_setting("trusted_targets", "named")).reasons == ["flow_private_to_external"]
	decide_with(inp, flow_setting("trusted_targets", "trusted")).allow
}

test_one_untrusted_or_unseen_target_keeps_the_label_rule if {
	inp := with_provenance("send_message", {"recipients": ["bob@corp.example", "new@corp.example"]}, ["private", "untrusted"], [
		entry("/recipients/0", "trusted", []),
		entry("/recipients/1", "unseen", []),
	])
	decide_with(inp, flow_setting("trusted_targets", "trusted")).reasons == ["flow_private_to_external"]
	no_targets := object.union(send_after(["private", "untrusted"], []), {"flow": object.union(flow(["private", "untrusted"], []), {"provenance": []})})
	decide_with(no_targets, flow_setting("trusted_targets", "trusted")).reasons == ["flow_private_to_external"]
}

# ---- a call that sets none of its targets, directory entries, payloads -----------------------------------

test_a_call_setting_none_of_its_targets_is_spared_only_when_the_data_spares_named_targets if {
	inp := with_provenance("update_payment", {"id": 7, "amount": 1200}, ["private", "untrusted"], [])
	decide_with(inp, fixtures.settings).reasons == ["flow_private_to_external"]
	decide_with(inp, flow_setting("trusted_targets", "named")).allow
	decide_with(inp, flow_setting("trusted_targets", "trusted")).allow

	# a target set, even one that normalizes to nothing, is an entry: not spared
	set := with_provenance("update_payment", {"recipient": "()"}, ["private", "untrusted"], [entry("/recipient", "unseen", [])])
	decide_with(set, flow_setting("trusted_targets", "named")).reasons == ["flow_private_to_external"]
}

listed(e) := object.union(e, {"directory": {"tool": "get_channels", "call_id": "c-1"}})

test_a_directory_entry_spares_a_state_changing_internal_write_only_with_the_setting if {
	inp := with_provenance("post_message", {"channel": "general", "body": "hi"}, ["untrusted"], [listed(entry("/channel", "untrusted", [["get_channels", "c-1"]]))])
	decide_with(inp, fixtures.settings).reasons == ["flow_untrusted_target /channel from get_channels call c-1"]
	decide_with(inp, flow_setting("internal_targets", "directory")).allow
	unseen := with_provenance("post_message", {"channel": "general"}, ["untrusted"], [listed(entry("/channel", "unseen", []))])
	decide_with(unseen, object.union(fixtures.settings, {"flow": {"unseen_target": "approval", "internal_targets": "directory"}})).allow
}

test_a_directory_entry_never_spares_an_external_sink_a_destructive_write_or_an_unlisted_value if {
	settings := flow_setting("internal_targets", "directory")
	send := with_provenance("send_message", {"recipients": ["x@evil.example"]}, ["untrusted"], [listed(entry("/recipients/0", "untrusted", [["get_users", "c-1"]]))])
	decide_with(send, settings).reasons == ["flow_untrusted_target /recipients/0 from get_users call c-1"]
	delete := with_provenance("delete_file", {"file_id": "13"}, ["untrusted"], [listed(entry("/file_id", "untrusted", [["list_files", "c-2"]]))])
	decide_with(delete, settings).reasons == ["flow_untrusted_target /file_id from list_files call c-2"]
	unlisted := with_provenance("post_message", {"channel": "x"}, ["untrusted"], [entry("/channel", "untrusted", [["read_inbox", "c-3"]])])
	decide_with(unlisted, settings).reasons == ["flow_untrusted_target /channel from read_inbox call c-3"]
}

with_payload(inp, entries) := object.union(inp, {"flow": object.union(inp.flow, {"payload": entries})})

test_an_untrusted_link_or_verbatim_text_in_a_payload_needs_approval_naming_its_source if {
	base := with_provenance("post_message", {"channel": "general", "body": "see www.evil.example"}, ["untrusted"], [listed(entry("/channel", "trusted", []))])
	inp := with_payload(base, [entry("/body", "untrusted", [["get_webpage", "c-4"]]), entry("/body", "unseen", [])])
	d := decide_with(inp, flow_setting("internal_targets", "directory"))
	d.require_approval
	d.reasons == ["flow_untrusted_payload /body from get_webpage call c-4"]
	decide_with(inp, object.union(fixtures.settings, {"flow": {"untrusted_payload": "deny"}})).reasons == ["flow_untrusted_payload /body from get_webpage call c-4"]
	not decide_with(inp, object.union(fixtures.settings, {"flow": {"untrusted_payload": "deny"}})).require_approval
	decide_with(inp, object.union(fixtures.settings, {"flow": {"untrusted_payload": "off"}})).allow
}

test_a_composed_or_named_payload_passes if {
	base := with_provenance("post_message", {"channel": "general", "body": "a summary"}, ["untrusted"], [entry("/channel", "trusted", [])])
	decide_with(with_payload(base, [entry("/body", "unseen", []), entry("/body", "trusted", [])]), fixtures.settings).allow

	# a write guarding nothing: its payload is not the policy's concern
	plain := object.union(fixtures.call("get_user_preferences", {"user_ref": "usr_1"}, []), {"flow": {"labels": ["untrusted"], "principal": scope(["untrusted"]), "run": null, "window_s": 60, "payload": [entry("/body", "untrusted", [["x", "c"]])]}})
	decide_with(plain, fixtures.settings).allow
}

link(e) := object.union(e, {"form": "link"})

test_an_unseen_link_in_a_payload_after_untrusted_output_waits_with_unseen_target_approval if {
	base := with_provenance("post_message", {"channel": "general", "body": "see www.evil.example"}, ["untrusted"], [entry("/channel", "trusted", [])])
	inp := with_payload(base, [link(entry("/body", "unseen", [])), object.union(entry("/body", "unseen", []), {"form": "text"})])
	decide_with(inp, fixtures.settings).allow
	d := decide_with(inp, flow_setting("unseen_target", "approval"))
	d.require_approval
	d.reasons == ["flow_unseen_payload /body after untrusted output of a_tool"]
	clean := with_payload(with_provenance("post_message", {"channel": "general"}, [], [entry("/channel", "trusted", [])]), [link(entry("/body", "unseen", []))])
	decide_with(clean, flow_setting("unseen_target", "approval")).allow
}
