{{/* Voluntary evictions (node drains, upgrades) take at most maxUnavailable pods at a time. */}}
{{- define "llmserve.pdb" -}}
{{- if .Values.podDisruptionBudget.enabled -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "llmserve.fullname" . }}
  labels:
    {{- include "llmserve.labels" . | nindent 4 }}
spec:
  {{- if .Values.podDisruptionBudget.minAvailable }}
  minAvailable: {{ .Values.podDisruptionBudget.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .Values.podDisruptionBudget.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "llmserve.selectorLabels" . | nindent 6 }}
{{- end -}}
{{- end }}
