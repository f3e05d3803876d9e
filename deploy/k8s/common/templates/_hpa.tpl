{{/* HorizontalPodAutoscaler. Arguments: root, metrics (YAML list of autoscaling/v2 metric specs). */}}
{{- define "llmserve.hpa" -}}
{{- $root := .root -}}
{{- $a := $root.Values.autoscaling -}}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) -}}
{{- fail (printf "autoscaling: minReplicas (%v) exceeds maxReplicas (%v)" $a.minReplicas $a.maxReplicas) -}}
{{- end -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "llmserve.fullname" $root }}
  labels:
    {{- include "llmserve.labels" $root | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "llmserve.fullname" $root }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- .metrics | nindent 4 }}
  {{- with $a.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{- define "llmserve.cpuMetrics" -}}
- type: Resource
  resource:
    name: cpu
    target:
      type: Utilization
      averageUtilization: {{ .Values.autoscaling.targetCPUUtilizationPercentage }}
{{- end }}
