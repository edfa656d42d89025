"""`gem train` with a parallel plan: the trainer plans, logs and reports it (torchrun, 4 CPU processes).

dp_shard=2 x cp=2 at ZeRO-2 from spec.parallelism.plan: context-parallel peers read
the same data shard, evaluation counts every eval example once, and the final report carries
`parallelPlan` with its reason for the operator's status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from gem.api.types import ParallelismSpec, TrainingSpec
from gem.launcher import free_port
from gem.parallel.plan import ParallelPlan

NUM_EVAL = 300


def test_deepspeed_config_takes_the_plan_and_drops_its_key():
    from gem.train.dist import deepspeed_config

    training = TrainingSpec(batch_size=16, deepspeed={"parallelPlan": {"cp": 2}, "wall_clock_breakdown": True})
    plan = ParallelPlan(world_size=8, dp_replicate=2, dp_shard=2, cp=2, zero_stage=3, sparse_shard=1)
    config = deepspeed_config(training, ParallelismSpec(zero_stage=3), world_size=8, plan=plan)
    assert "parallelPlan" not in config and config["wall_clock_breakdown"] is True
    assert config["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2}
    assert config["train_batch_size"] == 16 * 8  # DeepSpeed's data group: dp x cp


def test_gem_train_with_context_parallel_reports_its_plan(tmp_path):
    obj = {
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "cp-run", "namespace": "t"},
        "spec": {
            "model": {"preset": "tiny"},
            "data": {"synthetic": {"numUsers": 200, "numAds": 60, "numTrainExamples": 800,
                                   "numEvalExamples": NUM_EVAL, "meanHistoryLen": 12}},
            "training": {"steps": 4, "batchSize": 16, "warmupSteps": 1},
            "parallelism": {"numNodes": 1, "procsPerNode": 4, "zeroStage": 2, "plan": {"dpShard": 2, "cp": 2}},
            "checkpoint": {"path": str(tmp_path / "ckpt"), "everySteps": 4},
            "mlflow": {"enabled": False},
        },
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(obj))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "GEM_", "MLFLOW_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["GEM_TERMINATION_MESSAGE_PATH"] = str(tmp_path / "report.json")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
                           "--master-port", str(free_port()), "-m", "gem", "train", "--config", str(config)],
                          env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # ep chosen around the given degrees: the tiny preset's 2 experts, fp32 at ZeRO-2
    assert "parallel plan dp_replicate=1 dp_shard=2 ep=2 cp=2 tp=1 sparse_shard=1 zero_stage=2 chosen=spec" in out
    assert "parallel reason tp=1: " in out and "cp=2: given in spec.parallelism.plan" in out
    report = json.loads((tmp_path / "report.json").read_text())
    plan = report["parallelPlan"]
    assert (plan["dpShard"], plan["cp"], plan["zeroStage"], plan["worldSize"]) == (2, 2, 2, 4)
    assert plan["groupLevels"] == {"ep": "node", "cp": "node"} and plan["chosen"] == "spec"
    assert "dp_shard=2: given in spec.parallelism.plan" in plan["reason"]
    assert report["step"] == 4 and report["metrics"]["num_examples"] == NUM_EVAL  # no duplicates from cp peers
    assert len(json.dumps(report)) < 4096  # fits a termination message


# ---------------------------------------------------------------------------- ep + sparse_shard in gem train

SHARD_STEPS = 6


def _shard_manifest(tmp_path, name: str, plan: dict) -> "os.PathLike":
    obj = {
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": name, "namespace": "t"},
        "spec": {
            "model": {"preset": "tiny"},  # 2 stacked Wukong experts per layer, user (4096) and item (2048) tables
            "data": {"synthetic": {"numUsers": 200, "numAds": 60, "numTrainExamples": 800,
                                   "numEvalExamples": 200, "meanHistoryLen": 12}},
            # a small clip so every step is clipped: the shards must be scaled by the global norm
            "training": {"steps": SHARD_STEPS, "batchSize": 16, "warmupSteps": 2, "gradClip": 0.05,
                         "weightDecay": 0.01},
            "parallelism": {"numNodes": 1, "procsPerNode": 2, "zeroStage": 2, "plan": plan},
            "checkpoint": {"path": str(tmp_path / name), "everySteps": 3},
            "mlflow": {"enabled": False},
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def _launch(config, report, **extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "GEM_", "MLFLOW_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env.update(GEM_TERMINATION_MESSAGE_PATH=str(report), **extra)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "gem", "train", "--config", str(config)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _final_loss(out: str) -> float:
    import re

    found = re.findall(rf"step step={SHARD_STEPS} .* loss=([0-9.]+)", out)
    assert found, out[-4000:]
    return float(found[-1])


def test_gem_train_with_expert_and_embedding_shards_matches_the_dense_run_and_resumes(tmp_path):
    """ep=2 x sparse_shard=2 on 2 processes (ZeRO-2) against the same 2 ranks without shards (same data
    shards, so the same math): same loss and weights; killed after step 4 and resumed from step 3, it
    ends where the uninterrupted run does (per-rank shards and their AdamW state in the checkpoint)."""
    import torch

    from gem.train import checkpoint

    shard_plan = {"dpShard": 2, "ep": 2, "sparseShard": 2}
    # ep=1 given: fp32 at ZeRO-2 with experts, the automatic plan would pick ep=2 itself
    runs = {"dense": _shard_manifest(tmp_path, "dense", {"dpShard": 2, "ep": 1}),
            "shards": _shard_manifest(tmp_path, "shards", shard_plan),
            "killed": _shard_manifest(tmp_path, "killed", shard_plan)}
    procs = {name: _launch(cfg, tmp_path / f"{name}.json", **({"GEM_FAULT_AT_STEP": "4"} if name == "killed" else {}))
             for name, cfg in runs.items()}
    outs = {name: p.communicate(timeout=900)[0] for name, p in procs.items()}
    for name in ("dense", "shards"):
        assert procs[name].returncode == 0, (name, outs[name][-4000:])
    assert procs["killed"].returncode != 0 and "fault injected after step 4" in outs["killed"], outs["killed"][-4000:]
    assert "ep=2 cp=1 tp=1 sparse_shard=2 zero_stage=2 chosen=spec" in outs["shards"]
    assert "sparse_shard=1 zero_stage=2" in outs["dense"]

    resumed = _launch(runs["killed"], tmp_path / "resumed.json")
    out = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, out[-4000:]
    assert "resumed from" in out and "at step 3" in out
    killed_dir = checkpoint.job_dir(tmp_path / "killed", "t", "killed")
    assert sorted(p.name for p in (killed_dir / "step-00000003" / "shards").iterdir()) == \
        ["rank-00000.pt", "rank-00001.pt"]

    losses = {"dense": _final_loss(outs["dense"]), "shards": _final_loss(outs["shards"]), "resumed": _final_loss(out)}
    assert losses["shards"] == pytest.approx(losses["dense"], abs=3e-4), losses
    assert losses["resumed"] == pytest.approx(losses["shards"], abs=1e-4), losses

    def weights(name):
        return torch.load(checkpoint.job_dir(tmp_path / name, "t", name) / f"step-{SHARD_STEPS:08d}" / "model.pt",
                          weights_only=True)

    dense, shards, again = weights("dense"), weights("shards"), weights("killed")
    assert dense.keys() == shards.keys() == again.keys()  # the single-device names and shapes, gathered
    assert "affinity.embeddings.tables.user.weight" in dense  # the branch's tables (>= 1,024 rows: sharded) are compared too
    for key in dense:
        torch.testing.assert_close(shards[key], dense[key], rtol=1e-4, atol=2e-5, msg=key)
        torch.testing.assert_close(again[key], shards[key], rtol=1e-5, atol=1e-6, msg=key)
    report = json.loads((tmp_path / "shards.json").read_text())
    assert (report["parallelPlan"]["ep"], report["parallelPlan"]["sparseShard"]) == (2, 2)
    assert report["metrics"]["ne"] == pytest.approx(json.loads((tmp_path / "dense.json").read_text())["metrics"]["ne"],
                                                    rel=1e-3)
