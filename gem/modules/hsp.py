"""Hierarchical Seed Pooling: over-complete learned seeds read the sequence (GDPA), then
SumKronLinear compresses them to a few summary tokens (notes section 5).

    Q = RMSNorm_h(LN(E_seed) W_q)              [n_seed, H, dh], shared by every example
    K, V = RMSNorm_h(S W_k), S W_v              [ΣL, H, dh]   (S: the PFFN's RMS-normalised output)
    H_seed = GDPA(Q, K, V, broadcast_q)         [B, n_seed, d_t]   act(0) = 0: no key mask
    Y = RMSNorm(Σ_i Z_iᵀ H_seed W_i)            [B, n_out, d_t]
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gem.modules.common import JaggedModule, RMSNorm, linear_flops
from gem.modules.config import TierConfig
from gem.modules.oneseq import TierBatch
from gem.ops import Kernel, gdpa


class SumKronLinear(nn.Module):
    """Y = Σ_{i<k} Z_iᵀ X W_i: a rank-k Kronecker-structured map [B, n_in, d_in] -> [B, n_out, d_out].

    vec(Y) = (Σ_i W_iᵀ ⊗ Z_iᵀ) vec(X): k(n_in·n_out + d_in·d_out) parameters instead of the
    n_in·n_out·d_in·d_out of a dense map of the flattened tokens.
    """

    def __init__(self, n_in: int, n_out: int, d_in: int, d_out: int, rank: int):
        super().__init__()
        self.z = nn.Parameter(torch.randn(rank, n_in, n_out) / math.sqrt(n_in))
        self.w = nn.Parameter(torch.randn(rank, d_in, d_out) / math.sqrt(d_in * rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n_in, n_out = self.z.shape
        B, _, d_in = x.shape
        t = torch.einsum("kio,bid->bokd", self.z.to(x.dtype), x)  # [B, n_out, k, d_in]: Z_iᵀ X for all i
        return t.reshape(B, n_out, k * d_in) @ self.w.to(x.dtype).reshape(k * d_in, -1)  # Σ_i (Z_iᵀ X) W_i

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The definition, one term at a time (tests)."""
        return sum(self.z[i].T @ x @ self.w[i] for i in range(self.z.shape[0]))

    def flops(self, batch: int) -> float:
        k, n_in, n_out = self.z.shape
        d_in, d_out = self.w.shape[1:]
        return 2.0 * batch * k * n_in * n_out * d_in + linear_flops(batch * n_out, k * d_in, d_out)


class HierarchicalSeedPooling(JaggedModule):
    def __init__(self, tier: TierConfig, *, rank: int, activation: str):
        super().__init__()
        self.tier, self.activation = tier, activation
        dt, dh = tier.dim, tier.head_dim
        self.seeds = nn.Parameter(torch.randn(tier.num_seeds, dt))
        self.seed_norm = nn.LayerNorm(dt)
        self.w_q = nn.Linear(dt, dt, bias=False)
        self.w_kv = nn.Linear(dt, 2 * dt, bias=False)  # reads the PFFN's RMS-normalised output: no extra norm
        self.q_norm, self.k_norm = RMSNorm(dh), RMSNorm(dh)
        self.compress = SumKronLinear(tier.num_seeds, tier.num_summary_tokens, dt, dt, rank)
        self.out_norm = RMSNorm(dt)
        # Scale after the activation: 1/max_seq_len keeps the sum over events bounded (HSTU-style).
        self.qk_scale = 1.0 / tier.max_seq_len

    def forward(self, tb: TierBatch) -> torch.Tensor:
        """-> [B, n_out, d_t]"""
        s = tb.values
        n, dt, H, dh = self.tier.num_seeds, self.tier.dim, self.tier.num_heads, self.tier.head_dim
        q = self.q_norm(self.w_q(self.seed_norm(self.seeds)).view(n, H, dh)) * dh**-0.5  # [n_seed, H, dh]
        k, v = self.w_kv(s).view(-1, 2, H, dh).unbind(1)  # [ΣL, H, dh] each
        k = self.k_norm(k)
        q = q.to(k.dtype)
        pooled = gdpa(q, k, v, k_offsets=tb.offsets, broadcast_q=True, activation=self.activation,
                      qk_scale=self.qk_scale, kernel=self.kernel,
                      buckets=tb.seed_buckets(n) if self.kernel == Kernel.TILED else None)  # [B, n_seed, H, dh]
        B = pooled.shape[0]
        return self.out_norm(self.compress(pooled.reshape(B, n, dt)))

    def flops(self, batch: int, tokens: float) -> float:
        t = self.tier
        return (linear_flops(t.num_seeds, t.dim, t.dim)  # seed queries: once per batch
                + linear_flops(tokens, t.dim, 2 * t.dim)  # K, V
                + 2 * 2.0 * tokens * t.num_seeds * t.dim  # scores + pooling over all heads
                + self.compress.flops(batch))
