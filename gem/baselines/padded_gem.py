"""The same Kunlun GEM, but its local attention pads every sequence to the batch's longest and
runs dense softmax attention over it (what a model without jagged kernels does).

Only the attention is padded; every token-wise layer stays jagged, so this baseline is faster
than a fully padded model and the measured speedup is a conservative one.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gem.modules.attention import BlockAttentionLayer
from gem.modules.config import TierConfig
from gem.modules.kunlun import KunlunLayer, KunlunModel
from gem.modules.oneseq import TierBatch
from gem.ops.common import with_zero_row


def pad_rows(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row of the jagged values for each slot of a [B, Lmax] padded layout (pad: ΣL), and validity."""
    lengths = offsets.diff()
    max_len = max(int(lengths.max()) if lengths.numel() else 0, 1)
    p = torch.arange(max_len, device=offsets.device)
    valid = p[None, :] < lengths[:, None]  # [B, Lmax]
    rows = torch.where(valid, offsets[:-1, None] + p[None, :], int(offsets[-1]))
    return rows, valid, max_len


class PaddedAttentionLayer(BlockAttentionLayer):
    """S' = S + W_o · softmax-attention over the whole padded history (no blocks)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tb: TierBatch) -> torch.Tensor:
        H, dh = q.shape[1], self.tier.head_dim  # q, k arrive rotated (BlockAttentionLayer.qkv); tp: local heads
        rows, valid, T = pad_rows(tb.offsets)
        B = rows.shape[0]
        qp, kp, vp = (with_zero_row(x).index_select(0, rows.reshape(-1)).view(B, T, H, dh).transpose(1, 2)
                      for x in (q, k, v))  # [B, H, Lmax, dh]
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=valid[:, None, None, :])  # [B, H, Lmax, dh]
        return o.transpose(1, 2).reshape(B * T, H, dh)[valid.reshape(-1)]  # back to [ΣL, H, dh]

    def attention_flops(self, lengths: torch.Tensor) -> float:
        B, T = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
        return 2 * 2.0 * self.tier.dim * B * T * T


class PaddedKunlunLayer(KunlunLayer):
    def make_attention(self, tier: TierConfig, *, shift: int):
        return PaddedAttentionLayer(tier, shift=0)


class PaddedKunlunModel(KunlunModel):
    layer_cls = PaddedKunlunLayer
