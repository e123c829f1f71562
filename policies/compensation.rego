# Compensation (action "compensate"): may this caller undo a committed effect of
# input.original (an operation of its own tenant) by the compensating call in
# input.tool / input.arguments that the original's contract declares?
#
# Calling the original tool is not enough: a role must grant the compensation.
#   data.toolproxy.roles[role].compensate   original tool names a role may compensate ("*": all)
# The compensating tool must be one the caller may call (tools.rego), the
# caller must hold the declaration's required scopes, and every resource of the
# compensating call must be the caller's (resources.rego checks it for
# "compensate" as for "call").
package toolproxy.compensation

import data.toolproxy.tools

may_compensate(name) if {
	some role in tools.roles
	some grant in object.get(data.toolproxy.roles[role], "compensate", [])
	grant in {name, "*"}
}

deny contains "compensation_not_granted" if {
	input.action == "compensate"
	not may_compensate(input.original.tool)
}

deny contains "compensation_scope_insufficient" if {
	input.action == "compensate"
	some scope in input.compensation.required_scopes
	not scope in input.subject.scopes
}

deny contains "compensating_tool_not_permitted" if {
	input.action == "compensate"
	not tools.permitted(input.tool.name, input.tool.version)
}

deny contains "compensation_other_tenant" if {
	input.action == "compensate"
	input.original.tenant != input.subject.tenant
}
