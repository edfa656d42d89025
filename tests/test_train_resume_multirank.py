"""Resume fallback and failed saves with 2 ranks (torchrun, gloo on CPU): a newest checkpoint that
only one rank cannot read must send *every* rank back to the previous one, never leave the others
in one of DeepSpeed's collectives (ZeRO-3's load gathers the persistent parameters after each rank
read its own partition): checkpoint.unreadable, the check before DeepSpeed's load, is tested here
on its own and under torchrun in test_gem_distributed.py's ZeRO-3 resume (one scenario, one run).
A rank that cannot write its checkpoint files must stop every rank cleanly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from gem.launcher import free_port
from tests.test_gem_distributed import base_env, kill_tree

HANG_S = 120  # a healthy resume of this tiny job takes ~20 s on 2 shared cores


def manifest(tmp_path, name, zero_stage):
    obj = {
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name, "namespace": "t"},
        "spec": {
            "model": {"preset": "tiny"},
            "data": {"synthetic": {"numUsers": 50, "numAds": 20, "numTrainExamples": 256, "numEvalExamples": 64,
                                   "meanHistoryLen": 4}},
            "training": {"steps": 6, "batchSize": 8, "warmupSteps": 0},
            "parallelism": {"numNodes": 1, "procsPerNode": 2, "zeroStage": zero_stage},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 2, "keepLast": 3},
            "mlflow": {"enabled": False},
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def run(config, tmp_path, **extra) -> tuple[int, str]:
    """2 ranks under torchrun; a run still going after HANG_S is a hang: killed, whole process group."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "gem", "train", "--config", str(config)],
                            env=base_env(GEM_TERMINATION_MESSAGE_PATH=str(tmp_path / "termination-log"), **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=HANG_S)[0]
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out = proc.communicate()[0]
        pytest.fail(f"hung: no exit {HANG_S}s after start (a rank waits in a collective the other never "
                    f"entered)\n{out[-4000:]}")


def test_unreadable_names_a_damaged_torch_file_and_ignores_model_pt(tmp_path):
    import torch

    from gem.train import checkpoint
    from gem.train.dist import DistEnv

    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    ckpt = tmp_path / "step-00000002"
    (ckpt / "rng").mkdir(parents=True)
    torch.save({"x": torch.ones(3)}, ckpt / "mp_rank_00_model_states.pt")
    torch.save({"x": torch.ones(3)}, ckpt / "legacy_optim_states.pt", _use_new_zipfile_serialization=False)
    torch.save({"torch": torch.get_rng_state()}, ckpt / "rng" / "rank-00000.pt")
    (ckpt / "model.pt").write_bytes(b"not read on resume")
    assert checkpoint.unreadable(env, ckpt) is None
    rng = ckpt / "rng" / "rank-00000.pt"
    rng.write_bytes(rng.read_bytes()[:-30])
    assert checkpoint.unreadable(env, ckpt).startswith(f"{rng}: ")
    legacy = ckpt / "legacy_optim_states.pt"
    legacy.write_bytes(legacy.read_bytes()[:-10])
    rng.unlink()
    assert checkpoint.unreadable(env, ckpt).startswith(f"{legacy}: ")


# --------------------------------------------------------------------------- a rank that cannot save


def run_two_nodes(config, tmp_path, node_env: list[dict[str, str]]) -> list[tuple[int, str]]:
    """Two torchrun agents, one per simulated pod (as test_gem_distributed's): a rank that dies takes
    down only its own pod, as on a cluster; the other's must not wait for it. A run still going after
    HANG_S is a hang: both killed."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "-m", "gem", "train", "--config",
                               str(config)],
                              env=base_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(r),
                                           PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port),
                                           GEM_TERMINATION_MESSAGE_PATH=str(tmp_path / f"termination-node{r}"),
                                           **node_env[r]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(2)]
    results = []
    try:
        for p in procs:
            out = p.communicate(timeout=HANG_S)[0]  # one deadline for both: the second one is already late
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"hung: no exit {HANG_S}s after start (a rank waits in a collective the other never "
                    "entered)\n" + "\n".join(f"--- node {r}\n{o[-3000:]}" for r, o in enumerate(outs)))
    return results


@pytest.mark.parametrize("victim", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng/rank-00001.pt"])
def test_a_rank_that_cannot_write_its_checkpoint_files_stops_every_rank_cleanly(tmp_path, victim):
    """Disk full on node 1 only, at the step-2 save: rank 1's write fails, inside DeepSpeed's save
    (its ZeRO partition) or in ours (its RNG state). The save had barriers after the writes, in
    DeepSpeed's save_checkpoint and ours: rank 0 waited there for a rank that had left (NCCL: until
    the 30-minute timeout; gloo: an unexplained "Connection closed by peer" once rank 1's process is
    gone). Now both ranks exit together with the same error naming rank 1 and its file, and step 2 is
    not a checkpoint (no COMPLETE, temp dir removed)."""
    name = "full"
    obj = yaml.safe_load(manifest(tmp_path, name, zero_stage=1).read_text())
    obj["spec"]["parallelism"].update(numNodes=2, procsPerNode=1)
    obj["spec"]["training"]["steps"] = 4
    config = tmp_path / "two-nodes.yaml"
    config.write_text(yaml.safe_dump(obj))
    # each pod its own checkpoint volume (GEM_CHECKPOINT_DIR): node 1's full disk is /dev/full under
    # the file rank 1 writes (rank 0 empties the temp dir of a step only on its own volume)
    roots = [tmp_path / "node0", tmp_path / "node1"]
    full = roots[1] / "t" / name / ".tmp-step-00000002" / victim
    full.parent.mkdir(parents=True)
    full.symlink_to("/dev/full")

    (code0, out0), (code1, out1) = run_two_nodes(config, tmp_path, [{"GEM_CHECKPOINT_DIR": str(r)} for r in roots])
    both = f"--- node 0\n{out0[-3000:]}\n--- node 1\n{out1[-3000:]}"
    assert code0 != 0 and code1 != 0, both
    error = f"rank 1: writing {roots[1] / 't' / name / '.tmp-step-00000002' / victim}: "
    for r in range(2):
        report = json.loads((tmp_path / f"termination-node{r}").read_text())["error"]
        assert report.startswith("CheckpointSaveError: checkpoint step-00000002 under "), (r, report)
        # torch.save's zip writer hides ENOSPC ("RuntimeError: ... unexpected pos 128 vs 0"): the free space is added
        assert error in report and "free on that filesystem" in report, (r, report)
        assert "rank 0:" not in report and "a restart resumes from scratch" in report, (r, report)
    for root in roots:
        job = root / "t" / name
        assert not (job / "step-00000002").exists() and not (job / ".tmp-step-00000002").exists(), both
        assert not list(job.glob("*/COMPLETE")), both
