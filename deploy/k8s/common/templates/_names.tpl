{{/*
Names and labels. Every service chart carries the annotation llmserve.io/service (gateway, router,
worker, conversations): it names the Python module the pod runs and the config file it reads. The
chart name (an alias in the umbrella chart, e.g. worker-llama) keeps two pools of one service apart.
*/}}

{{- define "llmserve.service" -}}
{{- required "Chart.yaml must carry the annotation llmserve.io/service" (index (.Chart.Annotations | default dict) "llmserve.io/service") -}}
{{- end }}

{{- define "llmserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{- define "llmserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end }}

{{- define "llmserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "llmserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llmserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ include "llmserve.service" . }}
app.kubernetes.io/part-of: llmserve
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "llmserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "llmserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end }}

{{- define "llmserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end }}

{{/* The service's YAML config: .Values.config, with templates in its strings expanded
(so the umbrella chart can write "{{ .Release.Name }}-router:50050"). */}}
{{- define "llmserve.configYaml" -}}
{{- tpl (toYaml .Values.config) . -}}
{{- end }}

{{- define "llmserve.configPath" -}}
/etc/llmserve/{{ include "llmserve.service" . }}.yaml
{{- end }}
