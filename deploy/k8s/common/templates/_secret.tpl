{{/*
Secrets reach the service as environment overrides of its config. values.yaml declares
  secrets.env:            ENV_VAR -> key in the Secret (e.g. LLMSERVE_GATEWAY__DATABASE__URL: databaseUrl)
  secrets.existingSecret: a Secret you manage (External Secrets, Sealed Secrets, ...); the chart makes none
  secrets.values:         key -> value for a Secret the chart makes (tests and trials; not for production)
Every reference is optional, so an absent key leaves the config file's value in force.
*/}}

{{- define "llmserve.secretName" -}}
{{- default (include "llmserve.fullname" .) .Values.secrets.existingSecret -}}
{{- end }}

{{- define "llmserve.secretEnv" -}}
{{- $name := include "llmserve.secretName" . -}}
{{- range $env, $key := .Values.secrets.env }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ $key }}
      optional: true
{{- end }}
{{- end }}

{{- define "llmserve.secret" -}}
{{- $values := dict -}}
{{- range $key, $value := .Values.secrets.values -}}
{{- if $value -}}{{- $_ := set $values $key $value -}}{{- end -}}
{{- end -}}
{{- if and .Values.secrets.existingSecret $values -}}
{{- fail "secrets: set existingSecret or values, not both (the chart would ignore the values)" -}}
{{- end -}}
{{- if $values -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ include "llmserve.fullname" . }}
  labels:
    {{- include "llmserve.labels" . | nindent 4 }}
type: Opaque
data:
  {{- range $key, $value := $values }}
  {{ $key }}: {{ $value | toString | b64enc | quote }}
  {{- end }}
{{- end -}}
{{- end }}
