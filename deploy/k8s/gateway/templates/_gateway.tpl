{{/* The gateway's own part of the shared Deployment: one HTTP(S) port, HTTP probes, and TLS
files from a Secret with the config pointed at them. */}}

{{- define "gateway.scheme" -}}
{{- ternary "HTTPS" "HTTP" .Values.tls.enabled -}}
{{- end }}

{{- define "gateway.ports" -}}
- name: http
  containerPort: {{ .Values.config.server.port }}
  protocol: TCP
{{- end }}

{{- define "gateway.probes" -}}
{{- range $kind, $path := dict "startup" "/healthz" "readiness" "/healthz" "liveness" "/healthz" }}
{{ $kind }}Probe:
  httpGet:
    path: {{ $path }}
    port: http
    scheme: {{ include "gateway.scheme" $ }}
  {{- toYaml (index $.Values.probes $kind) | nindent 2 }}
{{- end }}
{{- if .Values.preStopSleepSeconds }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.preStopSleepSeconds }}
{{- end }}
{{- end }}

{{- define "gateway.tlsEnv" -}}
{{- if .Values.tls.enabled }}
- name: LLMSERVE_GATEWAY__SERVER__TLS_CERT_FILE
  value: {{ .Values.tls.mountPath }}/tls.crt
- name: LLMSERVE_GATEWAY__SERVER__TLS_KEY_FILE
  value: {{ .Values.tls.mountPath }}/tls.key
- name: LLMSERVE_GATEWAY__SERVER__PLAIN_HTTP
  value: "false"
{{- end }}
{{- end }}

{{- define "gateway.tlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName: name the kubernetes.io/tls Secret holding tls.crt and tls.key" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "gateway.tlsVolumeMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}
