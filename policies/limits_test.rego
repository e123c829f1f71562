package toolproxy.limits_test

import data.toolproxy_test.fixtures

test_too_many_resources_is_denied if {
	ids := ["order:ord_1", "counter:a", "counter:b", "counter:c"]
	fixtures.decide(fixtures.call("get_orders", {}, ids)).reasons == ["too_many_resources"]
}

test_resource_count_at_the_limit_is_allowed if {
	fixtures.decide(fixtures.call("get_orders", {}, ["order:ord_1", "counter:a", "counter:b"])).allow
}

test_amount_over_the_hard_limit_is_denied_even_with_approval if {
	inp := fixtures.call("refund_order", {"order_id": "ord_1", "amount": 1000001}, ["order:ord_1"])
	d := fixtures.decide(object.union(inp, {"approval": fixtures.approval({})}))
	"amount_over_limit" in d.reasons
	not d.allow
}
