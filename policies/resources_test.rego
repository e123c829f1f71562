package toolproxy.resource_access_test

import data.toolproxy_test.fixtures

test_own_tenant_resource_is_allowed if {
	fixtures.decide(fixtures.call("get_order", {"order_id": "ord_1"}, ["order:ord_1"])).allow
}

test_other_tenant_resource_is_denied if {
	d := fixtures.decide(fixtures.call("get_order", {"order_id": "ord_9"}, ["order:ord_9"]))
	not d.allow
	d.reasons == ["resource_not_owned:order:ord_9"]
}

test_forged_tenant_in_arguments_changes_nothing if {
	args := {"order_id": "ord_9", "tenant_id": "globex", "user_id": "root", "is_admin": true}
	d := fixtures.decide(fixtures.call("get_order", args, ["order:ord_9"]))
	d.reasons == ["resource_not_owned:order:ord_9"]
}

test_mixed_owned_and_foreign_resources_are_denied if {
	d := fixtures.decide(fixtures.call("get_orders", {}, ["order:ord_1", "order:ord_9"]))
	not d.allow
	d.reasons == ["resource_not_owned:order:ord_9"]
}

test_unknown_resource_is_denied if {
	d := fixtures.decide(fixtures.call("get_order", {}, ["order:ord_404"]))
	d.reasons == ["resource_not_owned:order:ord_404"]
}

test_unknown_kind_is_denied if {
	d := fixtures.decide(fixtures.call("get_order", {}, ["planet:mars"]))
	d.reasons == ["resource_kind_unknown:planet"]
}

test_shared_kind_is_allowed_for_any_tenant if {
	fixtures.decide(fixtures.call("adjust_counter", {}, ["counter:ctr_x"])).allow
}

test_owned_resource_of_another_subject_is_denied if {
	inp := fixtures.call("get_order", {}, ["order:ord_2"])
	fixtures.decide(inp).allow
	other := object.union(inp, {"subject": object.union(inp.subject, {"id": "dave"})})
	fixtures.decide(other).reasons == ["resource_not_owned:order:ord_2"]
}

test_override_role_may_act_on_another_subjects_resource if {
	inp := fixtures.call("get_order", {}, ["order:ord_2"])
	other := object.union(inp, {"subject": object.union(inp.subject, {"id": "dave", "roles": ["agent", "support_admin"]})})
	fixtures.decide(other).allow
}

test_at_write_kind_is_allowed_when_the_contract_reads_the_owner if {
	inp := object.union(fixtures.call("get_order", {}, ["doc:d_1"]), {"tool": {"name": "get_order", "version": "1.0.0", "ownership_read": true}})
	fixtures.decide(inp).allow
}

test_at_write_kind_is_denied_when_the_contract_reads_no_owner if {
	d := fixtures.decide(fixtures.call("get_order", {}, ["doc:d_1"]))
	not d.allow
	d.reasons == ["resource_not_owned:doc:d_1"]
}
