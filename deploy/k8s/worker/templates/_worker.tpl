{{/* The worker's own part of the shared Deployment: the model volume, shared memory, and the
queue-depth metric it scales on. */}}

{{- define "worker.volumes" -}}
{{- $from := .Values.model.from }}
{{- $source := index .Values.model (toString $from) }}
{{- if not $source }}
{{- fail (printf "model.from is %s but model.%s is empty" $from $from) }}
{{- end }}
- name: model
  {{- if eq $from "volume" }}
  {{- toYaml $source | nindent 2 }}
  {{- else }}
  {{ $from }}:
    {{- toYaml $source | nindent 4 }}
  {{- end }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- end }}

{{- define "worker.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: shm
  mountPath: /dev/shm
{{- end }}

{{- define "worker.hpaMetrics" -}}
- type: Pods
  pods:
    metric:
      name: {{ .Values.autoscaling.queueDepth.metricName | quote }}
    target:
      type: AverageValue
      averageValue: {{ .Values.autoscaling.queueDepth.targetAverageValue | quote }}
{{- end }}
