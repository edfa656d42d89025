"""Reference of jagged_attention: pad to the longest segment, mask, softmax, matmul (fp32)."""

from __future__ import annotations

import torch

from gem.ops.pytorch.pt_jagged import jagged_to_padded, padded_to_jagged


def pytorch_jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                             scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v inside every segment (no causal mask).

    q, k, v: [ΣL, H, dh]   offsets: [B+1]   ->   [ΣL, H, dh]
    """
    dh = q.shape[-1]
    scale = dh**-0.5 if scale is None else scale
    qp, mask = jagged_to_padded(q.float(), offsets)  # [B, T, H, dh], [B, T]
    kp, _ = jagged_to_padded(k.float(), offsets)
    vp, _ = jagged_to_padded(v.float(), offsets)
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale  # [B, H, T, T]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    attn = torch.softmax(scores, dim=-1)
    attn = torch.nan_to_num(attn, nan=0.0)  # padded query rows of an empty example
    out = torch.einsum("bhij,bjhd->bihd", attn, vp)  # [B, T, H, dh]
    return padded_to_jagged(out, offsets).to(q.dtype)
