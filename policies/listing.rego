# Listing (action "list": MCP tools/list, GET /v1/tools): which tools a caller is shown.
#
# Listing and calling are two questions with their own rules:
#   listing  this file: a tool is shown when the caller may call it at all (role,
#            scopes, never_for_agents: tools.rego) and no listing rule hides it;
#   calling  decision.rego, again for every call: tools.deny, resource_access.deny,
#            limits.deny and the approval rules, which read the call's arguments and
#            resources (a listing has neither).
# So a listed tool can still be refused, or need approval, for a given call; and a
# tool hidden from listings (a tool agents should not pick on their own) stays
# callable by whoever the call rules admit. `toolproxy policy explain` says which
# rules decided and, for a call, whether its tool is listed for that caller.
#
#   data.toolproxy.settings.listing.hidden   tool names never listed
package toolproxy.listing

import data.toolproxy.tools

default settings := {}

settings := data.toolproxy.settings.listing

# Why a tool of input.tools is not shown to this caller (one entry per reason).
hidden[tool.name] contains "tool_not_in_catalog" if {
	some tool in input.tools
	not tools.contract(tool.name, tool.version)
}

hidden[tool.name] contains "tool_not_granted" if {
	some tool in input.tools
	not tools.granted(tool.name)
}

hidden[tool.name] contains "scope_insufficient" if {
	some tool in input.tools
	contract := tools.contract(tool.name, tool.version)
	not tools.scopes_sufficient(tool.name, contract.mode)
}

hidden[tool.name] contains "tool_never_for_agents" if {
	some tool in input.tools
	tools.never_for_agents(tool.name)
}

hidden[tool.name] contains "listing_hidden" if {
	some tool in input.tools
	tool.name in object.get(settings, "hidden", [])
}

# The listing rule: the tools of input.tools this caller is shown.
visible contains tool.name if {
	input.action == "list"
	some tool in input.tools
	not hidden[tool.name]
}
