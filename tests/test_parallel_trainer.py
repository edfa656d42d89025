"""`gem train` with a parallel plan: the trainer plans, logs and reports it (torchrun, 4 CPU processes).

dp_shard=2 x cp=2 at ZeRO-2 from spec.training.deepspeed.parallelPlan: context-parallel peers read
the same data shard, evaluation counts every eval example once, and the final report carries
`parallelPlan` with its reason for the operator's status.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import yaml

from gem.api.types import ParallelismSpec, TrainingSpec
from gem.parallel.plan import ParallelPlan

NUM_EVAL = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            "training": {"steps": 4, "batchSize": 16, "warmupSteps": 1,
                         "deepspeed": {"parallelPlan": {"dpShard": 2, "cp": 2}}},
            "parallelism": {"numNodes": 1, "procsPerNode": 4, "zeroStage": 2},
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
    assert "parallel plan dp_replicate=1 dp_shard=2 ep=1 cp=2 tp=1" in out and "parallel reason given in spec" in out
    report = json.loads((tmp_path / "report.json").read_text())
    plan = report["parallelPlan"]
    assert (plan["dpShard"], plan["cp"], plan["zeroStage"], plan["worldSize"]) == (2, 2, 2, 4)
    assert plan["groupLevels"] == {"dp_shard_mod_ep": "node", "cp": "node"} and plan["reason"]
    assert report["step"] == 4 and report["metrics"]["num_examples"] == NUM_EVAL  # no duplicates from cp peers
    assert len(json.dumps(report)) < 4096  # fits a termination message
