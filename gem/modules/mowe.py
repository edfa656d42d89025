"""Mixture of Wukong Experts (notes section 8): global interaction, scaled horizontally.

Every expert m reads its own token-axis projection of the interaction input
Z = [X ‖ S_sum] [B, N_z, d], runs one Wukong layer, and the experts' outputs are concatenated
and projected back to N_out tokens. Experts are dense ensemble members over the whole batch,
not token-routed: GEM trains them with expert parallelism, one expert group per rank.

Layout for expert parallelism: every expert parameter has a leading expert dimension [M, ...],
so a rank holding experts `expert_slice(rank, world)` keeps `param[sl]` and runs
`forward_experts(z, sl)`; an all-gather of the [B, m, n_e, d] outputs over the expert axis
then feeds `combine`. On one device `forward` does both.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gem.modules.common import TokenLinear, linear_flops
from gem.modules.wukong import WukongLayer


def _stacked(m: int, d_in: int, d_out: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(m, d_in, d_out) / math.sqrt(d_in))


class MixtureOfWukongExperts(nn.Module):
    def __init__(self, *, num_in: int, num_out: int, dim: int, num_experts: int, expert_tokens: int,
                 rank: int, hidden: int):
        super().__init__()
        M, n, d = num_experts, expert_tokens, dim
        self.num_experts, self.n, self.d, self.k, self.hidden = M, n, d, rank, hidden
        self.n_f = n // 2
        self.n_l = n - self.n_f
        self.w_in = _stacked(M, num_in, n)  # LCB_m: each expert's view of Z
        self.y = nn.Parameter(torch.randn(M, n, rank) / math.sqrt(n))
        self.fm_norm_w = nn.Parameter(torch.ones(M, n * rank))
        self.fm_norm_b = nn.Parameter(torch.zeros(M, n * rank))
        self.fc1_w, self.fc1_b = _stacked(M, n * rank, hidden), nn.Parameter(torch.zeros(M, hidden))
        self.fc2_w, self.fc2_b = _stacked(M, hidden, self.n_f * d), nn.Parameter(torch.zeros(M, self.n_f * d))
        self.lcb = _stacked(M, n, self.n_l)
        self.out_norm_w = nn.Parameter(torch.ones(M, d))
        self.out_norm_b = nn.Parameter(torch.zeros(M, d))
        self.combine_proj = TokenLinear(M * n, num_out)

    @staticmethod
    def expert_slice(rank: int, world: int, num_experts: int) -> slice:
        """The contiguous experts rank `rank` of `world` expert-parallel ranks holds."""
        if num_experts % world:
            raise ValueError(f"{num_experts} experts cannot be split evenly over {world} expert-parallel ranks")
        per = num_experts // world
        return slice(rank * per, (rank + 1) * per)

    def forward_experts(self, z: torch.Tensor, sl: slice = slice(None)) -> torch.Tensor:
        """z [B, N_z, d] -> the selected experts' outputs [B, m, n_e, d]."""
        B, dt = z.shape[0], z.dtype
        x = torch.einsum("bzd,mze->bmed", z, self.w_in[sl].to(dt))  # [B, m, n, d]
        m = x.shape[1]
        xty = torch.einsum("bmnd,mnk->bmdk", x, self.y[sl].to(dt))  # [B, m, d, k]
        fm = torch.matmul(x, xty).reshape(B, m, self.n * self.k)  # [B, m, n·k]
        fm = F.layer_norm(fm, (self.n * self.k,)) * self.fm_norm_w[sl].to(dt) + self.fm_norm_b[sl].to(dt)
        h = F.gelu(torch.einsum("bmi,mio->bmo", fm, self.fc1_w[sl].to(dt)) + self.fc1_b[sl].to(dt))
        f = (torch.einsum("bmh,mho->bmo", h, self.fc2_w[sl].to(dt)) + self.fc2_b[sl].to(dt)).view(B, m, self.n_f, self.d)
        lcb = torch.einsum("bmnd,mnl->bmld", x, self.lcb[sl].to(dt))  # [B, m, n_L, d]
        out = F.layer_norm(torch.cat([f, lcb], dim=2) + x, (self.d,))
        return out * self.out_norm_w[sl, None, :].to(dt) + self.out_norm_b[sl, None, :].to(dt)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """[B, M, n_e, d] (all experts) -> [B, N_out, d]"""
        B = expert_out.shape[0]
        return self.combine_proj(expert_out.reshape(B, self.num_experts * self.n, self.d))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.combine(self.forward_experts(z))

    @torch.no_grad()
    def load_experts(self, layers: list[WukongLayer], w_in: list[torch.Tensor]) -> None:
        """Copy M plain Wukong layers (and their input projections) into the stacked layout (tests)."""
        for m, (layer, w) in enumerate(zip(layers, w_in)):
            self.w_in[m].copy_(w)
            self.y[m].copy_(layer.y)
            self.fm_norm_w[m].copy_(layer.fm_norm.weight)
            self.fm_norm_b[m].copy_(layer.fm_norm.bias)
            self.fc1_w[m].copy_(layer.fc1.weight.T)
            self.fc1_b[m].copy_(layer.fc1.bias)
            self.fc2_w[m].copy_(layer.fc2.weight.T)
            self.fc2_b[m].copy_(layer.fc2.bias)
            self.lcb[m].copy_(layer.lcb.weight)
            self.out_norm_w[m].copy_(layer.out_norm.weight)
            self.out_norm_b[m].copy_(layer.out_norm.bias)

    def flops(self, batch: int) -> float:
        M, n, d, k = self.num_experts, self.n, self.d, self.k
        num_in = self.w_in.shape[1]
        per_expert = 2.0 * num_in * n * d  # input projection
        per_expert += 2 * 2.0 * n * d * k + linear_flops(1, n * k, self.hidden) + linear_flops(1, self.hidden, self.n_f * d)
        per_expert += 2.0 * n * self.n_l * d
        return batch * M * per_expert + self.combine_proj.flops(batch, d)
