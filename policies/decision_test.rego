package toolproxy.decision_test

import data.toolproxy_test.fixtures

test_allowed_decision_carries_revision_and_catalog_state if {
	d := fixtures.decide(fixtures.call("get_order", {"order_id": "ord_1"}, ["order:ord_1"]))
	d.allow
	not d.require_approval
	d.reasons == []
	d.policy_revision == "test-rev"
	d.catalog_current
	d.risk == "read"
}

test_stale_catalog_digest_is_reported if {
	inp := object.union(fixtures.call("get_order", {}, []), {"catalog_digest": "other"})
	not fixtures.decide(inp).catalog_current
}

test_missing_identity_is_denied if {
	inp := fixtures.call("get_order", {}, [])
	d := fixtures.decide(object.union(inp, {"subject": {"id": "", "tenant": ""}}))
	not d.allow
	"identity_missing" in d.reasons
}

test_missing_subject_object_is_denied if {
	inp := json.remove(fixtures.call("get_order", {}, []), ["subject", "agent"])
	d := fixtures.decide(inp)
	"identity_missing" in d.reasons
	"agent_missing" in d.reasons
}

test_unknown_action_is_never_allowed if {
	inp := object.union(fixtures.call("get_order", {}, []), {"action": "teleport"})
	not fixtures.decide(inp).allow
}

test_listing_without_identity_is_denied if {
	inp := object.union(fixtures.list_input(["get_order"]), {"subject": {"id": "", "tenant": ""}})
	d := fixtures.decide(inp)
	not d.allow
	"identity_missing" in d.reasons
}

test_no_data_fails_closed if {
	d := data.toolproxy.decision with input as fixtures.call("get_order", {}, [])
		with data.toolproxy.catalog as {}
	not d.allow
	d.policy_revision == "unversioned"
}
