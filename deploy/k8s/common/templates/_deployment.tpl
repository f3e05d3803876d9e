{{/*
The one Deployment shape every service shares: `python -m services.<service> --config
/etc/llmserve/<service>.yaml`, its config from the chart's ConfigMap, its secrets as env, a
read-only root filesystem with a writable /tmp. Arguments (YAML strings besides root):
  root          the chart's context
  ports         container ports: [{name, containerPort}]
  probes        startupProbe / readinessProbe / livenessProbe (and lifecycle), as container fields
  env           extra environment entries
  volumes       extra pod volumes
  volumeMounts  extra container mounts
*/}}
{{- define "llmserve.deployment" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $service := include "llmserve.service" $root -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "llmserve.fullname" $root }}
  labels:
    {{- include "llmserve.labels" $root | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $v.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "llmserve.selectorLabels" $root | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "llmserve.labels" $root | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        # A changed config rolls the pods: the service reads its file once, at start.
        checksum/config: {{ include "llmserve.configYaml" $root | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "llmserve.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      # Longer than the service's own drain on SIGTERM, or the kubelet's SIGKILL cuts running
      # requests short.
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      containers:
        - name: {{ $service }}
          image: {{ include "llmserve.image" $root | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["python", "-m", "services.{{ $service }}", "--config", "{{ include "llmserve.configPath" $root }}"]
          ports:
            {{- .ports | trim | nindent 12 }}
          {{- $env := list (include "llmserve.secretEnv" $root) (.env | default "") (empty $v.env | ternary "" (toYaml $v.env)) | compact }}
          {{- if $env }}
          env:
            {{- range $env }}
            {{- . | trim | nindent 12 }}
            {{- end }}
          {{- end }}
          {{- .probes | trim | nindent 10 }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- toYaml $v.securityContext | nindent 12 }}
          volumeMounts:
            - name: config
              mountPath: {{ include "llmserve.configPath" $root }}
              subPath: {{ $service }}.yaml
              readOnly: true
            - name: tmp
              mountPath: /tmp
            {{- with .volumeMounts | default "" | trim }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        - name: config
          configMap:
            name: {{ include "llmserve.fullname" $root }}
        - name: tmp
          emptyDir:
            sizeLimit: {{ $v.tmpSizeLimit }}
        {{- with .volumes | default "" | trim }}
        {{- . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- tpl (toYaml .) $root | nindent 8 }}
      {{- end }}
{{- end }}
