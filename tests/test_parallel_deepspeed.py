"""DeepSpeed engines configured from a plan train like one process (4 gloo processes, CPU accelerator).

HSDP at ZeRO-3 with hpZ over the plan's shard group, tensor parallel through the mpu at ZeRO-1, and
context parallel (cp ranks as data ranks) at ZeRO-2, in one launch. The per-step losses and the
weights after each step (their difference is the learning rate times the gradient) must match the
single-process reference of tests/test_parallel_training.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from gem.parallel.plan import ParallelPlan, PlanError
from gem.parallel.testing import run_distributed
from test_parallel_training import GLOBAL_BATCH, LR, STEPS, TinyModel, loss_fn, make_batch

SCENARIOS = {
    "hsdp-zero3-hpz": dict(dp_replicate=2, dp_shard=2, zero_stage=3),
    "tp2-zero1": dict(dp_shard=2, tp=2, zero_stage=1),
    "cp2-zero2": dict(dp_shard=2, cp=2, zero_stage=2),
    # expert and embedding-row shards kept out of DeepSpeed's optimizer (split_for_deepspeed)
    "ep2-sparse2-zero2-split": dict(dp_shard=4, ep=2, sparse_shard=2, zero_stage=2),
    "replicas2-ep2-sparse4-zero1-split": dict(dp_replicate=2, dp_shard=2, ep=2, sparse_shard=4, zero_stage=1),
}
TOL = dict(rtol=2e-5, atol=2e-6)


def _reference() -> dict:
    torch.manual_seed(0)
    model = TinyModel()
    losses, params = [], []
    for step in range(STEPS):
        model.zero_grad()
        batch = make_batch(step, 0, GLOBAL_BATCH)
        loss = loss_fn(model(batch), batch)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        params.append({k: v.clone() for k, v in model.state_dict().items()})
    return {"losses": losses, "params": params}


def _run(rank: int, world: int, scenarios: dict) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    from gem.parallel.deepspeed_config import (
        deepspeed_config_fragment,
        prepare_deepspeed,
        reset_deepspeed_groups,
        split_for_deepspeed,
    )
    from gem.parallel.mesh import build_mesh
    from gem.parallel.parallelize import full_state_dict, parallelize, sync_parameter_gradients

    ds_logger.setLevel("ERROR")
    out = {}
    for name, kwargs in scenarios.items():
        split = name.endswith("-split")
        plan = ParallelPlan(world_size=world, **{"sparse_shard": 1, **kwargs})
        mesh = build_mesh(plan)
        torch.manual_seed(0)
        model = parallelize(TinyModel(), plan, mesh)
        mpu = prepare_deepspeed(plan, mesh, shards_outside=split)
        dense, shards = split_for_deepspeed(model, plan, mesh) if split else (list(model.parameters()), [])
        own = torch.optim.SGD(shards, lr=LR) if shards else None
        dp = plan.dp_replicate * plan.dp_shard
        per = GLOBAL_BATCH // dp
        config = {**deepspeed_config_fragment(plan, micro_batch_size=per), "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(dense, lr=LR), config=config, mpu=mpu)
        c = plan.coords(rank)
        shard = (c["dp_replicate"] * plan.dp_shard_mod_ep + c["dp_shard_mod_ep"]) * plan.ep + c["ep"]
        losses, params = [], []
        for step in range(STEPS):
            batch = make_batch(step, shard * per, (shard + 1) * per)
            loss = loss_fn(engine(batch), batch)
            engine.backward(loss)
            if own is not None:  # the shards' gradients: summed over their replicas, not averaged over data
                sync_parameter_gradients(shards, mesh)
                own.step()
                own.zero_grad()
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=mesh.get_group("data"))
            losses.append(mean.item() / plan.data_world)
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                params.append(full_state_dict(engine.module, mesh))
        from deepspeed.utils import groups as ds_groups

        hpz = ds_groups._get_zero_param_intra_parallel_group()
        out[name] = {"losses": losses, "params": params, "zero": engine.zero_optimization_stage(), "shards": len(shards),
                     "dp_world": engine.dp_world_size, "data": mesh.ranks("data"), "dp_shard": mesh.ranks("dp_shard"),
                     "hpz": dist.get_process_group_ranks(hpz) if hpz is not None else None}
        engine.destroy()
        reset_deepspeed_groups()
    # ZeRO-3 partitions every module parameter: shards cannot stay outside, the stage is named
    plan = ParallelPlan(world_size=world, dp_shard=4, ep=2, sparse_shard=1, zero_stage=3)
    mesh = build_mesh(plan)
    try:
        split_for_deepspeed(parallelize(TinyModel(), plan, mesh), plan, mesh)
        out["zero3-split"] = None
    except PlanError as e:
        out["zero3-split"] = (e.dimension, str(e))
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 4, SCENARIOS, timeout=300, env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_deepspeed_matches_single_process(name, results):
    ref = _reference()
    for rank, res in enumerate(results):
        got = res[name]
        assert got["zero"] == SCENARIOS[name]["zero_stage"]
        # the experts (4 Linear weights + biases, half of them on each ep rank) and the user table's rows
        assert got["shards"] == (0 if not name.endswith("-split") else 2 * 2 + 1), (name, got["shards"])
        assert got["dp_world"] == len(got["data"])  # DeepSpeed's data group is the plan's (cp ranks included)
        if name.startswith("hsdp"):
            assert got["hpz"] == got["dp_shard"] and len(got["hpz"]) == 2  # hpZ partitions inside the shard group
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (name, rank)
        for step in range(STEPS):
            for key, full in ref["params"][step].items():
                torch.testing.assert_close(got["params"][step][key], full, **TOL,
                                           msg=f"{name} rank {rank} step {step} {key}")


def test_deepspeed_path_rejects_what_it_cannot_checkpoint():
    from gem.parallel.deepspeed_config import check_deepspeed_plan, deepspeed_config_fragment

    # shards are stepped outside DeepSpeed's optimizer, which only ZeRO-1/2 allow: other stages are named
    with pytest.raises(PlanError, match="ep=2 is not supported with DeepSpeed at zero_stage 3") as e:
        check_deepspeed_plan(ParallelPlan(world_size=4, dp_shard=4, ep=2, sparse_shard=1, zero_stage=3))
    assert e.value.dimension == "ep"
    with pytest.raises(PlanError, match="sparse_shard=4 is not supported with DeepSpeed at zero_stage 0"):
        check_deepspeed_plan(ParallelPlan(world_size=4, dp_shard=4, zero_stage=0))
    for stage in (1, 2):  # what gem train runs (tests/test_parallel_trainer.py)
        check_deepspeed_plan(ParallelPlan(world_size=4, dp_shard=4, ep=2, sparse_shard=4, zero_stage=stage))
    frag = deepspeed_config_fragment(ParallelPlan(world_size=8, dp_replicate=2, dp_shard=2, cp=2, zero_stage=3),
                                     micro_batch_size=16)
    assert frag["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2}
    assert frag["train_batch_size"] == 16 * 8


def test_zero3_cannot_keep_shards_outside_deepspeed(results):
    for res in results:
        dimension, message = res["zero3-split"]
        assert dimension == "zero_stage" and "zero_stage 1 or 2, not 3" in message


# ---------------------------------------------------------------------------- a step DeepSpeed skips


def _nan_step(rank: int, world: int) -> dict:
    """ep=2 x sparse_shard=2 at ZeRO-1 as gem train runs it (gem/train/optim.py ShardOptimizer): one step whose
    gradients are NaN (a NaN label), then a normal one."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    from gem.api.types import TrainingSpec
    from gem.parallel.deepspeed_config import (
        deepspeed_config_fragment,
        prepare_deepspeed,
        reset_deepspeed_groups,
        split_for_deepspeed,
    )
    from gem.parallel.mesh import build_mesh
    from gem.parallel.parallelize import parallelize
    from gem.train.optim import ShardOptimizer, build_optimizer

    ds_logger.setLevel("ERROR")
    plan = ParallelPlan(world_size=world, dp_shard=2, ep=2, sparse_shard=2, zero_stage=1)
    mesh = build_mesh(plan)
    torch.manual_seed(0)
    model = parallelize(TinyModel(), plan, mesh)
    mpu = prepare_deepspeed(plan, mesh)
    dense, shards = split_for_deepspeed(model, plan, mesh)
    training = TrainingSpec(steps=10, warmup_steps=0, grad_clip=1.0, learning_rate=0.1)
    shard_opt = ShardOptimizer(model, shards, mesh, training)
    optimizer, scheduler = build_optimizer(model, training, params=dense)
    per = GLOBAL_BATCH // world
    config = {**deepspeed_config_fragment(plan, micro_batch_size=per), "gradient_clipping": 1.0,
              "steps_per_print": 10**9}
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=config, mpu=mpu)
    shard_opt.attach(engine)

    def step(i: int, nan: bool) -> None:
        batch = make_batch(i, rank * per, (rank + 1) * per)
        if nan:
            batch.label[0] = float("nan")
        engine.backward(loss_fn(engine(batch), batch))
        shard_opt.sync()
        engine.step()
        shard_opt.step(engine)

    before = [p.detach().clone() for p in shards]
    step(0, nan=True)
    out = {"skipped": engine.skipped_steps, "unchanged": all(torch.equal(a, p) for a, p in zip(before, shards)),
           "schedules": (scheduler.last_epoch, shard_opt.scheduler.last_epoch)}
    step(1, nan=False)
    out.update(finite=all(bool(torch.isfinite(p).all()) for p in shards),
               schedules_after=(scheduler.last_epoch, shard_opt.scheduler.last_epoch))
    engine.destroy()
    reset_deepspeed_groups()
    return out


def test_a_step_deepspeed_skips_leaves_the_shards_alone():
    """DeepSpeed skips a step with an inf / NaN gradient norm (weights and LR schedule as they were);
    the expert and embedding-row shards must skip it too, not take NaN gradients into AdamW."""
    for res in run_distributed(_nan_step, 2, timeout=120, env={"DS_ACCELERATOR": "cpu"}):
        assert res["skipped"] == 1, res
        assert res["unchanged"] and res["schedules"] == (0, 0), res
        assert res["finite"] and res["schedules_after"] == (1, 1), res
