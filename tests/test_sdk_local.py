"""The SDK's local backend: jobs as processes under a root directory, no cluster.

The first part swaps the trainer for a small Python script (the backend's `_patch_job` hook) to
check the backend's own behaviour quickly; the last part runs the real `gem train` end to end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gem_sdk import (
    AlreadyExistsError,
    BackendError,
    GEMClient,
    JobFailedError,
    LocalBackendConfig,
    NotFoundError,
    ValidationError,
    WaitTimeoutError,
)
from gem_sdk.backends.local import store
from gem_sdk.backends.local.backend import _alive

REPO = Path(__file__).resolve().parent.parent

# A stand-in trainer: prints, then writes the same termination report `gem train` does.
FAKE_TRAINER = r"""
import json, os, sys, time
report_path = os.environ["GEM_TERMINATION_MESSAGE_PATH"]
ckpt = os.environ["GEM_CHECKPOINT_DIR"]
mode = os.environ.get("FAKE_MODE", "ok")
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "on", os.environ["HOSTNAME"], flush=True)
print("mlflow", os.environ.get("MLFLOW_TRACKING_URI"), flush=True)
print("config", open(os.path.join("volumes", "config", "config.yaml")).read().count("kind:"), flush=True)
if mode == "sleep":
    time.sleep(120)
if mode == "flaky" and not os.path.exists(os.path.join(ckpt, "tried")):
    open(os.path.join(ckpt, "tried"), "w").close()
    print("first attempt fails", flush=True)
    sys.exit(3)
if mode == "fail":
    open(report_path, "w").write(json.dumps({"error": "FileNotFoundError: data.path /no/such/dir does not exist"}))
    sys.exit(1)
time.sleep(float(os.environ.get("FAKE_SECONDS", "0.3")))
os.makedirs(os.path.join(ckpt, "step-00000003"), exist_ok=True)
if os.environ["RANK"] == "0":
    open(report_path, "w").write(json.dumps({
        "metrics": {"ne/click": 0.91, "auc/click": 0.71, "ne/conversion": 0.95, "auc/conversion": 0.66},
        "ne": 0.93, "step": 3, "totalSteps": 3, "checkpoint": os.path.join(ckpt, "step-00000003"),
        "mlflowRunId": "abc123"}))
"""


def fake_trainer(mode: str = "ok", seconds: float = 0.3):
    def patch(job: dict) -> dict:
        for rs in job["spec"]["pytorchReplicaSpecs"].values():
            ctr = rs["template"]["spec"]["containers"][0]
            ctr["command"], ctr["args"] = [sys.executable, "-c", FAKE_TRAINER], []
            ctr["env"] += [{"name": "FAKE_MODE", "value": mode}, {"name": "FAKE_SECONDS", "value": str(seconds)}]
        return job

    return patch


def training(name: str = "quick", nodes: int = 2, **spec) -> dict:
    return {
        "apiVersion": "gem.dev/v1alpha1",
        "kind": "GEMTraining",
        "metadata": {"name": name, "labels": {"team": "ads"}},
        "spec": {"parallelism": {"numNodes": nodes}, "training": {"steps": 3}, **spec},
    }


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("GEM_HOME", str(tmp_path / "gemhome"))
    return tmp_path / "gemhome"


@pytest.fixture
def client(root):
    c = GEMClient(LocalBackendConfig(root=root))
    yield c
    for obj in c.list(all_namespaces=True):  # never leave processes behind
        c.delete(obj)


def fake(client: GEMClient, mode: str = "ok", seconds: float = 0.3) -> GEMClient:
    client.backend._patch_job = fake_trainer(mode, seconds)
    return client


def _gemctl(*args: str, root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GEM_HOME": str(root)}
    return subprocess.run([sys.executable, "-m", "gem_sdk.cli", *args], capture_output=True, text=True, env=env,
                          timeout=60)


# --------------------------------------------------------------------------- with a stand-in trainer


def test_submit_wait_and_another_process_sees_the_job(client, root):
    job = fake(client).submit(training())
    assert job.status.phase == "Created" and job.metadata.uid and job.metadata.generation == 1
    assert job.metadata.namespace == "default"
    final = client.wait(job, timeout=60)
    st = final.status
    assert st.phase == "Succeeded" and st.ne == pytest.approx(0.93)
    assert st.metrics["auc/click"] == pytest.approx(0.71)
    assert st.progress.percent == 100 and st.mlflow.run_id == "abc123"
    assert st.replicas["Master"].succeeded == 1 and st.replicas["Worker"].succeeded == 1
    assert {c.type for c in st.conditions} >= {"Valid", "Created", "Running", "Succeeded"}
    # the checkpoint went to a claim of the job's own, which survives the pods
    claim = final.spec.checkpoint.claim_name
    assert claim and Path(st.latest_checkpoint).is_dir()
    assert Path(st.latest_checkpoint).parent == root / "claims" / claim
    # a second process (gemctl) reads the same root
    out = _gemctl("list", "--local", "-o", "json", root=root)
    assert out.returncode == 0, out.stderr
    items = json.loads(out.stdout)["items"]
    assert [(i["metadata"]["name"], i["status"]["phase"]) for i in items] == [("quick", "Succeeded")]
    # on-disk layout
    d = root / "default" / "gemtrainings" / "quick"
    for f in ("object.yaml", "configmap.yaml", "pytorchjob.yaml", "pods.yaml", "supervisor.pid", "supervisor.log"):
        assert (d / f).exists(), f
    assert (d / "logs" / "quick-train-master-0.log").exists()


def test_the_job_runs_with_the_rendered_pytorchjob(client, root):
    job = fake(client).submit(training("env"))
    client.wait(job, timeout=60)
    lines = list(client.logs("env"))
    assert lines[0] == "rank 0 of 2 on env-train-master-0"
    assert lines[1] == f"mlflow sqlite:///{root}/mlflow.db"
    assert list(client.logs("env", replica="worker", index=0))[0] == "rank 1 of 2 on env-train-worker-0"
    rendered = yaml.safe_load((root / "default" / "gemtrainings" / "env" / "pytorchjob.yaml").read_text())
    assert rendered["kind"] == "PyTorchJob" and rendered["metadata"]["name"] == "env-train"
    assert rendered["status"]["conditions"][-1]["type"] == "Succeeded"
    with pytest.raises(NotFoundError, match="no pod env-train-worker-1"):
        client.logs("env", replica="worker", index=1)


def test_mlflow_uri_from_the_environment(client, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    client.wait(fake(client).submit(training("mlf", nodes=1)), timeout=60)
    assert "mlflow http://mlflow.example:5000" in list(client.logs("mlf"))


def test_failure_reports_the_trainer_error(client):
    job = fake(client, "fail").submit(training("bad", runPolicy={"backoffLimit": 0}))
    with pytest.raises(JobFailedError) as info:
        client.wait(job, timeout=60)
    err = info.value
    assert err.reason == "PyTorchJobFailed"
    assert "data.path /no/such/dir does not exist" in err.detail
    assert err.object.status.phase == "Failed"


def test_backoff_limit_restarts_the_gang(client):
    job = fake(client, "flaky").submit(training("flaky", runPolicy={"backoffLimit": 2}))
    final = client.wait(job, timeout=60)
    assert final.status.phase == "Succeeded"
    restarting = next(c for c in final.status.conditions if c.type == "Restarting")
    assert "restart 1 of 2" in restarting.message or restarting.status == "False"
    pods = yaml.safe_load((store.job_dir(client.backend.root, "GEMTraining", "default", "flaky") / "pods.yaml").read_text())
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 1 for p in pods["items"])


def test_backoff_limit_exhausted(client):
    job = fake(client, "fail").submit(training("nope", runPolicy={"backoffLimit": 1}))
    with pytest.raises(JobFailedError, match="does not exist"):
        client.wait(job, timeout=60)


def test_wait_times_out_and_delete_stops_the_processes(client, root):
    job = fake(client, "sleep").submit(training("sleepy"))
    running = client.wait(job, until=["Running"], timeout=30)
    assert running.status.phase == "Running"
    with pytest.raises(WaitTimeoutError) as info:
        client.wait(job, timeout=0.5)
    assert info.value.object.status.phase == "Running"
    d = root / "default" / "gemtrainings" / "sleepy"
    supervisor = int((d / "supervisor.pid").read_text())
    for _ in range(100):
        pods = (yaml.safe_load((d / "pods.yaml").read_text()) or {}).get("items", [])
        pids = [int(p["metadata"]["annotations"]["gem.dev/local-pid"]) for p in pods
                if p["metadata"]["annotations"]["gem.dev/local-pid"]]
        if len(pids) == 2:
            break
        time.sleep(0.1)
    assert len(pids) == 2
    client.delete(job)
    for pid in [supervisor, *pids]:
        assert not _alive(pid), pid  # gone (or a zombie waiting for init to reap it)
    assert not d.exists() and not (root / "claims" / job.spec.checkpoint.claim_name).exists()
    with pytest.raises(NotFoundError):
        client.get("sleepy")


def test_a_dead_supervisor_is_reported(client, root):
    job = fake(client, "sleep").submit(training("orphan", nodes=1))
    client.wait(job, until=["Running"], timeout=30)
    pid = int((root / "default" / "gemtrainings" / "orphan" / "supervisor.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(BackendError, match="supervisor .* exited without finishing"):
        client.wait(job, timeout=30)


def test_a_reused_supervisor_pid_is_not_taken_for_the_supervisor(client, root):
    job = fake(client, "sleep").submit(training("reused", nodes=1))
    client.wait(job, until=["Running"], timeout=30)
    pid_file = root / "default" / "gemtrainings" / "reused" / "supervisor.pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    pid_file.write_text(str(os.getpid()))  # after a crash or reboot the pid names another process
    with pytest.raises(BackendError, match="supervisor .* exited without finishing"):
        client.wait(job, timeout=10)


def test_follow_logs_until_the_pod_exits(client):
    job = fake(client, seconds=1.0).submit(training("follow", nodes=1))
    lines = list(client.logs(job, follow=True, timeout=30))
    assert lines[0] == "rank 0 of 1 on follow-train-master-0"
    assert client.get(job).status.phase in ("Running", "Succeeded")


def test_crud_errors_selectors_and_namespaces(client):
    fake(client).submit(training("a", nodes=1))
    fake(client).submit({**training("b", nodes=1), "metadata": {"name": "b", "labels": {"team": "search"}}},
                        namespace="other")
    with pytest.raises(AlreadyExistsError):
        client.submit(training("a", nodes=1))
    assert [o.metadata.name for o in client.list()] == ["a"]
    assert [o.metadata.name for o in client.list(all_namespaces=True)] == ["a", "b"]
    assert [o.metadata.name for o in client.list(all_namespaces=True, label_selector="team=search")] == ["b"]
    assert client.list(kind="lfd") == []
    assert client.get("b", namespace="other").metadata.namespace == "other"
    with pytest.raises(NotFoundError):
        client.get("b")
    with pytest.raises(ValidationError):
        client.submit({**training("c"), "spec": {"training": {"steps": 0}}})
    assert not (client.backend.root / "default" / "gemtrainings" / "c").exists()


def test_distillation_teacher_is_resolved_locally(client, root):
    student = {"kind": "LoopFMDistill", "metadata": {"name": "student"},
               "spec": {"teacher": {"gemTraining": "teacher"}, "parallelism": {"numNodes": 1}}}
    with pytest.raises(NotFoundError, match="teacher GEMTraining default/teacher .* not found"):
        client.submit(student)
    fake(client, "sleep").submit(training("teacher", nodes=1))
    with pytest.raises(ValidationError, match="is (Created|Running): it must have succeeded"):
        client.submit(student)
    client.delete("teacher")
    teacher = client.wait(fake(client).submit(training("teacher", nodes=1)), timeout=60)
    job = fake(client).submit(student)
    cm = yaml.safe_load((root / "default" / "loopfmdistills" / "student" / "configmap.yaml").read_text())
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["spec"]["teacher"] == {"checkpoint": teacher.status.latest_checkpoint}
    assert client.wait(job, timeout=60).status.phase == "Succeeded"


# --------------------------------------------------------------------------- the real trainer


def _trainer_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("gem.cli") is not None or importlib.util.find_spec("gem.__main__") is not None
    except ImportError:
        return False


real_trainer = pytest.mark.skipif(not _trainer_available(), reason="`gem train` (gem.cli) is not there yet")

TINY = {
    "model": {"preset": "tiny"},
    "data": {"synthetic": {"numUsers": 50, "numAds": 20, "numTrainExamples": 256, "numEvalExamples": 128,
                           "meanHistoryLen": 8}},
    "training": {"steps": 3, "batchSize": 32, "warmupSteps": 1},
    "parallelism": {"numNodes": 1, "zeroStage": 0},
    "checkpoint": {"everySteps": 3},
    "runPolicy": {"backoffLimit": 0},
}


@real_trainer
def test_real_trainer_end_to_end(client, root, tmp_path):
    """`gem train` for real: one tiny job that succeeds and one whose data is missing, side by side
    (the trainer's start-up dominates, so they share it)."""
    ok = client.submit({"kind": "GEMTraining", "metadata": {"name": "tiny"}, "spec": TINY})
    bad_spec = {**TINY, "data": {"source": "parquet", "path": str(tmp_path / "no-such-shards")},
                "mlflow": {"enabled": False}}
    bad = client.submit({"kind": "GEMTraining", "metadata": {"name": "nodata"}, "spec": bad_spec})

    with pytest.raises(JobFailedError) as info:
        client.wait(bad, timeout=300)
    detail = info.value.detail
    assert detail.startswith("trainer failed:") and ("no-such-shards" in detail or "parquet" in detail), detail

    try:
        final = client.wait(ok, timeout=300)
    except JobFailedError as e:
        pytest.fail(f"{e}\n--- master log ---\n" + "\n".join(client.logs("tiny"))[-4000:])
    st = final.status
    assert st.phase == "Succeeded" and st.ne is not None and st.ne > 0
    assert {"ne/click", "auc/click", "ne/conversion"} <= set(st.metrics)
    assert st.progress.step == 3 and st.progress.percent == 100
    assert st.latest_checkpoint and Path(st.latest_checkpoint).exists()
    assert str(root / "claims") in st.latest_checkpoint
    assert st.mlflow and st.mlflow.run_id and (root / "mlflow.db").exists()  # the default local store
    out = _gemctl("list", "gt", "--local", root=root)
    assert out.returncode == 0, out.stderr
    assert "tiny" in out.stdout and "Succeeded" in out.stdout and "nodata" in out.stdout and "Failed" in out.stdout
