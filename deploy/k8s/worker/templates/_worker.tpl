{{/* The worker's own part of the shared Deployment: the model volume, shared memory, and the
queue-depth metric it scales on. */}}

{{- define "worker.volumes" -}}
{{- include "worker.checkGpus" . }}
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

{{/* A tensor-parallel worker (config.engine.tensor_parallel_size N) spans N GPUs of its node: the
pod must be given exactly N. */}}
{{- define "worker.checkGpus" -}}
{{- $tp := int (default 1 .Values.config.engine.tensor_parallel_size) }}
{{- range $kind := list "requests" "limits" }}
{{- $gpus := int (index (index $.Values.resources $kind | default dict) "nvidia.com/gpu" | default 0) }}
{{- if and (gt $tp 1) (ne $tp $gpus) }}
{{- fail (printf "config.engine.tensor_parallel_size %d needs resources.%s nvidia.com/gpu: %d (it is %d)" $tp $kind $tp $gpus) }}
{{- end }}
{{- end }}
{{- end }}
