"""Plain padded+masked PyTorch references for the jagged ops (tests compare against these)."""

from __future__ import annotations

import torch


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[ΣL, ...] + offsets [B+1] -> padded [B, max_len, ...] and a validity mask [B, max_len]."""
    B = offsets.numel() - 1
    padded = values.new_zeros((B, max_len) + tuple(values.shape[1:]))
    mask = torch.zeros(B, max_len, dtype=torch.bool, device=values.device)
    rows = []
    for b in range(B):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        rows.append(torch.cat([values[lo:hi], values.new_zeros((max_len - (hi - lo),) + tuple(values.shape[1:]))]))
        mask[b, : hi - lo] = True
    padded = torch.stack(rows) if rows else padded
    return padded, mask


def pt_padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The reference of gem.model.jagged.jagged_attention: pad, mask, softmax, matmul.

    q: [B, Nq, H, dh]   k, v: [ΣL, H, dh]   ->   [B, Nq, H, dh]; empty examples give zeros.
    """
    B, Nq, H, dh = q.shape
    max_len = max(int(offsets.diff().max()) if B else 0, 1)
    kp, mask = jagged_to_padded(k, offsets, max_len)  # [B, T, H, dh], [B, T]
    vp, _ = jagged_to_padded(v, offsets, max_len)
    scores = torch.einsum("bnhd,bthd->bhnt", q, kp) / dh**0.5  # [B, H, Nq, T]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    attn = torch.softmax(scores, dim=-1)
    attn = torch.nan_to_num(attn, nan=0.0)  # rows with no events: all -inf -> nan -> 0
    return torch.einsum("bhnt,bthd->bnhd", attn, vp)  # [B, Nq, H, dh]
