{{/*
Names, labels and derived values shared by every template. Each helper takes
the chart's root context (or a subchart's, via .Subcharts.toolproxy).
*/}}

{{- define "toolproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "toolproxy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<suffix>", kept within the 63-character name limit. */}}
{{- define "toolproxy.component" -}}
{{- $full := include "toolproxy.fullname" .root }}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .suffix)))) .suffix | trimSuffix "-" }}
{{- end }}

{{- define "toolproxy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "toolproxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "toolproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "toolproxy.labels" -}}
helm.sh/chart: {{ include "toolproxy.chart" . }}
{{ include "toolproxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: toolproxy
{{- end }}

{{- define "toolproxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "toolproxy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference "repository:tag", or "repository:tag@sha256:..." when the
values pin a digest (the runtime then pulls exactly that image; the tag is kept
for people reading the manifest). Takes (dict "image" <values image> "tag" <default tag>).
*/}}
{{- define "toolproxy.imageRef" -}}
{{- $ref := printf "%s:%s" .image.repository (default .tag .image.tag) }}
{{- if .image.digest }}{{ $ref = printf "%s@%s" $ref .image.digest }}{{ end }}
{{- $ref }}
{{- end }}

{{- define "toolproxy.image" -}}
{{- include "toolproxy.imageRef" (dict "image" .Values.image "tag" .Chart.AppVersion) }}
{{- end }}

{{/* Path of the proxy's config file inside the toolproxy container. */}}
{{- define "toolproxy.configPath" -}}/etc/toolproxy/config/config.yaml{{- end }}
{{- define "toolproxy.redisTlsPath" -}}/etc/toolproxy/redis-tls{{- end }}
{{- define "toolproxy.opaConfigPath" -}}/opa-config{{- end }}
{{- define "toolproxy.bundleTokenPath" -}}/var/run/opa/bundle-token{{- end }}
{{- define "toolproxy.opaSocket" -}}{{ .Values.opa.socket.mountPath }}/opa.sock{{- end }}

{{- define "toolproxy.registryConfigMap" -}}
{{- if .Values.registry.existingConfigMap }}{{ .Values.registry.existingConfigMap }}
{{- else }}{{ include "toolproxy.component" (dict "root" . "suffix" "registry") }}{{ end }}
{{- end }}

{{- define "toolproxy.policiesConfigMap" -}}
{{- if .Values.opa.policies.existingConfigMap }}{{ .Values.opa.policies.existingConfigMap }}
{{- else }}{{ include "toolproxy.component" (dict "root" . "suffix" "policies") }}{{ end }}
{{- end }}

{{- define "toolproxy.catalogConfigMap" -}}
{{- if .Values.opa.catalog.existingConfigMap }}{{ .Values.opa.catalog.existingConfigMap }}
{{- else }}{{ include "toolproxy.component" (dict "root" . "suffix" "opa-catalog") }}{{ end }}
{{- end }}

{{- define "toolproxy.dataConfigMap" -}}
{{- if .Values.opa.data.existingConfigMap }}{{ .Values.opa.data.existingConfigMap }}
{{- else }}{{ include "toolproxy.component" (dict "root" . "suffix" "opa-data") }}{{ end }}
{{- end }}

{{/* OPA's policy data document: the bundled example deep-merged with opa.data.document. */}}
{{- define "toolproxy.policyData" -}}
{{- $doc := dict }}
{{- if .Values.opa.data.includeExamples }}
{{- range $path, $_ := .Files.Glob "files/opa-data/*.json" }}
{{- $doc = mustMergeOverwrite $doc ($.Files.Get $path | fromJson) }}
{{- end }}
{{- end }}
{{- $extra := .Values.opa.data.document }}
{{- if kindIs "string" $extra }}{{/* --set-file opa.data.document=data.json: the file's text (JSON or YAML) */}}
{{- $extra = fromYaml $extra }}
{{- if hasKey $extra "Error" }}
{{- fail (printf "opa.data.document: not a JSON or YAML object: %s" (get $extra "Error")) }}
{{- end }}
{{- end }}
{{- toJson (mustMergeOverwrite $doc (deepCopy $extra)) }}
{{- end }}

{{/*
"true" when OPA gets policy data (bundled/inline or from a ConfigMap). Never in
bundle mode: the bundle owns data.toolproxy and carries its data and catalog.
*/}}
{{- define "toolproxy.hasData" -}}
{{- if eq .Values.opa.policySource "configmap" }}
{{- if or .Values.opa.data.existingConfigMap (ne (include "toolproxy.policyData" .) "{}") }}true{{ end }}
{{- end }}
{{- end }}

{{/*
Where OPA's tool catalog comes from: "configmap" (opa.catalog.data or
existingConfigMap), "generate" (an init container runs `toolproxy opa-data`
on the registry) or "" (bundle mode: the bundle ships it).
*/}}
{{- define "toolproxy.catalogSource" -}}
{{- with .Values.opa.catalog }}
{{- if eq $.Values.opa.policySource "configmap" }}
{{- if or .existingConfigMap .data }}configmap{{ else if .generate }}generate{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "toolproxy.hasCatalog" -}}
{{- if include "toolproxy.catalogSource" . }}true{{ end }}
{{- end }}

{{/*
The registry's user files checked at render for what would stop the proxy at start: YAML that does not
parse, a tool without its required keys, a mode, risk or backend type the registry does not have.
`toolproxy check-registry` checks everything else; run it on the files before shipping them.
*/}}
{{- define "toolproxy.checkRegistryFiles" -}}
{{- range $name, $text := .Values.registry.files }}
{{- $doc := fromYaml $text }}
{{- if hasKey $doc "Error" }}
{{- fail (printf "registry.files[%s]: not YAML: %s" $name (get $doc "Error")) }}
{{- end }}
{{- range $i, $tool := (get $doc "tools" | default list) }}
{{- $where := printf "registry.files[%s]: tools[%d] (%v)" $name $i (get $tool "name" | default "no name") }}
{{- range $key := list "name" "version" "description" "mode" "risk" "inputSchema" "backend" }}
{{- if not (hasKey $tool $key) }}
{{- fail (printf "%s: %s is required (toolproxy check-registry %s says what else)" $where $key $name) }}
{{- end }}
{{- end }}
{{- if not (has (get $tool "mode") (list "read" "write")) }}
{{- fail (printf "%s: mode %v is not read or write" $where (get $tool "mode")) }}
{{- end }}
{{- if not (has (get $tool "risk") (list "read" "write" "external" "financial" "destructive")) }}
{{- fail (printf "%s: risk %v is not one of read, write, external, financial, destructive" $where (get $tool "risk")) }}
{{- end }}
{{- if not (has (get (get $tool "backend") "type") (list "http" "mcp")) }}
{{- fail (printf "%s: backend.type %v is not http or mcp" $where (get (get $tool "backend") "type")) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Registry files rendered into the chart's registry ConfigMap: name -> text. */}}
{{- define "toolproxy.registryFiles" -}}
{{- include "toolproxy.checkRegistryFiles" . }}
{{- $files := dict }}
{{- if .Values.registry.includeExamples }}
{{- range $path, $_ := .Files.Glob "files/registry/*.yaml" }}
{{- $_ := set $files (base $path) ($.Files.Get $path) }}
{{- end }}
{{- end }}
{{- range $name, $text := .Values.registry.files }}
{{- $_ := set $files $name $text }}
{{- end }}
{{- toYaml $files }}
{{- end }}

{{/* Rego files rendered into the chart's policies ConfigMap (tests excluded). */}}
{{- define "toolproxy.policyFiles" -}}
{{- $files := dict }}
{{- if .Values.opa.policies.includeDefault }}
{{- range $path, $_ := .Files.Glob "files/policies/**.rego" }}
{{- if not (hasSuffix "_test.rego" $path) }}
{{- $_ := set $files (trimPrefix "files/policies/" $path | replace "/" ".") ($.Files.Get $path) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $text := .Values.opa.policies.files }}
{{- $_ := set $files $name $text }}
{{- end }}
{{- toYaml $files }}
{{- end }}

{{/*
The proxy's YAML config: the user's proxy.config with the keys the chart owns
merged over it (ports, bind addresses, mount paths, OPA URL, Redis, backends).
*/}}
{{- define "toolproxy.proxyConfig" -}}
{{- $p := .Values.proxy }}
{{- $owned := dict
  "listen" (dict "host" $p.agentBindAddress "port" $p.ports.agent)
  "admin" (dict "host" "0.0.0.0" "port" $p.ports.admin)
  "ops" (dict "host" "0.0.0.0" "port" $p.ports.ops)
  "registry" (dict "paths" (list .Values.registry.mountPath))
  "opa" (dict "url" (printf "unix://%s" (include "toolproxy.opaSocket" .)) "decision_path" .Values.opa.decisionPath
              "push_catalog" false)
  "integrity" (dict "mac_key_file" (printf "%s/%s" (include "toolproxy.recordMacPath" .) (include "toolproxy.recordMacKey" .)))
  "log" (dict "level" $p.logLevel)
  "shutdown" (dict "drain_timeout_ms" (mul (int $p.drainSeconds) 1000)) }}
{{- with $p.tracing }}
{{- if .endpoint }}
{{- $_ := set $owned "tracing" (dict "endpoint" .endpoint "sampler" .sampler "sampler_arg" .samplerArg
                                "service_name" .serviceName "stages" (.stages | default "events")) }}
{{- end }}
{{- end }}
{{- if .Values.opa.allowTcp }}
{{- $_ := set $owned.opa "url" (printf "http://127.0.0.1:%d" (int .Values.opa.port)) }}
{{- $_ := set $owned.opa "allow_tcp" true }}
{{- end }}
{{- if .Values.opa.authz.enabled }}
{{- $_ := set $owned.opa "token_file" (printf "%s/%s" (include "toolproxy.opaTokenPath" .) (include "toolproxy.opaTokenKey" .)) }}
{{- end }}
{{- /* OPA refuses writes from the pod (see opa-system.yaml): the catalog is loaded from files, never pushed. */}}
{{- if $p.jwks.secretName }}
{{- $_ := set $owned "identity" (dict "jwt" (dict "jwks_file" (printf "%s/%s" $p.jwks.mountPath $p.jwks.key))) }}
{{- end }}
{{- if $p.hopSecret.secretName }}
{{- $identity := default (dict) (get $owned "identity") }}
{{- $_ := set $identity "headers" (dict "proof_secret_file" (printf "%s/%s" $p.hopSecret.mountPath $p.hopSecret.key)) }}
{{- $_ := set $owned "identity" $identity }}
{{- end }}
{{- if $p.adminJwks.secretName }}
{{- $_ := set $owned "admin_identity" (dict "jwt" (dict "jwks_file" (printf "%s/%s" $p.adminJwks.mountPath $p.adminJwks.key))) }}
{{- end }}
{{- if $p.backends }}
{{- $_ := set $owned "backends" (dict "services" $p.backends) }}
{{- end }}
{{- /* Backend credentials: each _file setting names a key of the credential's own Secret, mounted at
      credentialsMountPath/<name> in the toolproxy container only. */}}
{{- if $p.credentials }}
{{- $credentials := dict }}
{{- range $name, $credential := $p.credentials }}
{{- $settings := dict }}
{{- range $key, $value := $credential.settings }}
{{- if hasSuffix "_file" $key }}
{{- $_ := set $settings $key (printf "%s/%s/%s" $p.credentialsMountPath $name $value) }}
{{- else }}
{{- $_ := set $settings $key $value }}
{{- end }}
{{- end }}
{{- $_ := set $credentials $name $settings }}
{{- end }}
{{- $_ := set $owned "credentials" $credentials }}
{{- end }}
{{- with $p.callTokens }}
{{- if .secretName }}
{{- $tokens := dict "signing_key_file" (printf "%s/%s" .mountPath .key) "key_id" .keyId }}
{{- if .verificationKeysKey }}{{ $_ := set $tokens "verification_keys_file" (printf "%s/%s" .mountPath .verificationKeysKey) }}{{ end }}
{{- $_ := set $owned "call_tokens" $tokens }}
{{- end }}
{{- end }}
{{- $redis := dict "mode" $p.redis.mode "min_replica_acks" (int $p.redis.minReplicaAcks) "accept_eviction" $p.redis.acceptEviction }}
{{- if $p.redis.username }}{{ $_ := set $redis "username" $p.redis.username }}{{ end }}
{{- if eq $p.redis.mode "sentinel" }}
{{- $_ := set $redis "sentinels" $p.redis.sentinel.addresses }}
{{- $_ := set $redis "sentinel_service" $p.redis.sentinel.serviceName }}
{{- else if eq $p.redis.mode "cluster" }}
{{- $_ := set $redis "cluster_nodes" $p.redis.cluster.nodes }}
{{- else }}
{{- $_ := set $redis "url" $p.redis.url }}
{{- end }}
{{- with $p.redis.tls }}
{{- if .secretName }}
{{- if ne $p.redis.mode "standalone" }}{{ $_ := set $redis "tls" true }}{{ end }}
{{- $_ := set $redis "tls_ca_file" (printf "%s/%s" (include "toolproxy.redisTlsPath" $) .caKey) }}
{{- if .certKey }}{{ $_ := set $redis "tls_cert_file" (printf "%s/%s" (include "toolproxy.redisTlsPath" $) .certKey) }}{{ end }}
{{- if .keyKey }}{{ $_ := set $redis "tls_key_file" (printf "%s/%s" (include "toolproxy.redisTlsPath" $) .keyKey) }}{{ end }}
{{- end }}
{{- end }}
{{- $_ := set $owned "redis" $redis }}
{{- toYaml (mustMergeOverwrite (deepCopy $p.config) $owned) }}
{{- end }}

{{/* Validation that the schema cannot express; called from the Deployment/ConfigMaps. */}}
{{- define "toolproxy.validate" -}}
{{- if eq .Values.opa.policySource "bundle" }}
{{- if not .Values.opa.bundle.serviceUrl }}
{{- fail "opa.policySource=bundle needs opa.bundle.serviceUrl" }}
{{- end }}
{{- with .Values.opa }}
{{- if or .data.document .data.existingConfigMap .catalog.data .catalog.existingConfigMap .policies.files .policies.existingConfigMap }}
{{- fail "opa.policySource=bundle: the bundle carries the policies, their data and the catalog; unset opa.policies.files/existingConfigMap, opa.data.document/existingConfigMap and opa.catalog.*" }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (eq .Values.opa.policySource "configmap") (not .Values.opa.policies.existingConfigMap) (not (fromYaml (include "toolproxy.policyFiles" .))) }}
{{- fail "no Rego policies: set opa.policies.includeDefault, opa.policies.files or opa.policies.existingConfigMap (OPA would deny every call)" }}
{{- end }}
{{- if and (eq .Values.opa.policySource "configmap") (not (include "toolproxy.catalogSource" .)) }}
{{- fail "no tool catalog for OPA: set opa.catalog.generate, opa.catalog.data or opa.catalog.existingConfigMap (OPA refuses the proxy's catalog push, so decisions would fail closed)" }}
{{- end }}
{{- with .Values.proxy.callTokens }}
{{- if and .secretName (or (eq .mountPath $.Values.proxy.jwks.mountPath) (eq .mountPath $.Values.proxy.adminJwks.mountPath)) }}
{{- fail "proxy.callTokens.mountPath must differ from proxy.jwks.mountPath and proxy.adminJwks.mountPath" }}
{{- end }}
{{- end }}
{{- if and .Values.proxy.jwks.secretName .Values.proxy.adminJwks.secretName (eq .Values.proxy.jwks.mountPath .Values.proxy.adminJwks.mountPath) }}
{{- fail "proxy.jwks.mountPath and proxy.adminJwks.mountPath must differ" }}
{{- end }}
{{- if and (not .Values.registry.existingConfigMap) (not (fromYaml (include "toolproxy.registryFiles" .))) }}
{{- fail "no tool registry: set registry.includeExamples, registry.files or registry.existingConfigMap" }}
{{- end }}
{{- with .Values.proxy.redis }}
{{- if and (eq .mode "sentinel") (not .sentinel.addresses) }}
{{- fail "proxy.redis.mode=sentinel needs proxy.redis.sentinel.addresses (host:port of the Sentinels)" }}
{{- end }}
{{- if and (eq .mode "cluster") (not .cluster.nodes) }}
{{- fail "proxy.redis.mode=cluster needs proxy.redis.cluster.nodes (a few startup nodes, host:port)" }}
{{- end }}
{{- if and (ne .mode "standalone") .urlSecret.name }}
{{- fail "proxy.redis.urlSecret is for mode=standalone; sentinel/cluster take addresses, and the password from passwordSecret" }}
{{- end }}
{{- end }}
{{- if and (eq .Values.proxy.redis.mode "standalone") .Values.proxy.redis.tls.secretName (not (hasPrefix "rediss://" .Values.proxy.redis.url)) (not .Values.proxy.redis.urlSecret.name) }}
{{- fail "proxy.redis.tls.secretName is set but proxy.redis.url is not rediss://" }}
{{- end }}
{{- if ne (empty .Values.proxy.redis.tls.certKey) (empty .Values.proxy.redis.tls.keyKey) }}
{{- fail "proxy.redis.tls.certKey and keyKey go together (mutual TLS needs both)" }}
{{- end }}
{{- $identity := default (dict) (fromYaml (include "toolproxy.proxyConfig" .)).identity }}
{{- if eq (toString (default "jwt" $identity.mode)) "headers" }}
{{- $headers := default (dict) $identity.headers }}
{{- if not (or $headers.proof_secret_file $headers.xfcc_trusted_proxies) }}
{{- fail "identity.mode headers needs a proof of the trusted hop: set proxy.hopSecret.secretName (a secret header the mesh injects) or proxy.config.identity.headers.xfcc_trusted_proxies and xfcc_proxy_ids (Envoy's XFCC); without one the agent could name any subject" }}
{{- end }}
{{- end }}
{{- if .Values.egressGuard.enabled }}
{{- $uid := .Values.proxy.securityContext.runAsUser }}
{{- if not $uid }}
{{- fail "egressGuard.enabled needs proxy.securityContext.runAsUser (the UID the rules let through)" }}
{{- end }}
{{- if .Values.agent.enabled }}
{{- /* The agent's UID: its container's, else the pod's; with neither, its image's USER, which the chart cannot see. */}}
{{- $agentUid := default (default dict .Values.podSecurityContext).runAsUser .Values.agent.securityContext.runAsUser }}
{{- if not $agentUid }}
{{- fail "egressGuard.enabled needs the agent's UID: set agent.securityContext.runAsUser (or podSecurityContext.runAsUser); without one the agent runs as its image's USER, which may be the proxy's UID (the guard lets only that UID through)" }}
{{- end }}
{{- if eq (int $uid) (int $agentUid) }}
{{- fail "egressGuard.enabled: the agent's UID (agent.securityContext.runAsUser, else podSecurityContext.runAsUser) must differ from proxy.securityContext.runAsUser (the guard lets only the proxy's UID through)" }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.proxy.redis }}
{{- /* Whoever reaches an unauthenticated Redis can approve their own calls and forge outcomes. */}}
{{- if not (or .passwordSecret.name .urlSecret.name (and .tls.secretName .tls.certKey) .allowUnauthenticated) }}
{{- fail "proxy.redis: no credentials. Set proxy.redis.passwordSecret (plus proxy.redis.username for an ACL user; docs/scale.md has the least-privilege ACL), a urlSecret whose URL carries them, or a client certificate (proxy.redis.tls.certKey/keyKey); proxy.redis.allowUnauthenticated=true only for a throwaway cluster" }}
{{- end }}
{{- if and .username (not (or .passwordSecret.name .urlSecret.name)) }}
{{- fail "proxy.redis.username needs proxy.redis.passwordSecret (an ACL user authenticates with both)" }}
{{- end }}
{{- end }}
{{- if not .Values.proxy.integrity.macKeySecret.name }}
{{- fail "proxy.integrity.macKeySecret.name: no record MAC key. Every sidecar that shares a Redis needs the same key, kept across restarts, or records written before a restart (or by another replica) are refused: create one Secret (kubectl create secret generic toolproxy-record-mac --from-literal=mac.key=\"$(openssl rand -hex 32)\") and name it here" }}
{{- end }}
{{- with .Values.proxy.callTokens }}
{{- if not .secretName }}
{{- fail "proxy.callTokens.secretName: no call-token signing key. Backends verify every call's token against keys they trust, never a pod's own: make one with `toolproxy call-token-key --out signing-key.pem`, put it in a Secret (key signing-key.pem), name it here, and give the JWKS it printed as proxy.callTokens.jwks" }}
{{- end }}
{{- $kids := list }}
{{- range (default (list) .jwks.keys) }}{{ $kids = append $kids .kid }}{{ end }}
{{- if not $kids }}
{{- fail "proxy.callTokens.jwks: no public keys. Give the JWKS `toolproxy call-token-key` printed for the Secret's key: it renders into the ConfigMap backends verify call tokens with" }}
{{- end }}
{{- if and .keyId (not (has .keyId $kids)) }}
{{- fail (printf "proxy.callTokens.jwks has no key with kid %q (proxy.callTokens.keyId): backends could not verify a single call token" .keyId) }}
{{- end }}
{{- end }}
{{- if and .Values.agent.enabled (lt (int .Values.agent.terminationGracePeriodSeconds) (add (int .Values.proxy.drainSeconds) 5)) }}
{{- fail (printf "agent.terminationGracePeriodSeconds (%d) must be at least proxy.drainSeconds + 5 (%d): the kubelet kills what still runs when the grace period ends, and the agent, then the proxy's drain, then OPA share it" (int .Values.agent.terminationGracePeriodSeconds) (add (int .Values.proxy.drainSeconds) 5)) }}
{{- end }}
{{- $userOpa := default (dict) .Values.proxy.config.opa }}
{{- if or (hasKey $userOpa "url") (hasKey $userOpa "allow_tcp") }}
{{- fail "proxy.config.opa.url and opa.allow_tcp are the chart's: OPA listens on a Unix socket only the proxy and OPA mount (opa.socket). opa.allowTcp=true is the escape hatch to TCP on loopback, which any container of the pod can bind first" }}
{{- end }}
{{- $ports := list (int .Values.proxy.ports.agent) (int .Values.proxy.ports.admin) (int .Values.proxy.ports.ops) (int .Values.opa.diagnosticPort) }}
{{- if .Values.opa.allowTcp }}{{ $ports = append $ports (int .Values.opa.port) }}{{ end }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail (printf "proxy.ports and opa ports must all differ (they share the pod's network namespace): %v" $ports) }}
{{- end }}
{{- end }}

{{/*
The generated Secret (secrets.yaml): OPA's API token, unless given from a Secret of your own. Kept across
upgrades (lookup). The record MAC key is never generated: a fleet shares one (proxy.integrity.macKeySecret).
*/}}
{{- define "toolproxy.generatedSecret" -}}{{ include "toolproxy.component" (dict "root" . "suffix" "secrets") }}{{- end }}
{{- define "toolproxy.recordMacPath" -}}/etc/toolproxy/record-mac{{- end }}
{{- define "toolproxy.opaTokenPath" -}}/etc/toolproxy/opa-token{{- end }}
{{- define "toolproxy.recordMacSecret" -}}{{ .Values.proxy.integrity.macKeySecret.name }}{{- end }}
{{- define "toolproxy.recordMacKey" -}}{{ .Values.proxy.integrity.macKeySecret.key }}{{- end }}
{{- define "toolproxy.opaTokenSecret" -}}{{ .Values.opa.authz.tokenSecret.name | default (include "toolproxy.generatedSecret" .) }}{{- end }}
{{- define "toolproxy.opaTokenKey" -}}{{ ternary .Values.opa.authz.tokenSecret.key "opa-token" (not (empty .Values.opa.authz.tokenSecret.name)) }}{{- end }}
