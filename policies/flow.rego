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
#
# Argument provenance: a contract names the arguments that aim its call
# (flow.sink_arguments: a recipient, a URL, an IBAN, a file id); the proxy gives,
# per value at them, whether it was seen only in output a third party could
# write (input.flow.provenance, proxy/provenance.py). Such a target on an
# external sink, or on a write declaring flow.integrity (destructive,
# state_changing: deleting a file, changing a password, a message inside the
# workspace), is the injected action the labels alone miss. Values the user
# named (the trusted task context) or seen in a trusted_source tool's output pass.
#
#   data.toolproxy.settings.flow.untrusted_target  "approval" (default), "deny" or "off":
#       what such a call gets; its reason names the argument, the source tool and
#       call, and the rule: "flow_untrusted_target /to/0 from read_inbox call c-7".
#   data.toolproxy.settings.flow.trusted_targets  "hold" (default), "named" or "trusted":
#       whether flow_private_to_external spares a send whose every target is one
#       the user named (the trusted task context: "named"), or named or in the
#       user's own records ("trusted"). The data still goes out, but only where
#       the user pointed; "hold" keeps the label rule as it was.
#       With "named" or "trusted", a call that sets none of the sink arguments
#       its contract names is spared too: it aims at nobody new (an update that
#       keeps its recipient, an event with no participants).
#   data.toolproxy.settings.flow.unseen_target  "allow" (default) or "approval":
#       a target seen in no output at all, on a call after untrusted output (a
#       value the model composed: an attacker can spell an address out).
#   data.toolproxy.settings.flow.internal_targets  "provenance" (default) or "directory":
#       with "directory", a state_changing write inside the organisation (not an
#       external sink, not a destructive one) whose target is an existing entry
#       of a directory (a flow.directory tool's output: the member list, the
#       channel list) is not held for where that value came from: it cannot
#       leave the organisation nor touch anything that did not exist. Its
#       payload is still checked.
#
# Payload provenance: a contract names the arguments that carry free text to
# the call's readers (flow.payload_arguments: a body, a title); the proxy gives,
# per link in them (URL, address, host) and per short text as a whole, where it
# was seen (input.flow.payload). On an external sink or a guarded write, one
# seen only in untrusted output is a phishing link or a third party's words
# relayed verbatim.
#
#   data.toolproxy.settings.flow.untrusted_payload  "approval" (default), "deny" or "off":
#       its reason names the argument, the source tool and call, and the rule:
#       "flow_untrusted_payload /body from get_webpage call c-3".
#   With unseen_target: approval, a link (entry.form "link") seen in no output
#   after untrusted output is held too (flow_unseen_payload); a composed text
#   (form "text") never is.
package toolproxy.flow

import data.toolproxy.tools

default settings := {}

settings := data.toolproxy.settings.flow

default private_to_external := "approval"

private_to_external := settings.private_to_external

contract_flow := tools.contract(input.tool.name, input.tool.version).flow

external_sink if contract_flow.sink == "external"

# Where a target that came from untrusted output is an attack: a sink, or a
# write whose integrity the contract guards.
guarded_target if external_sink

guarded_target if contract_flow.integrity in {"destructive", "state_changing"}

default untrusted_target := "approval"

untrusted_target := settings.untrusted_target

default unseen_target := "allow"

unseen_target := settings.unseen_target

seen(label) if label in input.flow.labels

private_to_external_risk if {
	input.action == "call"
	external_sink
	seen("private")
	seen("untrusted")
	not targets_spared
}

default trusted_targets := "hold"

trusted_targets := settings.trusted_targets

# Every value aiming the call was named by the user (or, with "trusted", is in
# the user's records too); a call whose contract names no sink argument is
# never spared.
targets_spared if {
	trusted_targets in {"named", "trusted"}
	count(input.flow.provenance) > 0
	every entry in input.flow.provenance {
		spared_entry(entry)
	}
}

# The contract names the arguments that aim it, and the call sets none of them.
targets_spared if {
	trusted_targets in {"named", "trusted"}
	count(object.get(contract_flow, "sink_arguments", [])) > 0
	input.flow.provenance == []
}

spared_entry(entry) if "task_context" in entry.trusted_by

spared_entry(entry) if {
	trusted_targets == "trusted"
	entry.trusted
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

# A write guarding its integrity, decided without the flow context, is looked
# at by a person too.
needs contains "flow_context_missing" if {
	input.action == "call"
	not external_sink
	guarded_target
	not input.flow
}

# The proxy read the flow context without the provenance the contract asks for.
needs contains "flow_provenance_missing" if {
	input.action == "call"
	guarded_target
	count(object.get(contract_flow, "sink_arguments", [])) > 0
	input.flow
	not input.flow.provenance
}

default internal_targets := "provenance"

internal_targets := settings.internal_targets

# A target that is an existing directory entry, on a state_changing internal write.
listed_target(entry) if {
	internal_targets == "directory"
	not external_sink
	contract_flow.integrity == "state_changing"
	entry.directory
}

# One reason per untrusted value, naming it and its latest source.
untrusted_targets contains sprintf("flow_untrusted_target %s from %s call %s", [entry.argument, source.tool, source.call_id]) if {
	input.action == "call"
	untrusted_target != "off"
	guarded_target
	some entry in input.flow.provenance
	entry.seen == "untrusted"
	not listed_target(entry)
	source := entry.untrusted_sources[0]
}

unseen_targets contains sprintf("flow_unseen_target %s after untrusted output of %s", [entry.argument, seen.tool]) if {
	input.action == "call"
	unseen_target == "approval"
	guarded_target
	some entry in input.flow.provenance
	entry.seen == "unseen"
	not listed_target(entry)
	some seen in input.flow.principal.seen
	seen.label == "untrusted"
}

default untrusted_payload := "approval"

untrusted_payload := settings.untrusted_payload

untrusted_payloads contains sprintf("flow_untrusted_payload %s from %s call %s", [entry.argument, source.tool, source.call_id]) if {
	input.action == "call"
	untrusted_payload != "off"
	guarded_target
	some entry in object.get(input.flow, "payload", [])
	entry.seen == "untrusted"
	source := entry.untrusted_sources[0]
}

# With unseen_target: approval, a link in a payload seen in no output at all
# after untrusted output is held as an unseen target is: the model spelled it.
unseen_payloads contains sprintf("flow_unseen_payload %s after untrusted output of %s", [entry.argument, seen.tool]) if {
	input.action == "call"
	unseen_target == "approval"
	guarded_target
	some entry in object.get(input.flow, "payload", [])
	entry.form == "link"
	entry.seen == "unseen"
	some seen in input.flow.principal.seen
	seen.label == "untrusted"
}

needs contains reason if some reason in unseen_payloads

deny contains reason if {
	untrusted_payload == "deny"
	some reason in untrusted_payloads
}

needs contains reason if {
	untrusted_payload != "deny"
	some reason in untrusted_payloads
}

deny contains reason if {
	untrusted_target == "deny"
	some reason in untrusted_targets
}

needs contains reason if {
	untrusted_target != "deny"
	some reason in untrusted_targets
}

needs contains reason if some reason in unseen_targets
