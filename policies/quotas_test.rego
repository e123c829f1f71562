package toolproxy.quotas_test

import data.toolproxy.quotas
import data.toolproxy_test.fixtures

classes := {
	"subjects": {"acme": {"alice": "reduced"}},
	"tenants": {"acme": "standard", "globex": "noisy"},
}

caller(tenant, id) := object.union(
	fixtures.call("get_order", {"order_id": "ord_1"}, ["order:ord_1"]),
	{"subject": object.union(fixtures.subject, {"id": id, "tenant": tenant})},
)

test_subject_class_wins_over_tenant_class if {
	quotas.quota_class == "reduced" with input as caller("acme", "alice") with data.toolproxy.quota_classes as classes
}

test_tenant_class_applies_to_other_subjects if {
	quotas.quota_class == "standard" with input as caller("acme", "bob") with data.toolproxy.quota_classes as classes
	quotas.quota_class == "noisy" with input as caller("globex", "zed") with data.toolproxy.quota_classes as classes
}

test_no_class_without_data if {
	not quotas.quota_class with input as caller("acme", "alice")
}

test_no_class_for_an_unlisted_tenant if {
	not quotas.quota_class with input as caller("initech", "alice") with data.toolproxy.quota_classes as classes
}

test_allowed_decision_names_the_class if {
	d := fixtures.decide(fixtures.call("get_order", {"order_id": "ord_1"}, ["order:ord_1"]))
		with data.toolproxy.quota_classes as classes
	d.allow
	d.quota_class == "reduced"
}

test_decision_without_a_class_has_no_quota_class if {
	d := fixtures.decide(fixtures.call("get_order", {"order_id": "ord_1"}, ["order:ord_1"]))
	d.allow
	not d.quota_class
}
