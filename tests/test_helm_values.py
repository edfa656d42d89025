"""values.schema.json: bad values fail `helm install/upgrade/template` with the key's name, good ones pass."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (in the dev extra)")

CHART_DIR = Path(__file__).resolve().parent.parent / "helm" / "gem-platform"
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART_DIR / "values.yaml").read_text())


@functools.cache
def chart() -> Any:
    return helm.Chart.load(str(CHART_DIR))


def render(values: dict[str, Any]) -> dict[str, str]:
    return chart().render(values, name="gem-platform", namespace="gem-system", is_install=True)


def test_schema_is_valid_draft7_and_accepts_the_defaults() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(DEFAULTS)
    chart().validate_schema(None)


def test_every_default_key_is_declared() -> None:
    """additionalProperties: false all the way down, so every default must be in the schema."""

    def walk(values: Any, schema: dict[str, Any], path: str) -> None:
        if not isinstance(values, dict) or "properties" not in schema:
            return
        for key, value in values.items():
            assert key in schema["properties"], f"{path}{key} is in values.yaml but not in values.schema.json"
            walk(value, schema["properties"][key], f"{path}{key}.")

    walk(DEFAULTS, SCHEMA, "")


# (values, what the error must name)
BAD_VALUES = [
    ({"rbac": {"scope": "everywhere"}}, "/rbac/scope"),
    ({"rbacc": {"scope": "cluster"}}, "rbacc"),  # a typo at the top
    ({"operator": {"imagee": {}}}, "imagee"),  # a typo below
    ({"rbac": {"scope": "namespaced"}}, "/watchNamespaces"),  # namespaced RBAC needs namespaces
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
    ({"watchNamespaces": ["a", "a"]}, "/watchNamespaces"),
    ({"watchNamespaces": "team-a"}, "/watchNamespaces"),
    ({"operator": {"image": {"digest": "sha256:abc"}}}, "/operator/image/digest"),
    ({"operator": {"image": {"tag": "has space"}}}, "/operator/image/tag"),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
    ({"operator": {"resyncSeconds": 0}}, "/operator/resyncSeconds"),
    # the operator refuses these at start (gem_operator.settings: GEM_RESYNC_SECONDS >= 1,
    # GEM_TEACHER_POLL_SECONDS >= 0.1): the chart must not accept what leaves its pod crash-looping
    ({"operator": {"resyncSeconds": 0.5}}, "/operator/resyncSeconds"),
    ({"operator": {"teacherPollSeconds": 0.05}}, "/operator/teacherPollSeconds"),
    ({"operator": {"resources": {"requests": {"cpu": "lots"}}}}, "/operator/resources/requests/cpu"),
    ({"operator": {"health": {"port": 70000}}}, "/operator/health/port"),
    ({"operator": {"health": {"path": "healthz"}}}, "/operator/health/path"),
    # The restricted security context cannot be relaxed.
    ({"operator": {"securityContext": {"readOnlyRootFilesystem": False}}}, "/operator/securityContext/readOnlyRootFilesystem"),
    ({"operator": {"securityContext": {"allowPrivilegeEscalation": True}}}, "/operator/securityContext/allowPrivilegeEscalation"),
    ({"operator": {"securityContext": {"runAsNonRoot": False}}}, "/operator/securityContext/runAsNonRoot"),
    ({"operator": {"securityContext": {"privileged": True}}}, "/operator/securityContext/privileged"),
    ({"operator": {"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}}, "/operator/securityContext/capabilities/drop"),
    ({"operator": {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}}, "/operator/securityContext/capabilities/add"),
    ({"operator": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}}, "/operator/securityContext/seccompProfile/type"),
    ({"operator": {"podSecurityContext": {"runAsUser": 0}}}, "/operator/podSecurityContext/runAsUser"),
    ({"mlflow": {"trackingUri": "http://user:password@mlflow:5000"}}, "/mlflow/trackingUri"),
    ({"mlflow": {"trackingUri": "https://token@mlflow.example.com"}}, "/mlflow/trackingUri"),
    # a file store: the trainers refuse it (gem/train/tracking.py), so the chart does too
    ({"mlflow": {"trackingUri": "file:///mnt/mlruns"}}, "/mlflow/trackingUri"),
    ({"mlflow": {"trackingUri": "/mnt/mlruns"}}, "/mlflow/trackingUri"),
    ({"mlflow": {"credentialsSecret": "Not_A_Name"}}, "/mlflow/credentialsSecret"),
    ({"mlflow": {"password": "hunter2"}}, "password"),  # no place for credentials in values
    ({"kueue": {"enabled": "yes"}}, "/kueue/enabled"),
    ({"kueue": {"queueName": "Bad Queue"}}, "/kueue/queueName"),
    ({"kueue": {"localQueueNamespaces": ["Team_A"]}}, "/kueue/localQueueNamespaces/0"),
    # with watchNamespaces the LocalQueues go to exactly those: a second list would be ignored
    ({"watchNamespaces": ["team-a"], "kueue": {"localQueueNamespaces": ["team-b"]}}, "/kueue/localQueueNamespaces"),
    # the operator refuses a name that is not a Secret's at start (GEM_TRAINER_IMAGE_PULL_SECRETS)
    ({"trainer": {"imagePullSecrets": [{"name": "Not_A_Name"}]}}, "/trainer/imagePullSecrets/0/name"),
    ({"metrics": {"port": 0}}, "/metrics/port"),
    ({"metrics": {"service": {"type": "Ingress"}}}, "/metrics/service/type"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"serviceMonitor": {"interval": ""}}}, "/metrics/serviceMonitor/interval"),
    ({"metrics": {"serviceMonitor": {"scrapeTimeout": "10s30m"}}}, "/metrics/serviceMonitor/scrapeTimeout"),  # units out of order
    ({"serviceAccount": {"create": "true"}}, "/serviceAccount/create"),
    # no ServiceAccount of its own and none named: the RBAC went to the namespace's `default`, which every pod uses
    ({"serviceAccount": {"create": False}}, "/serviceAccount/name"),
    ({"serviceAccount": {"create": False}, "rbac": {"create": False}}, "/serviceAccount/name"),
    # names of every object are made of these: upper case or '_' would be refused by the API server
    ({"fullnameOverride": "Gem_Platform"}, "/fullnameOverride"),
    ({"fullnameOverride": "1gem"}, "/fullnameOverride"),  # a Service name must start with a letter
    ({"nameOverride": "GEM"}, "/nameOverride"),
    # a selector label would render twice in the pod template and stop matching the Deployment's selector
    ({"operator": {"podLabels": {"app.kubernetes.io/component": "ctl"}}}, "/operator/podLabels"),
    ({"nodePools": {"GPU": {}}}, "invalid propertyName 'GPU'"),
    # Solaris: enabled needs the checkpoint it serves
    ({"solaris": {"enabled": True}}, "/solaris/checkpoint/claimName"),
    ({"solaris": {"enabled": True, "checkpoint": {"claimName": "c"}}}, "/solaris/checkpoint/path"),
    ({"solaris": {"checkpoint": {"path": "/var/lib/gem/checkpoints/ns/fm/step-1"}}}, "/solaris/checkpoint/path"),  # inside the claim
    ({"solaris": {"checkpoint": {"path": "ns/../../etc"}}}, "/solaris/checkpoint/path"),
    ({"solaris": {"checkpoint": {"claimName": "Gem_Checkpoints"}}}, "/solaris/checkpoint/claimName"),
    ({"solaris": {"config": {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "w"},
                             "spec": {"data": {"source": "parquet"}}}}}, "/solaris/config/spec/data/source"),
    ({"solaris": {"config": {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "w"},
                             "spec": {"data": {"sources": [{"name": "a"}]}}}}}, "/solaris/config/spec/data/sources"),
    ({"solaris": {"config": {"kind": "GEMTraining", "spec": {}}}}, "/solaris/config"),  # no apiVersion, metadata
    ({"solaris": {"config": ["not", "a", "manifest"]}}, "/solaris/config"),
    ({"solaris": {"port": 0}}, "/solaris/port"),
    ({"solaris": {"ttlSeconds": 0}}, "/solaris/ttlSeconds"),
    ({"solaris": {"namespace": "Team_A"}}, "/solaris/namespace"),
    ({"solaris": {"existingConfigMap": {"key": "a/b"}}}, "/solaris/existingConfigMap/key"),
    ({"solaris": {"terminationGracePeriodSeconds": 0}}, "/solaris/terminationGracePeriodSeconds"),
    ({"solaris": {"securityContext": {"readOnlyRootFilesystem": False}}}, "/solaris/securityContext/readOnlyRootFilesystem"),
    ({"solaris": {"podSecurityContext": {"runAsUser": 0}}}, "/solaris/podSecurityContext/runAsUser"),
    ({"solaris": {"livenessProbe": {"path": "/other"}}}, "/solaris/livenessProbe"),  # the path is /healthz, not a value
    ({"solaris": {"workers": 4}}, "workers"),  # serve-precompute has no such flag
    ({"nodePools": {"gpu": {"nodeSelector": {"a": 1}}}}, "/nodePools/gpu/nodeSelector/a"),
    ({"nodePools": {"gpu": {"tolerations": [{"operator": "Maybe"}]}}}, "/nodePools/gpu/tolerations/0/operator"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_bad_values_are_rejected(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        render(values)
    assert where in str(e.value), str(e.value)


SOLARIS_ON = {"solaris": {"enabled": True, "checkpoint": {"claimName": "gem-checkpoints", "path": "team-a/fm/step-00000400"}}}
WORLD = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "fm"},
         "spec": {"data": {"source": "synthetic", "synthetic": {"seed": 0}}}}

# Mistakes the schema cannot see (they relate two values); the templates refuse them.
BAD_COMBINATIONS = [
    ({"operator": {"nodePool": "system"}}, 'operator.nodePool "system" is not a key of nodePools'),
    ({"trainer": {"nodePool": "tpu"}}, 'trainer.nodePool "tpu" is not a key of nodePools'),
    ({"metrics": {"port": 8080}}, "operator.health.port and metrics.port are both 8080"),
    ({"metrics": {"port": 8081}}, "operator.readiness.port and metrics.port are both 8081"),
    ({"operator": {"readiness": {"port": 8080}}}, "operator.readiness.port and operator.health.port are both 8080"),
    # Prometheus refuses a scrape whose timeout is longer than its interval (the ServiceMonitor is dropped)
    ({"metrics": {"serviceMonitor": {"enabled": True, "interval": "10s", "scrapeTimeout": "15s"}}},
     "metrics.serviceMonitor.scrapeTimeout (15s) is longer than metrics.serviceMonitor.interval (10s)"),
    ({"metrics": {"serviceMonitor": {"enabled": True, "interval": "1m", "scrapeTimeout": "1m500ms"}}},
     "metrics.serviceMonitor.scrapeTimeout (1m500ms) is longer"),
    # Solaris' --config: the manifest or a ConfigMap holding it, not both
    ({"solaris": {**SOLARIS_ON["solaris"], "config": WORLD, "existingConfigMap": {"name": "world"}}},
     "solaris.config and solaris.existingConfigMap.name are both set"),
    # the text form (--set-file) passes no schema: the template checks what serve-precompute would refuse
    ({"solaris": {**SOLARIS_ON["solaris"], "config": "kind: [GEMTraining"}}, "solaris.config is not the YAML of a manifest"),
    ({"solaris": {**SOLARIS_ON["solaris"], "config": "just text"}}, "solaris.config is not the YAML of a manifest"),
    ({"solaris": {**SOLARIS_ON["solaris"], "config": "metadata: {name: fm}"}}, "solaris.config holds no manifest"),
    ({"solaris": {**SOLARIS_ON["solaris"], "config": yaml.safe_dump({**WORLD, "spec": {"data": {"source": "parquet"}}})}},
     'spec.data.source is "parquet"'),
    ({"solaris": {**SOLARIS_ON["solaris"], "config": yaml.safe_dump({**WORLD, "spec": {"data": {"sources": [{"a": 1}]}}})}},
     "spec.data.sources is set"),
]


@pytest.mark.parametrize(("values", "message"), BAD_COMBINATIONS)
def test_inconsistent_values_fail_rendering(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as e:
        render(values)
    assert message in str(e.value)


GOOD_VALUES = [
    {"mlflow": {"trackingUri": "http://mlflow.mlflow.svc.cluster.local:5000"}},
    {"mlflow": {"trackingUri": "https://mlflow.example.com/api?x=1", "uiUrl": "https://mlflow.example.com"}},
    {"mlflow": {"trackingUri": "databricks"}},
    {"mlflow": {"trackingUri": "sqlite:////mnt/mlruns/mlflow.db"}},
    {"mlflow": {"credentialsSecret": "mlflow-credentials"}},
    {"operator": {"image": {"digest": "sha256:" + "0" * 64}}},
    {"operator": {"resources": {"requests": {"cpu": 1, "memory": "1.5Gi"}, "limits": {"cpu": "500m"}}}},
    {"operator": {"extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]}},
    {"watchNamespaces": ["team-a"], "rbac": {"scope": "namespaced"}},
    {"global": {"imageRegistry": "mirror.example.com"}},
    {"nodePools": {}, "trainer": {"nodePool": ""}},
    {"serviceAccount": {"create": False, "name": "default"}},  # said explicitly, it is a choice
    {"kueue": {"enabled": True, "clusterQueue": "cq", "localQueueNamespaces": ["default", "team-a"]}},
    {"operator": {"livenessProbe": None, "readinessProbe": None}},
    # Prometheus durations: compound ones too; a timeout equal to the interval
    {"metrics": {"serviceMonitor": {"enabled": True, "interval": "1m30s", "scrapeTimeout": "90s"}}},
    {"metrics": {"serviceMonitor": {"enabled": True, "interval": "1h", "scrapeTimeout": "59m59s999ms"}}},
    SOLARIS_ON,  # --config: the checkpoint's own gem.yaml
    {"solaris": {**SOLARIS_ON["solaris"], "config": WORLD}},
    {"solaris": {**SOLARIS_ON["solaris"], "config": yaml.safe_dump(WORLD)}},  # --set-file
    {"solaris": {**SOLARIS_ON["solaris"], "existingConfigMap": {"name": "world", "key": "gem.yaml"}, "namespace": "team-a",
                 "startupProbe": None, "livenessProbe": None, "readinessProbe": None, "ttlSeconds": 0.5}},
    {"solaris": {"enabled": False, "config": WORLD}},  # kept for later: nothing is rendered
]


@pytest.mark.parametrize("values", GOOD_VALUES)
def test_good_values_render(values: dict[str, Any]) -> None:
    assert render(values)


def test_names_yaml_would_read_as_numbers_or_booleans_render_as_strings() -> None:
    """`123`, `true` and `007` are valid Kubernetes names; unquoted in a template, YAML reads them as
    an int, a bool and 7, and the API server refuses the object (or, for 007, names another one)."""
    docs = [d for name, text in render({
        "operator": {"priorityClassName": "123"},
        "watchNamespaces": ["007"], "rbac": {"scope": "namespaced"},
        "kueue": {"enabled": True, "clusterQueue": "true", "queueName": "1e3"},
        "solaris": {**SOLARIS_ON["solaris"], "priorityClassName": "456", "namespace": "008"},
        "metrics": {"serviceMonitor": {"enabled": True}},
    }).items() if not name.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    specs = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in by_kind["Deployment"]}
    assert sorted(s.get("priorityClassName") for s in specs.values()) == ["123", "456"]
    (queue,) = by_kind["LocalQueue"]
    assert queue["metadata"] == {**queue["metadata"], "name": "1e3", "namespace": "007"}
    assert queue["spec"]["clusterQueue"] == "true"
    assert {d["metadata"]["namespace"] for d in by_kind["Role"] + by_kind["RoleBinding"]} >= {"007"}
    assert {d["metadata"]["namespace"] for d in by_kind["Deployment"] + by_kind["Service"]} == {"gem-system", "008"}
    solaris_monitor = [m for m in by_kind["ServiceMonitor"] if m["metadata"]["namespace"] == "008"]
    assert solaris_monitor and solaris_monitor[0]["spec"]["namespaceSelector"]["matchNames"] == ["008"]
