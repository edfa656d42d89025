"""Resume fallback with 2 ranks (torchrun, gloo on CPU): a newest checkpoint that only one rank
cannot read must send *every* rank back to the previous one, never leave the others in one of
DeepSpeed's collectives (ZeRO-3's load gathers the persistent parameters after each rank read its
own partition). Without the check before DeepSpeed's load (gem.train.checkpoint.unreadable),
rank 0 reaches that all-gather while rank 1 reports its error: gloo aborts the job on the
mismatched collective ("Received data size doesn't match expected size"), NCCL would hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.test_gem_distributed import base_env, free_port

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
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"hung: no exit {HANG_S}s after start (a rank waits in a collective the other never "
                    f"entered)\n{out[-4000:]}")


def test_a_newest_checkpoint_one_rank_cannot_read_sends_every_rank_to_the_previous(tmp_path):
    config = manifest(tmp_path, "z3", zero_stage=3)
    code, out = run(config, tmp_path, GEM_FAULT_AT_STEP="4")
    assert code != 0 and "fault injected after step 4" in out, out[-4000:]
    job = tmp_path / "ckpt/t/z3"
    newest = job / "step-00000004"
    assert (newest / "COMPLETE").is_file() and (job / "step-00000002" / "COMPLETE").is_file()
    # rank 1's ZeRO partition, read inside DeepSpeed's load; rank 0 never opens it
    victim = newest / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:100])  # truncated: a torch file that no longer loads

    code, out = run(config, tmp_path)
    assert code == 0, out[-4000:]
    assert "step-00000004 does not load" in out and victim.name in out, out[-4000:]
    assert "resumed from" in out and "at step 2" in out, out[-4000:]
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["step"] == 6 and report["checkpoint"] == str(job / "step-00000006")


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
