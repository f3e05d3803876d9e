{{/* Ports and probes of the gRPC services (router, worker, conversations): config.server.port
serves the service and grpc.health.v1, which the kubelet's native gRPC probes ask;
config.server.metrics_port serves Prometheus /metrics (0 turns it off). */}}

{{- define "llmserve.grpcContainerPorts" -}}
- name: grpc
  containerPort: {{ .Values.config.server.port }}
  protocol: TCP
{{- if .Values.config.server.metrics_port }}
- name: metrics
  containerPort: {{ .Values.config.server.metrics_port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* For llmserve.k8sService: a list of {name, port, appProtocol}. */}}
{{- define "llmserve.grpcServicePorts" -}}
- name: grpc
  port: {{ .Values.config.server.port }}
  appProtocol: grpc
{{- if .Values.config.server.metrics_port }}
- name: metrics
  port: {{ .Values.config.server.metrics_port }}
{{- end }}
{{- end }}

{{- define "llmserve.grpcProbes" -}}
{{- $port := .Values.config.server.port -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  grpc:
    port: {{ $port }}
  {{- toYaml (index $.Values.probes $kind) | nindent 2 }}
{{- end }}
{{- if .Values.preStopSleepSeconds }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.preStopSleepSeconds }}
{{- end }}
{{- end }}
