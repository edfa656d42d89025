"""The Helm chart (helm/gem-platform), rendered and linted offline.

Helm itself runs in-process: `helm-python-sdk` ships libhelm_c (Helm v4's Go SDK behind a C ABI),
so no `helm` binary and no cluster are needed. Rendered built-in kinds are checked against the
Kubernetes OpenAPI schemas bundled in `kubernetes-validate`.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (in the dev extra)")
kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extra)")

from gem_operator.__main__ import parse_args  # noqa: E402
from gem_operator.kube import RBAC_RULES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = ROOT / "helm" / "gem-platform"
RELEASE, NAMESPACE = "gem-platform", "gem-system"
#: Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas bundled.
KUBE_VERSIONS = ["1.27.0", kv.latest_version()]
#: Kinds kubernetes-validate has no schema for (CRD instances); they are checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor", "LocalQueue"}


@functools.cache
def chart() -> Any:
    return helm.Chart.load(str(CHART_DIR))


def render(values: dict[str, Any] | None = None, *, upgrade: bool = False, release: str = RELEASE) -> list[dict[str, Any]]:
    """`helm template` of the chart: every object it would apply (NOTES.txt and CRDs aside)."""
    out = chart().render(
        values, name=release, namespace=NAMESPACE, is_install=not upgrade, is_upgrade=upgrade, revision=2 if upgrade else 1
    )
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    out = chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def triples(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def granted(docs: list[dict[str, Any]]) -> dict[tuple[str, str], set[tuple[str, str, str]]]:
    """(kind, namespace) of each role -> the (apiGroup, resource, verb) triples it grants."""
    return {
        (d["kind"], d["metadata"].get("namespace", "")): triples(d["rules"])
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
    }


def validate_builtin(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        for version in KUBE_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: {e.message}")


NAMESPACED = {"rbac": {"scope": "namespaced"}, "watchNamespaces": ["team-a", "team-b"]}


# --------------------------------------------------------------------------- lint and render


def test_chart_metadata_matches_the_project() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2" and meta["name"] == "gem-platform"
    assert meta["appVersion"] == project["version"], "Chart.yaml appVersion must follow pyproject's version"


@pytest.mark.parametrize(
    "values",
    [None, NAMESPACED, {"solaris": {"enabled": True, "checkpoint": {"claimName": "c", "path": "ns/fm/step-00000001"},
                                    "existingConfigMap": {"name": "world"}}}],
    ids=["default", "namespaced", "solaris"],
)
def test_lint_is_clean(values: dict[str, Any] | None) -> None:
    report = helm.lint(str(CHART_DIR), values, strict=True, namespace=NAMESPACE, kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_lint_reports_bad_values() -> None:
    report = helm.lint(str(CHART_DIR), {"rbac": {"scope": "everywhere"}}, strict=True, namespace=NAMESPACE)
    assert any(m["severity"] == 3 for m in report["messages"]) or report["errors"], report


def test_default_render_is_valid_kubernetes() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ConfigMap"]
    ), kinds
    validate_builtin(docs)
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE and labels["app.kubernetes.io/part-of"] == "gem-platform"
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"]["namespace"] == NAMESPACE


def test_upgrade_render_equals_install_render() -> None:
    assert render(upgrade=True) == render()


def test_no_secret_is_rendered_or_read() -> None:
    values = {"mlflow": {"trackingUri": "http://mlflow.mlflow:5000", "credentialsSecret": "mlflow-credentials"}}
    for docs in (render(values), render({**values, **NAMESPACED})):
        assert not by_kind(docs, "Secret")
        text = json.dumps(docs)
        assert "secretKeyRef" not in text and "secretRef" not in text
        assert all(r != "secrets" for _, r, _ in set().union(*granted(docs).values()))


def _trainer_container(docs: list[dict[str, Any]], spec: dict[str, Any], monkeypatch) -> dict[str, Any]:
    """The trainer container the operator, configured by this render's env, gives a GEMTraining."""
    from gem.api import render as gem_render
    from gem.api.types import GEMTraining
    from gem_operator.settings import OperatorConfig

    for name, value in env_of(operator_container(docs)).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    obj = GEMTraining.model_validate({"metadata": {"name": "t", "namespace": "team-a", "uid": "u"}, "spec": spec})
    job = gem_render.render_pytorchjob(obj, defaults=OperatorConfig.from_env().platform_defaults())
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_the_chart_mlflow_secret_reaches_jobs_that_name_none_as_optional(monkeypatch) -> None:
    docs = render({"mlflow": {"credentialsSecret": "mlflow-creds"}})
    # a namespace that has not created it must still start its pods (no CreateContainerConfigError)
    assert _trainer_container(docs, {}, monkeypatch)["envFrom"] == [{"secretRef": {"name": "mlflow-creds", "optional": True}}]
    named = _trainer_container(docs, {"mlflow": {"credentialsSecret": "team-creds"}}, monkeypatch)
    assert named["envFrom"] == [{"secretRef": {"name": "team-creds"}}]
    # NOTES say so, instead of asking users to repeat the name in every spec
    text = notes({"mlflow": {"credentialsSecret": "mlflow-creds"}})
    assert "mlflow-creds" in text and "automatically" in text and "optional" in text
    assert "set spec.mlflow.credentialsSecret" not in text


def test_the_trainer_image_reaches_jobs_through_the_operator_not_the_crd(monkeypatch) -> None:
    from gem.api.crds import render_crd

    docs = render({"trainer": {"image": {"repository": "registry.example/trainer", "tag": "9"}}})
    assert _trainer_container(docs, {}, monkeypatch)["image"] == "registry.example/trainer:9"
    assert _trainer_container(docs, {"image": "mine:1"}, monkeypatch)["image"] == "mine:1"
    spec = render_crd("GEMTraining")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "default" not in spec["properties"]["image"]
    # so values.yaml must not tell readers the CRD defaults it
    values_text = (CHART_DIR / "values.yaml").read_text()
    assert not re.search(r"CRD[^\n]*defaults spec\.image", values_text)
    assert "GEM_TRAINER_IMAGE" in values_text


# --------------------------------------------------------------------------- CRDs


def test_chart_crds_equal_manifests_crds() -> None:
    chart_crds = {Path(f["name"]).name: f["data"] for f in chart().crds}
    manifests = {p.name: p.read_text() for p in sorted((ROOT / "manifests" / "crds").glob("*.yaml"))}
    assert chart_crds, "the chart has no crds/"
    assert sorted(chart_crds) == sorted(manifests), "run `python helm/generate.py` (or `make crds`)"
    for name, text in manifests.items():
        assert chart_crds[name] == text, f"helm/gem-platform/crds/{name} is stale: run `python helm/generate.py`"


def test_chart_crds_are_what_the_types_render() -> None:
    from gem.api.crds import render_all

    assert {Path(f["name"]).name: f["data"] for f in chart().crds} == render_all()


def test_crds_are_valid_and_never_templated() -> None:
    for f in chart().crds:
        assert "{{" not in f["data"], "crds/ is not templated by Helm"
        crd = yaml.safe_load(f["data"])
        validate_builtin([crd])
        assert "helm.sh/resource-policy" not in crd["metadata"].get("annotations", {})
    # Templates never carry CRDs (Helm would then delete them on uninstall, and the data with them).
    for values in (None, NAMESPACED):
        assert not by_kind(render(values), "CustomResourceDefinition")


def test_generated_files_are_fresh() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "helm" / "generate.py"), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- RBAC


def test_rbac_table_equals_operator_rules() -> None:
    table = yaml.safe_load((CHART_DIR / "files" / "rbac-rules.yaml").read_text())
    assert table["rules"] == RBAC_RULES


def test_cluster_rbac_is_exactly_rbac_rules() -> None:
    docs = render()
    role = one(docs, "ClusterRole")
    assert role["rules"] == RBAC_RULES
    binding = one(docs, "ClusterRoleBinding")
    sa = one(docs, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")


def test_namespaced_rbac_splits_rbac_rules() -> None:
    docs = render(NAMESPACED)
    grants = granted(docs)
    roles = {ns: g for (kind, ns), g in grants.items() if kind == "Role"}
    assert sorted(roles) == ["team-a", "team-b"]
    cluster = grants[("ClusterRole", "")]
    # Only the read-only rules on cluster-scoped resources are cluster-wide ...
    assert {r for _, r, _ in cluster} == {"customresourcedefinitions", "namespaces", "nodes"}
    assert {v for _, _, v in cluster} <= {"get", "list", "watch"}
    # ... and each namespace gets the rest: together, exactly RBAC_RULES.
    for ns, grant in roles.items():
        assert grant | cluster == triples(RBAC_RULES), ns
        assert not grant & cluster
    bindings = {d["metadata"]["namespace"]: d for d in by_kind(docs, "RoleBinding")}
    assert sorted(bindings) == ["team-a", "team-b"]
    for b in bindings.values():
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"][0]["namespace"] == NAMESPACE
    validate_builtin(docs)


def test_rbac_grants_nothing_dangerous() -> None:
    everything = set().union(*granted(render()).values(), *granted(render(NAMESPACED)).values())
    resources = {r for _, r, _ in everything}
    verbs = {v for _, _, v in everything}
    assert "*" not in resources | verbs | {g for g, _, _ in everything}
    assert not resources & {"secrets", "pods/exec", "pods/attach", "pods/portforward", "serviceaccounts/token"}
    # Nodes: read-only, for their topology labels (docs/parallelism.md); never patched or deleted.
    assert {v for _, r, v in everything if r == "nodes"} == {"list"}
    assert not verbs & {"escalate", "bind", "impersonate", "deletecollection"}
    # Subresources: status (ours), finalizers (ours, update only: see the next test) and pods/log,
    # read-only (the trainer's progress lines).
    assert all(r.endswith(("/status", "/finalizers")) or "/" not in r or r == "pods/log" for r in resources)
    assert {v for _, r, v in everything if r.endswith("/finalizers")} == {"update"}
    assert {v for _, r, v in everything if r == "pods/log"} == {"get"}


@pytest.mark.parametrize("values", [None, NAMESPACED], ids=["cluster", "namespaced"])
def test_rbac_lets_the_operator_set_block_owner_deletion_on_its_children(values: dict[str, Any] | None) -> None:
    # The OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift and hardened
    # clusters) refuses an ownerReference with blockOwnerDeletion: true (403) unless its creator
    # may update the owner's finalizers subresource: without it no job would ever be created.
    from gem.api import render as gem_render
    from gem.api.types import KINDS
    from gem_operator.validation import parse_resource

    grants = granted(render(values))
    served = set().union(*(g for (kind, ns), g in grants.items() if kind == "ClusterRole" or ns == "team-a"))
    bodies = [
        {"kind": "GEMTraining", "spec": {}},
        {"kind": "LoopFMDistill", "spec": {"teacher": {"checkpoint": "/ckpt/teacher"}}},
    ]
    for body in bodies:
        obj = parse_resource(body["kind"], {
            "apiVersion": "gem.dev/v1alpha1", **body,
            "metadata": {"name": "owner", "namespace": "team-a", "uid": "u-1", "generation": 1},
        })
        children = [gem_render.render_config_map(obj), gem_render.render_pytorchjob(obj)]
        for ref in (r for child in children for r in child["metadata"]["ownerReferences"] if r.get("blockOwnerDeletion")):
            group = ref["apiVersion"].split("/")[0]
            assert (group, f"{KINDS[ref['kind']]['plural']}/finalizers", "update") in served, ref["kind"]


def test_rbac_grants_no_write_the_operator_never_makes() -> None:
    # Children go by their ownerReferences and every write (kopf's too) is a patch: the
    # operator's code calls no delete_* or replace_* (update) method of the kubernetes client.
    code = "".join(p.read_text() for p in (ROOT / "operator" / "gem_operator").glob("*.py"))
    assert not re.search(r"\.(delete|replace)_\w+\(", code)
    everything = set().union(*granted(render()).values(), *granted(render(NAMESPACED)).values())
    assert {(r, v) for _, r, v in everything if v in ("delete", "update")} == {
        (f"{plural}/finalizers", "update") for plural in ("gemtrainings", "loopfmdistills")
    }


def test_rbac_create_false_renders_no_rbac() -> None:
    docs = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"}})
    assert not granted(docs) and not by_kind(docs, "ServiceAccount")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_plain_rbac_manifests_equal_rbac_rules() -> None:
    rbac = ROOT / "manifests" / "rbac"
    docs = [d for p in sorted(rbac.glob("*.yaml")) if p.name != "kustomization.yaml" for d in yaml.safe_load_all(p.read_text()) if d]
    assert one(docs, "ClusterRole")["rules"] == RBAC_RULES
    sa, binding = one(docs, "ServiceAccount"), one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}]
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]
    validate_builtin(docs)
    kustomization = yaml.safe_load((rbac / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in rbac.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_plain_rbac_builds_with_kustomize() -> None:
    proc = subprocess.run(["kubectl", "kustomize", str(ROOT / "manifests" / "rbac")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Namespace", "ServiceAccount"]


# --------------------------------------------------------------------------- the operator Deployment


def test_deployment_runs_one_operator_safely() -> None:
    docs = render()
    dep = one(docs, "Deployment")
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = operator_container(docs)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The root filesystem is read-only: /tmp is a writable emptyDir.
    (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == tmp["name"]]
    assert "emptyDir" in vol
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    # SIGTERM during a hung API request waits out the operator's request timeout (GEM_API_TIMEOUT_SECONDS)
    from gem_operator.settings import OperatorConfig

    assert pod["terminationGracePeriodSeconds"] > OperatorConfig().api_timeout_seconds


def test_probes_hit_liveness_and_readiness_endpoints() -> None:
    c = operator_container(render())
    args = parse_args(c["args"])  # the operator's own parser accepts what the chart passes
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert args.peering is None, "one replica, standalone: kopf peering would need RBAC the operator does not have"
    assert args.readiness == "http://0.0.0.0:8081/readyz"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8080, "ready": 8081, "metrics": 9090}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # readiness asks more than liveness: the API server answers and our CRDs and RBAC are in place
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ready"}


@pytest.mark.parametrize("probe", ["livenessProbe", "readinessProbe"])
def test_a_null_probe_is_dropped(probe: str) -> None:
    """`--set operator.<probe>=null` removes that probe; the other stays (was: a bare `null` under httpGet)."""
    docs = render({"operator": {probe: None}})
    validate_builtin(docs)
    c = operator_container(docs)
    other = "readinessProbe" if probe == "livenessProbe" else "livenessProbe"
    assert probe not in c and c[other]["httpGet"]["path"] in ("/healthz", "/readyz")


@pytest.mark.parametrize(
    ("watch", "expected"),
    [([], {"all_namespaces": True, "namespace": []}), (["team-a", "team-b"], {"all_namespaces": False, "namespace": ["team-a", "team-b"]})],
)
def test_watch_namespaces_become_operator_flags(watch: list[str], expected: dict[str, Any]) -> None:
    args = parse_args(operator_container(render({"watchNamespaces": watch}))["args"])
    assert {"all_namespaces": args.all_namespaces, "namespace": args.namespace} == expected


def test_operator_environment() -> None:
    values = {
        "mlflow": {"trackingUri": "http://mlflow.mlflow.svc:5000", "uiUrl": "https://mlflow.example.com", "credentialsSecret": "mlflow-creds"},
        "operator": {"resyncSeconds": 15, "verbose": True},
        "kueue": {"enabled": True, "queueName": "ads"},
    }
    c = operator_container(render(values))
    env = env_of(c)
    assert env["GEM_MLFLOW_TRACKING_URI"] == "http://mlflow.mlflow.svc:5000"
    assert env["GEM_MLFLOW_UI_URL"] == "https://mlflow.example.com"
    assert env["GEM_MLFLOW_CREDENTIALS_SECRET"] == "mlflow-creds"  # a name, not a secret
    assert env["GEM_RESYNC_SECONDS"] == "15" and env["GEM_TEACHER_POLL_SECONDS"] == "5"
    assert env["GEM_KUEUE_QUEUE_NAME"] == "ads" and env["GEM_KUEUE_QUEUE_LABEL"] == "kueue.x-k8s.io/queue-name"
    assert env["GEM_METRICS_PORT"] == "9090"
    assert env["GEM_TRAINER_IMAGE"] == "ghcr.io/gem-platform/trainer:0.1.0"
    assert parse_args(c["args"]).verbose is True

    # The values reach the operator's own configuration.
    from gem_operator.settings import OperatorConfig

    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        for k, v in env.items():
            if isinstance(v, str):
                m.setenv(k, v)
        cfg = OperatorConfig.from_env()
    assert cfg.mlflow_tracking_uri == "http://mlflow.mlflow.svc:5000" and cfg.resync_seconds == 15.0
    assert cfg.mlflow_ui_url == "https://mlflow.example.com"

    bare = env_of(operator_container(render()))
    assert not {"GEM_MLFLOW_TRACKING_URI", "GEM_MLFLOW_UI_URL", "GEM_MLFLOW_CREDENTIALS_SECRET", "GEM_KUEUE_QUEUE_NAME"} & set(bare)


def test_extra_env_cannot_repeat_a_variable() -> None:
    """The env list is a map keyed by name: server-side apply (Helm 4, Flux) refuses a duplicate, and
    client-side apply keeps both. An extraEnv naming a variable the chart sets rendered it twice."""
    full = {"mlflow": {"trackingUri": "http://mlflow:5000", "uiUrl": "https://mlflow.example.com", "credentialsSecret": "m"},
            "kueue": {"enabled": True}, "trainer": {"imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]}}
    names = [e["name"] for e in operator_container(render(full))["env"]]
    assert len(names) == len(set(names))
    assert env_of(operator_container(render(full)))["GEM_TRAINER_IMAGE_PULL_SECRETS"] == "regcred,mirror"
    assert "GEM_TRAINER_IMAGE_PULL_SECRETS" not in env_of(operator_container(render()))
    # the operator sets these two itself from its flags, overwriting an env of the same name
    for name in [*names, "GEM_WATCH_NAMESPACES", "GEM_READINESS_URL"]:
        with pytest.raises(helm.HelmRenderError, match=f"operator.extraEnv sets {name}, which the chart sets from"):
            render({**full, "operator": {"extraEnv": [{"name": name, "value": "1"}]}})
    with pytest.raises(helm.HelmRenderError, match="operator.extraEnv sets HTTPS_PROXY twice"):
        render({"operator": {"extraEnv": [{"name": "HTTPS_PROXY", "value": "a"}, {"name": "HTTPS_PROXY", "value": "b"}]}})
    env = env_of(operator_container(render({"operator": {"extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]}})))
    assert env["HTTPS_PROXY"] == "http://proxy:3128"


def test_image_references() -> None:
    assert operator_container(render())["image"] == "ghcr.io/gem-platform/operator:0.1.0"
    assert operator_container(render({"operator": {"image": {"tag": "0.2.0-rc1"}}}))["image"].endswith(":0.2.0-rc1")
    digest = "sha256:" + "a" * 64
    assert operator_container(render({"operator": {"image": {"digest": digest}}}))["image"] == f"ghcr.io/gem-platform/operator@{digest}"


DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@pytest.mark.parametrize(
    ("release", "values"), [("r" * 53, None), (RELEASE, {"fullnameOverride": "f" * 63})], ids=["release", "fullnameOverride"]
)
def test_the_longest_names_still_give_valid_object_names(release: str, values: dict[str, Any] | None) -> None:
    """Helm's longest release name (53) or a 63-character fullnameOverride: a Service name stays a DNS
    label of at most 63 characters (was: `<fullname>-metrics`, 71, which the API server refuses)."""
    everything = {**(values or {}), **solaris_values(), "metrics": {"serviceMonitor": {"enabled": True}}}
    for doc in render(everything, release=release):
        name = doc["metadata"]["name"]
        if doc["kind"] == "Service":
            assert DNS_LABEL.match(name) and len(name) <= 63, name
        else:
            assert DNS_SUBDOMAIN.match(name) and len(name) <= 253, name


@pytest.mark.parametrize("release", ["1gem", "gem.prod"])
def test_a_release_name_that_makes_no_service_name_fails_with_the_fix(release: str) -> None:
    with pytest.raises(helm.HelmRenderError, match="is not a DNS label.*set fullnameOverride"):
        render(None, release=release)
    assert render({"fullnameOverride": "gem-prod"}, release=release)


def test_trainer_default_matches_the_crd_default() -> None:
    from gem.api.types import DEFAULT_TRAINER_IMAGE

    cm = one(render(), "ConfigMap")
    assert cm["data"]["trainerImage"] == DEFAULT_TRAINER_IMAGE
    pools = yaml.safe_load(cm["data"]["nodePools.yaml"])
    assert cm["data"]["trainerNodePool"] in pools


def test_operator_node_pool_placement() -> None:
    values = {
        "nodePools": {"system": {"nodeSelector": {"pool": "system"}, "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}]}},
        "trainer": {"nodePool": ""},
        "operator": {"nodePool": "system", "nodeSelector": {"zone": "a"}},
    }
    pod = one(render(values), "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "system", "zone": "a"}
    assert pod["tolerations"] == [{"effect": "NoSchedule", "key": "system", "operator": "Exists"}]


# --------------------------------------------------------------------------- every combination of the toggles

TOGGLES = list(itertools.product(["cluster", "namespaced"], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize(("scope", "service_monitor", "kueue", "service"), TOGGLES)
def test_every_toggle_combination_renders(scope: str, service_monitor: bool, kueue: bool, service: bool) -> None:
    values: dict[str, Any] = {
        "rbac": {"scope": scope},
        "metrics": {"service": {"enabled": service}, "serviceMonitor": {"enabled": service_monitor, "labels": {"release": "prom"}}},
        "kueue": {"enabled": kueue, "clusterQueue": "cluster-queue" if kueue else ""},
    }
    if scope == "namespaced":
        values["watchNamespaces"] = ["team-a", "team-b"]
    docs = render(values)
    validate_builtin(docs)
    keys = [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "duplicate objects"

    # Metrics: the Service exists when asked for or when a ServiceMonitor needs it.
    services = by_kind(docs, "Service")
    assert len(services) == (1 if service or service_monitor else 0)
    monitors = by_kind(docs, "ServiceMonitor")
    assert len(monitors) == (1 if service_monitor else 0)
    if monitors:
        (svc,), (sm,) = services, monitors
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert sm["metadata"]["labels"]["release"] == "prom"
        assert sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    for svc in services:
        assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
        pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()

    # Kueue: the operator is told the queue; LocalQueues in each served namespace.
    env = env_of(operator_container(docs))
    assert ("GEM_KUEUE_QUEUE_NAME" in env) == kueue
    queues = by_kind(docs, "LocalQueue")
    if kueue:
        expected_ns = ["team-a", "team-b"] if scope == "namespaced" else [NAMESPACE]
        assert sorted(q["metadata"]["namespace"] for q in queues) == expected_ns
        assert all(q["spec"] == {"clusterQueue": "cluster-queue"} and q["metadata"]["name"] == "gem" for q in queues)
        assert all(q["apiVersion"] == "kueue.x-k8s.io/v1beta1" for q in queues)
    else:
        assert not queues

    # RBAC: exactly RBAC_RULES in every case.
    grants = granted(docs)
    if scope == "cluster":
        assert one(docs, "ClusterRole")["rules"] == RBAC_RULES
    else:
        for (kind, ns), g in grants.items():
            if kind == "Role":
                assert g | grants[("ClusterRole", "")] == triples(RBAC_RULES), ns


# --------------------------------------------------------------------------- Kueue LocalQueues


def local_queues(values: dict[str, Any]) -> list[str]:
    return sorted(q["metadata"]["namespace"] for q in by_kind(render(values), "LocalQueue"))


def kueue_notes(values: dict[str, Any]) -> str:
    text = notes(values)
    return text[text.index("Kueue:"):text.index("Upgrading:")]


def test_an_all_namespaces_operator_gets_local_queues_where_asked_and_notes_say_where() -> None:
    """The operator labels jobs in every namespace, but a LocalQueue exists only where the chart made
    one: NOTES name exactly those namespaces and warn that jobs elsewhere stay suspended."""
    kueue = {"enabled": True, "clusterQueue": "cq"}
    assert local_queues({"kueue": kueue}) == [NAMESPACE]  # default: the release namespace
    text = kueue_notes({"kueue": kueue})
    assert f"created in: {NAMESPACE}." in text and "stay suspended" in text
    assert "NS=gem-system" in notes({"kueue": kueue})  # the sample goes where it is admitted

    values = {"kueue": {**kueue, "localQueueNamespaces": ["team-b", "default"]}}
    assert local_queues(values) == ["default", "team-b"]
    text = kueue_notes(values)
    assert "created in: team-b, default." in text and NAMESPACE not in text and "stay suspended" in text
    assert "kueue.localQueueNamespaces" in text  # how to cover another namespace


def test_a_namespaced_operator_gets_a_local_queue_in_every_served_namespace() -> None:
    values = {"watchNamespaces": ["team-a", "team-b"], "kueue": {"enabled": True, "clusterQueue": "cq"}}
    assert local_queues(values) == ["team-a", "team-b"]
    text = kueue_notes(values)
    assert "created in: team-a, team-b." in text and "other namespace" not in text


def test_without_a_cluster_queue_notes_say_no_local_queue_was_created() -> None:
    values = {"kueue": {"enabled": True, "localQueueNamespaces": ["team-a"]}}
    assert local_queues(values) == []
    text = kueue_notes(values)
    assert "None was created" in text and "created in:" not in text


# --------------------------------------------------------------------------- NOTES.txt


def test_notes_say_what_to_do_next() -> None:
    text = notes({"mlflow": {"trackingUri": "http://mlflow:5000", "credentialsSecret": "mlflow-creds"}, "kueue": {"enabled": True}})
    for needle in ("kubectl -n", "apply -f manifests/samples/gemtraining.yaml", "gemctl submit", "describe gemtraining",
                   "mlflow-creds", "kueue.x-k8s.io/queue-name=gem", "crds/", "docs/operations.md"):
        assert needle in text, needle
    assert "team-a" in notes(NAMESPACED)


def test_notes_upgrade_commands_work_on_a_helm_installed_cluster() -> None:
    """Helm created the CRDs, so a server-side apply of new ones conflicts with manager "helm" unless
    forced (NOTES lacked --force-conflicts); --reuse-values would drop the new chart's defaults."""
    text = notes()
    upgrade = text[text.index("Upgrading:"):]
    assert "kubectl apply --server-side --force-conflicts -f <chart>/crds/" in upgrade
    assert "--reset-then-reuse-values" in upgrade
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert "kubectl apply --server-side --force-conflicts -f helm/gem-platform/crds/" in docs


# --------------------------------------------------------------------------- Solaris (gem serve-precompute)

SAMPLE_TEXT = (ROOT / "manifests" / "samples" / "gemtraining.yaml").read_text()
SOLARIS_CHECKPOINT = {"claimName": "gem-checkpoints", "path": "team-a/gem-sample/step-00000400"}
#: The ways to give `--config`: the manifest as a mapping, as its text (--set-file), a ConfigMap of
#: yours, or none: the checkpoint's own gem.yaml.
SOLARIS_CONFIGS = {
    "mapping": {"config": yaml.safe_load(SAMPLE_TEXT)},
    "text": {"config": SAMPLE_TEXT},
    "existingConfigMap": {"existingConfigMap": {"name": "world", "key": "gem.yaml"}},
    "checkpoint": {},
}


def solaris_values(config: str = "mapping", **extra: Any) -> dict[str, Any]:
    return {"solaris": {"enabled": True, "checkpoint": SOLARIS_CHECKPOINT, **SOLARIS_CONFIGS[config], **extra}}


def component(docs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == name]


def solaris_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = by_kind(component(docs, "solaris"), "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def test_solaris_is_off_by_default() -> None:
    docs = render()
    assert not component(docs, "solaris")
    assert "Solaris" not in notes()


def test_a_release_whose_values_lack_solaris_still_renders(tmp_path: Path) -> None:
    """`helm upgrade --reuse-values` renders the new chart with the old chart's defaults, which have no
    `solaris` section: the templates must read that as off, not fail on a nil map."""
    old = tmp_path / "gem-platform"
    shutil.copytree(CHART_DIR, old)
    values = yaml.safe_load((old / "values.yaml").read_text())
    del values["solaris"]
    (old / "values.yaml").write_text(yaml.safe_dump(values))
    out = helm.Chart.load(str(old)).render(None, name=RELEASE, namespace=NAMESPACE, is_install=False, is_upgrade=True)
    docs = [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    assert one(docs, "Deployment")["metadata"]["name"] == RELEASE and not component(docs, "solaris")


@pytest.mark.parametrize(
    ("config", "namespace", "service_monitor"),
    list(itertools.product(SOLARIS_CONFIGS, ["", "team-a"], [False, True])),
)
def test_every_solaris_combination_renders(config: str, namespace: str, service_monitor: bool) -> None:
    values = {**solaris_values(config, namespace=namespace), "metrics": {"serviceMonitor": {"enabled": service_monitor}}}
    docs = render(values)
    validate_builtin(docs)
    keys = [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "duplicate objects"
    ns = namespace or NAMESPACE
    solaris = component(docs, "solaris")
    kinds = sorted(d["kind"] for d in solaris)
    expected = ["Deployment", "Service"] + (["ConfigMap"] if config in ("mapping", "text") else [])
    assert kinds == sorted(expected + (["ServiceMonitor"] if service_monitor else [])), kinds
    assert all(d["metadata"]["namespace"] == ns for d in solaris)

    (dep,), (svc,) = by_kind(solaris, "Deployment"), by_kind(solaris, "Service")
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    # the operator's Service and ServiceMonitor select its own pod only, and the other way round
    operator_pod = one(component(docs, "operator"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not svc["spec"]["selector"].items() <= operator_pod.items()
    for op_svc in by_kind(component(docs, "operator"), "Service"):
        assert not op_svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    # the config volume is the ConfigMap the chart wrote, or the user's, with the key asked for
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    if config == "checkpoint":
        assert "config" not in volumes
        (c,) = pod["spec"]["containers"]
        assert "--config=/var/lib/gem/checkpoints/team-a/gem-sample/step-00000400/gem.yaml" in c["args"]
    elif config == "existingConfigMap":
        cm_ref = volumes["config"]["configMap"]
        assert cm_ref == {"name": "world", "items": [{"key": "gem.yaml", "path": "config.yaml"}]}
    else:
        (cm,) = by_kind(solaris, "ConfigMap")
        cm_ref = volumes["config"]["configMap"]
        assert cm_ref == {"name": cm["metadata"]["name"], "items": [{"key": "config.yaml", "path": "config.yaml"}]}
        assert yaml.safe_load(cm["data"]["config.yaml"]) == yaml.safe_load(SAMPLE_TEXT)
        assert pod["metadata"]["annotations"]["checksum/config"]  # a new config restarts the server
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "gem-checkpoints", "readOnly": True}

    if service_monitor:
        (sm,) = by_kind(solaris, "ServiceMonitor")
        assert sm["spec"]["namespaceSelector"] == {"matchNames": [ns]}
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        (endpoint,) = sm["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["path"] == "/metrics"
        (op_sm,) = by_kind(component(docs, "operator"), "ServiceMonitor")
        assert not op_sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


@pytest.mark.parametrize("config", ["mapping", "text", "checkpoint"])
def test_solaris_runs_what_gem_serve_precompute_accepts(config: str, tmp_path: Path, monkeypatch) -> None:
    """The container's command line goes through `gem`'s own parser; the files it names are where the
    chart mounts them, and the config is a manifest serve-precompute serves."""
    from gem import cli
    from gem.solaris.service import require_synthetic_world

    docs = render(solaris_values(config, port=9000, ttlSeconds=3600))
    c = solaris_container(docs)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert c["command"] == ["gem"] and c["args"][0] == "serve-precompute"
    flags = dict(a.split("=", 1) for a in c["args"][1:])
    assert flags["--checkpoint"] == f"{mounts['checkpoints']['mountPath']}/{SOLARIS_CHECKPOINT['path']}"
    assert mounts["checkpoints"]["readOnly"]
    if config == "checkpoint":
        # the manifest the checkpoint was trained from, as the trainer saved it (gem.train.checkpoint)
        assert flags["--config"] == f"{flags['--checkpoint']}/gem.yaml"
        text = yaml.safe_dump(yaml.safe_load(SAMPLE_TEXT), sort_keys=False)
    else:
        assert flags["--config"] == f"{mounts['config']['mountPath']}/config.yaml" and mounts["config"]["readOnly"]
        text = one(component(docs, "solaris"), "ConfigMap")["data"]["config.yaml"]

    # what the pod would read at --config, read here by the command itself
    local_config = tmp_path / "config.yaml"
    local_config.write_text(text)
    argv = [a if not a.startswith("--config=") else f"--config={local_config}" for a in c["args"]]
    seen = {}

    def serve(manifest: Any, args: Any) -> int:
        require_synthetic_world(manifest.spec.data)
        seen.update(vars(args))
        return 0

    monkeypatch.setattr(cli, "_serve_precompute", serve)
    assert cli.main(argv) == 0
    assert seen["host"] == "0.0.0.0", "the default 127.0.0.1 is unreachable for the probes and the Service"
    assert seen["port"] == 9000 == c["ports"][0]["containerPort"] and c["ports"][0]["name"] == "http"
    assert seen["ttl"] == 3600.0 and seen["checkpoint"] == flags["--checkpoint"]


def test_solaris_probes_restarts_and_security() -> None:
    docs = render(solaris_values())
    c = solaris_container(docs)
    pod = one(by_kind(component(docs, "solaris"), "Deployment"), "Deployment")["spec"]["template"]["spec"]
    # /healthz is the one health endpoint: 503 after 5 failed rounds in a row, so liveness restarts the pod
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    # liveness waits for the start (model load, segments, warm-up); the startup probe allows minutes
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
    # SIGTERM lets the round in flight finish: more than Kubernetes' default 30 s
    assert pod["terminationGracePeriodSeconds"] == 60
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and pod["securityContext"]["runAsUser"] == 10001
    (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert env_of(c)["HOME"] == "/tmp"
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]

    tuned = solaris_values(terminationGracePeriodSeconds=300, livenessProbe=None)
    c = solaris_container(render(tuned))
    assert "livenessProbe" not in c and c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert by_kind(component(render(tuned), "solaris"), "Deployment")[0]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 300


def test_solaris_image_is_the_trainer_image_unless_set() -> None:
    assert solaris_container(render(solaris_values()))["image"] == "ghcr.io/gem-platform/trainer:0.1.0"
    trainer = {"trainer": {"image": {"repository": "registry.example/trainer", "tag": "9"}}}
    assert solaris_container(render({**solaris_values(), **trainer}))["image"] == "registry.example/trainer:9"
    digest = "sha256:" + "b" * 64
    own = solaris_values(image={"repository": "registry.example/solaris", "digest": digest, "pullPolicy": "Always"})
    c = solaris_container(render(own))
    assert c["image"] == f"registry.example/solaris@{digest}" and c["imagePullPolicy"] == "Always"


def test_solaris_notes_say_where_it_serves() -> None:
    text = notes(solaris_values(namespace="team-a"))
    assert "http://gem-platform-solaris.team-a.svc:8080/lookup" in text
    assert "kubectl -n team-a rollout status deploy/gem-platform-solaris" in text and "/healthz" in text
