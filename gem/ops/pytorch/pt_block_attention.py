"""Reference of block_attention: each segment cut into fixed blocks, softmax inside each block."""

from __future__ import annotations

import torch

from gem.ops.common import block_leads
from gem.ops.pytorch.pt_jagged import jagged_to_padded, padded_to_jagged


def pytorch_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                            block_size: int, shift: int, scale: float | None, align: str = "start") -> torch.Tensor:
    """Query i of a segment attends to key j of the same segment iff
    (i + lead) // block_size == (j + lead) // block_size, lead from gem.ops.common.block_leads.

    q, k, v: [ΣL, H, dh]  ->  [ΣL, H, dh]   (fp32 inside)
    """
    dh = q.shape[-1]
    scale = dh**-0.5 if scale is None else scale
    qp, mask = jagged_to_padded(q.float(), offsets)  # [B, T, H, dh], [B, T]
    kp, _ = jagged_to_padded(k.float(), offsets)
    vp, _ = jagged_to_padded(v.float(), offsets)
    T = qp.shape[1]
    lead = block_leads(offsets.diff(), block_size, shift=shift, align=align)  # [B]
    block_of = (torch.arange(T, device=lead.device)[None, :] + lead[:, None]) // block_size  # [B, T]
    same_block = block_of[:, :, None] == block_of[:, None, :]  # [B, T, T]
    allowed = same_block & mask[:, None, :]  # [B, Tq, Tk]
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale  # [B, H, T, T]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    attn = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = torch.einsum("bhij,bjhd->bihd", attn, vp)
    return padded_to_jagged(out, offsets).to(q.dtype)
