"""Differentiable collectives along dim 0 ("rows"), each backward the exact adjoint of its forward.

    all_gather_rows(x, group)             [n_i, ...] on rank i  ->  [Σ n_i, ...] on every rank
    reduce_scatter_rows(x, sizes, group)  [Σ n_i, ...] on every rank, summed  ->  rows of rank i
    all_to_all_rows(x, send, recv, group) rows x[send[0]] to rank 0, ...; receives recv[j] rows from j
    all_reduce_sum(x, group)              Σ over ranks, every rank

Exact adjoints make the gradient rule of every parallel module here the same: a parameter's
gradient on a rank is the derivative of the sum of the losses of every rank it influenced, so the
trainer sums gradients over a parameter's replicas and divides by the number of data ranks
(gem/parallel/parallelize.py, `sync_gradients`), which is what DeepSpeed does for dense and
expert parameters alike. Row counts may differ between ranks (they are exchanged first).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# torch 2.13 renamed the tensor collectives (the old names warn); keep both working
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def gather_sizes(n: int, group, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's n, in group order. `device`: the data's (NCCL groups take only CUDA tensors)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(_size(group))]
    dist.all_gather(out, t, group=group)
    return [int(o) for o in out]


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    m = max(sizes)
    padded = x.new_zeros((m,) + x.shape[1:])
    padded[: x.shape[0]] = x
    out = x.new_empty((m * len(sizes),) + x.shape[1:])
    _all_gather_single(out, padded.contiguous(), group=group)
    return torch.cat([out[i * m: i * m + n] for i, n in enumerate(sizes)])


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    m, r = max(sizes), _rank(group)
    chunks = x.split(sizes)
    padded = x.new_zeros((m * len(sizes),) + x.shape[1:])
    for i, c in enumerate(chunks):
        padded[i * m: i * m + c.shape[0]] = c
    out = x.new_empty((m,) + x.shape[1:])
    _reduce_scatter_single(out, padded, group=group)
    return out[: sizes[r]]


def _all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all_rows(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def all_gather_rows(x: torch.Tensor, group, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's rows in group order; backward reduce-scatters (sums) the gradient."""
    if _size(group) == 1:
        return x
    sizes = sizes if sizes is not None else gather_sizes(x.shape[0], group, x.device)
    return _AllGatherRows.apply(x, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum x over ranks and keep this rank's `sizes[rank]` rows; backward all-gathers."""
    if _size(group) == 1:
        return x
    return _ReduceScatterRows.apply(x, sizes, group)


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Send x's consecutive row blocks of sizes `send` to ranks 0..n-1; receive `recv` rows from each."""
    if _size(group) == 1:
        return x
    return _AllToAllRows.apply(x, send, recv, group)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Σ over ranks on every rank; backward is the same all-reduce (the exact adjoint)."""
    if _size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
