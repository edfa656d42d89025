"""Process-group setup and the DeepSpeed config derived from the spec.

Inside a pod, `torchrun` (fed PET_NNODES / PET_NPROC_PER_NODE / PET_NODE_RANK / PET_MASTER_ADDR /
PET_MASTER_PORT by the Kubeflow training operator) sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT for each process. Without torchrun, `gem train` is one process:
world size 1 on a free local port. Backend: nccl on GPU, gloo on CPU.

`setup_parallel` turns the spec into a parallel plan (gem/parallel, docs/parallelism.md): the
operator's plan from GEM_TOPOLOGY, else the degrees of spec.parallelism.plan with the others chosen
automatically for the job's topology, logged with its reason; it builds the process groups, applies the plan to the model and hands
DeepSpeed its groups (`mpu`) and config (`deepspeed_config(..., plan=)`).
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import os
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

# DeepSpeed picks its accelerator when first imported: tell it before anyone imports it.
try:
    import torch
except ImportError as e:  # pragma: no cover - the training extra is not installed
    raise SystemExit("gem train needs the training stack: pip install 'gem-platform[train]'") from e
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as torch_dist  # noqa: E402

from gem.api.types import ParallelismSpec, TrainingSpec  # noqa: E402
from gem.api.validation import deepspeed_override_problems, derived_deepspeed_keys  # noqa: E402
from gem.data.errors import SpecError  # noqa: E402
from gem.launcher import free_port  # noqa: E402
from gem.parallel.job import deepspeed_overrides  # noqa: E402
from gem.parallel.plan import ParallelPlan  # noqa: E402

log = logging.getLogger("gem.train")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def local_device(local_rank: int) -> torch.device:
    """This process's device: the GPU of its local rank, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed() -> DistEnv:
    """Join the process group torchrun describes, or make a world of one."""
    if "RANK" not in os.environ:  # plain `gem train`: a single process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = local_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
        # Processes on one node share its cores; oversubscription makes CPU training crawl.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world_size))
    import deepspeed

    from gem.parallel.deepspeed_config import skip_cpu_shm_comm

    skip_cpu_shm_comm()
    if not torch_dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, timeout=dt.timedelta(minutes=30),
                                   dist_init_required=True, verbose=False)
    return DistEnv(rank, world_size, local_rank, local_world_size, device)


def barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """rank src's obj on every rank."""
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's obj, in rank order."""
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def failures_by_rank(failure: Any) -> dict[int, Any]:
    """Every rank's `failure` (an error message, a verdict; None or empty when it did not fail), by
    rank: the same dict on every rank, empty when none failed. Collective. Ranks that meet here before
    raising fail together, so none is left waiting in a collective the failed one never enters."""
    return {rank: f for rank, f in enumerate(all_gather_objects(failure)) if f}


def on_every_rank(fn: Callable[[], Any], *, kept: type[Exception], what: str | None = None) -> Any:
    """fn() on this rank; when it fails on any rank, every rank raises. Collective, so no rank is left
    waiting in a collective a failed one never enters: a failed rank raises its own error, the others
    the first failed rank's, as `kept` when it was one (a config error stays one: exit 2), else as a
    RuntimeError naming the rank (and `what` it failed to do)."""
    error: Exception | None = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - gathered, then raised again below
        error, result = e, None
    failed = failures_by_rank(None if error is None else (isinstance(error, kept), str(error)))
    if error is not None:
        error.on_every_rank = True  # type: ignore[attr-defined]
        raise error
    for rank, (is_kept, message) in failed.items():
        raised = kept(message) if is_kept else RuntimeError(f"rank {rank}{f' failed to {what}' if what else ''}: {message}")
        raised.on_every_rank = True  # type: ignore[attr-defined]
        raise raised
    return result


def shutdown() -> None:
    """Leave the process group, and forget DeepSpeed's cached groups so a later run in the same
    process (tests, notebooks) starts clean instead of reusing handles of a destroyed group."""
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if name.startswith("_") and "GROUP" in name and name.isupper():
            if isinstance(value, dict):
                value.clear()
            elif not isinstance(value, str):
                setattr(groups, name, None)
    ds_comm.cdb = None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def setup_parallel(model: torch.nn.Module, spec: Any, env: DistEnv, *, max_seq_len: int = 0):
    """Plan the job, build its process groups and parallelize `model` (gem.parallel.setup). Collective.

    Returns a gem.parallel.setup.ParallelSetup: .model, .mpu, .data_rank / .data_world_size (the
    data shard this rank reads: tensor- and context-parallel peers read the same one), .report().
    """
    from gem.parallel.setup import setup_parallel as _setup

    return _setup(model, spec, world_size=env.world_size, rank=env.rank, procs_per_node=env.local_world_size,
                  max_seq_len=max_seq_len)


def deepspeed_config(training: TrainingSpec, parallelism: ParallelismSpec, *, world_size: int,
                     plan: ParallelPlan | None = None) -> dict[str, Any]:
    """The DeepSpeed config the spec (and the parallel plan) imply, with training.deepspeed merged over it.

    With a plan, ZeRO runs at plan.zero_stage over the plan's data group (hpZ for HSDP at ZeRO-3)
    and the global batch counts that group. `parallelPlan` in training.deepspeed is the plan's
    input, not DeepSpeed's: it is left out.
    """
    config: dict[str, Any] = {
        # batch, clipping and precision keys: the ones runnable_field_problems checks overrides against too
        **derived_deepspeed_keys(training, data_world=world_size),
        "zero_optimization": {"stage": parallelism.zero_stage},
        "steps_per_print": 10**9,  # the trainer logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    if plan is not None:
        from gem.parallel.deepspeed_config import deepspeed_config_fragment

        config = _merge(config, deepspeed_config_fragment(plan, micro_batch_size=training.batch_size))
    overrides, _ = deepspeed_overrides(training.deepspeed)
    if overrides:
        hpz = None if plan is None else config["zero_optimization"].get("zero_hpz_partition_size", 1)
        _check_overrides(overrides, config, hpz=hpz)
        config = _merge(config, overrides)
    return config


def _check_overrides(overrides: dict[str, Any], derived: dict[str, Any], *, hpz: int | None = None) -> None:
    """Refuse training.deepspeed keys that differ from the config the trainer derived (a SpecError).

    The comparison is gem.api.validation's, which the operator and `gemctl --local` run from the spec
    alone; here it runs again with this run's plan and world size (torchrun by hand may differ from
    the spec's numNodes x procsPerNode, and the plan's tp sets the data-parallel ranks)."""
    problems = deepspeed_override_problems(overrides, derived, hpz=hpz)
    if problems:
        raise SpecError("; ".join(f"{where}: {problem}" for where, problem in problems))
