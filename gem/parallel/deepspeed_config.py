"""DeepSpeed configured from a ParallelPlan: the config fragment, the groups (an `mpu`), hpZ.

    fragment = deepspeed_config_fragment(plan, micro_batch_size=64)   # merge into the trainer's config
    mpu = prepare_deepspeed(plan, mesh)                                # before deepspeed.initialize
    engine, *_ = deepspeed.initialize(model=parallelize(model, plan, mesh), mpu=mpu, config=config, ...)

What DeepSpeed gets:
  * ZeRO stage `plan.zero_stage`, partitioned over the data group (dp_replicate x dp_shard x cp,
    the mpu's data-parallel group): dense gradients are averaged over it, which is the gradient
    rule of gem/parallel/functional.py (cp ranks count as data ranks; see context_parallel.py).
  * HSDP (dp_replicate > 1 and dp_shard > 1) at ZeRO-3: hierarchical partitioning (ZeRO++ hpZ),
    `zero_hpz_partition_size = dp_shard`, with the secondary partition group set to the plan's
    dp_shard group (DeepSpeed would otherwise take world-consecutive ranks, wrong once cp x tp > 1):
    parameter all-gathers in forward and backward stay inside one shard group (one block);
    gradients are reduce-scattered over the data group. MiCS, the exact HSDP, was removed from
    DeepSpeed 0.19. At ZeRO-1/2 the optimizer state is partitioned over the whole data group.
  * tensor parallel: the mpu's model-parallel group is tp; sharded parameters carry
    `tensor_model_parallel` so gradient-norm clipping counts them once per shard.
  * context parallel: not DeepSpeed's Ulysses sequence parallelism (which splits attention heads and
    sums gradients over its group); to DeepSpeed the cp ranks are data ranks.
  * expert parallel and sharded embeddings: their parameters must be reduced over other groups
    (expert_data, sparse_replica) and checkpointed per shard; DeepSpeed 0.19 does that only for its
    own MoE layers, so the DeepSpeed trainer rejects ep > 1 and sparse_shard > 1 for now (use
    parallelize + sync_gradients, which handle all five dimensions).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gem.parallel.mesh import ParallelMesh
from gem.parallel.plan import ParallelPlan, PlanError

#: The dimensions the DeepSpeed trainer path supports today (see the module docstring).
DEEPSPEED_DIMS = frozenset({"dp_replicate", "dp_shard", "cp", "tp"})


def check_deepspeed_plan(plan: ParallelPlan) -> None:
    """Raise PlanError for what the DeepSpeed path cannot run (named dimension, degree, world)."""
    for dim, degree in (("ep", plan.ep), ("sparse_shard", plan.sparse_shard)):
        if degree > 1 and dim not in DEEPSPEED_DIMS:
            raise PlanError(
                f"{dim}={degree} is not supported with DeepSpeed yet: its parameters must be reduced over the "
                f"{'expert_data' if dim == 'ep' else 'sparse_replica'} group and checkpointed per shard, which "
                f"DeepSpeed 0.19 only does for its own MoE layers; set {dim} to 1 (world size {plan.world_size}, "
                f"{plan.describe()})", dimension=dim, degree=degree, world_size=plan.world_size)


def deepspeed_config_fragment(plan: ParallelPlan, *, micro_batch_size: int) -> dict[str, Any]:
    """The DeepSpeed config keys the plan decides (merge the trainer's own over or under as it likes)."""
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage == 3 and plan.hsdp_enabled:
        zero["zero_hpz_partition_size"] = plan.dp_shard
    if plan.zero_stage in (1, 2) and (plan.ep > 1 or plan.sparse_shard > 1):
        zero["contiguous_gradients"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        # DeepSpeed counts every rank of its data group, cp peers included (they share examples)
        "train_batch_size": micro_batch_size * plan.data_world,
        "zero_optimization": zero,
    }


class DeepSpeedMPU:
    """The `mpu` object DeepSpeed queries for its groups, answered from a ParallelMesh."""

    def __init__(self, mesh: ParallelMesh):
        self.mesh = mesh

    # data parallel: every rank that sees different examples or sequences (tp excluded)
    def get_data_parallel_group(self):
        return self.mesh.get_group("data")

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.size("data")

    def get_data_parallel_rank(self) -> int:
        return self.mesh.local_rank("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.mesh.ranks("data")

    # model parallel = tensor parallel (no pipeline)
    def get_model_parallel_group(self):
        return self.mesh.get_group("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.size("tp")

    def get_model_parallel_rank(self) -> int:
        return self.mesh.local_rank("tp")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.mesh.ranks("tp")[0]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1


def prepare_deepspeed(plan: ParallelPlan, mesh: ParallelMesh) -> DeepSpeedMPU:
    """Check the plan, point DeepSpeed's hpZ group at the plan's shard group, return the mpu.

    Call after parallelize and before deepspeed.initialize, on every rank.
    """
    check_deepspeed_plan(plan)
    if plan.zero_stage == 3 and plan.hsdp_enabled:
        from deepspeed.utils import groups as ds_groups

        # DeepSpeed builds the hpZ group from world-consecutive ranks unless one exists already.
        ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = mesh.get_group("dp_shard")
        got = dist.get_process_group_ranks(ds_groups._get_zero_param_intra_parallel_group())
        assert got == mesh.ranks("dp_shard"), (got, mesh.ranks("dp_shard"))
    return DeepSpeedMPU(mesh)


def reset_deepspeed_groups() -> None:
    """Forget the hpZ group (tests that build several engines in one process)."""
    from deepspeed.utils import groups as ds_groups

    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
