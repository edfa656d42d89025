"""The typed API: CRDs rendered from it, the PyTorchJob it renders, and its error messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jsonschema
import pydantic
import pytest
import yaml

from gem.api import crds, render
from gem.api.status import apply_report, master_report, phase_from_job, set_condition
from gem.api.types import KINDS, GEMTraining, LoopFMDistill, TrainingSpec, parse_object

ROOT = Path(__file__).resolve().parents[1]
PYTORCHJOB_CRD = ROOT / "tests" / "kubeapi" / "crds" / "kubeflow.org_pytorchjobs.yaml"


def _pytorchjob_schema() -> dict:
    path = PYTORCHJOB_CRD if PYTORCHJOB_CRD.exists() else ROOT.parent / "shared/reference/kubeflow.org_pytorchjobs.yaml"
    crd = yaml.safe_load(path.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crds_match_the_models():
    rendered = crds.render_all()
    for name, text in rendered.items():
        path = ROOT / "manifests" / "crds" / name
        assert path.exists(), f"{path} missing: run `make crds`"
        assert path.read_text() == text, f"{path} drifted from gem/api/types.py: run `make crds`"
    assert sorted(p.name for p in (ROOT / "manifests" / "crds").glob("*.yaml")) == sorted(rendered)


def test_api_reference_page_matches_the_models():
    from gem.api.docs import render_page

    page = ROOT / "docs" / "api.md"
    assert page.read_text() == render_page(), "docs/api.md drifted from gem/api/types.py: run `make crds`"


def _walk(node: dict, path: str):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_crd_schema_is_structural_and_documented(kind):
    crd = crds.render_crd(kind)
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "title", "const", "$defs"}
    for path, node in _walk(schema["properties"]["spec"], "spec"):
        assert node.get("type") or node.get("x-kubernetes-preserve-unknown-fields") or (
            node.get("x-kubernetes-int-or-string") and "type" not in node), f"{path} has no type"
        assert not forbidden & set(node), f"{path} uses {forbidden & set(node)}"
        if path != "spec" and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description (kubectl explain shows nothing)"
        if isinstance(node.get("exclusiveMinimum"), bool):
            assert "minimum" in node
    assert version["subresources"] == {"status": {}}
    cols = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Progress", "NE", "Age"} <= cols
    assert crd["spec"]["names"]["shortNames"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_printer_columns_point_at_schema_fields_of_their_type(kind):
    """`kubectl get` columns: each jsonPath names a field of the schema, and the column type is that
    field's (Progress was a string column over the integer status.progress.percent)."""
    version = crds.render_crd(kind)["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    column_type = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean"}
    for col in version["additionalPrinterColumns"]:
        if col["jsonPath"] == ".metadata.creationTimestamp":
            assert col["type"] == "date"
            continue
        node = schema
        for part in col["jsonPath"].lstrip(".").split("."):
            node = node["properties"][part]
        assert col["type"] == column_type[node["type"]], col


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kubectl_explain_has_a_description_for_every_top_level_field(kind):
    schema = crds.render_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for key in ("apiVersion", "kind", "spec", "status"):
        assert schema["properties"][key].get("description"), f"{kind}.{key} has no description"
    # The API server refuses a root metadata schema with anything but type and restrictions of
    # name / generateName ("must not specify anything other than name and generateName"), a
    # description included: kubectl explain takes it from ObjectMeta.
    metadata = schema["properties"]["metadata"]
    assert set(metadata) <= {"type", "properties"} and metadata["type"] == "object"
    assert set(metadata.get("properties", {})) <= {"name", "generateName"}
    for path, node in _walk(schema["properties"]["status"], "status"):
        if not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description (kubectl explain shows nothing)"


@pytest.mark.parametrize("name", ["a", "gem-sample", "g" * 63, "g" * 64, "my.job", "1st-run", "Caps", "trailing-"])
def test_the_crd_refuses_the_names_the_operator_refuses(name):
    """The CRD took any DNS subdomain (253 characters, dots) as metadata.name, so `kubectl apply` of
    my.job or a 64-character name succeeded and the operator marked it Invalid afterwards."""
    from gem.api.validation import runnable_field_problems

    for kind in KINDS:
        meta = crds.render_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]
        crd_ok = jsonschema.Draft4Validator(meta).is_valid({"name": name})
        spec = {"teacher": {"checkpoint": "/c"}} if kind == "LoopFMDistill" else {}
        try:
            obj = parse_object({"kind": kind, "metadata": {"name": name}, "spec": spec})
        except pydantic.ValidationError:
            operator_ok = False
        else:
            operator_ok = not [w for w, _ in runnable_field_problems(obj) if w == "metadata.name"]
        assert crd_ok == operator_ok, (kind, name, crd_ok)


def test_crd_defaults_validate_against_their_own_schema():
    # A default that its own schema rejects makes the API server refuse the CRD.
    for kind in KINDS:
        schema = crds.render_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in _walk(schema, kind):
            if "default" in node and node["default"] != {}:
                sub = {k: v for k, v in node.items() if k not in ("default", "description", "nullable")}
                sub.pop("exclusiveMinimum", None)
                jsonschema.validate(node["default"], sub)


def _gemt(**spec) -> GEMTraining:
    return GEMTraining.model_validate(
        {"metadata": {"name": "quick", "namespace": "team-a", "uid": "uid-1", "generation": 1}, "spec": spec}
    )


def test_rendered_pytorchjob_validates_against_the_official_crd():
    obj = _gemt(
        checkpoint={"claimName": "ckpt"},
        resources={"gpusPerNode": 8, "nodeSelector": {"pool": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
        mlflow={"credentialsSecret": "mlflow-creds"},
        parallelism={"numNodes": 4, "procsPerNode": 8},
    )
    job = render.render_pytorchjob(obj, mlflow_tracking_uri="http://mlflow:5000")
    jsonschema.validate(job, _pytorchjob_schema())
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    container = specs["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"} in container["env"]
    assert container["envFrom"] == [{"secretRef": {"name": "mlflow-creds"}}]
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert job["spec"]["nprocPerNode"] == "8"


def test_spec_volumes_are_mounted_in_every_pod_and_validate_against_the_official_crd():
    """spec.volumes: a data claim (read-only by default) and a writable one with a subPath, in both replicas."""
    obj = _gemt(parallelism={"numNodes": 2}, volumes=[
        {"claimName": "ads-logs", "mountPath": "/data"},
        {"claimName": "scratch", "mountPath": "/scratch", "readOnly": False, "subPath": "team-a"}])
    job = render.render_pytorchjob(obj)
    jsonschema.validate(job, _pytorchjob_schema())
    for replica in ("Master", "Worker"):
        pod = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
        assert pod["volumes"][-2:] == [
            {"name": "volume-0", "persistentVolumeClaim": {"claimName": "ads-logs", "readOnly": True}},
            {"name": "volume-1", "persistentVolumeClaim": {"claimName": "scratch", "readOnly": False}}]
        assert pod["containers"][0]["volumeMounts"][-2:] == [
            {"name": "volume-0", "mountPath": "/data", "readOnly": True},
            {"name": "volume-1", "mountPath": "/scratch", "readOnly": False, "subPath": "team-a"}]
        names = [v["name"] for v in pod["volumes"]]
        assert len(names) == len(set(names))


@pytest.mark.parametrize(("volume", "field", "words"), [
    ({"claimName": "Logs", "mountPath": "/data"}, "claimName", "not a valid object name"),
    ({"claimName": "logs", "mountPath": "data"}, "mountPath", "absolute path"),
    ({"claimName": "logs", "mountPath": "/"}, "mountPath", "absolute path"),
    ({"claimName": "logs", "mountPath": "/var/lib/gem"}, "mountPath", "overlaps the checkpoint volume"),
    ({"claimName": "logs", "mountPath": "/etc/gem/data"}, "mountPath", "overlaps the config"),
    ({"claimName": "logs", "mountPath": "/dev"}, "mountPath", "overlaps shared memory"),
    ({"claimName": "logs", "mountPath": "/data", "subPath": "../x"}, "subPath", "without '..'"),
])
def test_spec_volumes_the_pod_could_not_carry_are_not_runnable(volume, field, words):
    from gem.api.validation import runnable_problems

    problems = runnable_problems(_gemt(volumes=[{"claimName": "ok", "mountPath": "/ok"}, volume]))
    assert len(problems) == 1 and problems[0].startswith(f"spec.volumes[1].{field}: ") and words in problems[0]


def test_two_spec_volumes_at_one_path_are_not_runnable_and_a_teacher_path_is_kept_free():
    from gem.api.validation import runnable_problems

    problems = runnable_problems(_gemt(volumes=[{"claimName": "a", "mountPath": "/data"},
                                                {"claimName": "b", "mountPath": "/data/more"}]))
    assert problems == ["spec.volumes[1].mountPath: '/data/more' overlaps spec.volumes[0].mountPath (/data); "
                        "pick another directory, e.g. /data"]
    lfd = LoopFMDistill.model_validate({"metadata": {"name": "lfd"}, "spec": {
        "teacher": {"gemTraining": "quick"}, "volumes": [{"claimName": "a", "mountPath": "/var/lib/gem/teacher"}]}})
    assert ["overlaps a teacher" in p for p in runnable_problems(lfd)] == [True]
    assert runnable_problems(_gemt(volumes=[{"claimName": "a", "mountPath": "/var/lib/gem/teacher"}])) == []


def test_spec_env_reaches_the_trainer_container_after_the_operators_own():
    obj = _gemt(env=[{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}, {"name": "NCCL_DEBUG", "value": "WARN"}])
    job = render.render_pytorchjob(obj)
    jsonschema.validate(job, _pytorchjob_schema())
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert env[-2:] == [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}, {"name": "NCCL_DEBUG", "value": "WARN"}]
    assert env[0]["name"] == "GEM_CHECKPOINT_DIR"


@pytest.mark.parametrize(("name", "words"), [
    ("1NCCL", "not a valid variable name"), ("A=B", "not a valid variable name"),
    ("GEM_CHECKPOINT_DIR", "the operator sets GEM_*"), ("MASTER_ADDR", "spec.parallelism"),
    ("PET_NNODES", "spec.parallelism"), ("RANK", "spec.parallelism"),
    ("MLFLOW_TRACKING_PASSWORD", "spec.mlflow.credentialsSecret"), ("DS_ACCELERATOR", "gpusPerNode"),
    ("CUDA_VISIBLE_DEVICES", "nvidia.com/gpu"), ("NCCL_DEBUG", "set twice"),
])
def test_spec_env_the_platform_sets_or_kubernetes_refuses_is_not_runnable(name, words):
    from gem.api.validation import runnable_problems

    problems = runnable_problems(_gemt(env=[{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": name, "value": "x"}]))
    assert len(problems) == 1 and problems[0].startswith("spec.env[1].name: ") and words in problems[0], problems
    assert runnable_problems(_gemt(env=[{"name": "RANKING_MODE", "value": "1"}, {"name": "GEMINI", "value": "1"}])) == []


def test_single_node_job_has_no_workers_and_a_distill_job_mounts_its_teacher():
    obj = _gemt(parallelism={"numNodes": 1})
    assert "Worker" not in render.render_pytorchjob(obj)["spec"]["pytorchReplicaSpecs"]
    lfd = LoopFMDistill.model_validate(
        {"metadata": {"name": "lfd", "namespace": "ns", "uid": "u2"}, "spec": {"teacher": {"gemTraining": "quick"}}}
    )
    teacher = render.TeacherMount(checkpoint="/ckpt/ns/quick/step-00000010", claim_name="teacher-pvc", mount_path="/ckpt")
    job = render.render_pytorchjob(lfd, teacher=teacher)
    jsonschema.validate(job, _pytorchjob_schema())
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "teacher", "persistentVolumeClaim": {"claimName": "teacher-pvc", "readOnly": True}} in pod["volumes"]
    manifest = yaml.safe_load(render.render_config_map(lfd, teacher)["data"]["config.yaml"])
    assert manifest["spec"]["teacher"] == {"checkpoint": "/ckpt/ns/quick/step-00000010"}
    assert "distill" in pod["containers"][0]["args"]


def test_job_names_are_deterministic_and_fit_a_service_name():
    assert render.job_name("GEMTraining", "a") == "a-train"
    long = "x" * 63
    name = render.job_name("GEMTraining", long)
    assert name == render.job_name("GEMTraining", long)
    assert len(name + "-master-0") <= 63
    assert name != render.job_name("LoopFMDistill", long)


@pytest.mark.parametrize("length", [45, 48, 63])
def test_every_replica_service_name_is_a_dns_label(length):
    """The training operator creates a Service per replica, named like its pod: "<job>-master-0" and
    "<job>-worker-<i>". Job names were cut to fit "-master-0" only, so a 48-character GEMTraining
    with 12 nodes or more had Services of 64+ characters (worker-10 on), which the API server refuses."""
    from tests.kubeapi.validation import is_dns1035_label

    max_nodes = 100_000  # spec.parallelism.numNodes' maximum
    with pytest.raises(pydantic.ValidationError, match="numNodes"):
        _gemt(parallelism={"numNodes": max_nodes + 1})
    for kind in KINDS:
        name = "g" * (length - 1) + "1"
        obj = parse_object({"kind": kind, "metadata": {"name": name}, "spec": {
            "teacher": {"checkpoint": "/c"}, "parallelism": {"numNodes": max_nodes}} if kind == "LoopFMDistill" else
            {"parallelism": {"numNodes": max_nodes}}})
        job = render.render_pytorchjob(obj)
        assert job["metadata"]["name"] == render.job_name(kind, name)
        for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
            last = f"{job['metadata']['name']}-{rtype.lower()}-{replica['replicas'] - 1}"
            assert is_dns1035_label(last) == [], last


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"parallelism": {"numNodes": -1}}, "parallelism.numNodes"),
        ({"training": {"steps": "many"}}, "training.steps"),
        ({"model": {"preset": "huge"}}, "model.preset"),
        ({"training": {"stepz": 3}}, "training.stepz"),
        ({"model": {"embeddingDim": 30, "numHeads": 4}}, "numHeads"),
        ({"data": {"source": "parquet"}}, "data.path"),
        ({"mlflow": {"trackingUri": "https://bob:secret@mlflow"}}, "credentialsSecret"),
        # numpy would reuse smaller seeds' streams for these (seed 2^32's train split is seed 0's eval split)
        ({"data": {"synthetic": {"seed": 2**32}}}, "data.synthetic.seed"),
        ({"training": {"seed": 2**32}}, "training.seed"),
    ],
)
def test_bad_specs_name_the_field(spec, field):
    with pytest.raises(pydantic.ValidationError) as e:
        _gemt(**spec)
    assert field in str(e.value)


def test_manifests_take_only_the_wire_names_the_crd_keeps():
    """A snake_case key (training.batch_size) parsed: gemctl and `gem train --config` ran batch 8,
    while the API server prunes the key the CRD does not have and the cluster ran the default 64."""
    from tests.kubeapi.schema import apply_defaults, prune

    doc = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "snake"},
           "spec": {"training": {"batch_size": 8}}}
    schema = crds.render_crd("GEMTraining")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    stored = apply_defaults(prune(yaml.safe_load(yaml.safe_dump(doc)), schema, root=True), schema)
    assert stored["spec"]["training"]["batchSize"] == 64 and "batch_size" not in stored["spec"]["training"]
    with pytest.raises(pydantic.ValidationError, match=r"spec\.training\.batch_size\n  Extra inputs"):
        parse_object(doc)
    assert parse_object({**doc, "spec": {"training": {"batchSize": 8}}}).spec.training.batch_size == 8
    assert GEMTraining.model_validate(stored).spec.training.batch_size == 64
    # Python code keeps its keyword names
    assert TrainingSpec(batch_size=8).batch_size == 8


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"parallelism": {"topology": {"levels": ["rack"], "nodesPerDomain": {"rack": 0}}}},
         "spec.parallelism.topology.nodesPerDomain.rack"),
        ({"data": {"synthetic": {"surfaceMix": [0.5, -0.1, 0.5, 0.1]}}}, "spec.data.synthetic.surfaceMix[1]"),
    ],
)
def test_bounds_on_map_values_and_list_items_are_in_the_crd(spec, field):
    """The CRD accepted these (the bound was a model validator's), so kubectl apply succeeded and the
    operator marked the resource Invalid afterwards; the API server now refuses them at apply."""
    from tests.kubeapi.schema import validate

    doc = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "b"}, "spec": spec}
    schema = crds.render_crd("GEMTraining")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert [f for f, _, _ in validate(doc, schema, root=True)] == [field]
    with pytest.raises(pydantic.ValidationError) as e:
        parse_object(doc)
    assert field.removeprefix("spec.").replace("[1]", ".1") in str(e.value)


def test_cpu_and_memory_take_numbers_as_kubernetes_quantities_do():
    """`cpu: 8` is how a Pod's requests are written; the CRD (type string) and the model refused it."""
    from tests.kubeapi.schema import apply_defaults, prune, validate

    schema = crds.render_crd("GEMTraining")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    doc = {"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "q"},
           "spec": {"resources": {"cpu": 8, "memory": 68719476736}}}
    stored = apply_defaults(prune(yaml.safe_load(yaml.safe_dump(doc)), schema, root=True), schema)
    assert validate(stored, schema, root=True) == []
    obj = parse_object(stored)
    assert (obj.spec.resources.cpu, obj.spec.resources.memory) == ("8", "68719476736")
    requests = render.render_pytorchjob(obj)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "8", "memory": "68719476736"}
    jsonschema.validate(render.render_pytorchjob(obj), _pytorchjob_schema())
    # a string still has to be a quantity, in both; a fraction of a number is not an int-or-string
    bad = {**doc, "spec": {"resources": {"cpu": "8 cores"}}}
    assert [f for f, _, _ in validate(bad, schema, root=True)] == ["spec.resources.cpu"]
    with pytest.raises(pydantic.ValidationError, match="resources.cpu"):
        parse_object(bad)
    assert [f for f, _, _ in validate({**doc, "spec": {"resources": {"cpu": 0.5}}}, schema, root=True)] == [
        "spec.resources.cpu"]
    with pytest.raises(pydantic.ValidationError, match="resources.cpu"):
        parse_object({**doc, "spec": {"resources": {"cpu": 0.5}}})
    # a negative integer: the pattern checks strings only, so the CRD's minimum refuses it at apply
    assert [f for f, _, _ in validate({**doc, "spec": {"resources": {"cpu": -1}}}, schema, root=True)] == [
        "spec.resources.cpu"]


def test_teacher_must_name_exactly_one_source():
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        parse_object({"kind": "LoopFMDistill", "metadata": {"name": "x"}, "spec": {"teacher": {}}})
    with pytest.raises(pydantic.ValidationError, match="gemTraining, checkpoint"):
        parse_object(
            {"kind": "LoopFMDistill", "metadata": {"name": "x"}, "spec": {"teacher": {"gemTraining": "a", "checkpoint": "/c"}}}
        )


def test_status_helpers_mirror_job_conditions_and_reports():
    job_status = {
        "conditions": [
            {"type": "Created", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            {"type": "Running", "status": "False", "lastTransitionTime": "2026-01-01T00:01:00Z"},
            {"type": "Succeeded", "status": "True", "message": "done", "lastTransitionTime": "2026-01-01T00:02:00Z"},
        ]
    }
    phase, cond = phase_from_job(job_status)
    assert phase == "Succeeded" and cond["message"] == "done"
    assert phase_from_job({"conditions": [{"type": "Created", "status": "True"}]})[0] == "Created"
    assert phase_from_job(None) == (None, None)

    pod = {
        "metadata": {"labels": {"training.kubeflow.org/replica-type": "master"}},
        "status": {
            "containerStatuses": [
                {
                    "name": "pytorch",
                    "state": {"terminated": {"exitCode": 0, "message": '{"metrics":{"ne/click":0.8},"ne":0.8,"step":10,"totalSteps":20,"checkpoint":"/c/step-10","mlflowRunId":"r1"}'}},
                }
            ]
        },
    }
    report = master_report([pod])
    status = apply_report({}, report)
    assert status["metrics"] == {"ne/click": 0.8}
    assert status["progress"] == {"step": 10, "totalSteps": 20, "percent": 50}
    assert status["latestCheckpoint"] == "/c/step-10" and status["mlflow"] == {"runId": "r1"}

    conds = set_condition([], "Valid", "False", "InvalidSpec", "bad")
    same = set_condition(conds, "Valid", "False", "InvalidSpec", "still bad")
    assert same[0]["lastTransitionTime"] == conds[0]["lastTransitionTime"] and same[0]["message"] == "still bad"
    assert len(set_condition(same, "Ready", "True", "Ok")) == 2


def test_api_sdk_and_operator_rendering_stay_torch_free():
    code = (
        "import sys, gem, gem.api, gem.api.render, gem.api.status, gem.api.crds;"
        "import gem_operator.reconcile;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_queue_priority_and_platform_defaults_reach_the_job():
    obj = _gemt(scheduling={"queueName": "team-a", "priorityClassName": "high"})
    defaults = render.PlatformDefaults(trainer_image="registry/trainer:1", queue_name="default-q",
                                       mlflow_credentials_secret="mlflow-creds")
    job = render.render_pytorchjob(obj, defaults=defaults)
    jsonschema.validate(job, _pytorchjob_schema())
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"priorityClass": "high"}
    # A PriorityClass is not a Kueue WorkloadPriorityClass: that label would leave the job suspended.
    assert "kueue.x-k8s.io/priority-class" not in job["metadata"]["labels"]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["template"]["spec"]["priorityClassName"] == "high"  # where Kueue reads the priority
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry/trainer:1"
    # The platform's default Secret may be missing in a namespace: optional, so the pods still start.
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "mlflow-creds", "optional": True}}]
    assert pod["securityContext"]["runAsNonRoot"] is True

    # A Secret the spec names stays required, default or not.
    named = render.render_pytorchjob(_gemt(mlflow={"credentialsSecret": "team-creds"}), defaults=defaults)
    container = named["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "team-creds"}}]
    off = render.render_pytorchjob(_gemt(mlflow={"enabled": False}), defaults=defaults)
    assert "envFrom" not in off["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]

    plain = render.render_pytorchjob(_gemt(image="mine:2"), defaults=defaults)
    assert plain["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "default-q"
    assert plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] == "mine:2"
    assert "kueue.x-k8s.io/queue-name" not in render.render_pytorchjob(_gemt())["metadata"]["labels"]


# spec.training.deepspeed keys that contradict what the trainer derives: the trainer refused them at
# setup (exit 2), but the operator accepted the resource and `gemctl --local` started it.
@pytest.mark.parametrize(
    ("training", "parallelism", "key"),
    [
        ({"batchSize": 8, "deepspeed": {"gradient_accumulation_steps": 4}}, {}, "gradient_accumulation_steps"),
        ({"batchSize": 8, "deepspeed": {"train_micro_batch_size_per_gpu": 4}}, {}, "train_micro_batch_size_per_gpu"),
        # 2 ranks x 8: 16, or 8 with tp 2; 20 is neither
        ({"batchSize": 8, "deepspeed": {"train_batch_size": 20}}, {"numNodes": 2}, "train_batch_size"),
        # tp given: 4 ranks / tp 2 = 2 data ranks x 8 = 16, not 32
        ({"batchSize": 8, "deepspeed": {"train_batch_size": 32}},
         {"numNodes": 1, "procsPerNode": 4, "plan": {"tp": 2}}, "train_batch_size"),
        # tp chosen by the plan the operator renders: 1 for the tiny model (4 data ranks x 8 = 32)
        ({"batchSize": 8, "deepspeed": {"train_batch_size": 16}}, {"numNodes": 1, "procsPerNode": 4}, "train_batch_size"),
        ({"precision": "bf16", "deepspeed": {"bf16": {"enabled": False}}}, {}, "bf16"),
        ({"precision": "mxfp8", "deepspeed": {"bf16": {"enabled": False}}}, {}, "bf16"),
        ({"precision": "fp32", "deepspeed": {"bf16": {"enabled": True}}}, {}, "bf16"),
        ({"precision": "fp32", "deepspeed": {"bfloat16": {"enabled": True}}}, {}, "bfloat16"),
        ({"precision": "bf16", "deepspeed": {"fp16": {"enabled": True}}}, {}, "fp16"),
        ({"precision": "bf16", "deepspeed": {"bf16": True}}, {}, "bf16"),  # not a section
        # the spec's gradClip (before, the override won for the dense weights only; the spec said otherwise)
        ({"gradClip": 1.0, "deepspeed": {"gradient_clipping": 5.0}}, {}, "gradient_clipping"),
        # spec.parallelism.zeroStage (the plan's rules, resume's check): before, the override won in DeepSpeed
        ({"deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True}}}, {"zeroStage": 1},
         "zero_optimization.stage"),
    ],
)
def test_deepspeed_overrides_that_contradict_the_spec_are_not_runnable(training, parallelism, key):
    from gem.api.validation import runnable_problems

    objs = [_gemt(training=training, parallelism=parallelism)]
    if "plan" in parallelism or "train_batch_size" not in training["deepspeed"]:
        # a distillation's trainer plans with its student's real shape: its tp is known when given
        objs.append(parse_object({"kind": "LoopFMDistill", "metadata": {"name": "s"}, "spec": {
            "teacher": {"checkpoint": "/c"}, "training": training, "parallelism": parallelism}}))
    for obj in objs:
        problems = runnable_problems(obj)
        assert len(problems) == 1 and problems[0].startswith(f"spec.training.deepspeed.{key}: "), problems
        assert "differs from the trainer's" in problems[0]
        if key in ("bf16", "bfloat16", "fp16"):
            assert "spec.training.precision" in problems[0]


@pytest.mark.parametrize(
    ("training", "parallelism"),
    [
        ({"batchSize": 8, "precision": "bf16", "deepspeed": {
            "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 8, "train_batch_size": 16,
            "bf16": {"enabled": True, "immediate_grad_update": True}, "fp16": {"enabled": False},
            "wall_clock_breakdown": True}}, {"numNodes": 2}),
        ({"precision": "mxfp8", "deepspeed": {"bfloat16": {"enabled": True}}}, {}),
        ({"deepspeed": {"bf16": {"enabled": False}, "fp16": {}}}, {}),
        # the plan the operator renders: tp 1 for the tiny model
        ({"batchSize": 8, "deepspeed": {"train_batch_size": 32}}, {"numNodes": 1, "procsPerNode": 4}),
        ({"batchSize": 8, "deepspeed": {"train_batch_size": 16}}, {"numNodes": 1, "procsPerNode": 4, "plan": {"tp": 2}}),
        ({"batchSize": 8, "deepspeed": {"train_batch_size": 16, "parallelPlan": {"tp": 2}}},
         {"numNodes": 1, "procsPerNode": 4}),
    ],
)
def test_deepspeed_overrides_that_agree_with_the_spec_are_runnable(training, parallelism):
    from gem.api.validation import runnable_problems

    assert runnable_problems(_gemt(training=training, parallelism=parallelism)) == []
    # next to a contradicting key, only that one is reported
    worse = {**training, "deepspeed": {**training["deepspeed"], "gradient_accumulation_steps": 2}}
    problems = runnable_problems(_gemt(training=worse, parallelism=parallelism))
    assert [p.split(": ", 1)[0] for p in problems] == ["spec.training.deepspeed.gradient_accumulation_steps"]


@pytest.mark.parametrize("key", ["optimizer", "scheduler"])
def test_deepspeed_sections_deepspeed_ignores_are_not_runnable(key):
    """The trainer hands DeepSpeed its own AdamW and warmup + cosine schedule: DeepSpeed then ignores
    these sections (the job trained at spec.training.learningRate whatever they said)."""
    from gem.api.validation import runnable_problems

    section = {"type": "Adam", "params": {"lr": 0.5}} if key == "optimizer" else {"type": "WarmupLR"}
    problems = runnable_problems(_gemt(training={"deepspeed": {key: section}}))
    assert len(problems) == 1 and problems[0].startswith(f"spec.training.deepspeed.{key}: the trainer hands"), problems
    assert "DeepSpeed ignores this section" in problems[0] and "spec.training." in problems[0].split(": ", 1)[1]
    assert runnable_problems(_gemt(training={"gradClip": 0.5, "deepspeed": {"gradient_clipping": 0.5}})) == []
    assert runnable_problems(_gemt(parallelism={"zeroStage": 2}, training={"deepspeed": {
        "zero_optimization": {"stage": 2, "overlap_comm": True}}})) == []
    assert runnable_problems(_gemt(training={"deepspeed": {"zero_optimization": {"overlap_comm": True}}})) == []


def test_train_batch_size_is_checked_against_the_plan_the_operator_renders():
    """With tp left to the plan, admission accepted any global batch some tp could give (here 8, 16 or
    32): the pods then exited 2 at setup. It now plans as the operator does; tp is chosen inside a node,
    so the node pool and placement (here two racks, Kueue) do not change it."""
    from gem.api.validation import runnable_problems
    from gem.parallel.job import build_topology, plan_job, spec_hints
    from gem.parallel.plan import DEEPSPEED_DIMS
    from gem.parallel.topology import NodePool

    wide = {"preset": "large", "embeddingDim": 2048}  # wide enough for tp
    par = {"numNodes": 2, "procsPerNode": 4, "topology": {"levels": ["rack"], "nodesPerDomain": {"rack": 1}}}
    spec = _gemt(model=wide, parallelism=par, training={"batchSize": 8}).spec
    job = plan_job(spec.parallelism, spec.training, topology=build_topology(spec.parallelism, NodePool()),
                   mode="kueue", hints=spec_hints(spec), allowed=DEEPSPEED_DIMS)
    assert job.plan.tp == 2 and job.plan.data_world == 4
    ok = _gemt(model=wide, parallelism=par, training={"batchSize": 8, "deepspeed": {"train_batch_size": 32}})
    assert runnable_problems(ok) == []
    for value in (16, 64):
        bad = _gemt(model=wide, parallelism=par, training={"batchSize": 8, "deepspeed": {"train_batch_size": value}})
        assert runnable_problems(bad) == [f"spec.training.deepspeed.train_batch_size: {value} differs from the "
                                          "trainer's 32; remove it: it is spec.training.batchSize x the data-parallel ranks"]
    # a distillation's trainer plans with its student's real shape (no plan from the operator): the
    # trainer checks the exact value at setup, admission only refuses one no tp could give
    distill = {"kind": "LoopFMDistill", "metadata": {"name": "s"}, "spec": {
        "teacher": {"checkpoint": "/c"}, "parallelism": par, "training": {"batchSize": 8, "deepspeed": {}}}}
    for value, refused in ((16, False), (24, True)):
        distill["spec"]["training"]["deepspeed"] = {"train_batch_size": value}
        assert bool(runnable_problems(parse_object(distill))) == refused


# DeepSpeed's other precision keys (what DeepSpeed 0.19 does with each: gem/api/validation.py). Before,
# none was checked: fp32 with torch_autocast trained the forward in bf16/fp16, a grad_accum_dtype or
# param_dtype other than the spec's dtype failed at setup (NotImplementedError / AssertionError, exit 1,
# restarted) or, at ZeRO-1/2, reduced the gradients in another dtype; amp failed at setup, exit 1.
@pytest.mark.parametrize(
    ("training", "field"),
    [
        ({"precision": "bf16", "deepspeed": {"amp": {"enabled": True}}}, "amp"),
        ({"deepspeed": {"amp": {"enabled": False}}}, "amp"),  # DeepSpeed 0.19 refuses the key itself
        ({"precision": "fp32", "deepspeed": {"torch_autocast": {"enabled": True, "dtype": "bf16"}}}, "torch_autocast"),
        ({"precision": "bf16", "deepspeed": {"torch_autocast": {"enabled": True, "dtype": "fp16"}}}, "torch_autocast"),
        ({"precision": "bf16", "deepspeed": {"torch_autocast": {"enabled": True}}}, "torch_autocast"),  # fp16 on GPUs
        ({"precision": "mxfp8", "deepspeed": {"torch_autocast": True}}, "torch_autocast"),
        ({"precision": "bf16", "deepspeed": {"data_types": {"grad_accum_dtype": "fp32"}}}, "data_types.grad_accum_dtype"),
        ({"precision": "fp32", "deepspeed": {"data_types": {"grad_accum_dtype": "bf16"}}}, "data_types.grad_accum_dtype"),
        ({"precision": "mxfp8", "deepspeed": {"data_types": {"param_dtype": "fp32"}}}, "data_types.param_dtype"),
        ({"precision": "fp32", "deepspeed": {"data_types": {"param_dtype": "half"}}}, "data_types.param_dtype"),
        ({"precision": "fp32", "deepspeed": {"data_types": "bf16"}}, "data_types"),
    ],
)
def test_deepspeed_dtype_overrides_that_contradict_the_precision_are_not_runnable(training, field):
    from gem.api.validation import runnable_problems

    for obj in (_gemt(training=training),
                parse_object({"kind": "LoopFMDistill", "metadata": {"name": "s"},
                              "spec": {"teacher": {"checkpoint": "/c"}, "training": training}})):
        problems = runnable_problems(obj)
        assert len(problems) == 1 and problems[0].startswith(f"spec.training.deepspeed.{field}: "), problems
        assert "use spec.training.precision" in problems[0]


@pytest.mark.parametrize(
    "training",
    [
        # the trainer's own bf16 autocast, said again
        {"precision": "bf16", "deepspeed": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}},
        {"precision": "mxfp8", "deepspeed": {"torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}},
        {"precision": "fp32", "deepspeed": {"torch_autocast": {"enabled": False, "dtype": "fp16"}}},
        {"precision": "bf16", "deepspeed": {"data_types": {"grad_accum_dtype": "bf16", "param_dtype": "bfloat16",
                                                           "buffer_dtype": "fp32", "keep_in_fp32_modules": []}}},
        {"precision": "fp32", "deepspeed": {"data_types": {"grad_accum_dtype": "float32", "param_dtype": None}}},
    ],
)
def test_deepspeed_dtype_overrides_that_agree_with_the_precision_are_runnable(training):
    from gem.api.validation import runnable_problems

    assert runnable_problems(_gemt(training=training)) == []
