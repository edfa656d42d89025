"""Padding helpers for the references: a Python loop over segments, as plain as possible."""

from __future__ import annotations

import torch


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """[ΣL, ...] + offsets [B+1] -> padded [B, max_len, ...] (zeros) and mask bool [B, max_len]."""
    lengths = offsets.diff().tolist()
    B = len(lengths)
    if max_len is None:
        max_len = max(lengths, default=0)
    max_len = max(max_len, 1)
    padded = values.new_zeros((B, max_len) + tuple(values.shape[1:]))
    mask = torch.zeros(B, max_len, dtype=torch.bool, device=values.device)
    for b, n in enumerate(lengths):
        start = int(offsets[b])
        n = min(n, max_len)
        padded[b, :n] = values[start : start + n]
        mask[b, :n] = True
    return padded, mask


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [ΣL, ...]: the first L_b rows of every example."""
    lengths = offsets.diff().tolist()
    parts = [padded[b, :n] for b, n in enumerate(lengths)]
    if not parts:
        return padded.new_zeros((0,) + tuple(padded.shape[2:]))
    return torch.cat(parts, dim=0)
