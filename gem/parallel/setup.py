"""One call for the trainer: plan the job, build the groups, parallelize the model, prepare DeepSpeed.

    par = setup_parallel(model, spec, world_size=..., rank=..., procs_per_node=..., max_seq_len=...)
    engine = deepspeed.initialize(model=par.model, mpu=par.mpu, config=merge(config, par.deepspeed_fragment), ...)
    loader = ShardedLoader(..., rank=par.data_rank, world_size=par.data_world_size)
    report["parallelPlan"] = par.report()

The trainer path runs on DeepSpeed, so the automatic plan chooses plan.DEEPSPEED_DIMS, plus ep when
the job can run it (ZeRO-1/2, fp32: plan.deepspeed_auto_dims, applied in job.choose_plan for the trainer
and the operator alike); sparse_shard runs only when given explicitly. ep and sparse_shard need ZeRO-1/2
and fp32 (check_deepspeed_plan(plan, precision) raises PlanError otherwise: the trainer steps their
shards outside DeepSpeed, gem/train/optim.py ShardOptimizer, where bf16 has no fp32 master weights).
The hints come from the model itself (model_shape_hints: the layers its tp plan splits, its
experts). Under the operator the plan comes from GEM_TOPOLOGY (gem/parallel/job.py), so the trainer
runs what the status shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from gem.parallel.deepspeed_config import DEEPSPEED_DIMS, DeepSpeedMPU, deepspeed_config_fragment, prepare_deepspeed
from gem.parallel.job import JobParallelism, plan_for_job
from gem.parallel.mesh import ParallelMesh, build_mesh
from gem.parallel.parallelize import model_shape_hints, parallelize

log = logging.getLogger("gem.parallel")


@dataclass
class ParallelSetup:
    job: JobParallelism
    mesh: ParallelMesh
    model: nn.Module
    """The parallelized model (possibly wrapped for context parallelism)."""
    mpu: DeepSpeedMPU

    @property
    def data_rank(self) -> int:
        """Which shard of the data this rank reads: tp and cp peers read the same one."""
        plan, c = self.job.plan, self.job.plan.coords(self.mesh.rank)
        return (c["dp_replicate"] * plan.dp_shard_mod_ep + c["dp_shard_mod_ep"]) * plan.ep + c["ep"]

    @property
    def data_world_size(self) -> int:
        """Distinct data shards: dp_replicate x dp_shard."""
        return self.job.plan.dp_replicate * self.job.plan.dp_shard

    @property
    def is_data_writer(self) -> bool:
        """One rank per data shard (tp and cp index 0): the one whose eval predictions count."""
        c = self.job.plan.coords(self.mesh.rank)
        return c["tp"] == 0 and c["cp"] == 0

    def deepspeed_fragment(self, micro_batch_size: int) -> dict[str, Any]:
        return deepspeed_config_fragment(self.job.plan, micro_batch_size=micro_batch_size)

    def report(self) -> dict[str, Any]:
        return self.job.report()


def setup_parallel(model: nn.Module, spec, *, world_size: int, rank: int, procs_per_node: int,
                   max_seq_len: int = 0) -> ParallelSetup:
    """Plan (explicit or automatic), validate, build the mesh, parallelize, prepare DeepSpeed. Collective."""
    hints = model_shape_hints(model, max_seq_len=max_seq_len)
    job = plan_for_job(spec.parallelism, spec.training, world_size=world_size, procs_per_node=procs_per_node,
                       hints=hints, allowed=DEEPSPEED_DIMS)
    if rank == 0:
        for note in job.notes:
            log.warning("parallel: %s", note)
        log.info("%s", job.log_line())
        log.info("parallel reason %s", job.reason)
    mesh = build_mesh(job.plan)
    model = parallelize(model, job.plan, mesh)
    mpu = prepare_deepspeed(job.plan, mesh)
    return ParallelSetup(job=job, mesh=mesh, model=model, mpu=mpu)
