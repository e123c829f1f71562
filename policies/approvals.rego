# Risk and approvals (ApprovalSatisfied): which calls need a human's approval,
# and whether the approval presented with the call satisfies it.
#
#   data.toolproxy.settings.approval.always_for_risks  risks that always need approval
#   data.toolproxy.settings.approval.thresholds[tool]  {"argument", "default", "tenants": {tenant: max}}:
#       an amount above the tenant's max (else the default) needs approval.
# A financial tool without a threshold always needs approval.
package toolproxy.approvals

import data.toolproxy.flow
import data.toolproxy.tools

risk := tools.contract(input.tool.name, input.tool.version).risk

default settings := {}

settings := data.toolproxy.settings.approval

threshold_config := settings.thresholds[input.tool.name]

threshold := object.get(object.get(threshold_config, "tenants", {}), input.subject.tenant, threshold_config.default)

needs contains sprintf("risk_%s", [risk]) if {
	input.action == "call"
	risk in object.get(settings, "always_for_risks", [])
}

needs contains "amount_over_threshold" if {
	input.action == "call"
	input.arguments[threshold_config.argument] > threshold
}

# Data-flow rules that ask for a person (flow.rego).
needs contains reason if some reason in flow.needs

needs contains "financial_without_threshold" if {
	input.action == "call"
	risk == "financial"
	not threshold_config
}

# The proxy already checked the approval in Redis (state, binding, expiry,
# single use); the policy checks the binding again so that a proxy bug can
# never turn an approval for one call into an approval for another.
bound(approval) if {
	approval.subject == input.subject.id
	approval.tenant == input.subject.tenant
	approval.tool == input.tool.name
	approval.tool_version == input.tool.version
	approval.args_hash == input.args_hash
	approval.approver != input.subject.id
}

satisfied if {
	approval := input.approval
	approval.status == "approved"
	bound(approval)
	approval.expires_at_ms * 1000000 > time.now_ns()
}

# "used": spent by this very operation (the proxy matched the operation key).
# Such a call only ever sees that operation's recorded outcome (the proxy's
# idempotency stage never reserves the key for it), so expiry does not matter;
# the rest of the policy (tool, resource, scope, tenant) still applies.
satisfied if {
	approval := input.approval
	approval.status == "used"
	bound(approval)
}

deny contains "approval_invalid" if {
	input.action == "call"
	input.approval != null
	not satisfied
}

required if {
	count(needs) > 0
	not satisfied
}
