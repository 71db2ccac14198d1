{{/* The release's name for every object: fullnameOverride; else the release name when it holds the
     chart's name or begins it (release "mixed-cpu" gives "mixed-cpu", not "mixed-cpu-mixed-cpu-nri-plugin");
     else the release name with the chart's added. */}}
{{- define "mixed-cpu-nri-plugin.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if or (contains .Chart.Name .Release.Name) (hasPrefix .Release.Name .Chart.Name) -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The shared CPUs as text: --set sharedCpuset=0 makes a number. */}}
{{- define "mixed-cpu-nri-plugin.sharedCpuset" -}}
{{- .Values.sharedCpuset | toString -}}
{{- end -}}

{{/* What the schema cannot say and the daemon would refuse at start (a pod in a crash loop on every
     node): refused here, at install, with the daemon's reason. */}}
{{- define "mixed-cpu-nri-plugin.validate" -}}
{{- if not .Values.image.repository -}}
{{- fail "image.repository is not set: no image is published; build packaging/Dockerfile, push it to a registry the nodes can pull from, and name it: --set image.repository=registry.example.com/you/mixed-cpu-nri-plugin (the chart's README, Install)" -}}
{{- end -}}
{{- $cpus := include "mixed-cpu-nri-plugin.sharedCpuset" . -}}
{{- if not $cpus -}}
{{- fail "sharedCpuset is not set: give the node's shared CPUs, a Linux cpu list that is also in kubelet's reservedSystemCPUs, e.g. --set sharedCpuset=0-1 (commas escaped: --set sharedCpuset=0\\,2)" -}}
{{- end -}}
{{- if not (regexMatch "^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$" $cpus) -}}
{{- fail (printf "sharedCpuset %q is not a Linux cpu list: write CPU numbers and low-high ranges joined by commas, e.g. --set sharedCpuset=0-1 or --set sharedCpuset=0\\,2\\,4-5" $cpus) -}}
{{- end -}}
{{- $index := toString .Values.plugin.index -}}
{{- if not (regexMatch "^[0-9]{2}$" $index) -}}
{{- fail (printf "plugin.index=%s is not two digits: NRI orders plugins by a two-digit index from 00 to 99; use --set plugin.index=10 (any of 10-99), or --set-string plugin.index=07 for one below 10 (--set reads 07 as the number 7)" $index) -}}
{{- end -}}
{{- range $part := splitList "," $cpus -}}
{{- $ends := splitList "-" $part -}}
{{- if and (eq (len $ends) 2) (gt (atoi (index $ends 0)) (atoi (index $ends 1))) -}}
{{- fail (printf "sharedCpuset %q: the range %s is reversed; write it low-high" $cpus $part) -}}
{{- end -}}
{{- end -}}
{{- if not (or .Values.trustedSources.devicePluginMarker .Values.trustedSources.podAnnotation) -}}
{{- fail "trustedSources: both sources are off, so no container could ever get shared CPUs; set trustedSources.devicePluginMarker=true (or podAnnotation=true where OpenShift's admission plugin adds the annotation)" -}}
{{- end -}}
{{- if and (not .Values.devicePlugin.enabled) (not .Values.dra.enabled) (not .Values.trustedSources.podAnnotation) -}}
{{- fail "devicePlugin.enabled=false leaves nothing to prove a request unless trustedSources.podAnnotation=true (where an admission plugin adds cpu-shared.crio.io annotations) or dra.enabled=true; keep the device plugin on otherwise" -}}
{{- end -}}
{{- if and .Values.dra.enabled (not .Values.trustedSources.devicePluginMarker) -}}
{{- fail "dra.enabled=true needs trustedSources.devicePluginMarker=true: a DRA-prepared container proves its request with the same signed marker; set it, or dra.enabled=false" -}}
{{- end -}}
{{- if and .Values.metrics.enabled (not .Values.hostNetwork) (regexMatch "^(127\\.|::1$|localhost$|\\[::1\\]$)" .Values.metrics.bindHost) -}}
{{- fail (printf "metrics.bindHost=%s is the pod's own loopback, which kubelet's probes (sent to the pod IP) never reach; use 0.0.0.0 (or ::), or hostNetwork=true" .Values.metrics.bindHost) -}}
{{- end -}}
{{- if and .Values.metrics.podMonitor.enabled (or .Values.hostNetwork (not .Values.metrics.enabled)) -}}
{{- fail "metrics.podMonitor.enabled needs metrics.enabled=true and hostNetwork=false: with hostNetwork the daemon listens on the node's 127.0.0.1, which Prometheus cannot scrape" -}}
{{- end -}}
{{- if and .Values.nri.runtime.patchConfig (eq .Values.runtime "openshift") -}}
{{- fail "nri.runtime.patchConfig is not for OpenShift, whose nodes are configured through MachineConfigs: apply packaging/runtime/openshift/machineconfig-crio.yaml instead" -}}
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

{{/* "true" when the chart makes its NetworkPolicy: asked for, on the pod network (a NetworkPolicy
     never applies to a hostNetwork pod), with a port to guard, and either the scrapers named or
     nothing set up to scrape (prometheus.io annotations, a PodMonitor): on by default wherever
     it cannot cut a scraper off. */}}
{{- define "mixed-cpu-nri-plugin.networkPolicy" -}}
{{- $metrics := .Values.metrics -}}
{{- $scraped := or $metrics.scrapeAnnotations $metrics.podMonitor.enabled -}}
{{- if and $metrics.enabled $metrics.networkPolicy.enabled (not .Values.hostNetwork) (or $metrics.networkPolicy.scrapers (not $scraped)) -}}
true
{{- end -}}
{{- end -}}
