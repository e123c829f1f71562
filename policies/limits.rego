# Hard limits no approval can lift.
#
#   data.toolproxy.settings.limits.max_resources_per_call   resources one call may touch
#   data.toolproxy.settings.limits.max_amount[tool]         {"argument", "max"}
package toolproxy.limits

default settings := {}

settings := data.toolproxy.settings.limits

deny contains "too_many_resources" if {
	input.action == "call"
	count(input.resources) > object.get(settings, "max_resources_per_call", 50)
}

deny contains "amount_over_limit" if {
	input.action == "call"
	limit := settings.max_amount[input.tool.name]
	input.arguments[limit.argument] > limit.max
}
