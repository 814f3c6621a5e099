{{/* Names, labels and the environment every loramux container shares. */}}

{{- define "loramux.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loramux.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loramux.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loramux.labels" -}}
helm.sh/chart: {{ include "loramux.chart" . }}
{{ include "loramux.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "loramux.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loramux.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "loramux.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "loramux.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loramux.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loramux.secretName" -}}
{{- default (include "loramux.fullname" .) .Values.existingSecret }}
{{- end }}

{{- define "loramux.engineHeadless" -}}
{{- printf "%s-engine" (include "loramux.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loramux.redisUrl" -}}
{{- printf "redis://%s-redis:6379/0" (include "loramux.fullname" .) }}
{{- end }}

{{/* LORAMUX_DATABASE_URL from the chart's Secret (or existingSecret). */}}
{{- define "loramux.databaseEnv" -}}
- name: LORAMUX_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "loramux.secretName" . }}
      key: {{ .Values.secretKeys.databaseUrl }}
{{- end }}

{{/* Environment shared by gateways and engines. */}}
{{- define "loramux.env" -}}
- name: LORAMUX_HOST
  value: "0.0.0.0"
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{ include "loramux.databaseEnv" . }}
- name: LORAMUX_REDIS_URL
{{- if .Values.redis.enabled }}
  value: {{ include "loramux.redisUrl" . | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "loramux.secretName" . }}
      key: {{ .Values.secretKeys.redisUrl }}
{{- end }}
- name: LORAMUX_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "loramux.secretName" . }}
      key: {{ .Values.secretKeys.clusterSecret }}
- name: LORAMUX_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "loramux.secretName" . }}
      key: {{ .Values.secretKeys.adminKey }}
      optional: true
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ include "loramux.secretName" . }}
      key: {{ .Values.secretKeys.awsAccessKeyId }}
      optional: true
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "loramux.secretName" . }}
      key: {{ .Values.secretKeys.awsSecretAccessKey }}
      optional: true
{{- end }}

{{- define "loramux.probes" -}}
livenessProbe:
  httpGet: {path: /health, port: http}
  initialDelaySeconds: {{ .Values.probes.liveness.initialDelaySeconds }}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
readinessProbe:
  httpGet: {path: /ready, port: http}
  initialDelaySeconds: {{ .Values.probes.readiness.initialDelaySeconds }}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
{{- end }}

{{/* Pod grace period: the server's drain (shutdownTimeout), the preStop sleep, 10 s spare. */}}
{{- define "loramux.gracePeriod" -}}
{{ add .Values.config.shutdownTimeout .Values.config.preStopSleepSeconds 10 }}
{{- end }}

{{/* Keep serving a few seconds after the pod is marked terminating (endpoints update). */}}
{{- define "loramux.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.config.preStopSleepSeconds | quote }}]
{{- end }}

{{/* True (non-empty) when the Gateway API Inference Extension routes (router.mode). */}}
{{- define "loramux.inferencePool" -}}
{{- if not (has .Values.router.mode (list "loramux" "inferencepool")) }}
{{- fail (printf "router.mode must be loramux or inferencepool, got %q" .Values.router.mode) }}
{{- end }}
{{- if eq .Values.router.mode "inferencepool" }}true{{ end }}
{{- end }}

{{/* True when the picker routes on the engines' KV events (precise prefix cache). */}}
{{- define "loramux.kvEvents" -}}
{{- if and (include "loramux.inferencePool" .) (eq .Values.router.epp.prefixCache "precise") }}true{{ end }}
{{- end }}

{{- define "loramux.eppName" -}}
{{- printf "%s-epp" (include "loramux.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loramux.eppSelectorLabels" -}}
{{ include "loramux.selectorLabels" . }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{/* The engine pods (the InferencePool's and the NetworkPolicy's selector). */}}
{{- define "loramux.engineSelectorLabels" -}}
{{ include "loramux.selectorLabels" . }}
app.kubernetes.io/component: engine
{{- end }}

{{/* engine.tensorParallelSize, checked: ranks in one engine pod (one device each), an integer >= 1. */}}
{{- define "loramux.tensorParallelSize" -}}
{{- $n := .Values.engine.tensorParallelSize }}
{{- if not (or (kindIs "int" $n) (kindIs "int64" $n) (kindIs "float64" $n)) }}
{{- fail (printf "engine.tensorParallelSize must be an integer >= 1, got %v" $n) }}
{{- end }}
{{- if or (lt (float64 $n) 1.0) (ne (float64 $n) (float64 (int $n))) }}
{{- fail (printf "engine.tensorParallelSize must be an integer >= 1, got %v" $n) }}
{{- end }}
{{- int $n }}
{{- end }}

{{/* Size of the engine's /dev/shm: engine.shmSizePerRank times the ranks (1Gi x 2 = 2Gi). */}}
{{- define "loramux.shmSize" -}}
{{- $per := toString .Values.engine.shmSizePerRank }}
{{- if not (regexMatch "^[0-9]+([KMGTPE]i|[kMGTPE])?$" $per) }}
{{- fail (printf "engine.shmSizePerRank must be a whole quantity such as 1Gi or 512Mi, got %q" $per) }}
{{- end }}
{{- $num := regexFind "^[0-9]+" $per }}
{{- printf "%d%s" (mul (atoi $num) (include "loramux.tensorParallelSize" . | atoi)) (trimPrefix $num $per) }}
{{- end }}
