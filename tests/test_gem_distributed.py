"""`gem train` under torchrun: 1 node x 2 processes with ZeRO-1, and 2 nodes x 1 process (the pod
layout the operator creates, via PET_* env and a static rendezvous on 127.0.0.1) with ZeRO-3,
killed mid-run and resumed past a newest checkpoint one rank cannot read. Both must end with the
same weights: same data, same math.
"""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml

from gem.launcher import free_port
from gem.train import checkpoint

TIMEOUT_S = 240


def manifest(tmp_path, name, zero_stage):
    obj = {
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name, "namespace": "team-a"},
        "spec": {
            # with the generative objective over the history: its lookups run outside the engine's
            # forward, which ZeRO-3 must gather for too (the ZeRO-3 run's weights are checked below)
            "model": {"preset": "tiny", "generativeLossWeight": 0.5},
            "data": {"synthetic": {"numUsers": 300, "numAds": 100, "numTrainExamples": 4000, "numEvalExamples": 600,
                                   "meanHistoryLen": 16}},
            "training": {"steps": 30, "batchSize": 32, "warmupSteps": 5},
            "parallelism": {"numNodes": 2, "procsPerNode": 1, "zeroStage": zero_stage},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 10, "keepLast": 3},
            "mlflow": {"enabled": False},
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def kill_tree(pid: int) -> None:
    """SIGKILL a launched process and everything below it: torchrun starts its workers in sessions of
    their own, so a killpg of the launcher's group alone left them training (and holding its output
    pipe, so a later communicate() never returned)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)  # before the launcher dies and they are reparented
    except psutil.NoSuchProcess:
        below = []
    for p in below:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def base_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "GEM_", "MLFLOW_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env.update(extra)
    return env


def torchrun(args, env):
    # its own process group: a hung run is killed whole (workers included), not left running
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_two_nodes(config, tmp_path, **extra):
    """Two torchrun agents, one per simulated pod, as the Kubeflow training operator starts them.
    Still going after TIMEOUT_S is a hang (a rank waiting in a collective the other never entered)."""
    port = free_port()
    procs = [torchrun(["-m", "gem", "train", "--config", str(config)],
                      base_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(r),
                               PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port),
                               GEM_TERMINATION_MESSAGE_PATH=str(tmp_path / f"termination-node{r}"), **extra))
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"hung: no exit {TIMEOUT_S}s after start\n" +
                    "\n".join(f"--- node {r}\n{o[-3000:]}" for r, o in enumerate(outs)))
    return [p.returncode for p in procs], outs


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("zero1")
    config = manifest(tmp_path, "zero-one", zero_stage=1)
    proc = torchrun(["--nnodes", "1", "--nproc-per-node", "2", "--master-port", str(free_port()),
                     "-m", "gem", "train", "--config", str(config)],
                    base_env(GEM_TERMINATION_MESSAGE_PATH=str(tmp_path / "termination-log")))
    out = proc.communicate(timeout=TIMEOUT_S)[0]
    assert proc.returncode == 0, out[-4000:]
    return tmp_path, json.loads((tmp_path / "termination-log").read_text())


def test_two_processes_zero1(zero1):
    tmp_path, report = zero1
    assert report["step"] == 30 and report["metrics"]["num_examples"] == 600  # eval covers both shards
    final = tmp_path / "ckpt/team-a/zero-one/step-00000030"
    assert report["checkpoint"] == str(final) and (final / "COMPLETE").is_file()
    shards = sorted(p.name for p in final.glob("*optim_states.pt"))
    assert len(shards) == 2, shards  # ZeRO-1: one optimizer partition per rank
    assert sorted(p.name for p in (final / "rng").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]


def test_two_nodes_zero3_resumes_past_a_checkpoint_one_rank_cannot_read_and_matches_zero1(zero1, tmp_path):
    """Killed after step 20, then rank 1's ZeRO partition of step 20 truncated: the resume must send
    *every* rank back to step 10, never leave the others in one of DeepSpeed's collectives (ZeRO-3's
    load gathers the persistent parameters after each rank read its own partition). Without the
    check before DeepSpeed's load (gem.train.checkpoint.unreadable), rank 0 reaches that all-gather
    while rank 1 reports its error: gloo aborts the job on the mismatched collective, NCCL would hang."""
    config = manifest(tmp_path, "zero-three", zero_stage=3)
    codes, outs = run_two_nodes(config, tmp_path, GEM_FAULT_AT_STEP="20")
    assert codes[0] != 0 and codes[1] != 0
    first = json.loads((tmp_path / "termination-node0").read_text())
    assert first["error"].startswith("RuntimeError: fault injected after step 20")
    job = tmp_path / "ckpt/team-a/zero-three"
    assert checkpoint.latest_complete(job) == job / "step-00000020"
    assert (job / "step-00000010" / "COMPLETE").is_file()
    # rank 1's ZeRO partition, read inside DeepSpeed's load; rank 0 never opens it
    victim = job / "step-00000020" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])  # truncated: a torch file that no longer loads

    codes, outs = run_two_nodes(config, tmp_path)
    assert codes == [0, 0], outs[0][-4000:]
    assert "step-00000020 does not load" in outs[0] and victim.name in outs[0], outs[0][-4000:]
    assert "resumed from" in outs[0] and "at step 10" in outs[0], outs[0][-4000:]
    report = json.loads((tmp_path / "termination-node0").read_text())
    assert report["step"] == 30
    # Only global rank 0 reports success; node 1's file still holds its earlier error.
    assert "error" in json.loads((tmp_path / "termination-node1").read_text())
    final = job / "step-00000030"
    assert len(list(final.glob("zero_pp_rank_*_model_states.pt"))) == 2  # ZeRO-3 shards the parameters
    # The consolidated fp32 weights gathered under ZeRO-3 equal those of the ZeRO-1 run.
    zero1_dir, zero1_report = zero1
    a = torch.load(zero1_dir / "ckpt/team-a/zero-one/step-00000030/model.pt")
    b = torch.load(final / "model.pt")
    assert a.keys() == b.keys() and {"generative.0.log_scale", "generative.1.log_scale"} <= a.keys()
    assert float(b["generative.0.log_scale"]) != pytest.approx(0.5 * math.log(32))  # trained from its start, log √d
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-4, rtol=1e-3, msg=name)
    assert report["metrics"]["ne/click"] == pytest.approx(zero1_report["metrics"]["ne/click"], abs=1e-3)
