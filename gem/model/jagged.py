"""Attention of a few query tokens per example over that example's own jagged event sequence.

Layout (see docs/gem-architecture-notes.md section 1): the keys/values of all B examples are
stored back to back, `k, v: [ΣL, H, dh]`, and `offsets: int64 [B+1]` delimits them. Nothing is
padded to the batch's longest history: the work and memory are O(ΣL · Nq · d), and the softmax
is done per segment with scatter/index_add over each event's owner index.

`pt_padded_attention` in gem/model/reference.py is the plain padded+masked version this must match.
"""

from __future__ import annotations

import torch

from gem.ops.common import segment_ids  # also what gem.distill and gem.loopfm import from here


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                     *, seg: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(dh)) v, where example b's queries only see example b's events.

    q: [B, Nq, H, dh]   k, v: [ΣL, H, dh]   offsets: int64 [B+1]   ->   [B, Nq, H, dh]
    An example with no events gets zeros.
    """
    B, Nq, H, dh = q.shape
    if seg is None:
        seg = segment_ids(offsets, k.shape[0])  # [ΣL]
    # Gather each event's queries with index_select, not q[seg]: the backward of advanced
    # indexing is an accumulating index_put, ~10x slower on CPU than index_select's index_add.
    q_e = q.index_select(0, seg)  # [ΣL, Nq, H, dh]
    scores = (q_e * k.unsqueeze(1)).sum(-1) * dh**-0.5  # [ΣL, Nq, H]
    # Subtract each segment's max before exp for stability. It cancels in the ratio, so no
    # gradient needs to flow through it.
    seg_max = torch.full((B, Nq, H), float("-inf"), dtype=scores.dtype, device=scores.device)
    seg_max = seg_max.scatter_reduce(0, seg.view(-1, 1, 1).expand_as(scores), scores.detach(), "amax")
    p = torch.exp(scores - seg_max.index_select(0, seg))  # [ΣL, Nq, H]
    denom = scores.new_zeros(B, Nq, H).index_add(0, seg, p)  # [B, Nq, H]
    out = q.new_zeros(B, Nq, H, dh).index_add(0, seg, p.unsqueeze(-1) * v.unsqueeze(1))  # [B, Nq, H, dh]
    # Empty segments have denom 0 and out 0; the clamp turns 0/0 into 0.
    return out / denom.clamp_min(torch.finfo(denom.dtype).tiny).unsqueeze(-1)
