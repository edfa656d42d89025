"""References of the segment reductions: pad, mask, reduce."""

from __future__ import annotations

import torch

from gem.ops.pytorch.pt_jagged import jagged_to_padded


def pytorch_segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[ΣL, ...] -> [B, ...]"""
    padded, mask = jagged_to_padded(values.float(), offsets)  # [B, T, ...], [B, T]
    mask = mask.view(*mask.shape, *([1] * (values.dim() - 1)))
    return (padded * mask).sum(dim=1).to(values.dtype)


def pytorch_jagged_last_k(values: torch.Tensor, offsets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last k rows of every segment, right-aligned: slot k-1 is the segment's last row.

    -> ([B, k, ...] zeros where a segment is shorter than k, bool [B, k])
    """
    B = offsets.numel() - 1
    out = values.new_zeros((B, k) + tuple(values.shape[1:]))
    mask = torch.zeros(B, k, dtype=torch.bool, device=values.device)
    for b in range(B):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        n = min(k, hi - lo)
        if n:
            out[b, k - n :] = values[hi - n : hi]
            mask[b, k - n :] = True
    return out, mask
