# OPA's own API authorization (opa run --authentication=token --authorization=basic):
# OPA answers the proxy only. Every container of the pod shares the network
# namespace, so without this the agent container could read every tenant's
# policy data, ask decisions unaudited, or rewrite policies.
#
# Loaded by the chart, `toolproxy dev` and the tests (proxy/policy/opa_authz.rego);
# configured through OPA's environment, so one file serves them all:
#   TOOLPROXY_OPA_TOKEN          the proxy's bearer token (a Secret; required: without it nothing but
#                                /health is admitted)
#   TOOLPROXY_OPA_DECISION_PATH  opa.decision_path (default toolproxy/decision)
#   TOOLPROXY_OPA_CATALOG_PUSH   "true" when the proxy PUTs its tool catalog (opa.push_catalog; the
#                                chart generates the catalog instead and leaves this unset)
#   TOOLPROXY_OPA_ADMIN_TOKEN    optional, never set by the chart: a second token with full access, for
#                                the test suite and the dev stack's console that load policies and data
#
# Denied requests get 401. Tokens are compared as SHA-256 digests, so the time a comparison takes says
# nothing about the token.
package system.authz

default allow := false

env := opa.runtime().env

# Probes: no data behind it.
allow if input.path == ["health"]

# The proxy: its decision document, nothing else of data.
allow if {
	holds("TOOLPROXY_OPA_TOKEN")
	input.method in {"GET", "POST"}
	input.path == array.concat(["v1", "data"], decision_path)
}

# The proxy: its tool catalog, when it pushes one.
allow if {
	holds("TOOLPROXY_OPA_TOKEN")
	object.get(env, "TOOLPROXY_OPA_CATALOG_PUSH", "") == "true"
	input.method == "PUT"
	input.path == ["v1", "data", "toolproxy", "catalog"]
}

allow if holds("TOOLPROXY_OPA_ADMIN_TOKEN")

holds(name) if {
	expected := object.get(env, name, "")
	expected != ""
	crypto.sha256(input.identity) == crypto.sha256(expected)
}

decision_path := split(trim(object.get(env, "TOOLPROXY_OPA_DECISION_PATH", "toolproxy/decision"), "/"), "/")
