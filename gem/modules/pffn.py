"""The personalised FFN as GDPA (notes sections 3 and 19.C.5), and a per-token FFN to compare.

PersonalizedFFN: an FFN whose two weight matrices are generated per example from the
non-sequence summary X_sum [B, n_sum, d]:

    K = RMSNorm_h(X_sum W_k), V = X_sum W_v       [B, n_sum, H, dh]   (W1 rows, W2 columns)
    S' = RMSNorm(GDPA(LN(S), K, V) + LN(S))       act(LN(S) Kᵀ) V / n_sum, per head

Keys are n_sum long (short-KV regime), so a token costs 4 · n_sum · d_t FLOPs instead of the
16 · d_t² of a 4x-wide per-token FFN, and every example gets its own FFN.
"""

from __future__ import annotations

import torch
from torch import nn

from gem.modules.common import JaggedModule, RMSNorm, linear_flops
from gem.modules.config import TierConfig
from gem.modules.oneseq import TierBatch
from gem.ops import Kernel, gdpa
from gem.ops.activations import ACTIVATIONS, check_activations


class PersonalizedFFN(JaggedModule):
    def __init__(self, tier: TierConfig, *, dim: int, num_sum_tokens: int, activation: str):
        super().__init__()
        self.tier, self.dim, self.n_sum, self.activation = tier, dim, num_sum_tokens, activation
        self.norm_in = nn.LayerNorm(tier.dim)
        self.w_kv = nn.Linear(dim, 2 * tier.dim, bias=False)
        self.k_norm = RMSNorm(tier.head_dim)
        self.out_norm = RMSNorm(tier.dim)

    def forward(self, tb: TierBatch, x_sum: torch.Tensor) -> torch.Tensor:
        """tb.values [ΣL, d_t], x_sum [B, n_sum, d] -> [ΣL, d_t]"""
        B, n, _ = x_sum.shape
        H, dh = self.tier.num_heads, self.tier.head_dim
        s = self.norm_in(tb.values)  # [ΣL, d_t]
        k, v = self.w_kv(x_sum).view(B, n, 2, H, dh).unbind(2)  # [B, n_sum, H, dh] each
        k = (self.k_norm(k) * dh**-0.5).to(s.dtype)  # the 1/sqrt(dh) on the n_sum keys, not the ΣL queries
        q = s.view(-1, H, dh)
        o = gdpa(q, k, v.to(s.dtype), q_offsets=tb.offsets, activation=self.activation, qk_scale=1.0 / n,
                 kernel=self.kernel, buckets=tb.kv_buckets(n) if self.kernel == Kernel.TILED else None)
        return self.out_norm(o.reshape(s.shape) + s)

    def flops(self, batch: int, tokens: float) -> float:
        return linear_flops(batch * self.n_sum, self.dim, 2 * self.tier.dim) + 2 * 2.0 * tokens * self.n_sum * self.tier.dim


class TokenFFN(nn.Module):
    """S' = RMSNorm(W2 act(W1 LN(S)) + LN(S)): the PFFN block with an ordinary per-token FFN (the
    same weights for every token) in place of the generated one: same norms, residual and
    activation, so a comparison of the two (benchmarks/model.py) measures only the FFN itself."""

    def __init__(self, tier: TierConfig, *, mult: int, activation: str = "gelu"):
        super().__init__()
        self.tier, self.hidden, self.activation = tier, mult * tier.dim, activation
        check_activations(activation, 1)
        self.norm_in = nn.LayerNorm(tier.dim)
        self.w1 = nn.Linear(tier.dim, self.hidden)
        self.w2 = nn.Linear(self.hidden, tier.dim)
        self.out_norm = RMSNorm(tier.dim)  # HSP reads this output without a norm of its own

    def forward(self, tb: TierBatch, x_sum: torch.Tensor | None = None) -> torch.Tensor:
        s = self.norm_in(tb.values)
        return self.out_norm(self.w2(ACTIVATIONS[self.activation](self.w1(s))) + s)

    def flops(self, batch: int, tokens: float) -> float:
        return 2 * linear_flops(tokens, self.tier.dim, self.hidden)
