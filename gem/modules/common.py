"""Building blocks shared by the modules: the kernel switch, token-axis linears, FLOP helpers."""

from __future__ import annotations

import math

import torch
from torch import nn

from gem.ops.common import DEFAULT_KERNEL, Kernel, block_leads


class JaggedModule(nn.Module):
    """A module that calls jagged ops; `set_kernel` switches the kernel of a whole stack."""

    kernel: Kernel = DEFAULT_KERNEL


def set_kernel(module: nn.Module, kernel: Kernel) -> nn.Module:
    for m in module.modules():
        if isinstance(m, JaggedModule):
            m.kernel = kernel
    return module


class _RMSNormFn(torch.autograd.Function):
    """y = x · r · w, r = rsqrt(mean(x²) + eps) over the last dim, with a hand-written backward
    (PyTorch's CPU backward of rms_norm is a chain of ~10 elementwise kernels; this is 4 passes).

    dx = r · (g·w − x · r² · mean(g·w·x)),   dw = Σ_rows g · x · r
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        D = x.shape[-1]
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16/fp16/fp32, fp64 stays fp64
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)  # one pass
        r = torch.rsqrt(norm.square() / D + eps)  # [..., 1]
        xr = x * r.to(x.dtype)
        ctx.save_for_backward(xr, r, weight)
        return xr * weight.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor):
        xr, r, weight = ctx.saved_tensors
        gw = g * weight.to(g.dtype)
        proj = torch.linalg.vecdot(gw, xr, dim=-1).unsqueeze(-1) / g.shape[-1]  # r · mean(g·w·x), one pass
        dx = (gw - xr * proj.to(xr.dtype)) * r.to(xr.dtype)
        dw = (g * xr).reshape(-1, g.shape[-1]).sum(0, dtype=r.dtype)
        return dx, dw.to(weight.dtype), None


_FP32_EPS = torch.finfo(torch.float32).eps


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same fp32 result) with a cheaper backward; works in the input's dtype.

    eps=None means float32's eps for every input dtype: the mean square is taken in fp32 anyway.
    nn.RMSNorm would use the input dtype's (0.0078 for bf16), larger than the mean square of the
    PFFN keys and HSP summaries at init (~1e-3), so under bf16 the norms hardly normalised and the
    model computed another function than in fp32.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = _FP32_EPS if self.eps is None else self.eps
        return _RMSNormFn.apply(x, self.weight, eps)


class TokenLinear(nn.Module):
    """A linear map over the token axis: [B, n_in, d] -> [B, n_out, d] (LCE / LCB)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bnd,no->bod", x, self.weight.to(x.dtype))

    def flops(self, batch: int, d: int) -> float:
        n_in, n_out = self.weight.shape
        return 2.0 * batch * n_in * n_out * d


class SelfGate(nn.Module):
    """x ⊙ σ(x W + b), token-wise: the InterFormer gate in its standard self-gating form."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.proj(x))

    def flops(self, rows: int) -> float:
        return linear_flops(rows, self.proj.in_features, self.proj.out_features)


def linear_flops(rows: float, d_in: int, d_out: int) -> float:
    """Multiply-adds of a [rows, d_in] x [d_in, d_out] matmul, counted as 2 FLOPs each."""
    return 2.0 * rows * d_in * d_out


def block_pairs(lengths: torch.Tensor, block: int, shift: int = 0, align: str = "start") -> float:
    """Σ over blocks of (tokens in the block)²: the (query, key) pairs block attention scores."""
    total = 0.0
    leads = block_leads(lengths, block, shift=shift, align=align)
    for n, lead in zip(lengths.tolist(), leads.tolist()):
        if n <= 0:
            continue
        first = min(n, block - lead)  # the first block is shorter by its lead
        rest = n - first
        full, tail = divmod(rest, block)
        total += first**2 + full * block**2 + tail**2
    return total


def pairwise_dots(tokens: torch.Tensor) -> torch.Tensor:
    """DLRM's dot interaction: the upper triangle (i < j) of tokens·tokensᵀ. [B, n, d] -> [B, n(n-1)/2]"""
    n = tokens.shape[1]
    iu = torch.triu_indices(n, n, offset=1, device=tokens.device)
    return torch.bmm(tokens, tokens.transpose(1, 2))[:, iu[0], iu[1]]


def pairwise_dots_flops(batch: int, n: int, d: int) -> float:
    return 2.0 * batch * n * n * d  # the full n x n product, as bmm computes it


def add_flops(acc: dict[str, float], key: str, value: float) -> None:
    acc[key] = acc.get(key, 0.0) + float(value)
