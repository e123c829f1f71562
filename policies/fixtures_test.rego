# Shared test fixtures: a small catalog and the OPA data the policies read.
# Tests swap them in with `with data.toolproxy.<doc> as fixtures.<doc>`; see
# the eval helpers below, which every *_test.rego uses.
package toolproxy_test.fixtures

catalog := {
	"digest": "digest-1",
	"tools": {
		"get_order": {"1.0.0": {"name": "get_order", "version": "1.0.0", "mode": "read", "risk": "read"}},
		"get_orders": {"1.0.0": {"name": "get_orders", "version": "1.0.0", "mode": "read", "risk": "read"}},
		"refund_order": {"1.0.0": {"name": "refund_order", "version": "1.0.0", "mode": "write", "risk": "financial"}},
		"transfer_funds": {"1.0.0": {"name": "transfer_funds", "version": "1.0.0", "mode": "write", "risk": "financial"}},
		"delete_customer": {"1.0.0": {"name": "delete_customer", "version": "1.0.0", "mode": "write", "risk": "destructive"}},
		"run_shell": {"1.0.0": {"name": "run_shell", "version": "1.0.0", "mode": "write", "risk": "destructive"}},
		"adjust_counter": {"1.0.0": {"name": "adjust_counter", "version": "1.0.0", "mode": "write", "risk": "write"}},
		"odd_mode": {"1.0.0": {"name": "odd_mode", "version": "1.0.0", "mode": "sideways", "risk": "read"}},
		"get_user_preferences": {"1.0.0": {"name": "get_user_preferences", "version": "1.0.0", "mode": "read", "risk": "read", "flow": {"produces": ["private"], "sink": "internal"}}},
		"fetch_page": {"1.0.0": {"name": "fetch_page", "version": "1.0.0", "mode": "read", "risk": "read", "flow": {"produces": ["untrusted"], "sink": "external"}}},
		"send_email": {"1.0.0": {"name": "send_email", "version": "1.0.0", "mode": "write", "risk": "external", "flow": {"produces": [], "sink": "external"}}},
	},
}

roles := {
	"agent": {"tools": ["*"], "compensate": ["*"]},
	"viewer": {"tools": ["get_order", "get_orders"]},
	"support": {"tools": ["get_order", "refund_order", "adjust_counter"]},
	"refunds_desk": {"tools": ["get_order", "refund_order", "adjust_counter"], "compensate": ["refund_order"], "operate_others": ["refund_order"]},
	"shift_lead": {"tools": [], "operate_others": ["*"]},
}

subjects := {"acme": {
	"carol": {"roles": ["support"]},
	"mallory": {"revoked_roles": ["agent"]},
}}

resource_kinds := {
	"order": {"ownership": "tenant"},
	"counter": {"ownership": "shared"},
	"doc": {"ownership": "at_write"},
}

resources := {
	"order:ord_1": {"tenant": "acme"},
	"order:ord_2": {"tenant": "acme", "owner": "alice"},
	"order:ord_9": {"tenant": "globex"},
}

settings := {
	"scopes": {
		"modes": {"read": ["tools:read"], "write": ["tools:write"]},
		"tools": {"refund_order": ["tools:write", "orders:refund"]},
	},
	"never_for_agents": ["run_shell"],
	"owner_override_roles": ["support_admin"],
	"approval": {
		"always_for_risks": ["destructive"],
		"thresholds": {"refund_order": {"argument": "amount", "default": 5000, "tenants": {"globex": 0}}},
	},
	"limits": {
		"max_resources_per_call": 3,
		"max_amount": {"refund_order": {"argument": "amount", "max": 1000000}},
	},
}

subject := {"id": "alice", "tenant": "acme", "roles": ["agent"], "scopes": ["tools:read", "tools:write", "orders:refund"]}

call(tool, arguments, resource_ids) := {
	"action": "call",
	"subject": subject,
	"agent": {"id": "agent-1"},
	"tool": {"name": tool, "version": "1.0.0"},
	"arguments": arguments,
	"args_hash": "hash-1",
	"resources": [{"id": id, "kind": split(id, ":")[0], "access": "exclusive"} | some id in resource_ids],
	"approval": null,
	"catalog_digest": "digest-1",
}

list_input(tool_names) := {
	"action": "list",
	"subject": subject,
	"agent": {"id": "agent-1"},
	"tools": [{"name": name, "version": "1.0.0"} | some name in tool_names],
	"catalog_digest": "digest-1",
}

approval(overrides) := object.union(
	{
		"id": "apr_1",
		"status": "approved",
		"subject": "alice",
		"tenant": "acme",
		"tool": "refund_order",
		"tool_version": "1.0.0",
		"args_hash": "hash-1",
		"approver": "bob",
		"expires_at_ms": (time.now_ns() / 1000000) + 60000,
	},
	overrides,
)

# The decision for an input, evaluated against the fixtures.
decide(inp) := d if {
	d := data.toolproxy.decision with input as inp
		with data.toolproxy.catalog as catalog
		with data.toolproxy.roles as roles
		with data.toolproxy.subjects as subjects
		with data.toolproxy.resource_kinds as resource_kinds
		with data.toolproxy.resources as resources
		with data.toolproxy.settings as settings
		with data.toolproxy.meta as {"revision": "test-rev"}
}
