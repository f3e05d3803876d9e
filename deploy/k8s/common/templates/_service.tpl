{{/* A Service over the pods. Arguments: root (the chart's context), ports (YAML list of
{name, port}), headless (bool: clusterIP None, so DNS answers with every ready pod). */}}
{{- define "llmserve.k8sService" -}}
{{- $root := .root -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "llmserve.fullname" $root }}{{ if .headless }}-headless{{ end }}
  labels:
    {{- include "llmserve.labels" $root | nindent 4 }}
  {{- with $root.Values.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if .headless }}
  clusterIP: None
  publishNotReadyAddresses: false
  {{- else }}
  type: {{ $root.Values.service.type }}
  {{- end }}
  selector:
    {{- include "llmserve.selectorLabels" $root | nindent 4 }}
  ports:
    {{- range .ports }}
    - name: {{ .name }}
      port: {{ .port }}
      targetPort: {{ .name }}
      protocol: TCP
      {{- with .appProtocol }}
      appProtocol: {{ . }}
      {{- end }}
    {{- end }}
{{- end }}
