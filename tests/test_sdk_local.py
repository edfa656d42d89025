"""The SDK's local backend: jobs as processes under a root directory, no cluster.

The first part swaps the trainer for a small Python script (the backend's `_patch_job` hook) to
check the backend's own behaviour quickly; the last part runs the real `gem train` end to end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
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
if mode == "progress":  # the line gem train logs every 10 steps, then a long step
    print("INFO rank=0 gem.train: step step=30 total_steps=120 lr=0.001 examples_per_s=900 loss=0.6", flush=True)
    time.sleep(120)
if mode == "flaky" and not os.path.exists(os.path.join(ckpt, "tried")):
    open(os.path.join(ckpt, "tried"), "w").close()
    print("first attempt fails", flush=True)
    sys.exit(3)
if mode == "fail":
    open(report_path, "w").write(json.dumps({"error": "FileNotFoundError: data.path /no/such/dir does not exist"}))
    sys.exit(1)
if mode == "crash" or (mode == "crash-worker" and os.environ["RANK"] != "0"):
    sys.exit(1)  # no report: the status message is the job's own
if mode == "crash-worker":
    time.sleep(120)  # the master waits for its worker, which never comes
if mode == "flaky-worker":  # the worker fails its first attempt; the master waits then
    marker = os.path.join(ckpt, "tried-" + os.environ["RANK"])
    if not os.path.exists(marker):
        open(marker, "w").close()
        if os.environ["RANK"] != "0":
            sys.exit(3)
        time.sleep(120)
if mode.startswith("flaky:"):  # fails its first n attempts
    tries = len(os.listdir(ckpt))
    if tries < int(mode[6:]):
        open(os.path.join(ckpt, f"try-{tries}"), "w").close()
        sys.exit(3)
time.sleep(float(os.environ.get("FAKE_SECONDS", "0.3")))
os.makedirs(os.path.join(ckpt, "step-00000003"), exist_ok=True)
if os.environ["RANK"] == "0":
    open(report_path, "w").write(json.dumps({
        "metrics": {"ne/click": 0.91, "auc/click": 0.71, "ne/conversion": 0.95, "auc/conversion": 0.66},
        "ne": 0.93, "step": 3, "totalSteps": 3, "checkpoint": os.path.join(ckpt, "step-00000003"),
        "mlflowRunId": "abc123"}))
"""


def fake_trainer(mode: str = "ok", seconds: float = 0.3, run_policy: dict | None = None):
    def patch(job: dict) -> dict:
        if run_policy is not None:
            job["spec"]["runPolicy"] = run_policy
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
    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", "0.1")  # the 10 s default would slow restart tests
    return tmp_path / "gemhome"


@pytest.fixture
def client(root):
    c = GEMClient(LocalBackendConfig(root=root))
    yield c
    for obj in c.list(all_namespaces=True):  # never leave processes behind
        c.delete(obj)


def fake(client: GEMClient, mode: str = "ok", seconds: float = 0.3, run_policy: dict | None = None) -> GEMClient:
    client.backend._patch_job = fake_trainer(mode, seconds, run_policy)
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


def _pods(client: GEMClient, name: str) -> dict[str, dict]:
    d = store.job_dir(client.backend.root, "GEMTraining", "default", name)
    return {p["metadata"]["name"]: p["status"]["containerStatuses"][0]
            for p in yaml.safe_load((d / "pods.yaml").read_text())["items"]}


@pytest.mark.parametrize("backoff", ["0", "0.1"])  # 0: restarts at once
def test_backoff_limit_restarts_the_gang(client, monkeypatch, backoff):
    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", backoff)
    job = fake(client, "flaky-worker").submit(training("flaky", runPolicy={"backoffLimit": 2}))
    final = client.wait(job, timeout=60)
    assert final.status.phase == "Succeeded"
    restarting = next(c for c in final.status.conditions if c.type == "Restarting")
    assert restarting.status == "False"
    # the whole gang restarted, but only the replica that failed counts it, as on a cluster
    assert {n: cs["restartCount"] for n, cs in _pods(client, "flaky").items()} == {
        "flaky-train-master-0": 0, "flaky-train-worker-0": 1}
    logs = store.job_dir(client.backend.root, "GEMTraining", "default", "flaky") / "logs"
    assert (logs / "flaky-train-master-0.log.previous").exists() and (logs / "flaky-train-worker-0.log.previous").exists()


@pytest.mark.parametrize(("limit", "restarts"), [(0, 0), (1, 0), (2, 1), (3, 2)])
def test_backoff_limit_counts_restarts_like_training_operator(client, limit, restarts):
    """As training-operator v1.9 (and gem.launcher.local, and the test API server): a limit of n
    allows n - 1 restarts, none for 0 or 1."""
    job = fake(client, "crash").submit(training(f"crash{limit}", nodes=1, runPolicy={"backoffLimit": limit}))
    with pytest.raises(JobFailedError) as info:
        client.wait(job, timeout=60)
    assert info.value.reason == "PyTorchJobFailed"
    assert info.value.detail == (f"PyTorchJob crash{limit}-train is failed because 1 Master replica(s) failed "
                                 f"(backoffLimit {limit} reached after {restarts} restart(s)).")
    assert _pods(client, f"crash{limit}")[f"crash{limit}-train-master-0"]["restartCount"] == restarts


def test_backoff_limit_counts_only_the_failed_replicas_of_a_gang(client):
    job = fake(client, "crash-worker").submit(training("gang", runPolicy={"backoffLimit": 3}))
    with pytest.raises(JobFailedError, match=r"1 Worker replica\(s\) failed \(backoffLimit 3 reached after 2 restart"):
        client.wait(job, timeout=60)
    assert {n: cs["restartCount"] for n, cs in _pods(client, "gang").items()} == {
        "gang-train-master-0": 0, "gang-train-worker-0": 2}


def test_no_backoff_limit_means_no_limit(client):
    # training-operator v1.9 never fails a job whose runPolicy has no backoffLimit (GEM always sets one)
    job = fake(client, "flaky:4", run_policy={"cleanPodPolicy": "None"}).submit(training("unset", nodes=1))
    assert client.wait(job, timeout=60).status.phase == "Succeeded"
    assert _pods(client, "unset")["unset-train-master-0"]["restartCount"] == 4


def test_backoff_limit_exhausted(client):
    job = fake(client, "fail").submit(training("nope", runPolicy={"backoffLimit": 1}))
    with pytest.raises(JobFailedError, match="does not exist"):
        client.wait(job, timeout=60)


def test_a_failed_replica_waits_out_its_back_off_with_its_log_in_place(client, root, monkeypatch):
    """A container that failed at once was replaced at once (no CrashLoopBackOff), so `logs` and a
    follower could miss why it failed. Now the gang waits out a back-off, Restarting, the failed
    container terminated in pods.yaml and its log where `logs` reads it."""
    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", "600")
    job = fake(client, "flaky", seconds=60).submit(training("crashloop", nodes=1, runPolicy={"backoffLimit": 3}))
    restarting = client.wait(job, until=["Restarting"], timeout=30)
    cond = next(c for c in restarting.status.conditions if c.type == "Restarting")
    assert cond.message.endswith("(1 restart(s) counted, backoffLimit 3); back-off 600s before the restart.")
    state = _pods(client, "crashloop")["crashloop-train-master-0"]
    assert state["restartCount"] == 0 and state["state"]["terminated"]["exitCode"] == 3
    assert list(client.logs(job))[-1] == "first attempt fails"
    logs = store.job_dir(root, "GEMTraining", "default", "crashloop") / "logs"
    assert not (logs / "crashloop-train-master-0.log.previous").exists()
    assert client.get(job).status.phase == "Restarting"


def test_logs_previous_reads_the_container_that_failed(client, root, monkeypatch):
    """`logs(previous=True)` (gemctl logs -p) as `kubectl logs --previous`: while the gang waits out
    its back-off, the container that just failed; after the restart, the one before the current."""
    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", "600")
    job = fake(client, "flaky", seconds=60).submit(training("loop", nodes=1, runPolicy={"backoffLimit": 3}))
    client.wait(job, until=["Restarting"], timeout=30)
    assert list(client.logs(job, previous=True))[-1] == "first attempt fails"
    r = _gemctl("logs", "gt", "loop", "-p", "--local", root=root)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "first attempt fails", r.stderr

    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", "0.1")
    done = fake(client, "flaky").submit(training("again", nodes=1, runPolicy={"backoffLimit": 3}))
    assert client.wait(done, timeout=60).status.phase == "Succeeded"
    assert list(client.logs(done, previous=True))[-1] == "first attempt fails"
    assert "first attempt fails" not in list(client.logs(done))

    once = fake(client).submit(training("once", nodes=1))
    with pytest.raises(NotFoundError, match="pod once-train-master-0 of GEMTraining default/once has no previous "
                                            "container: it has not been restarted"):
        client.wait(once, timeout=60)
        list(client.logs(once, previous=True))


def test_a_bad_restart_back_off_setting_is_refused_at_submit(client, root, monkeypatch):
    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", "10s")
    with pytest.raises(ValidationError, match=r"GEM_LOCAL_RESTART_BACKOFF_S='10s' is not a number of seconds >= 0"):
        fake(client).submit(training("early", nodes=1))
    assert not (root / "default" / "gemtrainings" / "early").exists()


def test_local_replicas_get_gpus_of_their_own(client, root, monkeypatch):
    def print_gpus(job: dict) -> dict:
        for rs in job["spec"]["pytorchReplicaSpecs"].values():
            ctr = rs["template"]["spec"]["containers"][0]
            ctr["command"], ctr["args"] = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"], []
        return job

    client.backend._patch_job = print_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValidationError, match=r"spec.resources.gpusPerNode: the job's replicas ask for 2 nvidia.com/gpu"):
        client.submit(training("gpus", resources={"gpusPerNode": 1}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,7")
    job = client.submit(training("gpus", resources={"gpusPerNode": 1}))
    client.wait(job, timeout=60)
    assert dict(client.all_logs(job)) == {"gpus-train-master-0": "3", "gpus-train-worker-0": "7"}


def test_a_resume_the_environment_would_break_is_refused_and_stays_suspended(client, root, monkeypatch):
    job = fake(client).submit({**training("later", nodes=1), "spec": {**training("later", nodes=1)["spec"],
                                                                       "suspend": True}})
    client.wait(job, until=["Suspended"], timeout=30)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    client.backend._patch_job = None
    d = store.job_dir(root, "GEMTraining", "default", "later")
    pytorchjob = yaml.safe_load((d / "pytorchjob.yaml").read_text())
    for rs in pytorchjob["spec"]["pytorchReplicaSpecs"].values():
        rs["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
    store.write_yaml(d / "pytorchjob.yaml", pytorchjob)
    with pytest.raises(ValidationError, match="spec.resources.gpusPerNode: the job's replicas ask for 2"):
        client.resume(job)
    after = client.get(job)
    assert after.spec.suspend is True and after.status.phase == "Suspended"


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


def test_delete_after_a_crash_spares_the_processes_that_reuse_its_pids(client, root):
    """After a crash (or reboot), supervisor.pid and pods.yaml name pids the system may have given to
    other processes: delete SIGTERMed another job's supervisor that reused the pid, and SIGKILLed the
    process group of whatever reused a replica's pid."""
    fake(client, "sleep").submit(training("crashed", nodes=1))
    other = fake(client, "sleep").submit(training("other", nodes=1))
    client.wait("crashed", until=["Running"], timeout=30)
    client.wait(other, until=["Running"], timeout=30)
    d, other_d = (root / "default" / "gemtrainings" / n for n in ("crashed", "other"))
    pods = yaml.safe_load((d / "pods.yaml").read_text())
    os.kill(int((d / "supervisor.pid").read_text()), signal.SIGKILL)
    os.killpg(int(pods["items"][0]["metadata"]["annotations"]["gem.dev/local-pid"]), signal.SIGKILL)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        # the crashed job's pids, as the system handed them out again
        (d / "supervisor.pid").write_text((other_d / "supervisor.pid").read_text())
        pods["items"][0]["metadata"]["annotations"]["gem.dev/local-pid"] = str(stranger.pid)
        store.write_yaml(d / "pods.yaml", pods)
        client.delete("crashed")
        assert stranger.poll() is None, "delete killed a process that only reused a replica's pid"
        assert client.get(other).status.phase == "Running"
        assert _alive(int((other_d / "supervisor.pid").read_text()))
    finally:
        stranger.kill()
        stranger.wait()


# A replica that starts a worker in a session of its own, as torchrun does, which ignores SIGTERM.
SPAWNS_WORKER = ("import os, subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', "
                 "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'], "
                 "start_new_session=True); open('worker.pid', 'w').write(str(w.pid)); time.sleep(120)")


@pytest.mark.parametrize("supervisor", ["running", "killed"])
def test_delete_leaves_no_worker_behind(client, root, supervisor):
    """torchrun starts its workers in sessions of their own: delete killed the replica's process
    group and left them running (holding GPUs and ports), the supervisor alive or not."""
    def spawn_worker(job: dict) -> dict:
        ctr = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        ctr["command"], ctr["args"] = [sys.executable, "-c", SPAWNS_WORKER], []
        return job

    client.backend._patch_job = spawn_worker
    client.submit(training("workers", nodes=1))
    d = root / "default" / "gemtrainings" / "workers"
    pid_file = d / "pods" / "workers-train-master-0" / "worker.pid"
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    client.wait("workers", until=["Running"], timeout=30)
    if supervisor == "killed":
        os.kill(int((d / "supervisor.pid").read_text()), signal.SIGKILL)
    client.delete("workers")
    for _ in range(100):  # SIGKILL is delivered asynchronously
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


def test_a_root_named_through_a_symlink_sees_the_supervisor_running(client, root, tmp_path):
    job = fake(client, "sleep").submit(training("linked", nodes=1))
    client.wait(job, until=["Running"], timeout=30)
    (tmp_path / "link").symlink_to(root)
    other = GEMClient(LocalBackendConfig(root=tmp_path / "link"))
    with pytest.raises(WaitTimeoutError):  # not BackendError: "its supervisor exited"
        other.wait("linked", timeout=1)


def test_wait_on_a_job_without_status_says_what_to_check(client, root, monkeypatch):
    # submit writes the first status and the supervisor keeps it; a job without one (an object.yaml
    # written by hand, a supervisor that hangs before its first write) timed out with "(phase None)".
    monkeypatch.setattr(client.backend, "_spawn", lambda d: None)  # no supervisor
    client.submit(training("mute", nodes=1))
    d = root / "default" / "gemtrainings" / "mute"
    body = yaml.safe_load((d / "object.yaml").read_text())
    del body["status"]
    (d / "object.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(WaitTimeoutError) as info:
        client.wait("mute", timeout=0.3)
    assert "phase None" not in str(info.value)
    assert f"no status yet: no local supervisor was started for it ({d / 'supervisor.pid'} is missing)" in str(info.value)
    # A supervisor that runs but has written nothing: its log says why.
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "gem_sdk.backends.local.supervisor",
                              str(d)])
    try:
        (d / "supervisor.pid").write_text(str(stuck.pid))
        with pytest.raises(WaitTimeoutError) as info:
            client.wait("mute", timeout=0.3)
        assert (f"(no status yet: its local supervisor (pid {stuck.pid}, is running) has not written one; "
                f"check its log, {d / 'supervisor.log'})") in str(info.value)
    finally:
        (d / "supervisor.pid").unlink()
        stuck.kill()
        stuck.wait()


def test_follow_logs_until_the_pod_exits(client):
    job = fake(client, seconds=1.0).submit(training("follow", nodes=1))
    lines = list(client.logs(job, follow=True, timeout=30))
    assert lines[0] == "rank 0 of 1 on follow-train-master-0"
    assert client.get(job).status.phase in ("Running", "Succeeded")


def test_follow_ends_with_the_container_a_restart_replaces(client, root):
    """`logs -f` streams one container, as `kubectl logs -f` does: a restart (which moves the log
    to `.previous` once its process has exited) ends the stream after what that container wrote.
    It used to go on into the next container's log, or stop before it, depending on timing."""
    job = client.wait(fake(client).submit(training("tail", nodes=1)), timeout=60)
    d = store.job_dir(root, "GEMTraining", "default", "tail")
    log, pods_file = d / "logs" / "tail-train-master-0.log", d / "pods.yaml"
    terminated = yaml.safe_load(pods_file.read_text())
    running = yaml.safe_load(pods_file.read_text())
    running["items"][0]["status"]["containerStatuses"][0]["state"] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    store.write_yaml(pods_file, running)  # the container runs (its supervisor is done: nothing else writes)
    log.write_text("first\n")
    lines: list[str] = []

    def follow():
        for line in client.logs(job, follow=True, timeout=30):
            lines.append(line)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    for _ in range(100):
        if lines:
            break
        time.sleep(0.05)
    assert lines == ["first"]
    with open(log, "a") as f:
        f.write("last words\n")
    os.replace(log, f"{log}.previous")  # the restart: the old container has exited
    log.write_text("second container\n")
    time.sleep(1.0)
    store.write_yaml(pods_file, terminated)
    reader.join(10)
    assert not reader.is_alive()
    assert lines == ["first", "last words"]


def test_wait_does_not_follow_a_new_job_of_the_same_name(client):
    job = fake(client, "sleep").submit(training("again", nodes=1))
    swapped = []

    def swap(obj):
        if not swapped:  # deleted and submitted again while `wait` waits: another job
            swapped.append(obj.metadata.uid)
            client.delete("again")
            fake(client).submit(training("again", nodes=1))

    with pytest.raises(NotFoundError, match="was deleted while waiting"):
        client.wait(job, timeout=60, callback=swap)
    assert swapped == [job.metadata.uid] and client.get("again").metadata.uid != job.metadata.uid


def test_a_corrupt_job_does_not_break_list_and_delete_removes_it(client, root):
    fake(client).submit(training("good", nodes=1))
    jobs = root / "default" / "gemtrainings"
    (jobs / "broken").mkdir()
    (jobs / "broken" / "object.yaml").write_text("{{{ not yaml")
    (jobs / "empty").mkdir()
    (jobs / "empty" / "object.yaml").write_text("")
    (jobs / "half").mkdir()  # what a submit killed before it wrote object.yaml leaves
    (jobs / "half" / "configmap.yaml").write_text("{}")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert [o.metadata.name for o in client.list()] == ["good"]
    assert sorted(Path(str(w.message).split(" in ", 1)[1].split(":", 1)[0]).name for w in seen) == ["broken", "empty"]
    out = _gemctl("list", "--local", root=root)
    assert out.returncode == 0 and "good" in out.stdout and "skipping" in out.stderr, out.stderr
    with pytest.raises(BackendError, match="GEMTraining default/broken cannot be read: .*`delete` removes it"):
        client.get("broken")
    for name in ("broken", "empty", "half"):
        client.delete(name)
        assert not (jobs / name).exists()
        fake(client).submit(training(name, nodes=1))  # the name is free again


def test_a_stop_while_replicas_start_stops_every_replica(client, root, monkeypatch):
    """SIGTERM (what `delete` sends) arriving while the supervisor starts a replica: it used to
    interrupt subprocess.Popen, so the replica's LocalPod never learnt its process and nothing
    stopped it (`delete` right after `submit` left such orphans)."""
    from gem.launcher import local as launcher
    from gem_sdk.backends.local import supervisor

    monkeypatch.setattr(client.backend, "_spawn", lambda d: None)  # no detached supervisor: one here
    fake(client, "sleep").submit(training("sig", nodes=2))
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before Popen returns
            time.sleep(0.1)
        return proc

    previous = signal.signal(signal.SIGTERM, supervisor._on_signal)
    launcher.subprocess.Popen = popen
    try:
        assert supervisor.Supervisor(store.job_dir(root, "GEMTraining", "default", "sig"), root).main() == 0
        alive = [p.pid for p in started if p.poll() is None]
    finally:
        launcher.subprocess.Popen = real_popen
        signal.signal(signal.SIGTERM, previous)
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert len(started) >= 1 and alive == []


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


# What kube-apiserver's labels.Parse accepts, and matches, with the labels team=ads, tier=3
SELECTORS_KUBECTL_ACCEPTS = {
    "team=ads": True, "team==ads,tier": True, "tier>2": True, "tier<3": False, "!canary": True,
    "team in (ads, search)": True, "team notin (ads)": False, "team in ()": False, "team=": False,
    "example.com/team!=ads": True, "in in (notin)": False,
}
# ... and refuses: a trailing comma, a blank inside a value, bad keys and values, '>' on a non-integer
SELECTORS_KUBECTL_REFUSES = ["team=ads,", "team in (ads search)", "-team=ads", "a/b/team=ads", "team=-ads",
                             "x" * 64 + "=ads", "tier>high", "!team=ads", "team=ads=x", ","]


@pytest.mark.parametrize("selector", sorted(SELECTORS_KUBECTL_ACCEPTS))
def test_label_selectors_match_like_kube_apiserver(client, selector):
    """The local list parsed selectors with a regex: it refused `tier>2`, and took `team=ads,` or
    `team in (ads search)` (which kubectl refuses) for selectors."""
    fake(client).submit({**training("sel", nodes=1), "metadata": {"name": "sel", "labels": {"team": "ads", "tier": "3"}}})
    want = ["sel"] if SELECTORS_KUBECTL_ACCEPTS[selector] else []
    assert [o.metadata.name for o in client.list(label_selector=selector)] == want


@pytest.mark.parametrize("selector", SELECTORS_KUBECTL_REFUSES)
def test_a_selector_kube_apiserver_refuses_is_refused(client, selector):
    with pytest.raises(ValidationError, match=f"invalid label selector {re.escape(repr(selector))}: "):
        client.list(label_selector=selector)


def test_gemctl_list_names_a_malformed_selector_with_exit_2(root):
    out = _gemctl("list", "--local", "-l", "tier in (gold silver)", root=root)
    assert out.returncode == 2, out.stderr
    assert ("invalid label selector 'tier in (gold silver)': unable to parse requirement: "
            "found 'silver', expected: ',' or ')'") in out.stderr


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


# Specs pydantic accepts but the operator refuses (Valid=False, gem.api.validation): one field each.
NOT_RUNNABLE = {
    "name": (training("1abc", nodes=1), "metadata.name"),
    "node-selector": (training("ns", nodes=1, resources={"nodeSelector": {"/0": "x"}}),
                      "spec.resources.nodeSelector['/0']"),
    "checkpoint-path": (training("ck", nodes=1, checkpoint={"path": "relative/dir"}), "spec.checkpoint.path"),
    "reserved-mount": (training("rm", nodes=1, checkpoint={"path": "/dev/shm/ckpt"}), "spec.checkpoint.path"),
    "procs-gpus": (training("pg", resources={"gpusPerNode": 1}, parallelism={"numNodes": 1, "procsPerNode": 2}),
                   "spec.parallelism.procsPerNode"),
    "queue": (training("qn", nodes=1, scheduling={"queueName": "team queue"}), "spec.scheduling.queueName"),
}


@pytest.mark.parametrize("case", sorted(NOT_RUNNABLE))
def test_a_spec_the_operator_refuses_is_refused_at_submit(client, root, case):
    """The same verdict as on a cluster, in the operator's words: before, the local backend ran
    such a spec (and, with the stand-in trainer, reported Succeeded)."""
    from gem.api.types import parse_object
    from gem_operator.validation import runnable_problems

    body, path = NOT_RUNNABLE[case]
    operator_says = runnable_problems(parse_object({"apiVersion": "gem.dev/v1alpha1", **body}))
    assert [p.split(": ", 1)[0] for p in operator_says] == [path]
    with pytest.raises(ValidationError) as info:
        fake(client).submit(body)
    err = info.value
    assert [str(e) for e in err.errors] == operator_says and err.errors[0].path == path
    assert str(err).startswith(f"invalid GEMTraining default/{body['metadata']['name']}:")
    assert client.list(all_namespaces=True) == [] and not (root / "default").exists()


def test_gemctl_refuses_a_spec_the_operator_refuses_with_exit_2(root, tmp_path):
    spec = tmp_path / "bad.yaml"
    body = training("ok", nodes=1, checkpoint={"path": "relative/dir"},
                    resources={"nodeSelector": {"/0": "x"}})
    spec.write_text(yaml.safe_dump(body))
    out = _gemctl("submit", "-f", str(spec), "--local", root=root)
    assert out.returncode == 2, out.stderr
    assert "spec.resources.nodeSelector['/0']: '/0' is not a valid label key" in out.stderr
    assert "spec.checkpoint.path: 'relative/dir' must be an absolute path without ':'" in out.stderr


def test_a_contradicting_deepspeed_override_is_refused_at_submit(client, root, tmp_path):
    """The trainer refuses these at setup (exit 2): before, --local started the job and its pods failed."""
    body = training("ds", nodes=1, training={"steps": 3, "precision": "bf16", "deepspeed": {
        "gradient_accumulation_steps": 4, "bf16": {"enabled": False}}})
    with pytest.raises(ValidationError) as info:
        fake(client).submit(body)  # the stand-in trainer: on the old code it ran (and succeeded)
    assert [e.path for e in info.value.errors] == ["spec.training.deepspeed.gradient_accumulation_steps",
                                                  "spec.training.deepspeed.bf16"]
    assert client.list(all_namespaces=True) == [] and not (root / "default").exists()
    spec = tmp_path / "ds.yaml"
    spec.write_text(yaml.safe_dump(body))
    out = _gemctl("submit", "-f", str(spec), "--local", root=root)
    assert out.returncode == 2, out.stderr
    assert "spec.training.deepspeed.gradient_accumulation_steps: 4 differs from the trainer's 1" in out.stderr


def test_the_examples_pass_the_operators_checks_and_run_locally(client):
    """examples/*.yaml still submit (and run, with the stand-in trainer): the distillation after
    its teacher, the quickstart."""
    teacher = fake(client).submit(str(REPO / "examples" / "quickstart.yaml"))
    assert client.wait(teacher, timeout=60).status.phase == "Succeeded"
    student = fake(client).submit(str(REPO / "examples" / "loopfm-distill.yaml"))
    assert client.wait(student, timeout=60).status.phase == "Succeeded"


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
    """`gem train` for real: one tiny job that succeeds, one whose data is missing and one reading Parquet
    shards from a claim in spec.volumes, side by side (the trainer's start-up dominates, so they share it)."""
    from gem.api.types import SyntheticDataSpec
    from gem.data.parquet import write_synthetic

    ok = client.submit({"kind": "GEMTraining", "metadata": {"name": "tiny"}, "spec": TINY})
    bad_spec = {**TINY, "data": {"source": "parquet", "path": str(tmp_path / "no-such-shards")},
                "mlflow": {"enabled": False}}
    bad = client.submit({"kind": "GEMTraining", "metadata": {"name": "nodata"}, "spec": bad_spec})
    # the claim is a directory under <root>/claims locally; the pod sees it at its mountPath
    write_synthetic(SyntheticDataSpec.model_validate(TINY["data"]["synthetic"]), root / "claims/ads-logs/logs")
    claimed_spec = {**TINY, "data": {"source": "parquet", "path": "/data/logs"}, "mlflow": {"enabled": False},
                    "volumes": [{"claimName": "ads-logs", "mountPath": "/data"}]}
    claimed = client.submit({"kind": "GEMTraining", "metadata": {"name": "claimed"}, "spec": claimed_spec})

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
    try:
        assert client.wait(claimed, timeout=300).status.progress.step == 3
    except JobFailedError as e:
        pytest.fail(f"{e}\n--- master log ---\n" + "\n".join(client.logs("claimed"))[-4000:])
    out = _gemctl("list", "gt", "--local", root=root)
    assert out.returncode == 0, out.stderr
    assert "tiny" in out.stdout and "Succeeded" in out.stdout and "nodata" in out.stdout and "Failed" in out.stdout


def test_a_running_job_shows_the_progress_its_trainer_logs(client):
    """The trainer writes its termination report only at the end; while it runs, the local backend
    reads the progress line from the master's log, as the operator reads the master pod's log (before,
    PROGRESS stayed empty until the job ended)."""
    job = fake(client, "progress").submit(training("prog", nodes=1))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        progress = client.get(job.metadata.name).status.progress
        if progress is not None:
            break
        time.sleep(0.2)
    assert progress is not None and (progress.step, progress.total_steps, progress.percent) == (30, 120, 25)
    assert client.get(job.metadata.name).status.phase == "Running"
