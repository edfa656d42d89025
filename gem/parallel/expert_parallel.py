"""Expert parallelism for dense expert ensembles (GEM's Wukong / DHEN experts).

GEM's experts are not token-routed: every expert runs on every example and their outputs are
combined (GEM-26: "local experts on the full batch"). A module is an ensemble when it has

    experts: nn.ModuleList          E experts with the same output shape
    expert_combine: str             "concat" (along the last dim, expert order) | "sum" | "mean"

and its forward is combine([e(x) for e in experts]), or when it keeps its experts stacked
(gem.modules.mowe.MixtureOfWukongExperts):

    num_experts, expert_slice(rank, world, num_experts), forward_experts(x, sl) -> [B, m, ...],
    combine(all experts' outputs [B, M, ...]); every expert parameter has a leading expert dim M

in which case the module keeps its parameters' expert-slice and its forward is replaced in place
(parameter names are unchanged). Either way the experts are split over the ep ranks of an
expert-parallel group (E/ep each):

    x_all = all_gather(x)                   [Σ B_i, ...]  the group's whole batch (EP ranks hold different examples)
    y_e   = e(x_all) for my experts         each local expert on the full batch
    concat: all_to_all back to the example's owner, experts concatenated in global order
    sum/mean: Σ_my experts, then reduce_scatter by example owner (GEM-26's EP reduce-scatter)

All collectives are exact adjoints (gem/parallel/functional.py): an expert's gradient on its
owner is the sum over the group's examples, and `sync_gradients` sums it over the expert's
replicas (the expert_data group) and divides by the data ranks, as DeepSpeed does for MoE.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gem.parallel.functional import all_gather_rows, all_to_all_rows, gather_sizes, reduce_scatter_rows

COMBINES = ("concat", "sum", "mean")

#: Attribute set on expert parameters: the group their replicas live in (see parallelize.sync_gradients).
GRAD_GROUP_ATTR = "_gem_grad_group"


def is_expert_ensemble(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.ModuleList) and \
        getattr(module, "expert_combine", None) in COMBINES


class ExpertParallel(nn.Module):
    """An ensemble whose experts are spread over an expert-parallel group."""

    def __init__(self, ensemble: nn.Module, group):
        super().__init__()
        if not is_expert_ensemble(ensemble):
            raise TypeError(f"{type(ensemble).__name__} is not a dense expert ensemble "
                            "(needs experts: nn.ModuleList and expert_combine in concat|sum|mean)")
        ep, r = dist.get_world_size(group), dist.get_rank(group)
        num = len(ensemble.experts)
        if num % ep:
            raise ValueError(f"{num} experts cannot be split evenly over ep={ep} ranks")
        per = num // ep
        self.group, self.num_experts, self.combine = group, num, ensemble.expert_combine
        self.first_expert = r * per
        self.experts = nn.ModuleList(ensemble.experts[r * per:(r + 1) * per])  # E/ep local experts
        for p in self.experts.parameters():
            setattr(p, GRAD_GROUP_ATTR, "expert_data")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = gather_sizes(x.shape[0], self.group, x.device)  # examples held by each EP rank
        x_all = all_gather_rows(x, self.group, sizes)  # [ΣB, ...]
        outs = [e(x_all) for e in self.experts]  # E/ep x [ΣB, ..., d_out]
        if self.combine == "concat":
            y = torch.cat(outs, dim=-1)  # [ΣB, ..., E/ep * d_out]
            mine = all_to_all_rows(y, sizes, [x.shape[0]] * len(sizes), self.group)  # [ep * B, ..., E/ep * d_out]
            blocks = mine.split(x.shape[0])  # one block per source rank = its experts, in expert order
            return torch.cat(blocks, dim=-1)  # [B, ..., E * d_out]
        y = torch.stack(outs).sum(0)  # [ΣB, ..., d_out]
        y = reduce_scatter_rows(y, sizes, self.group)  # [B, ..., d_out]: Σ over every expert
        return y / self.num_experts if self.combine == "mean" else y

    def extra_repr(self) -> str:
        return f"experts {self.first_expert}..{self.first_expert + len(self.experts) - 1} of {self.num_experts}, combine={self.combine}"


# ---------------------------------------------------------------------------- stacked experts

#: Set on a stacked expert parameter: its dim 0 holds this rank's experts (full_state_dict gathers it).
STACKED_ATTR = "_gem_expert_stacked"


def is_stacked_experts(module: nn.Module) -> bool:
    return all(callable(getattr(module, a, None)) for a in ("forward_experts", "combine", "expert_slice")) \
        and isinstance(getattr(module, "num_experts", None), int)


def _stacked_forward(self, z: torch.Tensor) -> torch.Tensor:
    group = self._gem_ep_group
    sizes = gather_sizes(z.shape[0], group, z.device)
    z_all = all_gather_rows(z, group, sizes)  # [ΣB, ...] the group's examples
    out = self.forward_experts(z_all)  # [ΣB, M/ep, ...] this rank's experts (its parameters hold only those)
    mine = all_to_all_rows(out, sizes, [z.shape[0]] * len(sizes), group)  # [ep * B, M/ep, ...]
    return self.combine(torch.cat(mine.split(z.shape[0]), dim=1))  # experts back in global order: [B, M, ...]


def shard_stacked_experts(module: nn.Module, group) -> None:
    """Keep this rank's experts of a stacked ensemble and route its forward through the EP group."""
    ep, r, num = dist.get_world_size(group), dist.get_rank(group), module.num_experts
    sl = module.expert_slice(r, ep, num)
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() and p.shape[0] == num:
            local = nn.Parameter(p.detach()[sl].clone(), requires_grad=p.requires_grad)
            setattr(local, GRAD_GROUP_ATTR, "expert_data")
            setattr(local, STACKED_ATTR, True)
            setattr(module, name, local)
    module._gem_ep_group = group
    module.forward = _stacked_forward.__get__(module)


def apply_expert_parallel(model: nn.Module, group) -> list[str]:
    """Split every dense expert ensemble in `model` over the EP group. Returns their names."""
    done = []
    for name, mod in list(model.named_modules()):
        if not name or any(name.startswith(d + ".") for d in done):
            continue
        if is_stacked_experts(mod):
            shard_stacked_experts(mod, group)
            done.append(name)
        elif is_expert_ensemble(mod):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, ExpertParallel(mod, group))
            done.append(name)
    return done
