{{/* The service's config file, mounted at /etc/llmserve/<service>.yaml. Secrets never go here:
they arrive as LLMSERVE_<SERVICE>__SECTION__KEY environment variables (see _secret.tpl). */}}
{{- define "llmserve.configmap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "llmserve.fullname" . }}
  labels:
    {{- include "llmserve.labels" . | nindent 4 }}
data:
  {{ include "llmserve.service" . }}.yaml: |
    {{- include "llmserve.configYaml" . | nindent 4 }}
{{- end }}
