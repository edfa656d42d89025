"""The local sequence layer: block attention with time-based rotary (notes sections 4 and 13).

    S' = S + W_o · BlockAttn_64(RoPE_time(LN(S) W_q), RoPE_time(LN(S) W_k), LN(S) W_v)

Blocks start at each segment's first event (tier.block_align="start", the default; "end" anchors
them at the most recent); `shift` (alternating 0 and block/2 across the local layers) moves the
block edges so information crosses them [PROPOSAL].
"""

from __future__ import annotations

import torch
from torch import nn

from gem.modules.common import JaggedModule, block_pairs, linear_flops
from gem.modules.config import TierConfig
from gem.modules.oneseq import TierBatch
from gem.ops import Kernel, block_attention, time_rotary


class BlockAttentionLayer(JaggedModule):
    def __init__(self, tier: TierConfig, *, shift: int = 0):
        super().__init__()
        self.tier, self.shift = tier, shift
        self.norm = nn.LayerNorm(tier.dim)
        self.w_qkv = nn.Linear(tier.dim, 3 * tier.dim, bias=False)
        self.w_o = nn.Linear(tier.dim, tier.dim, bias=False)

    @property
    def local_heads(self) -> int:
        """Heads this rank computes: all of them, or num_heads/tp once tensor parallelism has split w_qkv by heads."""
        return self.w_qkv.weight.shape[0] // (3 * self.tier.head_dim)

    def qkv(self, tb: TierBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections, q and k rotated by time (in one pass over both): [ΣL, H, dh] each."""
        H, dh = self.local_heads, self.tier.head_dim
        qkv = self.w_qkv(self.norm(tb.values)).view(-1, 3, H, dh)  # [ΣL, 3, H, dh]
        qk, v = qkv.split([2, 1], dim=1)  # split, not slicing: its backward is one cat, no zero-filled copies
        cos_sin = tb.rotary(dh, qk.dtype) if self.kernel == Kernel.TILED else None
        qk = time_rotary(qk.reshape(-1, 2 * H, dh), tb.phase, kernel=self.kernel, cos_sin=cos_sin)  # q, k heads side by side
        q, k = qk.view(-1, 2, H, dh).unbind(1)
        return q, k, v.squeeze(1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tb: TierBatch) -> torch.Tensor:
        """Block attention of already-rotated q, k."""
        t = self.tier
        plan = tb.block_plan(t.block_size, self.shift, t.block_align) if self.kernel == Kernel.TILED else None
        return block_attention(q, k, v, tb.offsets, block_size=t.block_size, shift=self.shift, align=t.block_align,
                               plan=plan, kernel=self.kernel)

    def forward(self, tb: TierBatch) -> torch.Tensor:
        q, k, v = self.qkv(tb)
        o = self.attend(q, k, v, tb)  # [ΣL, H, dh]
        return tb.values + self.w_o(o.flatten(1))  # [ΣL, H·dh]: all heads, or this tp rank's

    def attention_flops(self, lengths: torch.Tensor) -> float:
        t = self.tier
        return 2 * 2.0 * t.dim * block_pairs(lengths, t.block_size, self.shift, t.block_align)  # QKᵀ and PV, all heads

    def flops(self, lengths: torch.Tensor) -> float:
        tokens = float(lengths.sum())
        d = self.tier.dim
        return linear_flops(tokens, d, 3 * d) + linear_flops(tokens, d, d) + self.attention_flops(lengths)
