"""The SDK beyond submit/get/wait: suspend and resume, update, conditions, pods, every replica's
logs, metric history from MLflow, and the gemctl commands on top (both backends).

Kubernetes: against the API test server (no gem operator runs here: the tests play it where
needed). Local: jobs run as processes with a stand-in trainer that checkpoints every step and
resumes from its latest checkpoint, like `gem train`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gem_sdk import (
    GEMClient,
    KubernetesBackendConfig,
    LocalBackendConfig,
    MetricPoint,
    NotFoundError,
    ReplicaPod,
    ValidationError,
)
from gem_sdk.backends.local import store
from gem_sdk.backends.local.backend import _alive
from gem_sdk.cli import app

API = "gem.dev/v1alpha1"


def manifest(name: str, nodes: int = 1, **spec) -> dict:
    return {"apiVersion": API, "kind": "GEMTraining", "metadata": {"name": name, "labels": {"team": "ads"}},
            "spec": {"parallelism": {"numNodes": nodes}, "training": {"steps": 5}, **spec}}


def gemctl(*args: str):
    return CliRunner().invoke(app, list(args))


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture
def k8s(kubeapi) -> GEMClient:
    return GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeapi.kubeconfig_path)))


def test_suspend_and_resume_set_spec_suspend(k8s, kubeapi):
    job = k8s.submit(manifest("pause"))
    suspended = k8s.suspend(job)
    assert suspended.spec.suspend is True and suspended.metadata.generation == job.metadata.generation + 1
    assert kubeapi.get(API, "GEMTraining", "pause")["spec"]["suspend"] is True
    assert k8s.suspend("pause").spec.suspend is True  # idempotent
    assert k8s.resume("pause").spec.suspend is False
    kubeapi.patch_status(API, "GEMTraining", "pause", {"phase": "Succeeded"})
    with pytest.raises(ValidationError, match="has ended \\(Succeeded\\): there is nothing to suspend"):
        k8s.suspend("pause")
    with pytest.raises(NotFoundError):
        k8s.resume("ghost")


def test_update_labels_and_annotations(k8s, kubeapi):
    k8s.submit(manifest("tagged"))
    obj = k8s.update("tagged", labels={"tier": "gold", "team": None}, annotations={"note": "rerun of v1"})
    assert obj.metadata.labels == {"tier": "gold"} and obj.metadata.annotations["note"] == "rerun of v1"
    assert [o.metadata.name for o in k8s.list(label_selector="tier=gold")] == ["tagged"]
    assert k8s.update("tagged").metadata.labels == {"tier": "gold"}  # nothing to change


def test_conditions_and_phase_checks(k8s, kubeapi):
    k8s.submit(manifest("cond"))
    assert k8s.get_conditions("cond") == [] and not k8s.is_created("cond")
    kubeapi.patch_status(API, "GEMTraining", "cond", {"phase": "Running", "conditions": [
        {"type": "Valid", "status": "True", "reason": "SpecValid", "message": "spec is valid"},
        {"type": "Running", "status": "True", "reason": "PyTorchJobRunning", "message": "running"}]})
    conds = {c.type: c for c in k8s.get_conditions("cond")}
    assert conds["Running"].status == "True" and conds["Running"].reason == "PyTorchJobRunning"
    assert k8s.is_created("cond") and k8s.is_running("cond")
    assert not (k8s.is_succeeded("cond") or k8s.is_failed("cond") or k8s.is_suspended("cond") or k8s.is_restarting("cond"))
    kubeapi.patch_status(API, "GEMTraining", "cond", {"phase": "Invalid"})
    assert k8s.is_failed("cond") and not k8s.is_created("cond")


def test_wait_reports_each_version_and_takes_a_predicate(k8s, kubeapi):
    k8s.submit(manifest("progress"))
    seen: list[tuple[str | None, int | None]] = []

    def later() -> None:
        for pct in (10, 40, 70, 100):
            time.sleep(0.3)
            kubeapi.patch_status(API, "GEMTraining", "progress", {
                "phase": "Running", "progress": {"step": pct, "totalSteps": 100, "percent": pct}})

    threading.Thread(target=later, daemon=True).start()
    half = k8s.wait("progress", timeout=30, until=lambda o: bool(o.status and o.status.progress and o.status.progress.percent >= 40),
                    callback=lambda o: seen.append((o.status.phase if o.status else None,
                                                    o.status.progress.percent if o.status and o.status.progress else None)))
    assert half.status.progress.percent >= 40
    assert seen[0] == (None, None) and seen[-1][1] >= 40 and len(seen) >= 2


def _script_job(name: str, script: str, workers: int) -> dict:
    container = {"name": "pytorch", "image": "python", "command": [sys.executable, "-c", script]}
    replica = {"replicas": 1, "restartPolicy": "Never", "template": {"spec": {"containers": [container]}}}
    return {"metadata": {"name": name}, "spec": {"runPolicy": {"backoffLimit": 0}, "pytorchReplicaSpecs": {
        "Master": replica, "Worker": {**replica, "replicas": workers}}}}


def test_pods_and_every_replicas_logs(k8s, kubeapi):
    k8s.submit(manifest("gang", nodes=3))
    assert k8s.pods("gang") == []
    script = "import os,time\nfor i in range(3):\n    print('line', i, os.environ['HOSTNAME'], flush=True)\n    time.sleep(0.2)\n"
    kubeapi.create("kubeflow.org/v1", "PyTorchJob", _script_job("gang-train", script, workers=2))
    lines = list(k8s.all_logs("gang", follow=True, timeout=60))
    pods = ["gang-train-master-0", "gang-train-worker-0", "gang-train-worker-1"]
    for pod in pods:
        assert [line for p, line in lines if p == pod] == [f"line {i} {pod}" for i in range(3)]
    listed = k8s.pods("gang")
    assert [p.name for p in listed] == pods
    assert [(p.replica_type, p.index) for p in listed] == [("master", 0), ("worker", 0), ("worker", 1)]
    assert k8s.pod_names("gang", replica="worker") == pods[1:]
    assert k8s.pod_names("gang", replica="worker", index=1) == pods[2:]
    snapshot = list(k8s.all_logs("gang"))
    assert [p for p, _ in snapshot] == [p for p in pods for _ in range(3)]
    with pytest.raises(ValidationError):
        k8s.pods("gang", replica="chief")


# --------------------------------------------------------------------------- metrics (MLflow)


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory) -> str:
    """One sqlite tracking store for the module (creating one takes seconds)."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    mlflow.tracking.MlflowClient(uri).create_experiment("gem")
    return uri


def _run(uri: str, uid: str, points: dict[str, list[float]]) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("gem").experiment_id
    run = client.create_run(exp, tags={"gem.dev/uid": uid})
    for key, values in points.items():
        for step, value in enumerate(values):
            client.log_metric(run.info.run_id, key, value, step=step * 10)
    return run.info.run_id


def test_metric_history_from_mlflow(kubeapi, mlflow_db, tmp_path):
    k8s = GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeapi.kubeconfig_path), mlflow_tracking_uri=mlflow_db))
    job = k8s.submit(manifest("tracked"))
    with pytest.raises(NotFoundError, match="no MLflow run yet"):
        k8s.metrics(job)
    # While it runs, the run is found by the uid tag the trainer sets.
    run_id = _run(mlflow_db, job.metadata.uid, {"loss": [0.9, 0.7, 0.6], "ne/click": [0.95, 0.9]})
    history = k8s.metrics(job)
    assert sorted(history) == ["loss", "ne/click"]
    assert [(p.step, p.value) for p in history["loss"]] == [(0, 0.9), (10, 0.7), (20, 0.6)]
    assert isinstance(history["loss"][0], MetricPoint)
    # Once the trainer reported it, status.mlflow.runId decides.
    other = _run(mlflow_db, "someone-else", {"loss": [0.1]})
    kubeapi.patch_status(API, "GEMTraining", "tracked", {"phase": "Succeeded", "mlflow": {"runId": other}})
    assert [p.value for p in k8s.metrics("tracked", keys=["loss"])["loss"]] == [0.1]
    assert run_id != other
    with pytest.raises(NotFoundError, match="no metric nope"):
        k8s.metrics("tracked", keys=["nope"])
    # Without any tracking URI, and for a job that does not log to MLflow, the SDK says so.
    plain = GEMClient(KubernetesBackendConfig(kubeconfig=str(kubeapi.kubeconfig_path)))
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    with pytest.raises(ValidationError, match="no MLflow tracking URI"):
        plain.metrics("tracked")
    k8s.submit(manifest("untracked", mlflow={"enabled": False}))
    with pytest.raises(ValidationError, match="does not log to MLflow"):
        k8s.metrics("untracked")
    # gemctl
    r = gemctl("metrics", "gt", "tracked", "--kubeconfig", str(kubeapi.kubeconfig_path),
               "--mlflow-tracking-uri", mlflow_db)
    assert r.exit_code == 0, r.output
    assert "loss" in r.stdout and "0.1" in r.stdout
    r = gemctl("metrics", "gt", "tracked", "--kubeconfig", str(kubeapi.kubeconfig_path),
               "--mlflow-tracking-uri", mlflow_db, "-o", "json")
    assert json.loads(r.stdout)["loss"][0]["value"] == 0.1


# --------------------------------------------------------------------------- local: suspend and resume

# Checkpoints every step into GEM_CHECKPOINT_DIR and resumes from the newest one, as `gem train`.
RESUMABLE = r"""
import json, os, time
ckpt = os.environ["GEM_CHECKPOINT_DIR"]
total = int(os.environ.get("FAKE_STEPS", "60"))
rank = os.environ["RANK"]
done = sorted(int(n.split("-")[1]) for n in os.listdir(ckpt) if n.startswith("step-"))
start = done[-1] if done else 0
print("rank", rank, "resumed from", start, flush=True)
for step in range(start + 1, total + 1):
    time.sleep(0.1)
    if rank == "0":
        os.makedirs(os.path.join(ckpt, "step-%08d" % step), exist_ok=True)
    print("step step=%d total_steps=%d" % (step, total), flush=True)
if rank == "0":
    open(os.environ["GEM_TERMINATION_MESSAGE_PATH"], "w").write(json.dumps({
        "metrics": {"ne/click": 0.9}, "ne": 0.9, "step": total, "totalSteps": total,
        "checkpoint": os.path.join(ckpt, "step-%08d" % total)}))
"""


def resumable(steps: int = 60):
    def patch(job: dict) -> dict:
        for rs in job["spec"]["pytorchReplicaSpecs"].values():
            ctr = rs["template"]["spec"]["containers"][0]
            ctr["command"], ctr["args"] = [sys.executable, "-c", RESUMABLE], []
            ctr["env"].append({"name": "FAKE_STEPS", "value": str(steps)})
        return job

    return patch


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("GEM_HOME", str(tmp_path / "gemhome"))
    return tmp_path / "gemhome"


@pytest.fixture
def local(root):
    client = GEMClient(LocalBackendConfig(root=root))
    client.backend._patch_job = resumable()
    yield client
    for obj in client.list(all_namespaces=True):
        client.delete(obj)


def _pids(root: Path, name: str) -> list[int]:
    pods = store.read_yaml(root / "default" / "gemtrainings" / name / store.PODS_FILE) or {}
    return [int(p["metadata"]["annotations"]["gem.dev/local-pid"]) for p in pods.get("items", [])
            if p["metadata"]["annotations"].get("gem.dev/local-pid")]


def _checkpoints(root: Path) -> list[str]:
    claims = root / store.CLAIMS_DIR
    return sorted(p.name for p in claims.glob("*/step-*"))


def test_local_suspend_stops_the_processes_and_resume_continues_from_the_checkpoint(local, root):
    job = local.submit(manifest("long", nodes=2))
    local.wait(job, until="Running", timeout=60)
    deadline = time.monotonic() + 60
    while len(_checkpoints(root)) < 5:
        assert time.monotonic() < deadline, "the trainer never checkpointed"
        time.sleep(0.1)
    pids = _pids(root, "long")
    assert len(pids) == 2

    suspended = local.suspend("long")
    assert suspended.status.phase == "Suspended" and suspended.spec.suspend is True
    assert not any(_alive(pid) for pid in pids)  # every replica's process is gone
    assert local.pods("long") == [] and local.is_suspended("long")
    kept = len(_checkpoints(root))
    time.sleep(0.5)
    assert len(_checkpoints(root)) == kept  # nothing runs while suspended
    # Another process sees it suspended, and waiting does not mistake it for a dead supervisor.
    assert local.wait("long", until="Suspended", timeout=5).status.phase == "Suspended"

    local.resume("long")
    final = local.wait("long", timeout=120)
    assert final.status.phase == "Succeeded" and final.spec.suspend is False
    log = list(local.logs("long"))
    resumed_from = int(log[0].split()[-1])
    assert resumed_from >= kept - 1 > 0, log[:3]  # continued, not restarted from step 0
    conds = {c.type: c for c in final.status.conditions}
    assert conds["Suspended"].status == "False" and conds["Suspended"].reason == "PyTorchJobResumed"
    with pytest.raises(ValidationError, match="nothing to suspend"):
        local.suspend("long")


def test_local_submitted_suspended_waits_for_resume(local, root):
    local.submit(manifest("held", suspend=True))
    assert local.wait("held", until="Suspended", timeout=60).status.phase == "Suspended"
    assert _checkpoints(root) == []
    local.resume("held")
    assert local.wait("held", timeout=120).status.phase == "Succeeded"


def test_local_pods_update_and_gemctl(local, root, monkeypatch):
    local.backend._patch_job = resumable(steps=3)
    job = local.submit(manifest("small", nodes=2))
    final = local.wait(job, timeout=120)
    pods = local.pods("small")
    assert [(p.name, p.replica_type, p.index, p.phase, p.exit_code) for p in pods] == [
        ("small-train-master-0", "master", 0, "Succeeded", 0), ("small-train-worker-0", "worker", 0, "Succeeded", 0)]
    assert isinstance(pods[0], ReplicaPod) and json.loads(pods[0].message)["ne"] == 0.9
    lines = list(local.all_logs("small"))
    assert {p for p, _ in lines} == {"small-train-master-0", "small-train-worker-0"}
    updated = local.update("small", labels={"tier": "gold"}, annotations={"note": "x"})
    assert updated.metadata.labels == {"team": "ads", "tier": "gold"} and updated.status.phase == final.status.phase
    # gemctl, in another process's shoes (same GEM_HOME)
    r = gemctl("pods", "gt", "small", "--local")
    assert r.exit_code == 0 and "small-train-worker-0" in r.stdout and "Succeeded" in r.stdout
    assert yaml.safe_load(gemctl("pods", "gt", "small", "--local", "-o", "yaml").stdout)[1]["replicaType"] == "worker"
    r = gemctl("logs", "gt", "small", "--all-replicas", "--local")
    assert r.exit_code == 0 and "[small-train-worker-0] rank 1 resumed from 0" in r.stdout
    r = gemctl("suspend", "gt", "small", "--local")
    assert r.exit_code == 2 and "nothing to suspend" in r.stderr
    assert gemctl("resume", "gt", "ghost", "--local").exit_code == 3


def test_gemctl_suspend_and_resume_against_the_api_server(kubeapi):
    kc = str(kubeapi.kubeconfig_path)
    GEMClient(KubernetesBackendConfig(kubeconfig=kc)).submit(manifest("cli"))
    r = gemctl("suspend", "gt", "cli", "--kubeconfig", kc)
    assert r.exit_code == 0 and "gemtraining.gem.dev/cli suspended" in r.stdout
    assert kubeapi.get(API, "GEMTraining", "cli")["spec"]["suspend"] is True
    r = gemctl("resume", "gt", "cli", "--kubeconfig", kc, "-o", "json")
    assert r.exit_code == 0 and json.loads(r.stdout)["spec"]["suspend"] is False


def test_gemctl_wait_shows_progress_on_stderr(kubeapi):
    kc = str(kubeapi.kubeconfig_path)
    GEMClient(KubernetesBackendConfig(kubeconfig=kc)).submit(manifest("shown"))

    def later() -> None:
        time.sleep(0.5)
        kubeapi.patch_status(API, "GEMTraining", "shown", {
            "phase": "Running", "progress": {"step": 2, "totalSteps": 5, "percent": 40}})
        time.sleep(0.5)
        kubeapi.patch_status(API, "GEMTraining", "shown", {
            "phase": "Succeeded", "ne": 0.8, "progress": {"step": 5, "totalSteps": 5, "percent": 100}})

    threading.Thread(target=later, daemon=True).start()
    r = gemctl("wait", "gt", "shown", "--kubeconfig", kc, "--timeout", "60")
    assert r.exit_code == 0, r.output
    assert "gemtraining.gem.dev/shown Running 2/5 steps (40%)" in r.stderr
    assert "gemtraining.gem.dev/shown succeeded" in r.stdout and "Running" not in r.stdout
    quiet = gemctl("wait", "gt", "shown", "--kubeconfig", kc, "--no-progress")
    assert quiet.exit_code == 0 and quiet.stderr == ""
