# Tool permission: which tools a caller may call (ToolAllowed, ScopeSufficient); listing.rego
# shows a caller the tools it may call, minus the ones listing rules hide.
#
# Facts about a tool (mode, risk) come from the catalog the proxy loads into
# OPA from its trusted registry (data.toolproxy.catalog), never from the agent.
# Roles come from the verified token plus the directory in data.toolproxy.subjects
# (which can also revoke a token's role before the token expires).
package toolproxy.tools

# The trusted contract of a tool version, as pushed by the proxy.
contract(name, version) := data.toolproxy.catalog.tools[name][version]

token_roles contains role if some role in input.subject.roles

default directory := {}

directory := data.toolproxy.subjects[input.subject.tenant][input.subject.id]

directory_roles contains role if some role in object.get(directory, "roles", [])

revoked_roles contains role if some role in object.get(directory, "revoked_roles", [])

# Roles in force for this caller right now.
roles := (token_roles | directory_roles) - revoked_roles

# A role grants a tool by name, or every tool with "*".
granted(name) if {
	some role in roles
	some grant in data.toolproxy.roles[role].tools
	grant in {name, "*"}
}

# Scopes a tool needs: a per-tool override, else the scopes of its mode.
required_scopes(name, mode) := scopes if {
	scopes := data.toolproxy.settings.scopes.tools[name]
} else := object.get(data.toolproxy.settings.scopes.modes, mode, ["tools:unknown_mode"])

scopes_sufficient(name, mode) if {
	every scope in required_scopes(name, mode) {
		scope in input.subject.scopes
	}
}

never_for_agents(name) if name in data.toolproxy.settings.never_for_agents

# A tool this caller may call (approval rules aside: see approvals.rego).
permitted(name, version) if {
	tool := contract(name, version)
	granted(name)
	scopes_sufficient(name, tool.mode)
	not never_for_agents(name)
}

deny contains "tool_not_in_catalog" if {
	input.action == "call"
	not contract(input.tool.name, input.tool.version)
}

deny contains "tool_not_granted" if {
	input.action == "call"
	not granted(input.tool.name)
}

deny contains "scope_insufficient" if {
	input.action == "call"
	tool := contract(input.tool.name, input.tool.version)
	not scopes_sufficient(input.tool.name, tool.mode)
}

# An approver's token reaches a tool only for the read a contract shows beside a pending approval
# (subject.source "admin", agent toolproxy-console): never anything but a read.
deny contains "admin_reads_only" if {
	input.action == "call"
	input.subject.source == "admin"
	contract(input.tool.name, input.tool.version).mode != "read"
}

deny contains "tool_never_for_agents" if {
	input.action == "call"
	never_for_agents(input.tool.name)
}
