"""manifests/samples: what NOTES.txt and docs/operations.md tell users to `kubectl apply`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gem.api import render
from gem.api.types import DEFAULT_TRAINER_IMAGE, parse_object

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extra)")

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "manifests" / "samples"
KUBE_VERSIONS = ["1.27.0", kv.latest_version()]


def load(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((SAMPLES / name).read_text()) if d]
    return doc


def crd_schema(kind: str) -> dict[str, Any]:
    for path in (ROOT / "manifests" / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    raise AssertionError(f"no CRD for {kind}")


def kube_valid(doc: dict[str, Any]) -> None:
    for version in KUBE_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']} invalid for Kubernetes {version}: {e.message}")


def test_the_samples_are_there() -> None:
    assert sorted(p.name for p in SAMPLES.glob("*.yaml")) == ["gemtraining-gpu.yaml", "gemtraining.yaml", "loopfmdistill.yaml",
                                                                 "pvc-gem-checkpoints.yaml"]


def test_checkpoint_claim_is_read_write_many() -> None:
    pvc = load("pvc-gem-checkpoints.yaml")
    kube_valid(pvc)
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == "gem-checkpoints"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "namespace" not in pvc["metadata"], "samples go to the namespace of `kubectl -n`"


@pytest.mark.parametrize("name", ["gemtraining.yaml", "gemtraining-gpu.yaml", "loopfmdistill.yaml"])
def test_job_samples_are_valid(name: str) -> None:
    doc = load(name)
    obj = parse_object(doc)  # the operator's own validation
    # The API server's: the CRD's structural schema (OpenAPI v3.0 ~ JSON Schema draft 4).
    jsonschema.Draft4Validator(crd_schema(doc["kind"])).validate(doc)
    assert "namespace" not in doc["metadata"]
    assert obj.spec.checkpoint.claim_name == load("pvc-gem-checkpoints.yaml")["metadata"]["name"]
    assert obj.spec.image == DEFAULT_TRAINER_IMAGE


def test_distill_sample_learns_from_the_training_sample() -> None:
    training, distill = parse_object(load("gemtraining.yaml")), parse_object(load("loopfmdistill.yaml"))
    assert distill.spec.teacher.gem_training == training.metadata.name


@pytest.mark.parametrize("name", ["gemtraining.yaml", "gemtraining-gpu.yaml", "loopfmdistill.yaml"])
def test_samples_render_to_valid_pods(name: str) -> None:
    doc = load(name)
    doc["metadata"].update(namespace="default", uid="00000000-0000-0000-0000-000000000001", generation=1)
    obj = parse_object(doc)
    teacher = None
    if obj.kind == "LoopFMDistill":
        t = parse_object(load("gemtraining.yaml")).spec.checkpoint
        teacher = render.TeacherMount(checkpoint=f"{t.path}/step-400", claim_name=t.claim_name, mount_path=t.path)
    kube_valid(render.render_config_map(obj, teacher))
    job = render.render_pytorchjob(obj, mlflow_tracking_uri="http://mlflow:5000", teacher=teacher)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **replica["template"]["metadata"]}, "spec": replica["template"]["spec"]}
        kube_valid(pod)
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
        assert claims == {"gem-checkpoints"}


def test_gpu_sample_is_planned_and_placed() -> None:
    """The GPU sample through the operator's planner: a 5D plan with a reason, Kueue placement on
    both templates, and a PyTorchJob that still validates against the official CRD."""
    import logging

    from gem_operator import parallel

    doc = load("gemtraining-gpu.yaml")
    doc["metadata"].update(namespace="default", uid="00000000-0000-0000-0000-000000000002", generation=1)
    obj = parse_object(doc)
    defaults = render.PlatformDefaults()
    # nodesPerDomain sizes every level, so the planner reads no Node objects
    placement, job = parallel.plan("GEMTraining", obj, defaults, logging.getLogger("test"))
    assert job is not None and job.plan.world_size == 32 and job.reason
    rendered = render.render_pytorchjob(obj, defaults=defaults, placement=placement)
    official = ROOT.parent / "shared/reference/kubeflow.org_pytorchjobs.yaml"
    if not official.exists():  # a checkout without ../shared: the copy the API test server serves
        official = ROOT / "tests/kubeapi/crds/kubeflow.org_pytorchjobs.yaml"
    crd = yaml.safe_load(official.read_text())
    jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).validate(rendered)
    for replica in rendered["spec"]["pytorchReplicaSpecs"].values():
        annotations = replica["template"]["metadata"].get("annotations", {})
        assert annotations.get("kueue.x-k8s.io/podset-slice-required-topology") == "nvidia.com/gpu.clique"
        assert annotations.get("kueue.x-k8s.io/podset-slice-size") == "2"
        env = {e["name"]: e.get("value") for e in replica["template"]["spec"]["containers"][0]["env"]}
        assert json.loads(env["GEM_TOPOLOGY"])["placement"] == "kueue"
