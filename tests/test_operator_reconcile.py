"""The operator's reconcile, in-process, one pass at a time, against the API test server.

`gem_operator.kube` talks to the test server, so every call the operator makes is real HTTP; no
operator process and no kopf: each test builds the situation, runs `reconcile.reconcile` and looks
at the status it returns and at what it did to the cluster.
"""

from __future__ import annotations

import copy
import logging

import kopf
import pytest

from gem.api import render
from gem.api.crds import render_crd
from gem_operator import kube, reconcile
from tests.kubeapi import KubeAPIServer
from tests.kubeapi.schema import apply_defaults

API = "gem.dev/v1alpha1"
JOBS = "kubeflow.org/v1"
LOG = logging.getLogger("test_operator_reconcile")


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with KubeAPIServer(executor=False, workdir=tmp_path / "kubeapi") as server:
        api_client = server.api_client()
        monkeypatch.setattr(kube, "_api_client", lambda: api_client)
        yield server


def stored(cluster, kind: str, name: str, **spec) -> dict:
    """The resource as the API server stores it (defaults filled in, uid and generation set)."""
    return cluster.create(API, kind, {"apiVersion": API, "kind": kind, "metadata": {"name": name}, "spec": spec})


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


def warnings(cluster, name: str) -> list[str]:
    return [e["reason"] for e in cluster.events(involved_name=name) if e["type"] == "Warning"]


# --------------------------------------------------------------------------- procsPerNode vs GPUs


def test_more_processes_than_gpus_per_pod_is_invalid_and_names_procs_per_node(cluster):
    body = stored(cluster, "GEMTraining", "oversubscribed",
                  parallelism={"numNodes": 1, "procsPerNode": 8}, resources={"gpusPerNode": 4})
    status = reconcile.reconcile("GEMTraining", body, LOG)
    assert status["phase"] == "Invalid"
    message = condition(status, "Valid")["message"]
    assert message.startswith("spec.parallelism.procsPerNode: 8 processes per pod") and "at most 4" in message
    assert cluster.get(JOBS, "PyTorchJob", "oversubscribed-train") is None


@pytest.mark.parametrize("gpus", [0, 8])
def test_cpu_only_pods_and_one_process_per_gpu_still_run(cluster, gpus):
    # gpusPerNode 0: CPU processes share the pod's cores, any number of them
    body = stored(cluster, "GEMTraining", f"fits-{gpus}",
                  parallelism={"numNodes": 1, "procsPerNode": 8}, resources={"gpusPerNode": gpus})
    status = reconcile.reconcile("GEMTraining", body, LOG)
    assert status["phase"] == "Created", status.get("message")


def test_a_node_selector_key_with_an_empty_prefix_is_invalid(cluster):
    # "/pool" is no label key (the API server refuses the job's pods); found by tests/test_reliability_fuzz.py
    body = stored(cluster, "GEMTraining", "slash", parallelism={"numNodes": 1}, resources={"nodeSelector": {"/pool": "gpu"}})
    status = reconcile.reconcile("GEMTraining", body, LOG)
    assert status["phase"] == "Invalid"
    assert condition(status, "Valid")["message"].startswith("spec.resources.nodeSelector['/pool']: '/pool' is not a valid label key")


# --------------------------------------------------------------------------- the teacher's checkpoint


def teacher(cluster, name: str, status: dict, **checkpoint) -> dict:
    stored(cluster, "GEMTraining", name, checkpoint=checkpoint)
    return cluster.patch_status(API, "GEMTraining", name, status)


def test_a_teacher_that_succeeded_without_a_checkpoint_fails_the_distillation(cluster):
    # its pods were gone (cleanPodPolicy All, pod GC) before the operator read the trainer's report
    teacher(cluster, "no-report", {"phase": "Succeeded"}, claimName="shared", path="/ckpt")
    student = stored(cluster, "LoopFMDistill", "student", teacher={"gemTraining": "no-report"})
    status = reconcile.reconcile("LoopFMDistill", student, LOG)  # not a TemporaryError: waiting is pointless
    assert status["phase"] == "Failed"
    ready = condition(status, "TeacherReady")
    assert (ready["status"], ready["reason"]) == ("False", "TeacherHasNoCheckpoint")
    for fix in ("spec.teacher.mlflowModelUri", "spec.teacher.checkpoint", "/ckpt/default/no-report", "claim shared"):
        assert fix in ready["message"], fix
    assert warnings(cluster, "student") == ["TeacherHasNoCheckpoint"]
    assert cluster.get(JOBS, "PyTorchJob", "student-distill") is None

    # Following the message: the teacher named by its job directory on the shared claim.
    fixed = {**student, "status": status, "spec": {**student["spec"], "teacher": {"checkpoint": "/ckpt/default/no-report"},
                                                   "checkpoint": {**student["spec"]["checkpoint"], "claimName": "shared",
                                                                  "path": "/ckpt"}}}
    status = reconcile.reconcile("LoopFMDistill", fixed, LOG)
    assert status["phase"] == "Created" and condition(status, "TeacherReady")["status"] == "True"
    assert cluster.get(JOBS, "PyTorchJob", "student-distill") is not None


@pytest.mark.parametrize("teacher_status", [
    {"phase": "Succeeded", "latestCheckpoint": "/var/lib/gem/checkpoints/default/local/step-00000200"},
    {"phase": "Running"},  # its checkpoints will not outlive its pods either: no point waiting
])
def test_a_teacher_without_a_checkpoint_claim_fails_the_distillation(cluster, teacher_status):
    teacher(cluster, "local", teacher_status)  # emptyDir checkpoints: gone with its pods
    student = stored(cluster, "LoopFMDistill", "student", teacher={"gemTraining": "local"})
    status = reconcile.reconcile("LoopFMDistill", student, LOG)
    assert status["phase"] == "Failed"
    ready = condition(status, "TeacherReady")
    assert ready["reason"] == "TeacherCheckpointNotShared"
    assert "spec.checkpoint.claimName" in ready["message"] and "spec.teacher.mlflowModelUri" in ready["message"]
    assert cluster.get(JOBS, "PyTorchJob", "student-distill") is None


@pytest.mark.parametrize("teacher_status", [
    {"phase": "Running"},
    {"phase": "Succeeded", "latestCheckpoint": "/ckpt/default/fm/step-00000200"},
])
def test_a_distillation_named_like_its_teacher_on_the_same_claim_is_invalid(cluster, teacher_status):
    # LoopFMDistill fm and GEMTraining fm (two kinds: Kubernetes allows the name) on one claim share its
    # <ns>/fm/ directory, whatever path each mounts it at: the trainer refused it only once its pods ran
    teacher(cluster, "fm", teacher_status, claimName="shared", path="/ckpt")
    student = stored(cluster, "LoopFMDistill", "fm", teacher={"gemTraining": "fm"},
                     checkpoint={"claimName": "shared", "path": "/student"})
    status = reconcile.reconcile("LoopFMDistill", student, LOG)
    assert status["phase"] == "Invalid"
    valid = condition(status, "Valid")
    assert valid["status"] == "False" and valid["message"].startswith("spec.teacher.gemTraining: GEMTraining default/fm")
    for fix in ("metadata.name", "spec.checkpoint.claimName", "claim shared"):
        assert fix in valid["message"], fix
    assert warnings(cluster, "fm") == ["InvalidSpec"]
    assert cluster.get(JOBS, "PyTorchJob", "fm-distill") is None

    # another claim: the two job directories are on different volumes
    other = {**student, "status": status, "spec": {**student["spec"], "checkpoint": {
        **student["spec"]["checkpoint"], "claimName": "student-ckpt"}}}
    if teacher_status["phase"] == "Running":
        with pytest.raises(kopf.TemporaryError):
            reconcile.reconcile("LoopFMDistill", other, LOG)
    else:
        assert reconcile.reconcile("LoopFMDistill", other, LOG)["phase"] == "Created"


def test_a_teacher_checkpoint_inside_the_distillations_own_job_directory_is_invalid(cluster):
    student = stored(cluster, "LoopFMDistill", "fm", teacher={"checkpoint": "/ckpt/default/fm/step-00000200"},
                     checkpoint={"claimName": "shared", "path": "/ckpt/"})
    status = reconcile.reconcile("LoopFMDistill", student, LOG)
    assert status["phase"] == "Invalid"
    assert condition(status, "Valid")["message"].startswith(
        "spec.teacher.checkpoint: /ckpt/default/fm/step-00000200 is in this distillation's own job directory")
    assert cluster.get(JOBS, "PyTorchJob", "fm-distill") is None


def test_a_running_teacher_with_a_claim_is_still_waited_for(cluster):
    teacher(cluster, "busy", {"phase": "Running"}, claimName="shared")
    student = stored(cluster, "LoopFMDistill", "student", teacher={"gemTraining": "busy"})
    with pytest.raises(kopf.TemporaryError):
        reconcile.reconcile("LoopFMDistill", student, LOG)
    status = cluster.get(API, "LoopFMDistill", "student")["status"]
    assert (status["phase"], condition(status, "TeacherReady")["reason"]) == ("WaitingForTeacher", "TeacherNotSucceeded")


def test_pointing_a_waiting_distillation_at_a_new_teacher_waits_for_it(cluster):
    # The TeacherNotSucceeded of the old teacher is not "seen" for the new one: before the fix the
    # distillation failed at once with "teacher GEMTraining default/next was deleted before it succeeded".
    teacher(cluster, "first", {"phase": "Running"}, claimName="shared")
    stored(cluster, "LoopFMDistill", "student", teacher={"gemTraining": "first"})
    with pytest.raises(kopf.TemporaryError):
        reconcile.reconcile("LoopFMDistill", cluster.get(API, "LoopFMDistill", "student"), LOG)
    # kubectl edit: spec.teacher.gemTraining first -> next (to be created)
    edited = kube.custom().patch_namespaced_custom_object(
        "gem.dev", "v1alpha1", "default", "loopfmdistills", "student", {"spec": {"teacher": {"gemTraining": "next"}}})
    with pytest.raises(kopf.TemporaryError, match="does not exist"):
        reconcile.reconcile("LoopFMDistill", edited, LOG)
    status = cluster.get(API, "LoopFMDistill", "student")["status"]
    assert (status["phase"], condition(status, "TeacherReady")["reason"]) == ("WaitingForTeacher", "TeacherNotFound")
    assert "TeacherDeleted" not in warnings(cluster, "student")


def test_a_job_deleted_after_an_invalid_edit_fails_the_resource_instead_of_leaving_it_invalid(cluster):
    # Before the fix: phase Invalid (not JobDeleted), and once the spec was fixed it stayed Invalid
    # with the old message for good (Invalid is terminal and the vanished job was never reported).
    stored(cluster, "GEMTraining", "gone", parallelism={"numNodes": 1})
    status = reconcile.reconcile("GEMTraining", cluster.get(API, "GEMTraining", "gone"), LOG)
    cluster.patch_status(API, "GEMTraining", "gone", status)
    bad = kube.custom().patch_namespaced_custom_object(  # the CRD takes it, the operator's validation does not
        "gem.dev", "v1alpha1", "default", "gemtrainings", "gone",
        {"spec": {"parallelism": {"procsPerNode": 8}, "resources": {"gpusPerNode": 4}}})
    cluster.delete(JOBS, "PyTorchJob", "gone-train")  # kubectl delete pytorchjob gone-train
    status = reconcile.reconcile("GEMTraining", bad, LOG)
    assert status["phase"] == "Failed" and condition(status, "Failed")["reason"] == "JobDeleted"
    cluster.patch_status(API, "GEMTraining", "gone", status)
    fixed = kube.custom().patch_namespaced_custom_object(
        "gem.dev", "v1alpha1", "default", "gemtrainings", "gone", {"spec": {"parallelism": {"procsPerNode": 1}}})
    assert reconcile.reconcile("GEMTraining", fixed, LOG)["phase"] == "Failed"
    assert cluster.get(JOBS, "PyTorchJob", "gone-train") is None  # never a second job


def test_an_operator_that_died_after_creating_the_job_still_reports_created(cluster):
    teacher(cluster, "t", {"phase": "Running"}, claimName="shared")
    stored(cluster, "LoopFMDistill", "student", teacher={"gemTraining": "t"})
    with pytest.raises(kopf.TemporaryError):
        reconcile.reconcile("LoopFMDistill", cluster.get(API, "LoopFMDistill", "student"), LOG)
    cluster.patch_status(API, "GEMTraining", "t", {"phase": "Succeeded", "latestCheckpoint": "/var/lib/gem/checkpoints/x"})
    waiting = cluster.get(API, "LoopFMDistill", "student")
    reconcile.reconcile("LoopFMDistill", waiting, LOG)  # creates the job; the operator dies before the status write
    assert cluster.get(JOBS, "PyTorchJob", "student-distill") is not None
    status = reconcile.reconcile("LoopFMDistill", waiting, LOG)  # the restarted operator; no job condition yet
    # before the fix: still WaitingForTeacher, "waiting for teacher ... (now Running)", with its job running
    assert (status["phase"], status["message"]) == ("Created", "PyTorchJob student-distill created")
    assert condition(status, "TeacherReady")["status"] == "True"
    assert [e["reason"] for e in cluster.events(involved_name="student")].count("JobCreated") == 1


# --------------------------------------------------------------------------- a ConfigMap of someone else


def test_a_config_map_left_by_a_deleted_resource_of_the_same_name_is_not_adopted(cluster):
    # The resource was deleted and recreated; the garbage collector has not removed its ConfigMap yet.
    stale = {"metadata": {"name": "again-train-config", "ownerReferences": [
        {"apiVersion": API, "kind": "GEMTraining", "name": "again", "uid": "uid-of-the-deleted-one", "controller": True}]},
        "data": {"config.yaml": "old"}}
    cluster.create("v1", "ConfigMap", stale)
    body = stored(cluster, "GEMTraining", "again", parallelism={"numNodes": 1})
    with pytest.raises(kopf.TemporaryError, match="not owned by this resource"):
        reconcile.reconcile("GEMTraining", body, LOG)
    assert cluster.get("v1", "ConfigMap", "again-train-config")["data"] == {"config.yaml": "old"}  # left alone
    assert cluster.get(JOBS, "PyTorchJob", "again-train") is None  # no job whose pods would lose their config

    cluster.delete("v1", "ConfigMap", "again-train-config")  # what the garbage collector does
    assert reconcile.reconcile("GEMTraining", body, LOG)["phase"] == "Created"
    owners = cluster.get("v1", "ConfigMap", "again-train-config")["metadata"]["ownerReferences"]
    assert [o["uid"] for o in owners] == [body["metadata"]["uid"]]


def test_a_config_map_of_our_own_is_brought_up_to_date(cluster):
    body = stored(cluster, "GEMTraining", "mine", parallelism={"numNodes": 1})
    reconcile.reconcile("GEMTraining", body, LOG)
    cluster.store.mutate(cluster.resource("v1", "ConfigMap"), "default", "mine-train-config",
                         lambda o: o.__setitem__("data", {"config.yaml": "tampered"}))
    cm = render.render_config_map(reconcile.parse_resource("GEMTraining", body))
    kube.ensure_config_map(cm)  # a retried reconcile: 409 AlreadyExists, ours, patched
    assert cluster.get("v1", "ConfigMap", "mine-train-config")["data"] == cm["data"]


# --------------------------------------------------------------------------- spec changes vs CRD defaults


def _read_back_under_newer_crd(body: dict) -> dict:
    """The object as the API server returns it once a CRD with defaults is applied: every default filled in."""
    newer = copy.deepcopy(body)
    schema = render_crd(body["kind"])["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    apply_defaults(newer["spec"], schema["properties"]["spec"])
    return newer


def _unstored(name: str, spec: dict) -> dict:
    """A GEMTraining stored under an older CRD that did not yet have (or default) most fields."""
    return {"apiVersion": API, "kind": "GEMTraining",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "generation": 1}, "spec": spec}


def test_defaults_a_newer_crd_fills_in_are_not_a_spec_change_but_an_edit_is(cluster):
    old = _unstored("drift", {"parallelism": {"numNodes": 1}, "training": {"steps": 50}})
    reconcile.reconcile("GEMTraining", old, LOG)
    newer = _read_back_under_newer_crd(old)
    assert newer["spec"] != old["spec"] and newer["spec"]["training"]["warmupSteps"] == 20

    status = reconcile.reconcile("GEMTraining", newer, LOG)
    assert condition(status, "Valid")["status"] == "True"
    assert not any(c["type"] == "SpecChangeAccepted" for c in status["conditions"])
    assert warnings(cluster, "drift") == []

    edited = copy.deepcopy(newer)
    edited["spec"]["training"]["steps"] = 60
    edited["metadata"]["generation"] = 2
    status = reconcile.reconcile("GEMTraining", edited, LOG)
    rejected = condition(status, "SpecChangeAccepted")
    assert (rejected["status"], rejected["reason"]) == ("False", "ImmutableFieldChanged")
    assert warnings(cluster, "drift") == ["SpecChangeRejected"]


def test_jobs_of_an_older_operator_keep_comparing_and_learn_the_new_digest(cluster):
    old = _unstored("legacy", {"parallelism": {"numNodes": 1}})
    reconcile.reconcile("GEMTraining", old, LOG)

    def as_an_older_operator_rendered_it(job: dict) -> None:  # it wrote only gem.dev/spec-hash
        del job["metadata"]["annotations"][reconcile.ANNOTATION_SPEC_DIGEST]

    jobs = cluster.resource(JOBS, "PyTorchJob")
    cluster.store.mutate(jobs, "default", "legacy-train", as_an_older_operator_rendered_it)

    status = reconcile.reconcile("GEMTraining", old, LOG)  # the operator upgrade alone flags nothing
    assert not any(c["type"] == "SpecChangeAccepted" for c in status["conditions"])
    annotations = cluster.get(JOBS, "PyTorchJob", "legacy-train")["metadata"]["annotations"]
    assert annotations[reconcile.ANNOTATION_SPEC_DIGEST] == reconcile.spec_digest(
        reconcile.parse_resource("GEMTraining", old).spec)
    # ... so a CRD applied afterwards is no spec change either
    status = reconcile.reconcile("GEMTraining", _read_back_under_newer_crd(old), LOG)
    assert not any(c["type"] == "SpecChangeAccepted" for c in status["conditions"])

    # An edit made while only the old hash was there is still an edit.
    cluster.store.mutate(jobs, "default", "legacy-train", as_an_older_operator_rendered_it)
    edited = copy.deepcopy(old)
    edited["spec"]["training"] = {"steps": 7}
    status = reconcile.reconcile("GEMTraining", edited, LOG)
    assert condition(status, "SpecChangeAccepted")["reason"] == "ImmutableFieldChanged"
    assert reconcile.ANNOTATION_SPEC_DIGEST not in cluster.get(JOBS, "PyTorchJob", "legacy-train")["metadata"]["annotations"]


def test_suspend_stays_a_change_the_digest_ignores(cluster):
    body = stored(cluster, "GEMTraining", "pause", parallelism={"numNodes": 1})
    reconcile.reconcile("GEMTraining", body, LOG)
    paused = copy.deepcopy(body)
    paused["spec"]["suspend"] = True
    status = reconcile.reconcile("GEMTraining", paused, LOG)
    assert not any(c["type"] == "SpecChangeAccepted" for c in status["conditions"])
    assert cluster.get(JOBS, "PyTorchJob", "pause-train")["spec"]["runPolicy"]["suspend"] is True


# --------------------------------------------------------------------------- suspending a Kueue-queued job

#: Kueue's Workload, emulated: a CRD with an open schema and nothing behind it. The tests play Kueue
#: (they create the Workload it would create for a job); no real Kueue runs here.
WORKLOAD_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "workloads.kueue.x-k8s.io"},
    "spec": {
        "group": "kueue.x-k8s.io", "scope": "Namespaced",
        "names": {"plural": "workloads", "singular": "workload", "kind": "Workload", "listKind": "WorkloadList"},
        "versions": [{"name": "v1beta1", "served": True, "storage": True, "subresources": {"status": {}},
                      "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}],
    },
}
WORKLOADS = "kueue.x-k8s.io/v1beta1"


def kueue_creates_workload(cluster, job_name: str) -> str:
    job = cluster.get(JOBS, "PyTorchJob", job_name)
    name = f"pytorchjob-{job_name}-0a1b2"
    cluster.create(WORKLOADS, "Workload", {"metadata": {"name": name, "labels": {
        "kueue.x-k8s.io/job-uid": job["metadata"]["uid"]}}, "spec": {"active": True, "queueName": "team-a"}})
    return name


def with_suspend(body: dict, suspend: bool, generation: int) -> dict:
    out = copy.deepcopy(body)
    out["spec"]["suspend"] = suspend
    out["metadata"]["generation"] = generation
    return out


def test_a_queued_job_is_suspended_and_resumed_through_its_kueue_workload(cluster):
    cluster.apply_crd(WORKLOAD_CRD)
    body = stored(cluster, "GEMTraining", "queued", parallelism={"numNodes": 1}, scheduling={"queueName": "team-a"})
    reconcile.reconcile("GEMTraining", body, LOG)
    workload = kueue_creates_workload(cluster, "queued-train")

    reconcile.reconcile("GEMTraining", with_suspend(body, True, 2), LOG)
    assert cluster.get(WORKLOADS, "Workload", workload)["spec"]["active"] is False
    # runPolicy.suspend is Kueue's to set for a queued job: the operator leaves it alone
    assert cluster.get(JOBS, "PyTorchJob", "queued-train")["spec"]["runPolicy"]["suspend"] is False

    reconcile.reconcile("GEMTraining", with_suspend(body, False, 3), LOG)
    assert cluster.get(WORKLOADS, "Workload", workload)["spec"]["active"] is True
    messages = sorted(e["message"] for e in cluster.events(involved_name="queued") if e["reason"] in ("Suspended", "Resumed"))
    assert messages == [f"set spec.active={a} on Kueue Workload {workload}" for a in ("false", "true")]


def test_a_queued_job_created_suspended_deactivates_its_workload_once_kueue_made_it(cluster):
    cluster.apply_crd(WORKLOAD_CRD)
    body = stored(cluster, "GEMTraining", "held", parallelism={"numNodes": 1},
                  scheduling={"queueName": "team-a"}, suspend=True)
    reconcile.reconcile("GEMTraining", body, LOG)
    reconcile.reconcile("GEMTraining", body, LOG)  # no Workload yet: nothing to apply, nothing recorded
    annotations = cluster.get(JOBS, "PyTorchJob", "held-train")["metadata"]["annotations"]
    assert annotations[reconcile.ANNOTATION_REQUESTED_SUSPEND] == "false"

    workload = kueue_creates_workload(cluster, "held-train")
    reconcile.reconcile("GEMTraining", body, LOG)
    assert cluster.get(WORKLOADS, "Workload", workload)["spec"]["active"] is False
    annotations = cluster.get(JOBS, "PyTorchJob", "held-train")["metadata"]["annotations"]
    assert annotations[reconcile.ANNOTATION_REQUESTED_SUSPEND] == "true"


def test_without_kueue_a_queue_label_still_suspends_through_run_policy(cluster):
    body = stored(cluster, "GEMTraining", "no-kueue", parallelism={"numNodes": 1}, scheduling={"queueName": "team-a"})
    reconcile.reconcile("GEMTraining", body, LOG)
    reconcile.reconcile("GEMTraining", with_suspend(body, True, 2), LOG)
    assert cluster.get(JOBS, "PyTorchJob", "no-kueue-train")["spec"]["runPolicy"]["suspend"] is True


# --------------------------------------------------------------------------- Events of phase changes


def job_condition(type_: str, status: str, minute: int, reason: str = "", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason or f"PyTorchJob{type_}",
            "message": message or f"PyTorchJob back-train is {type_.lower()}.",
            "lastTransitionTime": f"2026-01-01T00:{minute:02d}:00Z"}


def reconcile_stored(cluster, kind: str, name: str) -> dict:
    """One reconcile of the stored resource, its status written back (as the handler does)."""
    status = reconcile.reconcile(kind, cluster.get(API, kind, name), LOG)
    return cluster.patch_status(API, kind, name, status)["status"]


def test_every_phase_change_posts_an_event_also_back_to_created_after_a_resume(cluster):
    # Before the fix: Suspended -> Created (resumed, pods not up yet) posted nothing: its Event
    # was keyed like the job's creation, found that Event (409) and was dropped.
    stored(cluster, "GEMTraining", "back")
    assert reconcile_stored(cluster, "GEMTraining", "back")["phase"] == "Created"
    created = job_condition("Created", "True", 0)
    history = [
        ("Running", [created, job_condition("Running", "True", 1)]),
        ("Suspended", [created, job_condition("Running", "False", 2, "PyTorchJobSuspended"),
                       job_condition("Suspended", "True", 2)]),
        ("Created", [created, job_condition("Suspended", "False", 3, "PyTorchJobResumed", "PyTorchJob back-train is resumed.")]),
        ("Running", [created, job_condition("Suspended", "False", 3, "PyTorchJobResumed"), job_condition("Running", "True", 4)]),
        ("Suspended", [created, job_condition("Running", "False", 5, "PyTorchJobSuspended"),
                       job_condition("Suspended", "True", 5)]),
        ("Created", [created, job_condition("Suspended", "False", 6, "PyTorchJobResumed", "PyTorchJob back-train is resumed.")]),
    ]
    for phase, conditions in history:
        cluster.patch_status(JOBS, "PyTorchJob", "back-train", {"conditions": conditions})
        status = reconcile_stored(cluster, "GEMTraining", "back")
        assert status["phase"] == phase
        reconcile_stored(cluster, "GEMTraining", "back")  # a rerun (resync, restart) posts nothing more
    events = sorted(cluster.events(involved_name="back"), key=lambda e: int(e["metadata"]["resourceVersion"]))
    assert [e["reason"] for e in events] == [
        "JobCreated", "JobRunning", "JobSuspended", "JobCreated", "JobRunning", "JobSuspended", "JobCreated"]
    assert events[3]["message"] == "PyTorchJob back-train is resumed."
    assert status["message"] == "PyTorchJob back-train is resumed."  # not the stale "is created."


# --------------------------------------------------------------------------- edits to a finished resource

FINISHED = {"Succeeded": [job_condition("Created", "True", 0), job_condition("Succeeded", "True", 5)],
            "Failed": [job_condition("Created", "True", 0), job_condition("Failed", "True", 5)]}
DISTILL_SPEC = {"teacher": {"checkpoint": "/ckpt/teacher"}}


def finished(cluster, kind: str, name: str, phase: str) -> dict:
    """A resource whose job ended (`phase`), its status written, with metrics to keep."""
    stored(cluster, kind, name, **(DISTILL_SPEC if kind == "LoopFMDistill" else {}))
    job_name = reconcile_stored(cluster, kind, name)["pytorchJob"]
    cluster.patch_status(JOBS, "PyTorchJob", job_name, {"conditions": FINISHED[phase], "completionTime": "2026-01-01T00:05:00Z"})
    status = reconcile_stored(cluster, kind, name)
    assert status["phase"] == phase
    return cluster.patch_status(API, kind, name, {**status, "metrics": {"ne/click": 0.8}})


def edit(cluster, kind: str, name: str, spec: dict) -> dict:
    plural = "gemtrainings" if kind == "GEMTraining" else "loopfmdistills"
    return kube.custom().patch_namespaced_custom_object("gem.dev", "v1alpha1", "default", plural, name, {"spec": spec})


@pytest.mark.parametrize("job_left", [True, False], ids=["job-left", "job-cleaned-up"])
@pytest.mark.parametrize("kind, phase", [("GEMTraining", "Succeeded"), ("LoopFMDistill", "Failed")])
def test_an_edit_of_a_finished_resource_is_reported_not_applied(cluster, kind, phase, job_left):
    # Before the fix, with the job cleaned up (TTL, kubectl delete): nothing at all, the edit was
    # ignored silently; with the job left: "only spec.suspend may change while a job exists", as
    # if the job still ran, and an edit of spec.suspend itself was ignored silently.
    before = finished(cluster, kind, "done", phase)
    job_name = before["status"]["pytorchJob"]
    if not job_left:
        cluster.delete(JOBS, "PyTorchJob", job_name)
    for spec in ({"training": {"steps": 7}}, {"suspend": True}):
        body = edit(cluster, kind, "done", spec)
        status = reconcile.reconcile(kind, body, LOG)
        rejected = condition(status, "SpecChangeAccepted")
        assert (rejected["status"], rejected["reason"]) == ("False", "Finished")
        assert rejected["message"].startswith(f"this {kind} has finished ({phase}): spec changes are not applied")
        assert "delete and re-create it" in rejected["message"] and "new name" in rejected["message"]
        # the rest of the status is kept as it was
        assert status["phase"] == phase and status["metrics"] == {"ne/click": 0.8}
        assert status["observedGeneration"] == body["metadata"]["generation"]
        cluster.patch_status(API, kind, "done", status)
        assert reconcile.reconcile(kind, cluster.get(API, kind, "done"), LOG) == status  # settled
    assert warnings(cluster, "done").count("SpecChangeRejected") == 2  # one per edit
    job = cluster.get(JOBS, "PyTorchJob", job_name)
    assert (job is None) != job_left
    assert job is None or not job["spec"]["runPolicy"].get("suspend")


# --------------------------------------------------------------------------- metrics


def transitions(kind: str, phase: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("gem_operator_phase_transitions_total", {"kind": kind, "phase": phase}) or 0.0


def test_each_phase_change_is_counted_once_whoever_computes_it_and_however_often(cluster):
    # Before the fix the counter was bumped where a reconcile computed a mirrored phase: twice for
    # a reconcile retried after its status write failed (or computed by the job event and the timer
    # at once), and never for phases set elsewhere (Created by the creation, Invalid, JobDeleted).
    from gem_operator import metrics

    before = {p: transitions("GEMTraining", p) for p in ("Created", "Running", "Invalid")}
    body = stored(cluster, "GEMTraining", "counted")
    uid = body["metadata"]["uid"]
    metrics.observe_phase("GEMTraining", uid, "Pending")  # the watch: ADDED, no status yet
    created = reconcile_stored(cluster, "GEMTraining", "counted")
    metrics.observe_phase("GEMTraining", uid, created["phase"])
    cluster.patch_status(JOBS, "PyTorchJob", "counted-train", {"conditions": [job_condition("Created", "True", 0),
                                                                               job_condition("Running", "True", 1)]})
    stale = cluster.get(API, "GEMTraining", "counted")
    reconcile.reconcile("GEMTraining", stale, LOG)  # its status write refused (409) ...
    running = reconcile_stored(cluster, "GEMTraining", "counted")  # ... and retried
    for phase in (running["phase"], running["phase"], "Running"):  # and every later write, a re-list
        metrics.observe_phase("GEMTraining", uid, phase)
    invalid = stored(cluster, "GEMTraining", "broken", parallelism={"numNodes": 1, "procsPerNode": 8}, resources={"gpusPerNode": 4})
    metrics.observe_phase("GEMTraining", invalid["metadata"]["uid"], "Pending")
    metrics.observe_phase("GEMTraining", invalid["metadata"]["uid"], reconcile_stored(cluster, "GEMTraining", "broken")["phase"])
    metrics.observe_phase("GEMTraining", uid, None)  # deleted
    after = {p: transitions("GEMTraining", p) for p in before}
    assert {p: after[p] - before[p] for p in before} == {"Created": 1, "Running": 1, "Invalid": 1}


def test_a_restarting_job_is_a_warning_like_the_training_operators_own_event(cluster):
    # Before the fix JobRestarting was Normal, while training-operator itself posts
    # PyTorchJobRestarting as a Warning: replicas failed, `kubectl get events --field-selector
    # type=Warning` should show it.
    stored(cluster, "GEMTraining", "back")
    reconcile_stored(cluster, "GEMTraining", "back")
    cluster.patch_status(JOBS, "PyTorchJob", "back-train", {"conditions": [
        job_condition("Created", "True", 0),
        job_condition("Restarting", "True", 2, message="PyTorchJob back-train is restarting because 1 Master replica(s) failed.")]})
    assert reconcile_stored(cluster, "GEMTraining", "back")["phase"] == "Restarting"
    assert {e["reason"]: e["type"] for e in cluster.events(involved_name="back")} == {
        "JobCreated": "Normal", "JobRestarting": "Warning"}


# --------------------------------------------------------------------------- job events vs newer state


def test_a_late_job_event_does_not_move_a_finished_resource_back(cluster):
    # Before the fix the job event's own (possibly old) copy of the job was mirrored into the
    # freshly read resource: an event for Running handled after the timer had already written
    # Succeeded put the resource back to Running until the next resync.
    stored(cluster, "GEMTraining", "late")
    reconcile_stored(cluster, "GEMTraining", "late")
    running = cluster.patch_status(JOBS, "PyTorchJob", "late-train", {"conditions": [
        job_condition("Created", "True", 0), job_condition("Running", "True", 1)]})
    cluster.patch_status(JOBS, "PyTorchJob", "late-train", {"conditions": FINISHED["Succeeded"], "completionTime": "2026-01-01T00:05:00Z"})
    assert reconcile_stored(cluster, "GEMTraining", "late")["phase"] == "Succeeded"  # the timer saw the end
    reconcile.sync_from_job(running, LOG)  # the Running event, handled late
    assert cluster.get(API, "GEMTraining", "late")["status"]["phase"] == "Succeeded"


def test_a_job_named_by_an_earlier_release_is_still_found(cluster, monkeypatch):
    # render.job_name's budget for long names changed (840fb89: room for every worker's Service), so a
    # 45-48 character GEMTraining's job, created by the previous operator, has another name than the
    # one this release renders. Before the fix the upgraded operator looked under the new name only,
    # found nothing and failed the running resource with JobDeleted.
    name = "a" * 46
    stored(cluster, "GEMTraining", name)
    real = render.job_name
    monkeypatch.setattr(render, "job_name", lambda kind, n: f"{n}-train")  # the earlier release's name
    reconcile_stored(cluster, "GEMTraining", name)
    monkeypatch.setattr(render, "job_name", real)
    assert real("GEMTraining", name) != f"{name}-train"
    status = reconcile_stored(cluster, "GEMTraining", name)
    assert (status["phase"], status["pytorchJob"]) == ("Created", f"{name}-train"), status
    assert "JobDeleted" not in warnings(cluster, name)
    assert [j["metadata"]["name"] for j in cluster.list(JOBS, "PyTorchJob")] == [f"{name}-train"]


def test_a_teacher_claim_at_a_path_a_spec_volume_takes_moves_to_the_teacher_mount_path():
    """The teacher's checkpoint claim is mounted at its own path unless the student's pod already mounts
    something there: spec.volumes count as well as the checkpoint volume."""
    from gem.api.types import TEACHER_MOUNT_PATH, LoopFMDistill
    from gem_operator.reconcile import _teacher_mount

    def lfd(volumes):
        return LoopFMDistill.model_validate({"metadata": {"name": "lfd", "namespace": "ns"}, "spec": {
            "teacher": {"gemTraining": "quick"}, "volumes": volumes}})

    ckpt = "/models/ns/quick/step-00000010"
    free = _teacher_mount(lfd([{"claimName": "logs", "mountPath": "/data"}]), ckpt, "teacher-pvc", "/models")
    assert (free.mount_path, free.checkpoint) == ("/models", ckpt)
    moved = _teacher_mount(lfd([{"claimName": "logs", "mountPath": "/models"}]), ckpt, "teacher-pvc", "/models")
    assert (moved.mount_path, moved.checkpoint) == (TEACHER_MOUNT_PATH, f"{TEACHER_MOUNT_PATH}/ns/quick/step-00000010")
