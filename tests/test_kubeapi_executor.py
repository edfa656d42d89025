"""The PyTorchJob executor: training-operator v1.9 semantics with pods as local processes."""

from __future__ import annotations

import json
import os
import sys

import psutil
import pytest
from kubernetes import client

from tests.kubeapi.testing import condition, pytorchjob, wait_for

PY = sys.executable
BASE_KEYS = {"PATH", "HOSTNAME", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "PYTHONPATH", "VIRTUAL_ENV",
             "SYSTEMROOT", "USER"}
DUMP_ENV = ["python", "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
JOBS = ("kubeflow.org/v1", "PyTorchJob")


def job_cond(kubeapi, name, ctype, timeout=30):
    return wait_for(lambda: condition(kubeapi.get(*JOBS, name), ctype), timeout, what=f"{name} {ctype}")


def pid_of(kubeapi, pod):
    def get():
        p = kubeapi.get("v1", "Pod", pod)
        for cs in ((p or {}).get("status") or {}).get("containerStatuses") or []:
            if "running" in cs["state"]:
                return int(cs["containerID"].rsplit("/", 1)[1])
        return None

    return wait_for(get, what=f"{pod} running")


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_env_contract_labels_and_services(kubeapi):
    core = client.CoreV1Api(kubeapi.api_client())
    core.create_namespaced_secret("default", {"metadata": {"name": "creds"}, "stringData": {"token": "s3cr3t"}})
    core.create_namespaced_config_map("default", {"metadata": {"name": "cfg"}, "data": {"LEVEL": "debug", "X": "1"}})
    extra = {"env": [{"name": "PLAIN", "value": "v"}, {"name": "REF", "value": "$(PLAIN)-x"},
                     {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                     {"name": "LVL", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "LEVEL"}}},
                     {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
             "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}]}
    body = pytorchjob("envjob", DUMP_ENV, workers=2, nprocPerNode="2", extra_container=extra)
    kubeapi.create(*JOBS, body)
    job_cond(kubeapi, "envjob", "Succeeded")
    envs = {}
    for pod in ("envjob-master-0", "envjob-worker-0", "envjob-worker-1"):
        log = core.read_namespaced_pod_log(pod, "default", _preload_content=False).data.decode()  # raw: JSON text
        envs[pod] = {k: v for k, v in json.loads(log).items() if k not in BASE_KEYS}
    port = envs["envjob-master-0"]["MASTER_PORT"]
    assert port != "23456" and int(port) > 0
    for pod, rank in (("envjob-master-0", "0"), ("envjob-worker-0", "1"), ("envjob-worker-1", "2")):
        assert envs[pod] == {
            "PLAIN": "v", "REF": "v-x", "TOKEN": "s3cr3t", "LVL": "debug", "POD": pod, "CFG_LEVEL": "debug", "CFG_X": "1",
            "PYTHONUNBUFFERED": "1", "MASTER_PORT": port, "PET_MASTER_PORT": port, "MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "6", "RANK": rank, "PET_NODE_RANK": rank,
            "PET_NPROC_PER_NODE": "2", "PET_NNODES": "3",
        }, pod
    # the Pod objects carry the cluster values, like the real operator writes them
    master = kubeapi.get("v1", "Pod", "envjob-master-0")
    penv = {e["name"]: e.get("value") for e in master["spec"]["containers"][0]["env"]}
    assert penv["MASTER_ADDR"] == "envjob-master-0" and penv["MASTER_PORT"] == "23456"
    assert master["metadata"]["labels"] == {
        "training.kubeflow.org/job-name": "envjob", "training.kubeflow.org/operator-name": "pytorchjob-controller",
        "training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0",
        "training.kubeflow.org/job-role": "master"}
    ref = master["metadata"]["ownerReferences"][0]
    assert ref["kind"] == "PyTorchJob" and ref["controller"] is True and ref["uid"] == kubeapi.get(*JOBS, "envjob")["metadata"]["uid"]
    svc = kubeapi.get("v1", "Service", "envjob-master-0")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == 23456
    # The job succeeds with its master (the training operator's default success policy); the
    # workers' exits are counted as the executor reaps them, which may be a moment later.
    st = wait_for(lambda: (s := kubeapi.get(*JOBS, "envjob")["status"])["replicaStatuses"].get("Worker", {})
                  .get("succeeded") == 2 and s, what="both workers counted as succeeded")
    assert st["replicaStatuses"]["Master"]["succeeded"] == 1
    assert st["startTime"] and st["completionTime"]
    types = [c["type"] for c in st["conditions"]]
    assert types[0] == "Created" and types[-1] == "Succeeded"
    succ = condition({"status": st}, "Succeeded")
    assert succ["reason"] == "PyTorchJobSucceeded" and succ["message"] == "PyTorchJob envjob is successfully completed."


def test_mounts_termination_message_and_pvc(kubeapi, tmp_path):
    hostdir = tmp_path / "host"
    hostdir.mkdir()
    kubeapi.create("v1", "ConfigMap", {"metadata": {"name": "gemcfg"}, "data": {
        "config.yaml": "checkpoint: /var/lib/gem/checkpoints/run\n"}})
    script = (
        "import os, pathlib\n"
        "cfg = pathlib.Path('/etc/gem/config.yaml').read_text()\n"
        "ckpt = cfg.split(': ')[1].strip()\n"
        "pathlib.Path(ckpt).mkdir(parents=True, exist_ok=True)\n"
        "pathlib.Path(ckpt, 'weights').write_text('w')\n"
        "pathlib.Path('/scratch/tmp').write_text('s')\n"
        "pathlib.Path(os.environ['HOSTOUT'], 'seen').write_text(os.environ['CKPT'])\n"
        "open('/dev/termination-log', 'w').write('{\"ne\": 0.5}')\n"
        "print('cwd', os.getcwd())\n"
    )
    volumes = [{"name": "config", "configMap": {"name": "gemcfg"}}, {"name": "scratch", "emptyDir": {}},
               {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt-claim"}},
               {"name": "host", "hostPath": {"path": str(hostdir)}}]
    mounts = [{"name": "config", "mountPath": "/etc/gem"}, {"name": "scratch", "mountPath": "/scratch"},
              {"name": "ckpt", "mountPath": "/var/lib/gem/checkpoints"}, {"name": "host", "mountPath": "/hostout"}]
    body = pytorchjob("mnt", ["python", "-c", script], volumes=volumes, extra_container={
        "volumeMounts": mounts, "env": [{"name": "HOSTOUT", "value": "/hostout"},
                                        {"name": "CKPT", "value": "/var/lib/gem/checkpoints/run"}]})
    kubeapi.create(*JOBS, body)
    job_cond(kubeapi, "mnt", "Succeeded")
    pod = kubeapi.get("v1", "Pod", "mnt-master-0")
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term == {**term, "exitCode": 0, "reason": "Completed", "message": '{"ne": 0.5}'}
    claim = kubeapi.workdir / "claims" / "default" / "ckpt-claim"
    assert (claim / "run" / "weights").read_text() == "w"
    assert (hostdir / "seen").read_text() == str(claim / "run")


def test_failure_restarts_until_backoff_limit(kubeapi):
    body = pytorchjob("crash", ["python", "-c", "import sys; print('boom'); sys.exit(3)"],
                      run_policy={"backoffLimit": 3}, extra_container={"terminationMessagePolicy": "FallbackToLogsOnError"})
    kubeapi.create(*JOBS, body)
    failed = job_cond(kubeapi, "crash", "Failed")
    assert failed["reason"] == "PyTorchJobFailed"
    assert failed["message"] == "Job crash has failed because it has reached the specified backoff limit"
    pod = kubeapi.get("v1", "Pod", "crash-master-0")
    cs = pod["status"]["containerStatuses"][0]
    assert cs["restartCount"] == 2 and pod["status"]["phase"] == "Failed"  # a limit of n allows n - 1
    assert cs["state"]["terminated"]["exitCode"] == 3 and cs["state"]["terminated"]["message"] == "boom\n"
    running = condition(kubeapi.get(*JOBS, "crash"), "Running")
    assert running is None  # set to False by the terminal condition


@pytest.mark.parametrize(("limit", "restarts"), [(0, 0), (1, 0), (2, 1), (3, 2)])
def test_a_worker_that_always_fails_makes_limit_minus_one_restarts(kubeapi, limit, restarts):
    # training-operator v1.9 PastBackoffLimit, as gem.launcher.local and the SDK's supervisor count
    body = pytorchjob("wf", ["python", "-c", "import time; time.sleep(60)"], worker=["python", "-c", "raise SystemExit(1)"],
                      workers=1, run_policy={"backoffLimit": limit, "cleanPodPolicy": "Running"})
    kubeapi.create(*JOBS, body)
    failed = job_cond(kubeapi, "wf", "Failed")
    assert failed["message"] == "Job wf has failed because it has reached the specified backoff limit"
    worker = kubeapi.get("v1", "Pod", "wf-worker-0")["status"]
    assert worker["phase"] == "Failed" and worker["containerStatuses"][0]["restartCount"] == restarts


def test_restart_policy_never_fails_at_once(kubeapi):
    kubeapi.create(*JOBS, pytorchjob("never", ["python", "-c", "raise SystemExit(1)"], restart_policy="Never",
                                     run_policy={"backoffLimit": 5}))
    failed = job_cond(kubeapi, "never", "Failed")
    assert failed["message"] == "PyTorchJob never is failed because 1 Master replica(s) failed."
    assert kubeapi.get("v1", "Pod", "never-master-0")["status"]["containerStatuses"][0]["restartCount"] == 0


def test_exit_code_policy_recreates_on_retryable_codes(kubeapi, tmp_path):
    marker = tmp_path / "attempts"
    script = (f"import os, pathlib; p = pathlib.Path({str(marker)!r}); n = int(p.read_text()) if p.exists() else 0; "
              "p.write_text(str(n + 1)); os._exit(137 if n == 0 else 0)")
    kubeapi.create(*JOBS, pytorchjob("ec", ["python", "-c", script], restart_policy="ExitCode", run_policy={"backoffLimit": 3}))
    job_cond(kubeapi, "ec", "Succeeded")
    conds = kubeapi.get(*JOBS, "ec")["status"]["conditions"]
    assert "Restarting" not in [c["type"] for c in conds if c["status"] == "True"]
    evs = [e["reason"] for e in kubeapi.events(involved_name="ec")]
    assert "PyTorchJobRestarting" in evs and marker.read_text() == "2"
    kubeapi.create(*JOBS, pytorchjob("ec2", ["python", "-c", "raise SystemExit(2)"], restart_policy="ExitCode",
                                     run_policy={"backoffLimit": 3}))
    job_cond(kubeapi, "ec2", "Failed")


def test_suspend_stops_and_resume_restarts(kubeapi):
    kubeapi.create(*JOBS, pytorchjob("sus", ["python", "-c", "import time; time.sleep(60)"], workers=1))
    pid = pid_of(kubeapi, "sus-master-0")
    job_cond(kubeapi, "sus", "Running")
    custom = client.CustomObjectsApi(kubeapi.api_client())
    custom.patch_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", "sus", {"spec": {"runPolicy": {"suspend": True}}})
    c = job_cond(kubeapi, "sus", "Suspended")
    assert c["reason"] == "PyTorchJobSuspended" and c["message"] == "PyTorchJob sus is suspended."
    wait_for(lambda: not kubeapi.list("v1", "Pod"), what="pods deleted")
    wait_for(lambda: gone(pid), what="process killed")
    custom.patch_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", "sus", {"spec": {"runPolicy": {"suspend": False}}})
    pid2 = pid_of(kubeapi, "sus-master-0")
    assert pid2 != pid
    st = kubeapi.get(*JOBS, "sus")["status"]
    resumed = next(c for c in st["conditions"] if c["type"] == "Suspended")
    assert resumed["status"] == "False" and resumed["reason"] == "PyTorchJobResumed"


@pytest.mark.parametrize("policy", ["Running", "None", "All"])
def test_clean_pod_policy(kubeapi, policy, tmp_path):
    go = tmp_path / "go"
    master = ["python", "-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)"]
    body = pytorchjob("cl", master, worker=["python", "-c", "import time; time.sleep(60)"], workers=1,
                      run_policy={"cleanPodPolicy": policy})
    kubeapi.create(*JOBS, body)
    worker_pid = pid_of(kubeapi, "cl-worker-0")
    go.write_text("")
    job_cond(kubeapi, "cl", "Succeeded")
    if policy == "None":
        kubeapi.get("v1", "Pod", "cl-worker-0")
        assert not gone(worker_pid)
        assert kubeapi.get("v1", "Pod", "cl-master-0")["status"]["phase"] == "Succeeded"
    else:
        wait_for(lambda: kubeapi.get("v1", "Pod", "cl-worker-0") is None, what="running pod deleted")
        wait_for(lambda: gone(worker_pid), what="worker killed")
        master = kubeapi.get("v1", "Pod", "cl-master-0")
        assert (master is None) == (policy == "All")


def test_deleting_the_job_kills_its_processes(kubeapi):
    kubeapi.create(*JOBS, pytorchjob("del", ["python", "-c", "import subprocess, time; "
                                             "subprocess.Popen(['sleep', '60']); time.sleep(60)"], workers=1))
    pid = pid_of(kubeapi, "del-master-0")
    wait_for(lambda: psutil.Process(pid).children(), what="grandchild started")
    child = psutil.Process(pid).children()[0].pid
    client.CustomObjectsApi(kubeapi.api_client()).delete_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", "del")
    wait_for(lambda: not kubeapi.list("v1", "Pod") and not kubeapi.list("v1", "Service"), what="GC of pods and services")
    wait_for(lambda: gone(pid) and gone(child), what="process group killed")


def test_active_deadline(kubeapi):
    kubeapi.create(*JOBS, pytorchjob("dl", ["python", "-c", "import time; time.sleep(60)"],
                                     run_policy={"activeDeadlineSeconds": 2, "cleanPodPolicy": "Running"}))
    pid = pid_of(kubeapi, "dl-master-0")
    c = job_cond(kubeapi, "dl", "Failed", timeout=15)
    assert c["message"] == "Job dl has failed because it was active longer than specified deadline"
    wait_for(lambda: gone(pid), what="killed after the deadline")


def test_log_follow_and_tail(kubeapi):
    kubeapi.create(*JOBS, pytorchjob("lg", ["python", "-c", "import time\nfor i in range(5):\n print('line', i); time.sleep(0.1)"]))
    core = client.CoreV1Api(kubeapi.api_client())
    pid_of(kubeapi, "lg-master-0")
    resp = core.read_namespaced_pod_log("lg-master-0", "default", follow=True, _preload_content=False)
    text = resp.read().decode()
    assert text.splitlines() == [f"line {i}" for i in range(5)]
    assert core.read_namespaced_pod_log("lg-master-0", "default", tail_lines=2, container="pytorch") == "line 3\nline 4\n"


def test_training_client_end_to_end(kubeapi):
    from kubeflow.training import TrainingClient, models

    tc = TrainingClient(config_file=str(kubeapi.kubeconfig_path), namespace="default")
    c = client.V1Container(name="pytorch", image="local", command=["python", "-c", "import os; print('rank', os.environ['RANK'])"])

    def rs(n):
        return models.KubeflowOrgV1ReplicaSpec(replicas=n, restart_policy="OnFailure",
                                               template=client.V1PodTemplateSpec(spec=client.V1PodSpec(containers=[c])))

    job = models.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1", kind="PyTorchJob", metadata=client.V1ObjectMeta(name="tc"),
        spec=models.KubeflowOrgV1PyTorchJobSpec(run_policy=models.KubeflowOrgV1RunPolicy(clean_pod_policy="None"), pytorch_replica_specs={"Master": rs(1), "Worker": rs(1)}))
    tc.create_job(job)
    done = tc.wait_for_job_conditions("tc", timeout=60, polling_interval=1)
    assert done.status.conditions[-1].type == "Succeeded"
    assert tc.get_job("tc").metadata.name == "tc"
    logs, _ = tc.get_job_logs("tc", is_master=False)
    assert logs == {"tc-master-0": "rank 0\n", "tc-worker-0": "rank 1\n"}


def test_server_shutdown_leaves_no_orphans(tmp_path):
    from tests.kubeapi import KubeAPIServer

    with KubeAPIServer(executor=True, workdir=tmp_path) as s:
        s.create(*JOBS, pytorchjob("orph", ["python", "-c", "import time; time.sleep(60)"]))
        pid = pid_of(s, "orph-master-0")
    assert gone(pid)
    assert os.path.isdir(tmp_path / "pods")


async def test_a_cancel_that_lands_as_the_executor_is_poked_still_stops_it(tmp_path):
    """Server shutdown cancels the loop while the pods it kills poke it: 3.11's asyncio.wait_for swallowed
    that cancel and the loop ran on, so every KubeAPIServer.stop() so hit waited out its 30 s join."""
    import asyncio

    from tests.kubeapi.executor import PyTorchJobExecutor
    from tests.kubeapi.store import Store

    executor = PyTorchJobExecutor(Store(), tmp_path, tick=0.2)
    executor.start(asyncio.get_running_loop())
    await asyncio.sleep(0.05)  # the loop is waiting for a poke or its tick
    executor._wake.set()
    executor._task.cancel()
    done, _ = await asyncio.wait([executor._task], timeout=10)  # a guard, not a timing: it stops or it never does
    assert executor._task in done and executor._task.cancelled()


def test_a_restarted_container_keeps_the_previous_ones_id_and_log(kubeapi, tmp_path):
    # As the kubelet: lastState.terminated is the container that exited (its containerID, exit code,
    # times), and ?previous=true serves its log; before, lastState showed the new container's id and
    # previous gave nothing.
    go, ran = tmp_path / "go", tmp_path / "ran"
    script = (f"import os, sys, time\nfirst = not os.path.exists({str(ran)!r})\nopen({str(ran)!r}, 'a').close()\n"
              f"print('first' if first else 'second', flush=True)\n"
              f"while first and not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
              "sys.exit(3) if first else time.sleep(60)\n")
    kubeapi.create(*JOBS, pytorchjob("again", ["python", "-c", script], run_policy={"backoffLimit": 3}))
    core = client.CoreV1Api(kubeapi.api_client())
    first_pid = pid_of(kubeapi, "again-master-0")
    with pytest.raises(client.ApiException) as info:
        core.read_namespaced_pod_log("again-master-0", "default", previous=True)
    assert info.value.status == 400
    assert json.loads(info.value.body)["message"] == 'previous terminated container "pytorch" in pod "again-master-0" not found'
    go.touch()

    def restarted():
        cs = kubeapi.get("v1", "Pod", "again-master-0")["status"]["containerStatuses"][0]
        return cs if cs["restartCount"] == 1 and "running" in cs["state"] else None

    cs = wait_for(restarted, what="the restarted container running")
    last = cs["lastState"]["terminated"]
    assert last["containerID"] == f"local://{first_pid}" != cs["containerID"]
    assert last["exitCode"] == 3 and last["reason"] == "Error" and last["finishedAt"]
    assert last["startedAt"] <= last["finishedAt"] <= cs["state"]["running"]["startedAt"]
    assert core.read_namespaced_pod_log("again-master-0", "default", previous=True) == "first\n"
    wait_for(lambda: core.read_namespaced_pod_log("again-master-0", "default") == "second\n", what="the new log")
    assert core.read_namespaced_pod_log("again-master-0", "default", previous=True) == "first\n"
