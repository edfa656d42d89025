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
    only the backward parameter all-gathers stay inside one shard group (one block). The forward
    all-gather still runs over the data group (stage3.py _post_step -> invalidate_secondary_tensor
    drops the secondary copy after every step), and so does the gradient reduce-scatter. MiCS, the
    exact HSDP, was removed from DeepSpeed 0.19. At ZeRO-1/2 the optimizer state is partitioned
    over the whole data group: gradients are all-reduced and the updated parameters all-gathered
    over it (gem/parallel/comm_model.py has the per-stage list with its sources).
  * tensor parallel: the mpu's model-parallel group is tp; sharded parameters carry
    `tensor_model_parallel` so gradient-norm clipping counts them once per shard.
  * context parallel: not DeepSpeed's Ulysses sequence parallelism (which splits attention heads and
    sums gradients over its group); to DeepSpeed the cp ranks are data ranks.
  * expert parallel and sharded embeddings: their shards must be summed over other groups
    (expert_data, sparse_replica), which DeepSpeed 0.19 does only for its own MoE layers. At ZeRO-1/2
    `split_for_deepspeed` keeps them out of DeepSpeed's optimizer; the trainer syncs them and steps
    a second AdamW over them, clipped with the global norm of both (gem/train/optim.py
    ShardOptimizer, docs/parallelism.md §7). `check_deepspeed_plan` rejects ep > 1 and
    sparse_shard > 1 at ZeRO-0 and ZeRO-3, and (given the precision) with bf16 / mxfp8, where the
    shards stepped outside DeepSpeed would have no fp32 master weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gem.parallel.mesh import ParallelMesh

# Torch-free, in plan.py so the operator checks plans the same way; re-exported here.
from gem.parallel.plan import DEEPSPEED_DIMS, ParallelPlan, PlanError, check_deepspeed_plan  # noqa: F401


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


def skip_cpu_shm_comm() -> None:
    """Keep DeepSpeed's CPU accelerator from JIT-compiling its shared-memory all-reduce op.

    Its TorchBackend builds `deepspeed_shm_comm` with g++ whenever it starts on CPU (~40 s of both
    cores; measured rebuilding 3 times in one test-suite run), yet only `inference_all_reduce` (AutoTP
    inference) uses it: training collectives go through torch.distributed (gloo). DeepSpeed 0.19
    has no switch for it, so mark the op incompatible in `deepspeed.ops.__compatible_ops__`, which
    `deepspeed.comm.torch.build_shm_op` consults. A no-op where CUDA is available (no such op there).
    """
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):  # another DeepSpeed version: its default, and the test says so
        compatible["deepspeed_shm_comm"] = False


def prepare_deepspeed(plan: ParallelPlan, mesh: ParallelMesh, *, shards_outside: bool = False) -> DeepSpeedMPU:
    """Check the plan, point DeepSpeed's hpZ group at the plan's shard group, return the mpu.

    Call after parallelize and before deepspeed.initialize, on every rank. The plan is checked
    (check_deepspeed_plan: ep / sparse_shard only at ZeRO-1/2, where the caller keeps their shards
    out of DeepSpeed with split_for_deepspeed); `shards_outside` skips that check.
    """
    if not shards_outside:
        check_deepspeed_plan(plan)
    skip_cpu_shm_comm()  # an engine on a group that init_distributed did not start (tests, notebooks)
    if plan.zero_stage == 3 and plan.hsdp_enabled:
        from deepspeed.utils import groups as ds_groups

        # DeepSpeed builds the hpZ group from world-consecutive ranks unless one exists already.
        ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = mesh.get_group("dp_shard")
        got = dist.get_process_group_ranks(ds_groups._get_zero_param_intra_parallel_group())
        assert got == mesh.ranks("dp_shard"), (got, mesh.ranks("dp_shard"))
    return DeepSpeedMPU(mesh)


#: DeepSpeed group names of the shards kept outside its optimizer (see split_for_deepspeed).
SHARD_GROUP_PREFIX = "gem_"


def split_for_deepspeed(model: nn.Module, plan: ParallelPlan,
                        mesh: ParallelMesh) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(parameters for DeepSpeed's optimizer, expert and embedding-row shards kept outside it).

    DeepSpeed averages every parameter it optimizes over its data group; a shard's gradient must
    instead be summed over the group holding its replicas (expert_data, sparse_replica) — DeepSpeed
    does that only for its own MoE layers (docs/parallelism.md §7). So the shards are left out of
    its optimizer: at ZeRO-1/2 its reduction hooks cover only the optimizer's parameters; the
    caller reduces the shards with `sync_parameter_gradients(shards, mesh)` after
    `engine.backward` and steps its own optimizer over them. They are also marked as DeepSpeed
    expert parameters of a group that is their replica group, so the engine's initial broadcast
    copies each shard from its own replica instead of rank 0's shard over the data group.
    ZeRO-0 (the engine reduces every module gradient) and ZeRO-3 (it partitions every module
    parameter) cannot keep parameters out: a PlanError names the stage.
    """
    from deepspeed.utils import groups as ds_groups

    from gem.parallel.parallelize import grad_group

    dense, shards = [], []
    for p in model.parameters():
        if p.requires_grad:
            (dense if grad_group(p) == "data" else shards).append(p)
    if shards and plan.zero_stage not in (1, 2):
        raise PlanError(
            f"ep={plan.ep} / sparse_shard={plan.sparse_shard} with DeepSpeed need zero_stage 1 or 2, not "
            f"{plan.zero_stage}: at stage 0 the engine all-reduces every module gradient over the data group, "
            f"at stage 3 it partitions every module parameter ({plan.describe()})",
            dimension="zero_stage", degree=plan.zero_stage, world_size=plan.world_size)
    for name in sorted({grad_group(p) for p in shards}):
        key = SHARD_GROUP_PREFIX + name
        group = mesh.get_group(name)
        ds_groups._EXPERT_DATA_PARALLEL_GROUP[key] = group
        ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[key] = mesh.ranks(name)
    for p in shards:
        p.allreduce = False  # deepspeed.moe.utils.is_moe_param
        p.group_name = SHARD_GROUP_PREFIX + grad_group(p)
    return dense, shards


def reset_deepspeed_groups() -> None:
    """Forget the hpZ group and the shard groups (tests that build several engines in one process)."""
    from deepspeed.utils import groups as ds_groups

    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    for table in (ds_groups._EXPERT_DATA_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        for key in [k for k in table if k.startswith(SHARD_GROUP_PREFIX)]:
            del table[key]
