{{- define "kvtier.fullname" -}}
{{- printf "%s-kvtier" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvtier.labels" -}}
app.kubernetes.io/name: kvtier
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvtier.selector" -}}
app.kubernetes.io/name: kvtier
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvtier.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* host:port of etcd: this release's member, or the endpoint given in values. */}}
{{- define "kvtier.etcdEndpoint" -}}
{{- if .Values.etcd.enabled -}}
{{ include "kvtier.fullname" . }}-etcd:2379
{{- else -}}
{{- required "etcd.endpoint is required when etcd.enabled is false" .Values.etcd.endpoint -}}
{{- end -}}
{{- end -}}

{{/* The etcd endpoint the components dial: https:// when etcd.client.tls is on. */}}
{{- define "kvtier.etcdUrl" -}}
{{- if .Values.etcd.client.tls -}}https://{{- end -}}{{ include "kvtier.etcdEndpoint" . }}
{{- end -}}

{{/* Refuse security values that cannot work together. */}}
{{- define "kvtier.checkSecurity" -}}
{{- $s := .Values.security -}}
{{- if and $s.insecure (ne $s.mode "none") -}}
{{- fail "security.insecure is for security.mode none: drop it with mtls or token" -}}
{{- end -}}
{{- if ne $s.mode "none" -}}
{{- if or (not $s.tls.daemonSecret) (not $s.tls.conductorSecret) -}}
{{- fail (printf "security.mode %s needs security.tls.daemonSecret and security.tls.conductorSecret (tls.crt, tls.key, ca.crt)" $s.mode) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $s.mode "token") (or (not $s.tokens.keysSecret) (not $s.tokens.conductorTokenSecret)) -}}
{{- fail "security.mode token needs security.tokens.keysSecret and security.tokens.conductorTokenSecret" -}}
{{- end -}}
{{- if and $s.tls.crlSecret (ne $s.mode "mtls") -}}
{{- fail "security.tls.crlSecret revokes client certificates: it needs security.mode mtls" -}}
{{- end -}}
{{- if and .Values.etcd.client.caSecret (not .Values.etcd.client.tls) -}}
{{- fail "etcd.client.caSecret is the CA of etcd's TLS certificate: set etcd.client.tls too" -}}
{{- end -}}
{{- range $name := list "daemon" "conductor" -}}
{{- $c := index $.Values.etcd.client $name -}}
{{- if and $c.certSecret (not $.Values.etcd.client.tls) -}}
{{- fail (printf "etcd.client.%s.certSecret is a TLS client certificate: set etcd.client.tls too" $name) -}}
{{- end -}}
{{- if ne (empty $c.user) (empty $c.passwordSecret) -}}
{{- fail (printf "etcd.client.%s.user and etcd.client.%s.passwordSecret go together" $name $name) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.etcd.server.auth.enabled (not .Values.etcd.server.auth.rootPasswordSecret) -}}
{{- fail "etcd.server.auth.enabled needs etcd.server.auth.rootPasswordSecret" -}}
{{- end -}}
{{- end -}}

{{/* Volume mounts of one component's security Secrets. Argument: (dict "root" $ "c" "daemon"). */}}
{{- define "kvtier.securityMounts" -}}
{{- $v := .root.Values -}}
{{- $c := index $v.etcd.client .c -}}
{{- if ne $v.security.mode "none" }}
- {name: tls, mountPath: /etc/kvtier/tls, readOnly: true}
{{- end }}
{{- if $v.security.tls.crlSecret }}
- {name: crl, mountPath: /etc/kvtier/crl, readOnly: true}
{{- end }}
{{- if eq $v.security.mode "token" }}
{{- if eq .c "daemon" }}
- {name: token-keys, mountPath: /etc/kvtier/token-keys, readOnly: true}
{{- else }}
- {name: token, mountPath: /etc/kvtier/token, readOnly: true}
{{- end }}
{{- end }}
{{- if $v.etcd.client.caSecret }}
- {name: etcd-ca, mountPath: /etc/kvtier/etcd-ca, readOnly: true}
{{- end }}
{{- if $c.certSecret }}
- {name: etcd-client, mountPath: /etc/kvtier/etcd-client, readOnly: true}
{{- end }}
{{- if $c.passwordSecret }}
- {name: etcd-password, mountPath: /etc/kvtier/etcd-password, readOnly: true}
{{- end }}
{{- end -}}

{{/* The volumes behind kvtier.securityMounts. Argument: (dict "root" $ "c" "daemon"). */}}
{{- define "kvtier.securityVolumes" -}}
{{- $v := .root.Values -}}
{{- $c := index $v.etcd.client .c -}}
{{- if ne $v.security.mode "none" }}
- name: tls
  secret: {secretName: {{ index $v.security.tls (printf "%sSecret" .c) | quote }}, defaultMode: 0400}
{{- end }}
{{- if $v.security.tls.crlSecret }}
- name: crl
  secret: {secretName: {{ $v.security.tls.crlSecret | quote }}, items: [{key: ca.crl, path: ca.crl}]}
{{- end }}
{{- if eq $v.security.mode "token" }}
{{- if eq .c "daemon" }}
- name: token-keys
  secret: {secretName: {{ $v.security.tokens.keysSecret | quote }}}
{{- else }}
- name: token
  secret: {secretName: {{ $v.security.tokens.conductorTokenSecret | quote }}, defaultMode: 0400}
{{- end }}
{{- end }}
{{- if $v.etcd.client.caSecret }}
- name: etcd-ca
  secret: {secretName: {{ $v.etcd.client.caSecret | quote }}, items: [{key: ca.crt, path: ca.crt}]}
{{- end }}
{{- if $c.certSecret }}
- name: etcd-client
  secret: {secretName: {{ $c.certSecret | quote }}, defaultMode: 0400, items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]}
{{- end }}
{{- if $c.passwordSecret }}
- name: etcd-password
  secret: {secretName: {{ $c.passwordSecret | quote }}, defaultMode: 0400, items: [{key: {{ $c.passwordKey | quote }}, path: password}]}
{{- end }}
{{- end -}}

{{/* The KVTIER_ETCD_* variables every etcd client reads (kvstore/security/etcd.py). Argument: (dict "root" $ "c" "daemon"). */}}
{{- define "kvtier.etcdClientEnv" -}}
{{- $v := .root.Values -}}
{{- $c := index $v.etcd.client .c -}}
{{- if $v.etcd.client.caSecret }}
- name: KVTIER_ETCD_CA
  value: /etc/kvtier/etcd-ca/ca.crt
{{- end }}
{{- if $v.etcd.client.serverName }}
- name: KVTIER_ETCD_SERVER_NAME
  value: {{ $v.etcd.client.serverName | quote }}
{{- end }}
{{- if $c.certSecret }}
- name: KVTIER_ETCD_CERT
  value: /etc/kvtier/etcd-client/tls.crt
- name: KVTIER_ETCD_KEY
  value: /etc/kvtier/etcd-client/tls.key
{{- end }}
{{- if $c.user }}
- name: KVTIER_ETCD_USER
  value: {{ $c.user | quote }}
- name: KVTIER_ETCD_PASSWORD_FILE
  value: /etc/kvtier/etcd-password/password
{{- end }}
{{- end -}}

{{/* The daemon's security section as KVTIER_SECURITY__* variables (kvstore/node/config.py). */}}
{{- define "kvtier.daemonSecurityEnv" -}}
{{- $s := .Values.security -}}
{{- if ne $s.mode "none" }}
- name: KVTIER_SECURITY__CERT_FILE
  value: /etc/kvtier/tls/tls.crt
- name: KVTIER_SECURITY__KEY_FILE
  value: /etc/kvtier/tls/tls.key
{{- end }}
{{- if eq $s.mode "mtls" }}
- name: KVTIER_SECURITY__CLIENT_CA_FILE
  value: /etc/kvtier/tls/ca.crt
{{- if $s.tls.crlSecret }}
- name: KVTIER_SECURITY__CRL_FILE
  value: /etc/kvtier/crl/ca.crl
{{- end }}
{{- end }}
{{- if eq $s.mode "token" }}
- name: KVTIER_SECURITY__TOKEN_KEYS
  value: /etc/kvtier/token-keys
{{- end }}
{{- end -}}

{{/* Probes of a gRPC port: grpc.health.v1 in plaintext; a TCP connect when the port speaks TLS
(the kubelet's gRPC probe has no TLS). Argument: (dict "root" $ "port" N "period" S "failures" F). */}}
{{- define "kvtier.probe" -}}
{{- if eq .root.Values.security.mode "none" -}}
grpc: {port: {{ .port }}}
{{- else -}}
tcpSocket: {port: {{ .port }}}
{{- end }}
periodSeconds: {{ .period }}
{{- with .failures }}
failureThreshold: {{ . }}
{{- end }}
{{- end -}}
