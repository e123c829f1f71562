# Operations of another subject (actions "cancel", "read_operation" and
# "compensate"): may this caller act on input.original, an operation that
# someone else in its tenant started?
#
# The proxy asks only when the caller is not the operation's own subject (its
# own operations it may always read and cancel; compensating them is
# compensation.rego's question). Starting a call is not enough: a role must
# grant acting on other subjects' operations of that tool.
#   data.toolproxy.roles[role].operate_others   original tool names ("*": all)
# Another tenant's operation is never anyone's here (operators who span
# tenants work on the admin listener).
package toolproxy.operations

import data.toolproxy.tools

operation_actions := {"cancel", "read_operation", "compensate"}

may_operate_others(name) if {
	some role in tools.roles
	some grant in object.get(data.toolproxy.roles[role], "operate_others", [])
	grant in {name, "*"}
}

deny contains "operation_other_subject" if {
	input.action in operation_actions
	input.original.subject != input.subject.id
	not may_operate_others(input.original.tool)
}

deny contains "operation_other_tenant" if {
	input.action in {"cancel", "read_operation"}
	input.original.tenant != input.subject.tenant
}
