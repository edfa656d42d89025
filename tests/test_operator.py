"""The operator, run as its own process against the API test server.

The executor is off here: the tests play the training operator by writing PyTorchJob status and
pods themselves, which makes every transition deterministic and fast. tests/test_e2e.py runs
the real thing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from gem.api.crds import render_crd
from gem.launcher import free_port
from tests.kubeapi import KubeAPIServer
from tests.kubeapi.testing import wait_for

ROOT = Path(__file__).resolve().parents[1]
GROUP, VERSION = "gem.dev", "v1alpha1"


# --------------------------------------------------------------------------- fixtures


class Operator:
    """`gem-operator` as a child process; stop() and start() again to restart it."""

    def __init__(self, kubeconfig: Path, log: Path, **env: str):
        self.kubeconfig, self.log, self.proc, self.env = kubeconfig, log, None, env

    def start(self) -> "Operator":
        env = {
            **os.environ,
            "GEM_RESYNC_SECONDS": "2",
            "GEM_TEACHER_POLL_SECONDS": "0.3",
            "GEM_MLFLOW_TRACKING_URI": "http://mlflow.test:5000",
            **self.env,
        }
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gem_operator", "--kubeconfig", str(self.kubeconfig), "-n", "default"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def cluster(tmp_path):
    with KubeAPIServer(executor=False, workdir=tmp_path / "kubeapi") as server:
        yield server


@pytest.fixture
def operator(cluster, tmp_path):
    op = Operator(cluster.kubeconfig_path, tmp_path / "operator.log").start()
    yield op
    op.stop()


@pytest.fixture
def api(cluster):
    return client.CustomObjectsApi(cluster.api_client())


def gemtraining(name: str, **spec) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GEMTraining", "metadata": {"name": name}, "spec": spec}


def distill(name: str, teacher: dict, **spec) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LoopFMDistill",
        "metadata": {"name": name},
        "spec": {"teacher": teacher, **spec},
    }


def create(api, body: dict) -> dict:
    plural = "gemtrainings" if body["kind"] == "GEMTraining" else "loopfmdistills"
    return api.create_namespaced_custom_object(GROUP, VERSION, "default", plural, body)


def get(cluster, kind: str, name: str) -> dict | None:
    return cluster.get(f"{GROUP}/{VERSION}", kind, name)


def status_of(cluster, kind: str, name: str) -> dict:
    return (get(cluster, kind, name) or {}).get("status") or {}


def wait_phase(cluster, kind: str, name: str, phase: str, timeout: float = 30) -> dict:
    return wait_for(
        lambda: status_of(cluster, kind, name) if status_of(cluster, kind, name).get("phase") == phase else None,
        timeout=timeout,
        what=f"{kind} {name} phase {phase} (now {status_of(cluster, kind, name).get('phase')})",
    )


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


def job_conditions(*types: str) -> list[dict]:
    return [
        {"type": t, "status": "True", "reason": f"PyTorchJob{t}", "message": f"PyTorchJob default/x is {t.lower()}.",
         "lastTransitionTime": f"2026-01-01T00:0{i}:00Z"}
        for i, t in enumerate(types)
    ]


def master_pod(job_name: str, report: dict, exit_code: int = 0) -> dict:
    return {
        "metadata": {
            "name": f"{job_name}-master-0",
            "labels": {
                "training.kubeflow.org/job-name": job_name,
                "training.kubeflow.org/replica-type": "master",
                "training.kubeflow.org/replica-index": "0",
                "app.kubernetes.io/managed-by": "gem-operator",
            },
        },
        "spec": {"containers": [{"name": "pytorch", "image": "trainer"}]},
        "status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": [
                {"name": "pytorch", "image": "trainer", "imageID": "", "ready": False, "restartCount": 0,
                 "state": {"terminated": {"exitCode": exit_code, "message": json.dumps(report)}}}
            ],
        },
    }


def finish_job(cluster, job_name: str, report: dict, succeeded: bool = True) -> None:
    pod = master_pod(job_name, report, 0 if succeeded else 1)
    status = pod.pop("status")
    cluster.create("v1", "Pod", pod)
    cluster.patch_status("v1", "Pod", pod["metadata"]["name"], status)
    final = "Succeeded" if succeeded else "Failed"
    cluster.patch_status(
        "kubeflow.org/v1",
        "PyTorchJob",
        job_name,
        {
            "conditions": job_conditions("Created", "Running", final),
            "replicaStatuses": {"Master": {"succeeded" if succeeded else "failed": 1}},
            "completionTime": "2026-01-01T00:05:00Z",
        },
    )


def jobs(cluster) -> list[dict]:
    return cluster.list("kubeflow.org/v1", "PyTorchJob")


# --------------------------------------------------------------------------- tests


def test_gemtraining_gets_one_job_and_its_status_follows_the_job(cluster, operator, api):
    create(api, gemtraining("quick", training={"steps": 20}, checkpoint={"claimName": "ckpt"}))
    status = wait_phase(cluster, "GEMTraining", "quick", "Created")
    assert status["pytorchJob"] == "quick-train"
    assert condition(status, "Valid")["status"] == "True"

    job = cluster.get("kubeflow.org/v1", "PyTorchJob", "quick-train")
    owner = get(cluster, "GEMTraining", "quick")
    assert job["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.test:5000"} in container["env"]
    cm = cluster.get("v1", "ConfigMap", "quick-train-config")
    manifest = yaml.safe_load(cm["data"]["config.yaml"])
    assert manifest["spec"]["training"]["steps"] == 20 and manifest["metadata"]["uid"] == owner["metadata"]["uid"]

    cluster.patch_status("kubeflow.org/v1", "PyTorchJob", "quick-train", {
        "conditions": job_conditions("Created", "Running"), "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 1}},
    })
    status = wait_phase(cluster, "GEMTraining", "quick", "Running")
    assert status["replicas"]["Worker"]["active"] == 1

    report = {"metrics": {"ne/click": 0.71, "auc/click": 0.8}, "ne": 0.75, "step": 20, "totalSteps": 20,
              "checkpoint": "/ckpt/default/quick/step-00000020", "mlflowRunId": "r1", "mlflowExperimentId": "3"}
    finish_job(cluster, "quick-train", report)
    status = wait_phase(cluster, "GEMTraining", "quick", "Succeeded")
    assert status["metrics"] == {"ne/click": 0.71, "auc/click": 0.8} and status["ne"] == 0.75
    assert status["latestCheckpoint"] == "/ckpt/default/quick/step-00000020"
    assert status["mlflow"]["runId"] == "r1" and status["progress"]["percent"] == 100
    reasons = {e["reason"] for e in cluster.events(involved_name="quick")}
    assert {"JobCreated", "JobRunning", "JobSucceeded"} <= reasons
    assert len(jobs(cluster)) == 1


def test_trainer_failure_reason_reaches_the_status(cluster, operator, api):
    create(api, gemtraining("boom"))
    wait_phase(cluster, "GEMTraining", "boom", "Created")
    finish_job(cluster, "boom-train", {"error": "FileNotFoundError: /data/shards"}, succeeded=False)
    status = wait_phase(cluster, "GEMTraining", "boom", "Failed")
    assert "FileNotFoundError: /data/shards" in status["message"]
    assert any(e["type"] == "Warning" and e["reason"] == "JobFailed" for e in cluster.events(involved_name="boom"))


def _permissive(crd: dict) -> dict:
    """The CRD as an older, schema-less version of it would have stored objects."""
    crd = copy.deepcopy(crd)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    schema.pop("required", None)
    return crd


BAD_SPECS = {
    "wrong-type": ({"training": {"steps": "many"}}, "spec.training.steps"),
    "unknown-enum": ({"model": {"preset": "huge"}}, "spec.model.preset"),
    "negative-nodes": ({"parallelism": {"numNodes": -1}}, "spec.parallelism.numNodes"),
    "cross-field": ({"model": {"embeddingDim": 30, "numHeads": 4}}, "numHeads"),
    "unknown-field": ({"trainng": {}}, "spec.trainng"),
}


def test_bad_specs_get_a_condition_and_the_operator_keeps_serving(cluster, operator, api):
    # What the API server's schema rejects never reaches the operator: it answers 422 naming the field.
    with pytest.raises(ApiException) as e:
        create(api, gemtraining("rejected", parallelism={"numNodes": -1}))
    assert e.value.status == 422 and "spec.parallelism.numNodes" in e.value.body

    # Objects stored under an older, looser CRD (or written by any path around the schema) do reach it.
    cluster.apply_crd(_permissive(render_crd("GEMTraining")))
    cluster.apply_crd(_permissive(render_crd("LoopFMDistill")))
    for name, (spec, _) in BAD_SPECS.items():
        create(api, gemtraining(name, **spec))
    create(api, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GEMTraining", "metadata": {"name": "no-spec"}})
    create(api, distill("two-teachers", {"gemTraining": "a", "checkpoint": "/c"}))
    create(api, gemtraining("good"))

    for name, (_, field) in BAD_SPECS.items():
        status = wait_phase(cluster, "GEMTraining", name, "Invalid")
        valid = condition(status, "Valid")
        assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
        assert field in valid["message"], (name, valid["message"])
        assert any(e["type"] == "Warning" and e["reason"] == "InvalidSpec" for e in cluster.events(involved_name=name))
    assert "spec: field required" in wait_phase(cluster, "GEMTraining", "no-spec", "Invalid")["message"]
    assert "exactly one" in wait_phase(cluster, "LoopFMDistill", "two-teachers", "Invalid")["message"]
    wait_phase(cluster, "GEMTraining", "good", "Created")
    assert [j["metadata"]["name"] for j in jobs(cluster)] == ["good-train"]
    assert operator.alive


def test_distillation_waits_for_its_teacher_then_runs_from_its_checkpoint(cluster, operator, api):
    create(api, distill("student", {"gemTraining": "teacher"}))
    status = wait_phase(cluster, "LoopFMDistill", "student", "WaitingForTeacher")
    assert condition(status, "TeacherReady")["reason"] == "TeacherNotFound"
    assert "teacher" in status["message"] and "does not exist" in status["message"]

    create(api, gemtraining("teacher", checkpoint={"claimName": "teacher-ckpt", "path": "/ckpt"}))
    wait_phase(cluster, "GEMTraining", "teacher", "Created")
    status = wait_for(
        lambda: (s := status_of(cluster, "LoopFMDistill", "student"))
        and condition(s, "TeacherReady")["reason"] == "TeacherNotSucceeded" and s,
        what="TeacherNotSucceeded",
    )
    assert status["phase"] == "WaitingForTeacher"

    finish_job(cluster, "teacher-train", {"metrics": {"ne/click": 0.7}, "ne": 0.7,
                                          "checkpoint": "/ckpt/default/teacher/step-00000200"})
    wait_phase(cluster, "GEMTraining", "teacher", "Succeeded")
    status = wait_phase(cluster, "LoopFMDistill", "student", "Created")
    assert condition(status, "TeacherReady")["status"] == "True"
    cm = cluster.get("v1", "ConfigMap", "student-distill-config")
    assert yaml.safe_load(cm["data"]["config.yaml"])["spec"]["teacher"] == {"checkpoint": "/ckpt/default/teacher/step-00000200"}
    pod = cluster.get("kubeflow.org/v1", "PyTorchJob", "student-distill")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "teacher", "persistentVolumeClaim": {"claimName": "teacher-ckpt", "readOnly": True}} in pod["volumes"]


def test_distillation_fails_when_its_teacher_failed(cluster, operator, api):
    create(api, gemtraining("bad-teacher"))
    wait_phase(cluster, "GEMTraining", "bad-teacher", "Created")
    finish_job(cluster, "bad-teacher-train", {"error": "RuntimeError: diverged"}, succeeded=False)
    wait_phase(cluster, "GEMTraining", "bad-teacher", "Failed")
    create(api, distill("orphan", {"gemTraining": "bad-teacher"}))
    status = wait_phase(cluster, "LoopFMDistill", "orphan", "Failed")
    assert condition(status, "TeacherReady")["reason"] == "TeacherFailed"
    assert not cluster.get("kubeflow.org/v1", "PyTorchJob", "orphan-distill")


def test_suspend_is_applied_in_flight_and_other_changes_are_rejected(cluster, operator, api):
    create(api, gemtraining("flex", training={"steps": 50}))
    wait_phase(cluster, "GEMTraining", "flex", "Created")
    api.patch_namespaced_custom_object(GROUP, VERSION, "default", "gemtrainings", "flex", {"spec": {"suspend": True}})
    wait_for(lambda: cluster.get("kubeflow.org/v1", "PyTorchJob", "flex-train")["spec"]["runPolicy"]["suspend"], what="suspend")

    api.patch_namespaced_custom_object(GROUP, VERSION, "default", "gemtrainings", "flex", {"spec": {"training": {"steps": 99}}})
    status = wait_for(
        lambda: (s := status_of(cluster, "GEMTraining", "flex"))
        and any(c["type"] == "SpecChangeAccepted" and c["status"] == "False" for c in s.get("conditions", [])) and s,
        what="SpecChangeAccepted=False",
    )
    assert "only spec.suspend may change" in condition(status, "SpecChangeAccepted")["message"]
    cm = cluster.get("v1", "ConfigMap", "flex-train-config")
    assert yaml.safe_load(cm["data"]["config.yaml"])["spec"]["training"]["steps"] == 50

    # A queue controller (Kueue) suspending the job is not undone by the operator.
    api.patch_namespaced_custom_object(GROUP, VERSION, "default", "gemtrainings", "flex", {"spec": {"suspend": False, "training": {"steps": 50}}})
    wait_for(lambda: not cluster.get("kubeflow.org/v1", "PyTorchJob", "flex-train")["spec"]["runPolicy"]["suspend"], what="resume")
    custom = client.CustomObjectsApi(cluster.api_client())
    custom.patch_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", "flex-train", {"spec": {"runPolicy": {"suspend": True}}})
    wait_for(lambda: condition(status_of(cluster, "GEMTraining", "flex"), "SpecChangeAccepted")["status"] == "True", what="accepted")
    assert cluster.get("kubeflow.org/v1", "PyTorchJob", "flex-train")["spec"]["runPolicy"]["suspend"] is True


def test_a_restarted_operator_never_creates_a_second_job(cluster, operator, api):
    create(api, gemtraining("steady"))
    wait_phase(cluster, "GEMTraining", "steady", "Created")
    operator.stop()
    create(api, gemtraining("while-down"))
    cluster.patch_status("kubeflow.org/v1", "PyTorchJob", "steady-train", {"conditions": job_conditions("Created", "Running")})
    operator.start()
    wait_phase(cluster, "GEMTraining", "while-down", "Created")
    wait_phase(cluster, "GEMTraining", "steady", "Running")
    operator.stop()
    operator.start()
    finish_job(cluster, "steady-train", {"metrics": {"ne/click": 0.9}, "ne": 0.9})
    wait_phase(cluster, "GEMTraining", "steady", "Succeeded")
    assert sorted(j["metadata"]["name"] for j in jobs(cluster)) == ["steady-train", "while-down-train"]


def test_deleting_a_resource_garbage_collects_its_children(cluster, operator, api):
    create(api, gemtraining("temp"))
    wait_phase(cluster, "GEMTraining", "temp", "Created")
    api.delete_namespaced_custom_object(GROUP, VERSION, "default", "gemtrainings", "temp")
    wait_for(lambda: not jobs(cluster) and not cluster.get("v1", "ConfigMap", "temp-train-config"), what="GC")


def test_a_deleted_teacher_fails_the_waiting_distillation(cluster, operator, api):
    create(api, gemtraining("short-lived", checkpoint={"claimName": "shared-ckpt"}))
    create(api, distill("left-behind", {"gemTraining": "short-lived"}))
    wait_for(
        lambda: (s := status_of(cluster, "LoopFMDistill", "left-behind"))
        and (condition(s, "TeacherReady") or {}).get("reason") == "TeacherNotSucceeded",
        what="teacher seen",
    )
    api.delete_namespaced_custom_object(GROUP, VERSION, "default", "gemtrainings", "short-lived")
    status = wait_phase(cluster, "LoopFMDistill", "left-behind", "Failed")
    assert condition(status, "TeacherReady")["reason"] == "TeacherDeleted"


def test_metrics_count_resources_by_phase_and_reconciles(cluster, api, tmp_path):
    import urllib.request

    port = free_port()
    op = Operator(cluster.kubeconfig_path, tmp_path / "op.log")
    os.environ["GEM_METRICS_PORT"] = str(port)
    try:
        op.start()
    finally:
        del os.environ["GEM_METRICS_PORT"]
    try:
        create(api, gemtraining("counted"))
        create(api, gemtraining("counted-too"))
        wait_phase(cluster, "GEMTraining", "counted-too", "Created")
        wait_phase(cluster, "GEMTraining", "counted", "Created")

        def scrape() -> str:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return text if 'gem_operator_resources{kind="GEMTraining",phase="Created"} 2.0' in text else ""

        text = wait_for(scrape, what="phase gauge")
        assert 'gem_operator_reconciles_total{kind="GEMTraining",result="ok"}' in text
        # Pending -> Created, seen on the watch, once each (the creation's, which no job condition made)
        assert 'gem_operator_phase_transitions_total{kind="GEMTraining",phase="Created"} 2.0' in text
    finally:
        op.stop()


def test_peered_replicas_never_both_act_and_a_standby_takes_over(cluster, api, tmp_path):
    for doc in yaml.safe_load_all((ROOT / "manifests/peering/kopf-peering.yaml").read_text()):
        if doc["kind"] == "CustomResourceDefinition":
            cluster.apply_crd(doc)
    cluster.create("kopf.dev/v1", "KopfPeering", {"metadata": {"name": "gem-operator"}})
    os.environ["GEM_PEERING_LIFETIME"] = "3"
    try:
        active = Operator(cluster.kubeconfig_path, tmp_path / "active.log")
        standby = Operator(cluster.kubeconfig_path, tmp_path / "standby.log")
        _start_with(active, ["--peering", "gem-operator", "--priority", "200"])
        _start_with(standby, ["--peering", "gem-operator", "--priority", "100"])
    finally:
        del os.environ["GEM_PEERING_LIFETIME"]
    try:
        wait_for(
            lambda: len((cluster.get("kopf.dev/v1", "KopfPeering", "gem-operator") or {}).get("status") or {}) == 2,
            timeout=30,
            what="both replicas announced in the peering object",
        )
        create(api, gemtraining("peered"))
        wait_phase(cluster, "GEMTraining", "peered", "Created")
        assert "created PyTorchJob" in (tmp_path / "active.log").read_text()
        assert "created PyTorchJob" not in (tmp_path / "standby.log").read_text()

        active.stop()  # a crash: its peering record expires after its lifetime
        create(api, gemtraining("after-failover"))
        wait_phase(cluster, "GEMTraining", "after-failover", "Created", timeout=45)
        assert "created PyTorchJob" in (tmp_path / "standby.log").read_text()
        assert sorted(j["metadata"]["name"] for j in jobs(cluster)) == ["after-failover-train", "peered-train"]
    finally:
        active.stop()
        standby.stop()


def _start_with(op: Operator, extra: list[str]) -> None:
    env = {**os.environ, "GEM_RESYNC_SECONDS": "2"}
    with open(op.log, "ab") as out:
        op.proc = subprocess.Popen(
            [sys.executable, "-m", "gem_operator", "--kubeconfig", str(op.kubeconfig), "-n", "default", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )


# --------------------------------------------------------------------------- lifecycle under change
# (appended with the reliability work: tests/test_reliability_*.py drive the same paths under
# kills and API faults)


def test_a_job_deleted_by_hand_fails_the_resource_and_is_not_recreated(cluster, operator, api):
    create(api, gemtraining("orphaned"))
    wait_phase(cluster, "GEMTraining", "orphaned", "Created")
    cluster.patch_status("kubeflow.org/v1", "PyTorchJob", "orphaned-train", {"conditions": job_conditions("Created", "Running")})
    wait_phase(cluster, "GEMTraining", "orphaned", "Running")
    cluster.delete("kubeflow.org/v1", "PyTorchJob", "orphaned-train")
    status = wait_phase(cluster, "GEMTraining", "orphaned", "Failed")
    assert condition(status, "Failed")["reason"] == "JobDeleted" and "never starts a second job" in status["message"]
    import time

    time.sleep(3)  # more than one resync period: still no new job
    assert jobs(cluster) == []


def test_a_job_deleted_by_hand_is_reported_without_waiting_for_the_resync(cluster, api, tmp_path):
    # Before the fix the job's DELETED event was ignored: the resource stayed Running until the
    # resync timer (GEM_RESYNC_SECONDS, 30 s by default) noticed; here the timer never comes.
    op = Operator(cluster.kubeconfig_path, tmp_path / "op.log", GEM_RESYNC_SECONDS="3600").start()
    try:
        create(api, gemtraining("dropped"))
        wait_phase(cluster, "GEMTraining", "dropped", "Created")
        cluster.patch_status("kubeflow.org/v1", "PyTorchJob", "dropped-train", {"conditions": job_conditions("Created", "Running")})
        wait_phase(cluster, "GEMTraining", "dropped", "Running")
        cluster.delete("kubeflow.org/v1", "PyTorchJob", "dropped-train")
        status = wait_phase(cluster, "GEMTraining", "dropped", "Failed")
        assert condition(status, "Failed")["reason"] == "JobDeleted"
        assert [e["reason"] for e in cluster.events(involved_name="dropped") if e["type"] == "Warning"] == ["JobDeleted"]
        create(api, gemtraining("gone-with-it"))  # deleting a resource deletes its job: nothing to report
        wait_phase(cluster, "GEMTraining", "gone-with-it", "Created")
        api.delete_namespaced_custom_object(GROUP, VERSION, "default", "gemtrainings", "gone-with-it")
        wait_for(lambda: get(cluster, "GEMTraining", "gone-with-it") is None, what="gone-with-it deleted")
        assert jobs(cluster) == []
    finally:
        op.stop()
    assert "Traceback" not in op.log.read_text()


def test_an_invalid_edit_while_the_job_runs_is_a_rejected_change(cluster, operator, api):
    cluster.apply_crd(_permissive(render_crd("GEMTraining")))
    create(api, gemtraining("edited"))
    wait_phase(cluster, "GEMTraining", "edited", "Created")
    api.patch_namespaced_custom_object(GROUP, VERSION, "default", "gemtrainings", "edited", {"spec": {"training": {"steps": "many"}}})
    status = wait_for(
        lambda: (s := status_of(cluster, "GEMTraining", "edited"))
        and any(c["type"] == "SpecChangeAccepted" and c["reason"] == "InvalidSpec" for c in s.get("conditions", [])) and s,
        what="SpecChangeAccepted=False (InvalidSpec)",
    )
    assert status["phase"] == "Created" and "spec.training.steps" in condition(status, "SpecChangeAccepted")["message"]
    finish_job(cluster, "edited-train", {"metrics": {"ne/click": 0.8}, "ne": 0.8})
    assert wait_phase(cluster, "GEMTraining", "edited", "Succeeded")["metrics"] == {"ne/click": 0.8}


def test_each_transition_posts_exactly_one_event_even_across_restarts(cluster, operator, api):
    create(api, gemtraining("once"))
    wait_phase(cluster, "GEMTraining", "once", "Created")
    operator.stop()
    operator.start()
    cluster.patch_status("kubeflow.org/v1", "PyTorchJob", "once-train", {"conditions": job_conditions("Created", "Running")})
    wait_phase(cluster, "GEMTraining", "once", "Running")
    operator.stop()
    operator.start()
    finish_job(cluster, "once-train", {"metrics": {"ne/click": 0.8}, "ne": 0.8})
    wait_phase(cluster, "GEMTraining", "once", "Succeeded")
    import time

    time.sleep(3)  # the restarted operator re-reconciles everything: no second Event
    reasons = [e["reason"] for e in cluster.events(involved_name="once")]
    for reason in ("JobCreated", "JobRunning", "JobSucceeded"):
        assert reasons.count(reason) == 1, reasons


def test_readiness_follows_the_api_and_logs_can_be_json(cluster, api, tmp_path):
    import urllib.error
    import urllib.request

    ready_port, metrics_port = free_port(), free_port()
    op = Operator(cluster.kubeconfig_path, tmp_path / "op.log")
    os.environ["GEM_METRICS_PORT"] = str(metrics_port)
    try:
        _start_with(op, ["--readiness", f"http://127.0.0.1:{ready_port}/readyz", "--log-format", "json"])
    finally:
        del os.environ["GEM_METRICS_PORT"]

    def probe() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ready_port}/readyz", timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    try:
        wait_for(lambda: probe() == 200, timeout=60, what="ready")
        # Without the API (here: listing GEMTrainings fails) it is not ready, and ready again after.
        rule = cluster.faults.add(method="GET", path=r"/gemtrainings\?limit=1", status=503)
        wait_for(lambda: probe() == 503, timeout=30, interval=0.5, what="not ready while the API fails")
        cluster.faults.remove(rule)
        wait_for(lambda: probe() == 200, timeout=30, interval=0.5, what="ready again")

        create(api, gemtraining("logged"))
        wait_phase(cluster, "GEMTraining", "logged", "Created")
        records = [json.loads(line) for line in (tmp_path / "op.log").read_text().splitlines() if line.startswith("{")]
        created = [r for r in records if "created PyTorchJob" in r.get("message", "")]
        assert created and created[0]["object"]["name"] == "logged" and created[0]["severity"] == "info"
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'gem_operator_reconcile_duration_seconds_bucket{kind="GEMTraining"' in text
    finally:
        op.stop()
