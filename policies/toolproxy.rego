# Placeholder decision until the authorization policies land: the proxy does
# not query OPA yet. Kept so the dev stack's OPA has a package to serve.
package toolproxy

default decision := {"allow": false, "require_approval": false, "reasons": ["no policy loaded"]}
