# Data flow across calls: a sequence of harmless calls can still be an
# exfiltration (the "lethal trifecta" of prompt injection): read a customer's
# private record, read a page an attacker wrote, send an email outside.
#
# Facts about a tool (what its output brings, where its arguments go) come from
# the registry's contract (flow.produces, flow.sink) through the catalog the
# proxy loads into OPA; what the agent was exposed to comes from the proxy's
# flow stage as input.flow (proxy/flow.py): the labels seen per tenant, agent
# and subject over flow.window_s whatever the run id (input.flow.principal),
# and for this run (input.flow.run). input.flow.labels is their union.
#
#   data.toolproxy.settings.flow.private_to_external  "approval" (default) or "deny":
#       what an external sink gets once both private and untrusted were seen.
package toolproxy.flow

import data.toolproxy.tools

default settings := {}

settings := data.toolproxy.settings.flow

default private_to_external := "approval"

private_to_external := settings.private_to_external

external_sink if tools.contract(input.tool.name, input.tool.version).flow.sink == "external"

seen(label) if label in input.flow.labels

private_to_external_risk if {
	input.action == "call"
	external_sink
	seen("private")
	seen("untrusted")
}

deny contains "flow_private_to_external" if {
	private_to_external_risk
	private_to_external == "deny"
}

needs contains "flow_private_to_external" if {
	private_to_external_risk
	private_to_external != "deny"
}

# An external sink decided without the flow context (a proxy that did not read
# it) is not waved through: a person looks at it.
needs contains "flow_context_missing" if {
	input.action == "call"
	external_sink
	not input.flow
}
