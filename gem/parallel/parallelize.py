"""Apply a ParallelPlan to a single-device model, from outside it (torchtitan's parallelize_*).

    model = parallelize(model, plan, mesh)     # same seed on every rank first: the shards come from one init
    loss = loss_fn(model(batch), batch); loss.backward()
    sync_gradients(model, mesh)                # without DeepSpeed; DeepSpeed does the same itself
    optimizer.step()

Fixed order:
  1. tensor parallel: the `tp_plan` argument, else the model's `tp_plan(tp)` method (Kunlun: block
     attention heads and per-token FFNs), else MLP-shaped modules (fc1/fc2 Linear pairs) -> column/row shards
  2. expert parallel: dense expert ensembles (experts + expert_combine) -> E/ep experts per rank
  3. sparse: nn.Embedding tables with >= sparse_min_rows rows -> row-wise shards over the sparse group
  4. context parallel: the model's forward runs each cp rank on a token-balanced sub-batch
The model's code is untouched and so are its parameter names (only tp and ep change shapes); a dimension switched on that finds nothing to act on is logged as
a warning (its ranks then simply hold more copies).

Gradients: every parameter is tagged with the group holding its replicas (data for dense params,
expert_data for experts, sparse_replica for embedding shards). `sync_gradients` sums each over
that group and divides by the number of data ranks, which turns the exact-adjoint gradients of
gem/parallel/functional.py into the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from gem.parallel.context_parallel import apply_context_parallel
from gem.parallel.expert_parallel import GRAD_GROUP_ATTR, apply_expert_parallel
from gem.parallel.mesh import ParallelMesh
from gem.parallel.plan import ModelShapeHints, ParallelPlan
from gem.parallel.sharded_embedding import apply_sparse_sharding
from gem.parallel.tensor_parallel import apply_tensor_parallel, tp_plan_for, tp_split_shape

log = logging.getLogger("gem.parallel")

#: Embedding tables at least this big are row-sharded (smaller ones cost more to shard than to copy).
SPARSE_MIN_ROWS = 1024


@dataclass
class Applied:
    """What parallelize changed, for logs and the trainer's report."""

    tensor_parallel: list[str] = field(default_factory=list)
    expert_parallel: list[str] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)
    context_parallel: bool = False
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"tp on {len(self.tensor_parallel)} linears, ep on {len(self.expert_parallel)} ensembles, "
                f"{len(self.sparse)} sharded tables, cp {'on' if self.context_parallel else 'off'}")


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: ParallelMesh, *,
                tp_plan: Mapping[str, str] | None = None, sparse_min_rows: int = SPARSE_MIN_ROWS) -> nn.Module:
    """`model` with `plan` applied in place (returned for convenience); `model.gem_parallel` says what changed."""
    if mesh.plan != plan:
        raise ValueError(f"the mesh was built for {mesh.plan.describe()}, not {plan.describe()}")
    applied = Applied()
    if plan.tp_enabled:
        # With ep, experts stay whole under tp: ExpertParallel and full_state_dict treat them as unsplit
        # matrices, and the shard optimizer counts each expert once per tp peer (gem/train/optim.py).
        ensembles = _expert_ensembles(model) if plan.ep_enabled else []
        applied.tensor_parallel = apply_tensor_parallel(model, mesh.get_group("tp"),
                                                        tp_plan if tp_plan is not None else tp_plan_for(model, plan.tp),
                                                        exclude=ensembles)
        if not applied.tensor_parallel:
            applied.warnings.append(f"tp={plan.tp} has no effect: no layer of the model's tp plan (or MLP: fc1/fc2 "
                                    f"Linear pair) divisible by {plan.tp}")
    if plan.ep_enabled:
        applied.expert_parallel = apply_expert_parallel(model, mesh.get_group("ep"))
        if not applied.expert_parallel:
            applied.warnings.append(f"ep={plan.ep} has no effect: the model has no dense expert ensemble")
    if plan.sparse_enabled:
        applied.sparse = apply_sparse_sharding(model, mesh.get_group("sparse"), min_rows=sparse_min_rows)
        if not applied.sparse:
            applied.warnings.append(f"sparse_shard={plan.sparse_shard} has no effect: no embedding table "
                                    f"has >= {sparse_min_rows} rows")
    for p in model.parameters():
        if not hasattr(p, GRAD_GROUP_ATTR):
            setattr(p, GRAD_GROUP_ATTR, "data")
    if plan.cp_enabled:
        apply_context_parallel(model, mesh.get_group("cp"))
        applied.context_parallel = True
    for w in applied.warnings:
        log.warning("%s", w)
    model.gem_parallel = applied
    return model


def _expert_ensembles(model: nn.Module) -> list[str]:
    """Names of the dense expert ensembles expert parallelism will split (what apply_expert_parallel finds)."""
    from gem.parallel.expert_parallel import is_expert_ensemble, is_stacked_experts

    return [name for name, mod in model.named_modules()
            if name and (is_expert_ensemble(mod) or is_stacked_experts(mod))]


def grad_group(param: torch.Tensor) -> str:
    """The group holding this parameter's replicas (set by parallelize; data when untouched)."""
    return getattr(param, GRAD_GROUP_ATTR, "data")


@torch.no_grad()
def sync_gradients(model: nn.Module, mesh: ParallelMesh) -> None:
    """Sum each gradient over its replicas' group, divide by the data ranks. Collective.

    A parameter without a gradient on this rank counts as zero (every rank must join every
    all-reduce). One flat all-reduce per group.
    """
    sync_parameter_gradients([p for p in model.parameters() if p.requires_grad], mesh)


@torch.no_grad()
def sync_parameter_gradients(params: list[nn.Parameter], mesh: ParallelMesh) -> None:
    """sync_gradients for a subset (the same subset on every rank, in the same order). Collective."""
    by_group: dict[str, list[nn.Parameter]] = {}
    for p in params:
        by_group.setdefault(grad_group(p), []).append(p)
    scale = 1.0 / mesh.plan.data_world
    for name in sorted(by_group):
        members = by_group[name]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in members]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if mesh.size(name) > 1:
            dist.all_reduce(flat, group=mesh.get_group(name))
        flat.mul_(scale)
        for p, chunk in zip(members, flat.split([g.numel() for g in grads])):
            if p.grad is None:
                p.grad = chunk.view_as(p).clone()
            else:
                p.grad.copy_(chunk.view_as(p))


def _gather_objects(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@torch.no_grad()
def full_state_dict(model: nn.Module, mesh: ParallelMesh | None = None, *, grads: bool = False,
                    value: Callable[[nn.Parameter], torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """The single-device state dict (names and shapes of the unparallelized model), on every rank.

    Shards are gathered from their groups (tp columns/rows, expert owners, embedding rows); with
    grads=True the same for the gradients; `value(param)` overrides what is read from a parameter
    (e.g. DeepSpeed's fp32 master copy). Collective; it moves whole tensors as pickled objects
    (fine for checkpoints of this size and tests; not for billions of parameters).
    """
    from gem.parallel.expert_parallel import STACKED_ATTR, ExpertParallel
    from gem.parallel.sharded_embedding import RowShardedEmbedding
    from gem.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    del mesh  # every sharded module knows its own group
    root = model
    out: dict[str, torch.Tensor] = {}
    read = value

    def value(p: torch.Tensor) -> torch.Tensor:
        t = read(p) if read is not None else None
        if t is None:
            t = p.grad if grads else p
        return (torch.zeros_like(p) if t is None else t).detach().cpu().clone()

    for mod_name, mod in root.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, ExpertParallel):
            local = {name: value(p) for name, p in mod.experts.named_parameters()}
            for r, part in enumerate(_gather_objects(local, mod.group)):
                for name, t in part.items():
                    i, rest = name.split(".", 1)
                    out[f"{prefix}experts.{r * len(mod.experts) + int(i)}.{rest}"] = t
            continue
        if any(isinstance(m, ExpertParallel) for m in _ancestors(root, mod_name)):
            continue  # inside an ExpertParallel: handled above
        for name, p in mod.named_parameters(recurse=False):
            t = value(p)
            if isinstance(mod, ColumnParallelLinear):
                t = mod.unshard(_gather_objects(t, mod.group))
            elif isinstance(mod, RowParallelLinear) and name == "weight":
                t = torch.cat(_gather_objects(t, mod.group), dim=1)
            elif isinstance(mod, RowShardedEmbedding) or getattr(p, STACKED_ATTR, False):
                group = mod.group if isinstance(mod, RowShardedEmbedding) else mod._gem_ep_group
                t = torch.cat(_gather_objects(t, group), dim=0)
            out[prefix + name] = t
        if not grads:
            for name, b in mod.named_buffers(recurse=False):
                out[prefix + name] = b.detach().cpu().clone()
    return out


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".") if name else []
    return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]


def model_shape_hints(model: nn.Module, *, max_seq_len: int = 0, sparse_min_rows: int = SPARSE_MIN_ROWS,
                      gpu_memory_bytes: int | None = None) -> ModelShapeHints:
    """What auto_plan needs, read off a single-device model (before parallelize)."""
    from gem.parallel.expert_parallel import is_expert_ensemble, is_stacked_experts

    sparse = experts = expert_params = 0
    seen: set[int] = set()
    for mod in model.modules():
        if is_stacked_experts(mod) or is_expert_ensemble(mod):
            num = mod.num_experts if is_stacked_experts(mod) else len(mod.experts)
            params = [p for p in mod.parameters() if id(p) not in seen]
            per = sum(p.numel() for p in params if (p.dim() and p.shape[0] == num) or not is_stacked_experts(mod)) // num
            experts, expert_params = max(experts, num), max(expert_params, per)
            seen.update(id(p) for p in params)
        elif isinstance(mod, nn.Embedding) and mod.num_embeddings >= sparse_min_rows:
            sparse += mod.weight.numel()
            seen.add(id(mod.weight))
    hidden, units = tp_split_shape(model)  # what parallelize's tp would split, not just any wide layer
    dense = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    kwargs = {"gpu_memory_bytes": gpu_memory_bytes} if gpu_memory_bytes else {}
    if not kwargs and torch.cuda.is_available():
        kwargs["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return ModelShapeHints(dense_params=dense, hidden_dim=hidden, hidden_units=units, num_experts=experts,
                           expert_params=expert_params, max_seq_len=max_seq_len, sparse_params=sparse, **kwargs)
