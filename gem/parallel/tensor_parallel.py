"""Tensor parallelism for MLPs and projections, in plain PyTorch (Megatron-LM's column/row split).

    y = fc2(act(fc1(x)))        fc1: ColumnParallelLinear  (rows of W1 split: each rank owns d_h/tp outputs)
                                fc2: RowParallelLinear     (columns of W2 split: partial sums all-reduced)

Per MLP: one all-reduce of the output in forward and one of the input gradient in backward, both
inside the tensor-parallel group (inside one node, see plan.py). The elementwise activation
between the two needs no communication.

Gradient convention (Megatron's, unlike gem/parallel/functional.py): every tp rank ends backward
holding the true gradient of the loss for its shard and for every replicated parameter, because the
tp ranks of a group see identical inputs and compute the identical loss. So tensor parallelism adds
nothing to the gradient sync: the data group (plan.py) excludes tp.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

log = logging.getLogger("gem.parallel")


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward (the input fans out to every shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward (sum of partial products); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[r].contiguous(), None


def _matmul_of(linear: nn.Linear, local_weight: torch.Tensor) -> Callable:
    """The matmul a shard of `linear` keeps: its class's own `matmul` (gem.train.precision.MXFP8Linear's) when
    the shard's widths are still multiples of the class's `matmul_block`, else F.linear (with a warning)."""
    matmul = getattr(type(linear), "matmul", None)
    if matmul is None:
        return F.linear
    block = getattr(type(linear), "matmul_block", 1)
    if any(n % block for n in local_weight.shape):
        log.warning("tp: a %dx%d shard of a %s is not made of whole %d-wide blocks: it runs as a plain linear",
                    *local_weight.shape, type(linear).__name__, block)
        return F.linear
    return matmul


def _mark_sharded(param: nn.Parameter, dim: int) -> None:
    """Megatron's attributes: DeepSpeed's gradient-norm clipping counts such a parameter on every tp rank
    (each holds a different shard) and a replicated one only on tp rank 0."""
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


class ColumnParallelLinear(nn.Module):
    """y[..., shard] = x W[shard]^T + b[shard]: this rank's out_features/tp output columns."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group, gather_output: bool = False):
        super().__init__()
        tp = dist.get_world_size(group)
        if out_features % tp:
            raise ValueError(f"out_features={out_features} is not divisible by tp={tp}")
        self.in_features, self.out_features, self.group, self.gather_output = in_features, out_features, group, gather_output
        self.groups = 1  # stacked output blocks split separately (from_linear's groups)
        self.matmul = F.linear  # from_linear keeps the replaced layer's own (MXFP8)
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp)) if bias else None
        _mark_sharded(self.weight, 0)
        if self.bias is not None:
            _mark_sharded(self.bias, 0)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, *, gather_output: bool = False,
                    groups: int = 1) -> "ColumnParallelLinear":
        """This rank's output rows of `linear`. groups=g: the outputs are g stacked blocks (a fused q/k/v
        projection has 3) and the rank takes its slice of each, kept in block order ([q_r; k_r; v_r]),
        so the module's own reshape into (g, heads, head_dim) works on the local width."""
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.out_features % (groups * tp):
            raise ValueError(f"out_features={linear.out_features} is not divisible by {groups} blocks x tp={tp}")
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                  gather_output=gather_output).to(linear.weight.device, linear.weight.dtype)
        mod.groups = groups
        if groups > 1:
            for p in mod.parameters():
                p.partition_stride = groups

        def local(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([block.chunk(tp, dim=0)[r] for block in t.chunk(groups, dim=0)], dim=0)

        with torch.no_grad():
            mod.weight.copy_(local(linear.weight))
            if linear.bias is not None:
                mod.bias.copy_(local(linear.bias))
        mod.matmul = _matmul_of(linear, mod.weight)
        return mod

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (rank order): the inverse of from_linear's split."""
        blocks = [p.chunk(self.groups, dim=0) for p in parts]
        return torch.cat([b[g] for g in range(self.groups) for b in blocks], dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(_CopyToRegion.apply(x, self.group), self.weight, self.bias)  # [..., out/tp]
        if self.gather_output and self.groups > 1:
            raise ValueError("gather_output of a grouped (fused q/k/v) split would interleave the blocks")
        return _GatherFromRegion.apply(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_out={self.weight.shape[0]}"


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x[..., shard] W[:, shard]^T + b: input split by features, output all-reduced."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, group):
        super().__init__()
        tp = dist.get_world_size(group)
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by tp={tp}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # replicated, added once
        self.matmul = F.linear  # from_linear keeps the replaced layer's own (MXFP8)
        _mark_sharded(self.weight, 1)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group) -> "RowParallelLinear":
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  group=group).to(linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            mod.weight.copy_(linear.weight.chunk(tp, dim=1)[r])
            if linear.bias is not None:
                mod.bias.copy_(linear.bias)
        mod.matmul = _matmul_of(linear, mod.weight)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromRegion.apply(self.matmul(x, self.weight, None), self.group)  # [..., out]
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_in={self.weight.shape[1]}"


# ---------------------------------------------------------------------------- plans

COLWISE, ROWWISE = "colwise", "rowwise"
#: A fused q/k/v projection ([q; k; v] rows): colwise over each of the 3 blocks, so a rank owns whole
#: heads when num_heads % tp == 0 (Megatron's attention split; the output projection is ROWWISE).
QKV_COLWISE = "colwise_qkv"
_GROUPS = {COLWISE: 1, QKV_COLWISE: 3}


def default_tp_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """Column/row pairs for every MLP-shaped module: children `fc1` and `fc2` that are nn.Linear.

    fc1's outputs (the hidden width) must be divisible by tp; narrower MLPs are left whole.
    """
    plan: dict[str, str] = {}
    for name, mod in model.named_modules():
        fc1, fc2 = getattr(mod, "fc1", None), getattr(mod, "fc2", None)
        if isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear) and fc1.out_features % tp == 0 \
                and fc2.in_features == fc1.out_features:
            prefix = f"{name}." if name else ""
            plan[f"{prefix}fc1"], plan[f"{prefix}fc2"] = COLWISE, ROWWISE
    return plan


def tp_plan_for(model: nn.Module, tp: int) -> dict[str, str]:
    """What parallelize splits at degree tp: the model's own `tp_plan(tp)` when it has one, else default_tp_plan."""
    own = getattr(model, "tp_plan", None)
    return own(tp) if callable(own) else default_tp_plan(model, tp)


def tp_split_shape(model: nn.Module, max_degree: int = 64) -> tuple[int, int]:
    """(width, units) of the widest layer the model's tp plan splits, for auto_plan's hints; (0, 0) if none.

    width: output columns of one colwise block (a fused q/k/v layer counts one of its 3 blocks);
    units: the lcm of the degrees <= max_degree at which the plan still splits that layer (e.g. its
    attention heads), so a degree up to max_degree divides units exactly when the plan can use it.
    """
    def colwise(tp: int) -> dict[str, int]:  # name -> block width of the linears split colwise at tp
        plan = tp_plan_for(model, tp)
        out = {}
        for name, mod in model.named_modules():
            style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
            if style in _GROUPS and isinstance(mod, nn.Linear):
                out[name] = mod.out_features // _GROUPS[style]
        return out

    widths = colwise(1)
    if not widths:
        return 0, 0
    name, width = max(widths.items(), key=lambda kv: kv[1])
    units = 1
    for t in range(2, max_degree + 1):
        if width % t == 0 and name in colwise(t):
            units = math.lcm(units, t)
    return width, units


def apply_tensor_parallel(model: nn.Module, group, plan: Mapping[str, str], *,
                          exclude: Sequence[str] = ()) -> list[str]:
    """Replace the nn.Linear modules named by `plan` (fnmatch patterns -> colwise|rowwise) in place.

    Returns the names replaced; modules under a name in `exclude` are left whole. A colwise layer must
    feed a rowwise one through elementwise ops only: that is what keeps the hidden activations split
    and the forward to one all-reduce.
    """
    done = []
    for name, mod in list(model.named_modules()):
        if any(name.startswith(prefix + ".") for prefix in exclude):
            continue
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None or not isinstance(mod, nn.Linear):
            continue
        if style in _GROUPS:
            new = ColumnParallelLinear.from_linear(mod, group, groups=_GROUPS[style])
        elif style == ROWWISE:
            new = RowParallelLinear.from_linear(mod, group)
        else:
            raise ValueError(f"unknown tp style {style!r} for {name}: {', '.join([*_GROUPS, ROWWISE])}")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        done.append(name)
    return done
