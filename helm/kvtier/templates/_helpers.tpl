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
