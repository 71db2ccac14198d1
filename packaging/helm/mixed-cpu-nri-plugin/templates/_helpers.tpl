{{/* The release's name for every object: the release name, with the chart name added unless present. */}}
{{- define "mixed-cpu-nri-plugin.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mixed-cpu-nri-plugin.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mixed-cpu-nri-plugin.labels" -}}
{{ include "mixed-cpu-nri-plugin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
mixed-cpu-nri-plugin/runtime: {{ .Values.runtime }}
{{- end -}}

{{- define "mixed-cpu-nri-plugin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mixed-cpu-nri-plugin.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mixed-cpu-nri-plugin.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* host:port of /metrics, /healthz, /readyz: the node's loopback with hostNetwork, else bindHost
     in the pod's own network namespace; "" when metrics are off. */}}
{{- define "mixed-cpu-nri-plugin.metricsAddress" -}}
{{- if not .Values.metrics.enabled -}}
{{- else if .Values.hostNetwork -}}
{{- printf "127.0.0.1:%d" (int .Values.metrics.port) -}}
{{- else if contains ":" .Values.metrics.bindHost -}}
{{- printf "[%s]:%d" .Values.metrics.bindHost (int .Values.metrics.port) -}}
{{- else -}}
{{- printf "%s:%d" .Values.metrics.bindHost (int .Values.metrics.port) -}}
{{- end -}}
{{- end -}}

{{/* SELinux type spc_t on the runtimes whose hosts usually enforce SELinux. */}}
{{- define "mixed-cpu-nri-plugin.needsSpcT" -}}
{{- if has .Values.runtime (list "cri-o" "openshift") -}}true{{- end -}}
{{- end -}}
