{{/* Chart name, truncated to a DNS label. */}}
{{- define "gem-platform.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, unless the release name already contains the chart name. */}}
{{- define "gem-platform.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
<fullname>-<suffix> for objects whose name must be a DNS label (Services: at most 63 characters):
the full name is cut so that the suffix still fits. Takes (dict "ctx" $ "suffix" "metrics").
*/}}
{{- define "gem-platform.suffixedName" -}}
{{- $suffix := printf "-%s" .suffix -}}
{{- $name := printf "%s%s" (include "gem-platform.fullname" .ctx | trunc (int (sub 63 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "Service name %q is not a DNS label (a-z, 0-9 and '-', starting with a letter; a release name starting with a digit or holding a '.' gives one): set fullnameOverride" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "gem-platform.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gem-platform.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gem-platform.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "gem-platform.labels" -}}
helm.sh/chart: {{ include "gem-platform.chart" . }}
{{ include "gem-platform.selectorLabels" . }}
{{ include "gem-platform.commonLabels" . }}
{{- end -}}

{{- define "gem-platform.commonLabels" -}}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gem-platform
{{- end -}}

{{/* Solaris (gem serve-precompute): its own component, so the operator's Service and ServiceMonitor never select it. */}}
{{- define "gem-platform.solarisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "gem-platform.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: solaris
{{- end -}}

{{- define "gem-platform.solarisLabels" -}}
helm.sh/chart: {{ include "gem-platform.chart" . }}
{{ include "gem-platform.solarisSelectorLabels" . }}
{{ include "gem-platform.commonLabels" . }}
{{- end -}}

{{/*
The solaris values, or an empty dict: values of a release made with a chart without the section
(`helm upgrade --reuse-values`) have none, and .Values.solaris.enabled would fail on nil.
*/}}
{{- define "gem-platform.solarisEnabled" -}}
{{- if (.Values.solaris | default dict).enabled -}}true{{- end -}}
{{- end -}}

{{- define "gem-platform.solarisNamespace" -}}
{{- default .Release.Namespace .Values.solaris.namespace -}}
{{- end -}}

{{/* An image reference from (dict "repository" R "tag" T "digest" D): R@D, else R:T. */}}
{{- define "gem-platform.image" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
{{- end -}}

{{/* The Solaris image: the trainer image unless solaris.image says otherwise; a digest wins over the tag. */}}
{{- define "gem-platform.solarisImage" -}}
{{- $img := .Values.solaris.image -}}
{{- include "gem-platform.image" (dict "repository" (default .Values.trainer.image.repository $img.repository)
    "tag" (default (default .Chart.AppVersion .Values.trainer.image.tag) $img.tag) "digest" $img.digest) -}}
{{- end -}}

{{- define "gem-platform.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gem-platform.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "gem-platform.operatorImage" -}}
{{- $img := .Values.operator.image -}}
{{- include "gem-platform.image" (dict "repository" $img.repository "tag" (default .Chart.AppVersion $img.tag)
    "digest" $img.digest) -}}
{{- end -}}

{{- define "gem-platform.trainerImage" -}}
{{- printf "%s:%s" .Values.trainer.image.repository (default .Chart.AppVersion .Values.trainer.image.tag) -}}
{{- end -}}

{{/*
Namespaces that get the Kueue LocalQueue: every served namespace (watchNamespaces). An operator
serving all namespaces labels jobs everywhere, but the chart cannot create a queue in namespaces
it does not know: kueue.localQueueNamespaces, else the release namespace.
*/}}
{{- define "gem-platform.localQueueNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- toJson (uniq .Values.watchNamespaces) -}}
{{- else if .Values.kueue.localQueueNamespaces -}}
{{- toJson (uniq .Values.kueue.localQueueNamespaces) -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* Where NOTES run the sample: a served namespace; with Kueue one that has the LocalQueue, so it is admitted. */}}
{{- define "gem-platform.sampleNamespace" -}}
{{- if or .Values.watchNamespaces (and .Values.kueue.enabled .Values.kueue.clusterQueue) -}}
{{- first (include "gem-platform.localQueueNamespaces" . | fromJsonArray) -}}
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/* The metrics Service exists when asked for, or when a ServiceMonitor needs it. */}}
{{- define "gem-platform.metricsService" -}}
{{- if or .Values.metrics.service.enabled .Values.metrics.serviceMonitor.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The operator's RBAC rules: files/rbac-rules.yaml, the one table that equals
gem_operator.kube.RBAC_RULES (tests/test_helm_chart.py keeps them equal).
"gem-platform.rbacRules" takes (dict "ctx" $ "scope" "namespaced"|"cluster"|"all") and returns
the rules on namespaced resources, on cluster-scoped resources, or all of them.
*/}}
{{- define "gem-platform.rbacRules" -}}
{{- $table := .ctx.Files.Get "files/rbac-rules.yaml" | fromYaml -}}
{{- $clusterScoped := $table.clusterScopedResources -}}
{{- $out := list -}}
{{- range $rule := $table.rules -}}
{{- $isCluster := true -}}
{{- range $res := $rule.resources -}}
{{- if not (has $res $clusterScoped) -}}{{- $isCluster = false -}}{{- end -}}
{{- end -}}
{{- if or (eq $.scope "all") (and (eq $.scope "cluster") $isCluster) (and (eq $.scope "namespaced") (not $isCluster)) -}}
{{- $out = append $out $rule -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Milliseconds of a Prometheus duration (1m30s, 500ms; the schema checked its form). */}}
{{- define "gem-platform.durationMs" -}}
{{- $ms := dict "y" 31536000000 "w" 604800000 "d" 86400000 "h" 3600000 "m" 60000 "s" 1000 "ms" 1 -}}
{{- $total := 0 -}}
{{- range regexFindAll "[0-9]+(ms|[ywdhms])" . -1 -}}
{{- $n := regexFind "^[0-9]+" . -}}
{{- $total = add $total (mul (atoi $n) (get $ms (trimPrefix $n .))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}
