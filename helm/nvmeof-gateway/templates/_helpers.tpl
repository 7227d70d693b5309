{{/*
Names. fullname = "<release>-nvmeof-gateway", or the release name alone when it already
contains the chart name, truncated to 63 characters; fullnameOverride replaces it.
*/}}
{{- define "nvmeof.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nvmeof.fullname" -}}
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

{{- define "nvmeof.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nvmeof.controlName" -}}{{ include "nvmeof.fullname" . }}-control{{- end }}
{{- define "nvmeof.controlHeadless" -}}{{ include "nvmeof.fullname" . }}-control-hl{{- end }}
{{- define "nvmeof.gatewayName" -}}{{ include "nvmeof.fullname" . }}-gateway{{- end }}
{{- define "nvmeof.gatewayHeadless" -}}{{ include "nvmeof.fullname" . }}-gateway-hl{{- end }}
{{- define "nvmeof.gatewayConfigName" -}}{{ include "nvmeof.fullname" . }}-gateway-config{{- end }}

{{/* Common labels of every object. */}}
{{- define "nvmeof.labels" -}}
helm.sh/chart: {{ include "nvmeof.chart" . }}
{{ include "nvmeof.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: nvmeof-gateway
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "nvmeof.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nvmeof.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "gateway") */}}
{{- define "nvmeof.componentSelector" -}}
{{ include "nvmeof.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "nvmeof.componentLabels" -}}
{{ include "nvmeof.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "nvmeof.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "nvmeof.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nvmeof.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Ceph access. */}}
{{- define "nvmeof.cephConfigMapName" -}}
{{- default (printf "%s-ceph-conf" (include "nvmeof.fullname" .)) .Values.ceph.existingConfigMap }}
{{- end }}

{{- define "nvmeof.cephConfigMapKey" -}}
{{- if .Values.ceph.existingConfigMap }}{{ .Values.ceph.existingConfigMapKey }}{{ else }}ceph.conf{{ end }}
{{- end }}

{{- define "nvmeof.keyringSecretName" -}}
{{- default (printf "%s-ceph-keyring" (include "nvmeof.fullname" .)) .Values.ceph.keyringSecret.name }}
{{- end }}

{{/*
/etc/ceph as one projected volume: ceph.conf from the ConfigMap and the keyring from the
Secret, optional, so that a missing Secret leaves no file (the process says so and stays
not ready) instead of a pod stuck in ContainerCreating or, with a subPath mount, a directory
where the keyring should be.
*/}}
{{- define "nvmeof.cephVolume" -}}
- name: ceph
  projected:
    defaultMode: 0440
    sources:
      - configMap:
          name: {{ include "nvmeof.cephConfigMapName" . }}
          items:
            - key: {{ include "nvmeof.cephConfigMapKey" . }}
              path: ceph.conf
      - secret:
          name: {{ include "nvmeof.keyringSecretName" . }}
          optional: true
          items:
            - key: {{ .Values.ceph.keyringSecret.key }}
              path: keyring
{{- end }}

{{/* The monitors from a Secret (Rook's rook-ceph-config): librados reads $CEPH_ARGS after
the conf file, so "-m" there wins over any mon_host in it. */}}
{{- define "nvmeof.cephEnv" -}}
{{- with .Values.ceph.monHostSecret.name }}
- name: CEPH_MON_HOST
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.ceph.monHostSecret.key }}
- name: CEPH_ARGS
  value: "-m $(CEPH_MON_HOST)"
{{- end }}
{{- end }}

{{/* Scratch directories for a read-only root file system (librados' admin socket, temp files). */}}
{{- define "nvmeof.scratchVolumes" -}}
- name: tmp
  emptyDir:
    medium: Memory
    sizeLimit: 16Mi
- name: ceph-run
  emptyDir:
    medium: Memory
    sizeLimit: 16Mi
{{- end }}

{{- define "nvmeof.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: ceph-run
  mountPath: /var/run/ceph
{{- end }}

{{/* TLS Secrets. */}}
{{- define "nvmeof.controlTlsSecret" -}}
{{- default (printf "%s-control-tls" (include "nvmeof.fullname" .)) .Values.tls.controlSecret }}
{{- end }}
{{- define "nvmeof.gatewayTlsSecret" -}}
{{- default (printf "%s-gateway-tls" (include "nvmeof.fullname" .)) .Values.tls.gatewaySecret }}
{{- end }}
{{- define "nvmeof.cliTlsSecret" -}}
{{- default (printf "%s-cli-tls" (include "nvmeof.fullname" .)) .Values.tls.cliSecret }}
{{- end }}

{{/* "host:port" of control-plane replica r: (dict "ctx" $ "r" 0) */}}
{{- define "nvmeof.controlReplicaAddress" -}}
{{- printf "%s-%d.%s.%s.svc:%d" (include "nvmeof.controlName" .ctx) (int .r) (include "nvmeof.controlHeadless" .ctx) .ctx.Release.Namespace (int .ctx.Values.controlPlane.port) }}
{{- end }}

{{/* The comma-separated --server list of nvmeofctl: the ClusterIP Service. */}}
{{- define "nvmeof.controlServiceAddress" -}}
{{- printf "%s:%d" (include "nvmeof.controlName" .) (int .Values.controlPlane.port) }}
{{- end }}

{{/* topologySpreadConstraints with the component's selector filled in where missing. */}}
{{- define "nvmeof.topologySpread" -}}
{{- $selector := include "nvmeof.componentSelector" (dict "ctx" .ctx "component" .component) | fromYaml }}
{{- range .constraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
- {{ toYaml $c | nindent 2 | trim }}
{{- end }}
{{- end }}

{{/* Preflight checks: values the schema cannot express. */}}
{{- define "nvmeof.preflight" -}}
{{- if not (or .Values.ceph.monHost .Values.ceph.monHostSecret.name .Values.ceph.existingConfigMap) }}
{{- fail "ceph.monHost is required unless ceph.monHostSecret.name names a Secret holding mon_host or ceph.existingConfigMap names a ConfigMap holding ceph.conf" }}
{{- end }}
{{- if and .Values.tls.certManager.enabled (not .Values.tls.enabled) }}
{{- fail "tls.certManager.enabled needs tls.enabled: true" }}
{{- end }}
{{- if and .Values.monitoring.serviceMonitor.enabled .Values.monitoring.podMonitor.enabled }}
{{- fail "monitoring.serviceMonitor.enabled and monitoring.podMonitor.enabled: choose one (both would scrape every target twice)" }}
{{- end }}
{{- /* the leave, then closing connections and images (up to 10 s): SIGKILL must not cut them */}}
{{- if lt (int .Values.gateway.terminationGracePeriodSeconds) (add (div (int .Values.gateway.leaveTimeoutMs) 1000) 10) }}
{{- fail (printf "gateway.terminationGracePeriodSeconds (%d) must be at least gateway.leaveTimeoutMs / 1000 + 10 (%d): the planned leave, then closing the images" (int .Values.gateway.terminationGracePeriodSeconds) (add (div (int .Values.gateway.leaveTimeoutMs) 1000) 10)) }}
{{- end }}
{{- if eq (int .Values.gateway.ports.metrics) (int .Values.gateway.ports.nvme) }}
{{- fail "gateway.ports.metrics and gateway.ports.nvme must differ" }}
{{- end }}
{{- end }}
