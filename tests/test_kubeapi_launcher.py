"""gem.launcher: the training-operator env contract and local runs without any server."""

from __future__ import annotations

import sys
import time

import pytest

from gem.launcher import JobFailure, LocalPyTorchJob, RestartBackOff, training_operator_env
from gem.launcher.env import container_env
from gem.launcher.local import LOW_PORT, ephemeral_ports, restart_backoff_from_env
from tests.kubeapi.testing import pytorchjob


@pytest.fixture(autouse=True)
def _quick_restarts(monkeypatch):
    monkeypatch.setenv("GEM_LOCAL_RESTART_BACKOFF_S", "0")  # the 10 s default would slow restart tests


def test_env_contract_master_and_workers():
    job = pytorchjob("j", ["x"], workers=3, nprocPerNode="4")
    env = dict(training_operator_env(job, "Worker", 2))
    assert env == {"PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456", "MASTER_ADDR": "j-master-0",
                   "PET_MASTER_ADDR": "j-master-0", "WORLD_SIZE": "16", "RANK": "3", "PET_NODE_RANK": "3",
                   "PET_NPROC_PER_NODE": "4", "PET_NNODES": "4"}
    names = [k for k, _ in training_operator_env(job, "Master", 0, "127.0.0.1", 5555)]
    assert names == ["PYTHONUNBUFFERED", "MASTER_PORT", "PET_MASTER_PORT", "MASTER_ADDR", "PET_MASTER_ADDR", "WORLD_SIZE",
                     "RANK", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_NNODES"]
    # nprocPerNode defaults to "auto", which counts as 1 in WORLD_SIZE
    dflt = dict(training_operator_env(pytorchjob("k", ["x"], workers=1), "Master", 0))
    assert dflt["PET_NPROC_PER_NODE"] == "auto" and dflt["WORLD_SIZE"] == "2"
    # worker-only jobs get no master variables
    wonly = dict(training_operator_env(pytorchjob("w", None, ["x"], workers=2), "Worker", 0))
    assert wonly == {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "2"}


def test_elastic_env():
    job = pytorchjob("e", None, ["x"], workers=2, elasticPolicy={"minReplicas": 1, "maxReplicas": 3, "maxRestarts": 2,
                                                               "rdzvId": "r", "rdzvConf": [{"key": "a", "value": "b"}]})
    env = dict(training_operator_env(job, "Worker", 0))
    assert env["PET_RDZV_ENDPOINT"] == "e-worker-0:23456" and env["PET_RDZV_BACKEND"] == "c10d"
    assert env["PET_NNODES"] == "1:3" and env["PET_MAX_RESTARTS"] == "2" and env["PET_RDZV_CONF"] == "a=b"


def test_operator_vars_override_user_env_and_expand():
    c = {"env": [{"name": "RANK", "value": "99"}, {"name": "A", "value": "$(B)$$(C)"}, {"name": "B", "value": "b"}]}
    env = container_env(c, [("RANK", "0")])
    assert env["RANK"] == "0" and env["A"] == "$(B)$(C)"


def test_local_job_runs_and_fails_like_the_operator(tmp_path):
    script = "import os, sys; print(os.environ['RANK']); sys.exit(int(os.environ['RANK']) == 2)"
    # No backoffLimit: the failing worker restarts until the master's success ends the job. With a
    # limit, which exit the poll saw first would decide (CI once saw the worker's: "Failed").
    job = pytorchjob("loc", ["python", "-c", script], workers=2)
    with LocalPyTorchJob(job, tmp_path) as run:
        run.start()
        assert run.wait(timeout=30) == "Succeeded"  # the master decides
        assert run.logs("loc-master-0") == "0\n"
    job = pytorchjob("loc", [sys.executable, "-c", "raise SystemExit(4)"], run_policy={"backoffLimit": 1})
    with LocalPyTorchJob(job, tmp_path / "2") as run:
        run.start()
        assert run.wait(timeout=30) == "Failed"
        # backoffLimit 1: the operator fails the job as the first restart's restartCount reaches 1
        assert run.pods["loc-master-0"].state.restart_count == 0 and run.pods["loc-master-0"].state.exit_code == 4


# The first `fails` runs exit with `code`, later ones succeed (the sandbox, so the count, survives restarts).
FLAKY = ("import pathlib, sys; p = pathlib.Path('runs'); n = len(p.read_text()) if p.exists() else 0; "
         "p.write_text('x' * (n + 1)); sys.exit({code} if n < {fails} else 0)")


@pytest.mark.parametrize(("policy", "limit", "fails", "code", "phase", "restarts"), [
    # OnFailure (what gem.api.render renders): v1.9 PastBackoffLimit fails the job once the pods'
    # summed restartCount is >= backoffLimit (> 0 for 0), so a limit of n allows n - 1 restarts.
    ("OnFailure", 3, 2, 1, "Succeeded", 2),
    ("OnFailure", 3, 3, 1, "Failed", 2),
    ("OnFailure", 1, 1, 1, "Failed", 0),
    ("OnFailure", 0, 1, 1, "Failed", 0),
    ("OnFailure", None, 3, 1, "Succeeded", 3),  # no limit: restarts go on
    # ExitCode recreations (exit >= 128) are outside that rule: up to backoffLimit of them
    ("ExitCode", 1, 1, 137, "Succeeded", 1),
    ("ExitCode", 1, 2, 137, "Failed", 1),
])
def test_backoff_limit_counts_restarts_like_training_operator(tmp_path, policy, limit, fails, code, phase, restarts):
    run_policy = {} if limit is None else {"backoffLimit": limit}
    job = pytorchjob("bo", [sys.executable, "-c", FLAKY.format(code=code, fails=fails)], restart_policy=policy,
                     run_policy=run_policy)
    with LocalPyTorchJob(job, tmp_path) as run:
        run.start()
        assert run.wait(timeout=30, interval=0.02) == phase
        assert run.pods["bo-master-0"].state.restart_count == restarts == run.restarts


@pytest.mark.parametrize(("limit", "restarts"), [(0, 0), (1, 0), (2, 1), (3, 2)])
def test_a_worker_that_always_fails_makes_limit_minus_one_restarts(tmp_path, limit, restarts):
    job = pytorchjob("wf", [sys.executable, "-c", "import time; time.sleep(60)"],
                     worker=[sys.executable, "-c", "raise SystemExit(1)"], workers=1, run_policy={"backoffLimit": limit})
    with LocalPyTorchJob(job, tmp_path) as run:
        run.start()
        assert run.wait(timeout=30, interval=0.02) == "Failed"
        assert run.pods["wf-worker-0"].state.restart_count == restarts == run.restarts
        failure = run.failure_now()
        assert failure.reason == "BackoffLimitExceeded"
        assert failure.message == f"backoffLimit {limit} reached after {restarts} restart(s)"
        assert run.pods["wf-master-0"].state.phase == "Running"


def test_restart_back_off_is_the_kubelets_crash_loop_back_off():
    backoff = RestartBackOff(10.0)
    assert [backoff.next(ran_s=1.0) for _ in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert backoff.next(ran_s=600.0) == 10  # a container that ran 10 min starts the back-off afresh
    assert backoff.next(ran_s=1.0) == 20
    assert restart_backoff_from_env({}) == 10.0 and restart_backoff_from_env({"GEM_LOCAL_RESTART_BACKOFF_S": "0.5"}) == 0.5
    for bad in ("-1", "nan", "inf", "10s"):
        with pytest.raises(ValueError, match=f"GEM_LOCAL_RESTART_BACKOFF_S='{bad}' is not a number of seconds >= 0"):
            restart_backoff_from_env({"GEM_LOCAL_RESTART_BACKOFF_S": bad})


def test_a_failed_replica_is_not_restarted_before_its_back_off(tmp_path):
    """poll() restarted a failed replica at once; it waits out its back-off now, its log in place."""
    job = pytorchjob("cl", [sys.executable, "-c", "print('why it failed'); raise SystemExit(3)"],
                     run_policy={"backoffLimit": 3})
    with LocalPyTorchJob(job, tmp_path, restart_backoff=600) as run:
        run.start()
        pod = run.pods["cl-master-0"]
        pod.proc.wait(30)
        for _ in range(3):
            assert run.poll()["cl-master-0"].phase == "Failed" and run.phase_now() == "Running"
        assert pod.state.restart_count == 0 and pod.state.exit_code == 3
        assert run.logs("cl-master-0") == "why it failed\n"


def _gpu_job(gpus: str, workers: int = 1) -> dict:
    job = pytorchjob("g", [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                     workers=workers)
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        rs["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    return job


def test_each_replica_gets_gpus_of_its_own(tmp_path, monkeypatch):
    """Every replica saw every GPU, so each one's local rank 0 took GPU 0 (NCCL: duplicate GPU);
    as the device plugin does, each gets the GPUs it asks for, from CUDA_VISIBLE_DEVICES's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with LocalPyTorchJob(_gpu_job("2"), tmp_path) as run:
        run.start()
        assert run.wait(timeout=30) == "Succeeded"
        assert run.logs("g-master-0") == "4,5\n" and run.logs("g-worker-0") == "6,7\n"
    with LocalPyTorchJob(_gpu_job("1"), tmp_path / "uuids", gpus=["GPU-a", "GPU-b"]) as run:
        assert dict(run.pods["g-worker-0"].extra_env)["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    with pytest.raises(ValueError, match=r"ask for 6 nvidia.com/gpu together .* this machine has 4 for them"):
        LocalPyTorchJob(_gpu_job("2", workers=2), tmp_path / "short")


# A replica that starts a worker in a session of its own, as torchrun starts its workers (torch's
# SubprocessHandler: start_new_session=True), and ignores SIGTERM for a while, as a trainer may.
SPAWNS_WORKER = ("import os, subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', "
                 "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'], "
                 "start_new_session=True); open('worker.pid', 'w').write(str(w.pid)); time.sleep(120)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_leaves_no_worker_of_a_replica_behind(tmp_path):
    """stop() signalled the replica's process group only: torchrun's workers (sessions of their own)
    outlived it, holding GPUs and ports. As the kubelet kills the container's every process, stop
    kills every process that runs in the pod's sandbox."""
    job = pytorchjob("orph", [sys.executable, "-c", SPAWNS_WORKER])
    run = LocalPyTorchJob(job, tmp_path)
    run.start()
    pid_file = tmp_path / "pods" / "orph-master-0" / "worker.pid"
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    assert _alive(worker)
    run.stop(grace=0.5)
    for _ in range(100):  # SIGKILL is delivered asynchronously
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


def test_rendezvous_ports_are_outside_the_ephemeral_range(tmp_path):
    """The master port came from bind(0): a port of the range the kernel gives every outgoing
    connection, which one (another local job's, MLflow's) could take before torchrun binds it."""
    lo, _ = ephemeral_ports()
    if lo - LOW_PORT < 1000:
        pytest.skip(f"this machine's ephemeral range starts at {lo}: no room below it")
    jobs = [LocalPyTorchJob(pytorchjob("p", ["true"]), tmp_path / str(i)) for i in range(20)]
    assert all(LOW_PORT <= job.master_port < lo for job in jobs), [job.master_port for job in jobs]
    env = dict(jobs[0].pods["p-master-0"].extra_env)
    assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == str(jobs[0].master_port)


def test_failure_now_names_the_replica_that_may_not_restart(tmp_path):
    job = pytorchjob("nv", [sys.executable, "-c", "raise SystemExit(2)"], restart_policy="Never",
                     run_policy={"backoffLimit": 3})
    with LocalPyTorchJob(job, tmp_path) as run:
        run.start()
        assert run.failure_now() is None
        assert run.wait(timeout=30, interval=0.02) == "Failed"
        assert run.failure_now() == JobFailure("ReplicaFailed", "nv-master-0 exited with code 2 (restartPolicy Never)")


# ConfigMap files: the mountPath rewrite keeps a YAML/JSON document's meaning (gem.launcher.local.rewrite_document)

CONFIG_YAML = """\
# the trainer's manifest, as gem.api.render writes it (plus a comment)
spec:
  checkpoint:
    path: /var/lib/gem/checkpoints  # the claim
  data:
    path: /var/lib/gem/checkpoints/data
  args: ["--out", "/var/lib/gem/checkpoints/x"]
"""


def _pod(tmp_path, claims_dir, files):
    from gem.launcher.local import LocalPod

    spec = {"containers": [{"name": "pytorch", "image": "x", "command": ["true"], "volumeMounts": [
                {"name": "config", "mountPath": "/etc/gem"},
                {"name": "ckpt", "mountPath": "/var/lib/gem/checkpoints"}]}],
            "volumes": [{"name": "config", "configMap": {"name": "cfg"}},
                        {"name": "ckpt", "persistentVolumeClaim": {"claimName": "x"}}]}
    pod = LocalPod("p-0", spec, tmp_path / "sandbox", configmaps={"cfg": files}, claims_dir=claims_dir)
    pod.environment()  # materialises the volumes
    return pod, tmp_path / "sandbox" / "volumes" / "config"


@pytest.mark.parametrize("dirname", ["run #1", "run: 1", "it's \"q\"", "plain"])
def test_configmap_yaml_paths_read_back_as_the_local_directory(tmp_path, dirname):
    import json

    import yaml

    claims = tmp_path / dirname / "claims"
    local = str(claims / "x")
    files = {"config.yaml": CONFIG_YAML, "gem": CONFIG_YAML, "c.json": json.dumps({"path": "/var/lib/gem/checkpoints"}),
             "multi.yml": "a: /var/lib/gem/checkpoints\n---\n- /var/lib/gem/checkpoints/y\n"}
    _, vol = _pod(tmp_path, claims, files)
    for name in ("config.yaml", "gem"):  # a YAML file by suffix, or without one
        spec = yaml.safe_load((vol / name).read_text())["spec"]
        assert spec["checkpoint"]["path"] == local, (name, (vol / name).read_text())
        assert spec["data"]["path"] == local + "/data" and spec["args"] == ["--out", local + "/x"]
    assert json.loads((vol / "c.json").read_text()) == {"path": local}
    assert list(yaml.safe_load_all((vol / "multi.yml").read_text())) == [{"a": local}, [local + "/y"]]
    if dirname == "plain":  # replacing the text is right: the file keeps its comments and layout
        assert (vol / "config.yaml").read_text() == CONFIG_YAML.replace("/var/lib/gem/checkpoints", local)


def test_configmap_files_that_are_not_yaml_are_rewritten_as_text(tmp_path):
    claims = tmp_path / "run #1" / "claims"
    local = str(claims / "x")
    script = "#!/bin/sh\nexec gem train --out /var/lib/gem/checkpoints/a: b\n"
    files = {"run.sh": script, "notes": "see /var/lib/gem/checkpoints\n", "bad.yaml": "a: [/var/lib/gem/checkpoints\n",
             "blob.bin": b"\xff/var/lib/gem/checkpoints"}
    _, vol = _pod(tmp_path, claims, files)
    assert (vol / "run.sh").read_text() == script.replace("/var/lib/gem/checkpoints", local)
    assert (vol / "notes").read_text() == f"see {local}\n"
    assert (vol / "bad.yaml").read_text() == f"a: [{local}\n"  # not YAML after all: text, as before
    assert (vol / "blob.bin").read_bytes() == b"\xff/var/lib/gem/checkpoints"  # binary: untouched
