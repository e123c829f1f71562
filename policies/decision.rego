# The decision document the proxy asks for (POST /v1/data/toolproxy/decision):
#   Allow = IdentityValid AND ToolAllowed AND ResourceOwned AND ScopeSufficient AND ApprovalSatisfied
# Actions: "call" (may this call run now: the call rules below), "list" (which tools
# may this caller see: the listing rules, listing.rego), "compensate" (may this caller
# undo an operation: compensation.rego), "cancel" and "read_operation" (may this
# caller act on another subject's operation: operations.rego).
# Input and output are described by schemas/opa-input.schema.json and
# schemas/opa-decision.schema.json. Reasons are for the audit trail; the proxy
# never shows them to the model.
package toolproxy

import data.toolproxy.approvals
import data.toolproxy.compensation
import data.toolproxy.flow
import data.toolproxy.limits
import data.toolproxy.listing
import data.toolproxy.operations
import data.toolproxy.quotas
import data.toolproxy.resource_access
import data.toolproxy.tools

default policy_revision := "unversioned"

# Set by whoever ships the policy (bundle manifest step, ConfigMap, dev data).
policy_revision := data.toolproxy.meta.revision

# The proxy compares this with the digest of its registry and reloads the
# catalog when OPA lost it (a restarted OPA) or holds another one.
catalog_current if input.catalog_digest == data.toolproxy.catalog.digest

present(value) if {
	is_string(value)
	value != ""
}

identity_valid if {
	present(input.subject.id)
	present(input.subject.tenant)
}

agent_valid if present(input.agent.id)

identity_deny contains "identity_missing" if not identity_valid

identity_deny contains "agent_missing" if not agent_valid

reasons := ((((((identity_deny | tools.deny) | resource_access.deny) | limits.deny) | approvals.deny) | compensation.deny) | operations.deny) | flow.deny

default risk := "unknown"

risk := approvals.risk

base := {"policy_revision": policy_revision, "catalog_current": catalog_current}

default catalog_current := false

# The caller's quota class (quotas.rego), only on a decision that allows a call.
default quota := {}

quota := {"quota_class": quotas.quota_class}

decision := object.union(base, {
	"allow": true,
	"require_approval": false,
	"reasons": [],
	"visible_tools": sort([name | some name in listing.visible]),
}) if {
	input.action == "list"
	count(identity_deny) == 0
} else := object.union(base, {
	"allow": false,
	"require_approval": false,
	"reasons": sort([r | some r in reasons]),
	"risk": risk,
}) if {
	count(reasons) > 0
} else := object.union(base, {
	"allow": false,
	"require_approval": true,
	"reasons": sort([r | some r in approvals.needs]),
	"risk": risk,
}) if {
	input.action == "call"
	approvals.required
} else := object.union(object.union(base, quota), {
	"allow": input.action in {"call", "compensate", "cancel", "read_operation"},
	"require_approval": false,
	"reasons": [],
	"risk": risk,
})
