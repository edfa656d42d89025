"""Segment reductions over jagged values: sum / mean pooling and the last k rows.

    values: [ΣL, ...]  offsets: int64 [B+1]
    segment_sum / segment_mean -> [B, ...]   (an empty segment gives zeros)
    jagged_last_k -> ([B, k, ...], bool [B, k]), right-aligned: slot k-1 is the most recent row
"""

from __future__ import annotations

import torch

from gem.ops.common import DEFAULT_KERNEL, Kernel, check_offsets
from gem.ops.pytorch.pt_segment import pytorch_jagged_last_k, pytorch_segment_sum
from gem.ops.tiled.tiled_segment import tiled_jagged_last_k, tiled_segment_sum


def segment_sum(values: torch.Tensor, offsets: torch.Tensor, *, kernel: Kernel = DEFAULT_KERNEL,
                seg: torch.Tensor | None = None) -> torch.Tensor:
    check_offsets(offsets, values.shape[0])
    if kernel == Kernel.PYTORCH:
        return pytorch_segment_sum(values, offsets)
    return tiled_segment_sum(values, offsets, seg)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor, *, kernel: Kernel = DEFAULT_KERNEL,
                 seg: torch.Tensor | None = None) -> torch.Tensor:
    total = segment_sum(values, offsets, kernel=kernel, seg=seg)  # [B, ...]
    lengths = offsets.diff().clamp_min(1).to(total.dtype)
    return total / lengths.view(-1, *([1] * (values.dim() - 1)))


def jagged_last_k(values: torch.Tensor, offsets: torch.Tensor, k: int, *,
                  kernel: Kernel = DEFAULT_KERNEL) -> tuple[torch.Tensor, torch.Tensor]:
    check_offsets(offsets, values.shape[0])
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if kernel == Kernel.PYTORCH:
        return pytorch_jagged_last_k(values, offsets, k)
    return tiled_jagged_last_k(values, offsets, k)
