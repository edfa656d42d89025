"""Segment reductions with index_add / one gather (no padding at all)."""

from __future__ import annotations

import torch

from gem.ops.common import segment_ids, with_zero_row


def tiled_segment_sum(values: torch.Tensor, offsets: torch.Tensor, seg: torch.Tensor | None = None) -> torch.Tensor:
    """[ΣL, ...] -> [B, ...]"""
    B = offsets.numel() - 1
    seg = segment_ids(offsets, values.shape[0]) if seg is None else seg
    return values.new_zeros((B,) + tuple(values.shape[1:])).index_add(0, seg, values)


def tiled_jagged_last_k(values: torch.Tensor, offsets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[ΣL, ...] -> ([B, k, ...], bool [B, k]) right-aligned; one index_select."""
    B = offsets.numel() - 1
    slot = torch.arange(k, device=offsets.device)  # [k]
    rows = offsets[1:, None] - k + slot[None, :]  # [B, k], the row that would fill each slot
    valid = rows >= offsets[:-1, None]
    # invalid -> the appended zero row, at values.shape[0] (= offsets[-1], read without a device sync)
    rows = torch.where(valid, rows, values.shape[0])
    out = with_zero_row(values).index_select(0, rows.reshape(-1)).view(B, k, *values.shape[1:])
    return out, valid
