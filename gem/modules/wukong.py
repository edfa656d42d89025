"""Wukong interaction layer (notes section 7): an FM block and a linear compression block.

    FMB: F = MLP(LN(flatten(X (Xᵀ Y))))  -> [B, n_F, d]      (low-rank optimised FM, Y [n, k])
    LCB: L = Wᵀ X                         -> [B, n_L, d]      (token-axis linear)
    X'  = LN([F ‖ L] + X)                 (token-axis projection of X when n != n_F + n_L)

This single-layer module is the plain reference; gem.modules.mowe stacks several of them as
experts with a leading expert dimension.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gem.modules.common import TokenLinear, linear_flops


class WukongLayer(nn.Module):
    def __init__(self, *, num_tokens: int, dim: int, num_fm: int, num_lcb: int, rank: int, hidden: int):
        super().__init__()
        self.n, self.d, self.n_f, self.n_l, self.k, self.hidden = num_tokens, dim, num_fm, num_lcb, rank, hidden
        self.y = nn.Parameter(torch.randn(num_tokens, rank) / math.sqrt(num_tokens))
        self.fm_norm = nn.LayerNorm(num_tokens * rank)
        self.fc1 = nn.Linear(num_tokens * rank, hidden)
        self.fc2 = nn.Linear(hidden, num_fm * dim)
        self.lcb = TokenLinear(num_tokens, num_lcb)
        self.res = None if num_tokens == num_fm + num_lcb else TokenLinear(num_tokens, num_fm + num_lcb)
        self.out_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, n, d] -> [B, n_F + n_L, d]"""
        B = x.shape[0]
        xty = torch.einsum("bnd,nk->bdk", x, self.y.to(x.dtype))  # [B, d, k]
        fm = torch.bmm(x, xty).flatten(1)  # [B, n·k]: the n x k interaction matrix X (Xᵀ Y)
        f = self.fc2(F.gelu(self.fc1(self.fm_norm(fm)))).view(B, self.n_f, self.d)
        lcb = self.lcb(x)  # [B, n_L, d]
        res = x if self.res is None else self.res(x)
        return self.out_norm(torch.cat([f, lcb], dim=1) + res)

    def flops(self, batch: int) -> float:
        n, d, k = self.n, self.d, self.k
        total = 2 * 2.0 * batch * n * d * k  # Xᵀ Y and X (Xᵀ Y)
        total += linear_flops(batch, n * k, self.hidden) + linear_flops(batch, self.hidden, self.n_f * d)
        total += self.lcb.flops(batch, d) + (0.0 if self.res is None else self.res.flops(batch, d))
        return total
