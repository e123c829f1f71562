# Resource ownership: every resource a call touches belongs to the caller's tenant
# (ResourceOwned). Facts come from OPA data, never from the tool arguments:
#   data.toolproxy.resource_kinds[kind].ownership  "tenant" (look the id up), "shared" or "at_write" (below)
#   data.toolproxy.resources[id]                   {"tenant": ..., "owner"?: subject}
# A resource id or kind that OPA does not know is refused (fail closed).
package toolproxy.resource_access

ownership(resource) := data.toolproxy.resource_kinds[resource.kind].ownership

owned(resource) if ownership(resource) == "shared"

owned(resource) if {
	ownership(resource) == "tenant"
	fact := data.toolproxy.resources[resource.id]
	fact.tenant == input.subject.tenant
	owner_matches(fact)
}

# A resource with an "owner" is the owner's alone, unless the caller holds an
# override role (support_admin may act on others' orders).
owner_matches(fact) if not fact.owner

owner_matches(fact) if fact.owner == input.subject.id

owner_matches(fact) if {
	fact.owner
	some role in data.toolproxy.tools.roles
	role in data.toolproxy.settings.owner_override_roles
}

# One reason per refused resource, so a batch-like call that mixes an owned and
# a foreign resource is refused as a whole and the audit trail names the item.
deny contains sprintf("resource_kind_unknown:%s", [resource.kind]) if {
	input.action in {"call", "compensate"}
	some resource in input.resources
	not ownership(resource)
}

deny contains sprintf("resource_not_owned:%s", [resource.id]) if {
	input.action in {"call", "compensate"}
	some resource in input.resources
	ownership(resource)
	not owned(resource)
}

# "at_write": too many ids for OPA data; the contract has the proxy read the owning tenant from the system
# of record under the call's lock, right before sending (ownership_read), and refuse another tenant's.
# A contract that declares no such read cannot touch the kind.
owned(resource) if {
	ownership(resource) == "at_write"
	input.tool.ownership_read == true
}
