{{/*
The public named templates: what a team includes in its own agent workload.

  initContainers:
    {{- include "toolproxy.initContainers" .Subcharts.toolproxy | nindent 4 }}
  containers:
    - name: my-agent
      ...
  volumes:
    {{- include "toolproxy.volumes" .Subcharts.toolproxy | nindent 4 }}
  metadata.labels:       {{- include "toolproxy.podLabels" .Subcharts.toolproxy | nindent 8 }}
  metadata.annotations:  {{- include "toolproxy.podAnnotations" .Subcharts.toolproxy | nindent 8 }}

Inside this chart the same templates are called with the root context (".").
The ConfigMaps, Services and NetworkPolicy they refer to are rendered by the
chart itself; the pod labels are what the Services and NetworkPolicy select.

The toolproxy and OPA containers are native sidecars: init containers with
restartPolicy: Always, after the run-to-completion ones. The kubelet starts
OPA, waits for its startup probe, starts the proxy, waits for its startup probe
(/readyz), and only then starts the pod's containers (the agent); at shutdown
it stops the agent first, then the proxy, then OPA. So no call leaves the agent
before its guard is ready, and the guard outlives the agent's last call.
*/}}

{{/* Labels every pod carrying the sidecars must have (Service and NetworkPolicy selectors). */}}
{{- define "toolproxy.podLabels" -}}
{{ include "toolproxy.selectorLabels" . }}
toolproxy.dev/sidecar: "true"
{{- end }}

{{/*
Pod annotations: roll the pods when the proxy's config or registry changes (the
config is read at start-up; the proxy reloads a registry in place, but OPA's
catalog of it is generated once, by the init container). Policies and the OPA catalog are deliberately not
here: OPA watches them, so editing those ConfigMaps changes decisions in place.
*/}}
{{- define "toolproxy.podAnnotations" -}}
checksum/toolproxy-config: {{ include "toolproxy.proxyConfig" . | sha256sum }}
checksum/toolproxy-registry: {{ printf "%s%s" .Values.registry.existingConfigMap (include "toolproxy.registryFiles" .) | sha256sum }}
{{- end }}

{{/* The agent container's view of the proxy: where to send tool calls. */}}
{{- define "toolproxy.agentEnv" -}}
- name: TOOLPROXY_URL
  value: {{ printf "http://127.0.0.1:%d" (int .Values.proxy.ports.agent) | quote }}
{{- end }}

{{/*
Init containers (list items for initContainers:): the egress guard (opt-in), the tool catalog for OPA
(produced from the mounted registry by the proxy image itself), then the two native sidecars.
*/}}
{{- define "toolproxy.initContainers" -}}
{{- include "toolproxy.validate" . }}
{{- if .Values.egressGuard.enabled }}
{{- /* The egress guard (values.yaml egressGuard; proxy/guard/): the default-deny rules of `toolproxy egress-rules`, loaded with
       nft in the pod's network namespace; root with NET_ADMIN only here, and only until the rules are in. */}}
- name: toolproxy-egress-guard
  image: {{ include "toolproxy.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - egress-rules
    - --uid
    - {{ .Values.proxy.securityContext.runAsUser | quote }}
    {{- if eq .Values.opa.policySource "bundle" }}
    # OPA fetches its bundles itself.
    - --uid
    - {{ .Values.opa.securityContext.runAsUser | quote }}
    {{- end }}
    - --agent-port
    - {{ .Values.proxy.ports.agent | quote }}
    {{- range .Values.egressGuard.allow }}
    - --allow
    - {{ . | quote }}
    {{- end }}
    {{- range .Values.egressGuard.dns }}
    - --dns
    - {{ . | quote }}
    {{- end }}
    - --apply
  resources:
    {{- toYaml .Values.egressGuard.resources | nindent 4 }}
  securityContext:
    runAsUser: 0
    runAsGroup: 0
    runAsNonRoot: false
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL], add: [NET_ADMIN]}
    seccompProfile: {type: RuntimeDefault}
{{- end }}
{{- if eq (include "toolproxy.catalogSource" .) "generate" }}
- name: toolproxy-opa-catalog
  image: {{ include "toolproxy.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [/bin/sh, -c]
  args:
    - exec python -m proxy.cli opa-data --registry "$0" > "$1/catalog.json"
    - {{ .Values.registry.mountPath }}
    - {{ .Values.opa.catalog.mountPath }}
  resources:
    {{- toYaml .Values.opa.catalog.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.proxy.securityContext | nindent 4 }}
  volumeMounts:
    - {name: toolproxy-registry, mountPath: {{ .Values.registry.mountPath }}, readOnly: true}
    - {name: toolproxy-opa-catalog, mountPath: {{ .Values.opa.catalog.mountPath }}}
{{- end }}
{{- include "toolproxy.nativeSidecars" . }}
{{- end }}

{{/*
Nothing: the sidecars are init containers now (toolproxy.initContainers renders them). Kept so that a
chart that still includes it under containers: renders the same pod instead of failing.
*/}}
{{- define "toolproxy.sidecars" -}}
{{- end }}

{{- define "toolproxy.nativeSidecars" -}}
{{- $p := .Values.proxy }}
{{- $o := .Values.opa }}
- name: toolproxy-opa
  image: {{ include "toolproxy.imageRef" (dict "image" $o.image "tag" $o.image.tag) | quote }}
  imagePullPolicy: {{ $o.image.pullPolicy }}
  restartPolicy: Always
  args:
    - run
    - --server
    {{- if $o.allowTcp }}
    - --addr=127.0.0.1:{{ $o.port }}
    {{- else }}
    - --addr=unix://{{ include "toolproxy.opaSocket" . }}
    {{- /* The socket's directory is mounted into the toolproxy and OPA containers only: that mount is the
           boundary, and the two containers run as different users, so the socket admits every user. */}}
    - --unix-socket-perm=666
    {{- end }}
    - --diagnostic-addr=0.0.0.0:{{ $o.diagnosticPort }}
    - --log-level={{ $o.logLevel }}
    - --log-format=json
    - --skip-version-check
    {{- /* kubelet mounts ConfigMaps as symlinks into hidden ..<timestamp> dirs; load only the visible names. */}}
    - --ignore=.*
    {{- if $o.authz.enabled }}
    - --authentication=token
    - --authorization=basic
    {{- end }}
    {{- if $o.decisionLogsToConsole }}
    - --set=decision_logs.console=true
    {{- end }}
    {{- if eq $o.policySource "bundle" }}
    - --config-file={{ include "toolproxy.opaConfigPath" . }}/config.yaml
    {{- end }}
    {{- if or (eq $o.policySource "configmap") (include "toolproxy.hasCatalog" .) (include "toolproxy.hasData" .) $o.authz.enabled }}
    - --watch
    {{- end }}
    {{- if eq $o.policySource "configmap" }}
    - {{ $o.policies.mountPath }}
    {{- end }}
    {{- if $o.authz.enabled }}
    - {{ $o.authz.mountPath }}
    {{- end }}
    {{- if include "toolproxy.hasData" . }}
    - {{ $o.data.mountPath }}
    {{- end }}
    {{- if include "toolproxy.hasCatalog" . }}
    - {{ printf "%s:%s" $o.catalog.dataPath $o.catalog.mountPath }}
    {{- end }}
  {{- if or $o.authz.enabled $o.goMemLimit }}
  env:
    {{- if $o.goMemLimit }}
    # Go's soft memory limit: OPA collects garbage harder as it nears it, before the container limit kills it.
    - {name: GOMEMLIMIT, value: {{ $o.goMemLimit | quote }}}
    {{- end }}
    {{- if $o.authz.enabled }}
    # Read by the system.authz policy (opa.runtime().env): the one bearer token OPA answers.
    - name: TOOLPROXY_OPA_TOKEN
      valueFrom: {secretKeyRef: {name: {{ include "toolproxy.opaTokenSecret" . | quote }}, key: {{ include "toolproxy.opaTokenKey" . | quote }}}}
    - name: TOOLPROXY_OPA_DECISION_PATH
      value: {{ $o.decisionPath | quote }}
    {{- end }}
  {{- end }}
  ports:
    - {name: opa-diag, containerPort: {{ $o.diagnosticPort }}, protocol: TCP}
  {{- $health := ternary "/health?bundles" "/health" (eq $o.policySource "bundle") }}
  startupProbe:
    httpGet: {path: {{ $health | quote }}, port: opa-diag}
    {{- toYaml $o.probes.startup | nindent 4 }}
  livenessProbe:
    httpGet: {path: /health, port: opa-diag}
    {{- toYaml $o.probes.liveness | nindent 4 }}
  readinessProbe:
    httpGet: {path: {{ $health | quote }}, port: opa-diag}
    {{- toYaml $o.probes.readiness | nindent 4 }}
  resources:
    {{- toYaml $o.resources | nindent 4 }}
  securityContext:
    {{- toYaml $o.securityContext | nindent 4 }}
  volumeMounts:
    - {name: toolproxy-opa-tmp, mountPath: /tmp}
    {{- if not $o.allowTcp }}
    - {name: toolproxy-opa-socket, mountPath: {{ $o.socket.mountPath }}}
    {{- end }}
    {{- if eq $o.policySource "configmap" }}
    - {name: toolproxy-policies, mountPath: {{ $o.policies.mountPath }}, readOnly: true}
    {{- else }}
    - {name: toolproxy-opa-config, mountPath: {{ include "toolproxy.opaConfigPath" . }}, readOnly: true}
    {{- if $o.bundle.tokenSecret.name }}
    - {name: toolproxy-opa-bundle-token, mountPath: {{ include "toolproxy.bundleTokenPath" . }}, readOnly: true}
    {{- end }}
    {{- end }}
    {{- if $o.authz.enabled }}
    - {name: toolproxy-opa-authz, mountPath: {{ $o.authz.mountPath }}, readOnly: true}
    {{- end }}
    {{- if include "toolproxy.hasData" . }}
    - {name: toolproxy-opa-data, mountPath: {{ $o.data.mountPath }}, readOnly: true}
    {{- end }}
    {{- if include "toolproxy.hasCatalog" . }}
    - {name: toolproxy-opa-catalog, mountPath: {{ $o.catalog.mountPath }}, readOnly: true}
    {{- end }}
- name: toolproxy
  image: {{ include "toolproxy.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  restartPolicy: Always
  args: [run, --config, {{ include "toolproxy.configPath" . }}]
  ports:
    - {name: tp-admin, containerPort: {{ $p.ports.admin }}, protocol: TCP}
    - {name: tp-ops, containerPort: {{ $p.ports.ops }}, protocol: TCP}
  env:
    - name: TOOLPROXY_IDENTITY_AGENT_ID
      {{- if $p.agentId }}
      value: {{ $p.agentId | quote }}
      {{- else }}
      valueFrom: {fieldRef: {fieldPath: spec.serviceAccountName}}
      {{- end }}
    {{- with $p.redis.urlSecret }}{{ if .name }}
    - name: TOOLPROXY_REDIS_URL
      valueFrom: {secretKeyRef: {name: {{ .name | quote }}, key: {{ .key | quote }}}}
    {{- end }}{{ end }}
    {{- with $p.redis.passwordSecret }}{{ if .name }}
    - name: TOOLPROXY_REDIS_PASSWORD
      valueFrom: {secretKeyRef: {name: {{ .name | quote }}, key: {{ .key | quote }}}}
    {{- end }}{{ end }}
    {{- with $p.redis.sentinel.passwordSecret }}{{ if and .name (eq $p.redis.mode "sentinel") }}
    - name: TOOLPROXY_REDIS_SENTINEL_PASSWORD
      valueFrom: {secretKeyRef: {name: {{ .name | quote }}, key: {{ .key | quote }}}}
    {{- end }}{{ end }}
    {{- with $p.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  livenessProbe:
    httpGet: {path: /healthz, port: tp-ops}
    {{- toYaml $p.probes.liveness | nindent 4 }}
  readinessProbe:
    httpGet: {path: /readyz, port: tp-ops}
    {{- toYaml $p.probes.readiness | nindent 4 }}
  startupProbe:
    httpGet: {path: /readyz, port: tp-ops}
    {{- toYaml $p.probes.startup | nindent 4 }}
  resources:
    {{- toYaml $p.resources | nindent 4 }}
  securityContext:
    {{- toYaml $p.securityContext | nindent 4 }}
  volumeMounts:
    - {name: toolproxy-config, mountPath: {{ include "toolproxy.configPath" . | dir }}, readOnly: true}
    - {name: toolproxy-registry, mountPath: {{ .Values.registry.mountPath }}, readOnly: true}
    - {name: toolproxy-tmp, mountPath: /tmp}
    - {name: toolproxy-record-mac, mountPath: {{ include "toolproxy.recordMacPath" . }}, readOnly: true}
    {{- if not .Values.opa.allowTcp }}
    - {name: toolproxy-opa-socket, mountPath: {{ .Values.opa.socket.mountPath }}}
    {{- end }}
    {{- if .Values.opa.authz.enabled }}
    - {name: toolproxy-opa-token, mountPath: {{ include "toolproxy.opaTokenPath" . }}, readOnly: true}
    {{- end }}
    {{- if $p.redis.tls.secretName }}
    - {name: toolproxy-redis-tls, mountPath: {{ include "toolproxy.redisTlsPath" . }}, readOnly: true}
    {{- end }}
    {{- if $p.jwks.secretName }}
    - {name: toolproxy-jwks, mountPath: {{ $p.jwks.mountPath }}, readOnly: true}
    {{- end }}
    {{- if $p.adminJwks.secretName }}
    - {name: toolproxy-admin-jwks, mountPath: {{ $p.adminJwks.mountPath }}, readOnly: true}
    {{- end }}
    {{- if $p.hopSecret.secretName }}
    - {name: toolproxy-hop-secret, mountPath: {{ $p.hopSecret.mountPath }}, readOnly: true}
    {{- end }}
    {{- range $name, $_ := $p.credentials }}
    # A backend credential (docs/backends.md#credentials): this container only.
    - {name: toolproxy-cred-{{ $name }}, mountPath: {{ printf "%s/%s" $p.credentialsMountPath $name }}, readOnly: true}
    {{- end }}
    {{- if $p.callTokens.secretName }}
    # The call-token signing key: this container only (no other container of the pod mounts it).
    - {name: toolproxy-call-tokens, mountPath: {{ $p.callTokens.mountPath }}, readOnly: true}
    {{- end }}
{{- end }}

{{- define "toolproxy.volumes" -}}
{{- $p := .Values.proxy }}
{{- $o := .Values.opa -}}
- name: toolproxy-config
  configMap: {name: {{ include "toolproxy.component" (dict "root" . "suffix" "config") }}}
- name: toolproxy-registry
  configMap: {name: {{ include "toolproxy.registryConfigMap" . }}}
- name: toolproxy-tmp
  emptyDir: {sizeLimit: 64Mi}
- name: toolproxy-opa-tmp
  emptyDir: {sizeLimit: 64Mi}
{{- if not $o.allowTcp }}
- name: toolproxy-opa-socket
  # OPA's decision socket: mounted into the toolproxy and OPA containers only.
  emptyDir: {sizeLimit: 1Mi}
{{- end }}
- name: toolproxy-record-mac
  # Only the toolproxy container mounts it: a process that reaches Redis without this key cannot forge
  # an approval or an outcome (docs/scale.md).
  secret:
    secretName: {{ include "toolproxy.recordMacSecret" . }}
    defaultMode: 0444
    items: [{key: {{ include "toolproxy.recordMacKey" . | quote }}, path: {{ include "toolproxy.recordMacKey" . | quote }}}]
{{- if $o.authz.enabled }}
- name: toolproxy-opa-token
  secret:
    secretName: {{ include "toolproxy.opaTokenSecret" . }}
    defaultMode: 0444
    items: [{key: {{ include "toolproxy.opaTokenKey" . | quote }}, path: {{ include "toolproxy.opaTokenKey" . | quote }}}]
{{- end }}
{{- if $p.redis.tls.secretName }}
- name: toolproxy-redis-tls
  # 0444: only the toolproxy container mounts it, and it runs as one non-root user.
  secret: {secretName: {{ $p.redis.tls.secretName }}, defaultMode: 0444}
{{- end }}
{{- with $p.callTokens }}
{{- if .secretName }}
- name: toolproxy-call-tokens
  secret:
    secretName: {{ .secretName }}
    # 0444 as the other Secrets: only the toolproxy container mounts it, and it runs as one non-root user.
    defaultMode: 0444
    items:
      - {key: {{ .key | quote }}, path: {{ .key | quote }}}
      {{- if .verificationKeysKey }}
      - {key: {{ .verificationKeysKey | quote }}, path: {{ .verificationKeysKey | quote }}}
      {{- end }}
{{- end }}
{{- end }}
{{- range $name, $credential := $p.credentials }}
- name: toolproxy-cred-{{ $name }}
  secret:
    secretName: {{ $credential.secretName }}
    defaultMode: 0444
{{- end }}
{{- range $volume, $ref := dict "toolproxy-jwks" $p.jwks "toolproxy-admin-jwks" $p.adminJwks "toolproxy-hop-secret" $p.hopSecret }}
{{- if $ref.secretName }}
- name: {{ $volume }}
  secret:
    secretName: {{ $ref.secretName }}
    defaultMode: 0444
    items: [{key: {{ $ref.key | quote }}, path: {{ $ref.key | quote }}}]
{{- end }}
{{- end }}
{{- if eq $o.policySource "configmap" }}
- name: toolproxy-policies
  configMap: {name: {{ include "toolproxy.policiesConfigMap" . }}}
{{- else }}
- name: toolproxy-opa-config
  configMap: {name: {{ include "toolproxy.component" (dict "root" . "suffix" "opa-config") }}}
{{- if $o.bundle.tokenSecret.name }}
- name: toolproxy-opa-bundle-token
  secret:
    secretName: {{ $o.bundle.tokenSecret.name }}
    defaultMode: 0444
    items: [{key: {{ $o.bundle.tokenSecret.key | quote }}, path: token}]
{{- end }}
{{- end }}
{{- if $o.authz.enabled }}
- name: toolproxy-opa-authz
  configMap: {name: {{ include "toolproxy.component" (dict "root" . "suffix" "opa-authz") }}}
{{- end }}
{{- if include "toolproxy.hasData" . }}
- name: toolproxy-opa-data
  configMap: {name: {{ include "toolproxy.dataConfigMap" . }}}
{{- end }}
{{- if eq (include "toolproxy.catalogSource" .) "configmap" }}
- name: toolproxy-opa-catalog
  configMap: {name: {{ include "toolproxy.catalogConfigMap" . }}}
{{- else if eq (include "toolproxy.catalogSource" .) "generate" }}
- name: toolproxy-opa-catalog
  emptyDir: {sizeLimit: 16Mi}
{{- end }}
{{- end }}
