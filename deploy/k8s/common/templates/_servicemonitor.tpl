{{/* Prometheus Operator scrape config, when serviceMonitor.enabled (needs its CRDs). Arguments:
root, port (the Service port serving /metrics), scheme (http or https). */}}
{{- define "llmserve.serviceMonitor" -}}
{{- $root := .root -}}
{{- $m := $root.Values.serviceMonitor -}}
{{- if $m.enabled -}}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "llmserve.fullname" $root }}
  labels:
    {{- include "llmserve.labels" $root | nindent 4 }}
    {{- with $m.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "llmserve.selectorLabels" $root | nindent 6 }}
  endpoints:
    - port: {{ .port }}
      path: /metrics
      scheme: {{ .scheme | default "http" }}
      interval: {{ $m.interval }}
      scrapeTimeout: {{ $m.scrapeTimeout }}
      {{- with $m.tlsConfig }}
      tlsConfig:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
{{- end }}
