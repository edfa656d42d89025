"""jagged_attention over length-bucketed dense tiles.

Segments are sorted by length and cut into a few groups (common.plan_buckets); each group is
padded to its own longest member (not the batch's) and runs one
`scaled_dot_product_attention` call with a key-padding mask. On the reference workload
(B=64, L ~ LogNormal(5, 1) clipped to [8, 2048]) this removes ~90% of the padded work while
keeping every call a large dense kernel.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gem.ops.common import BucketPlan, from_slots, plan_buckets, to_slots


def tiled_jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                           scale: float | None = None, buckets: BucketPlan | None = None) -> torch.Tensor:
    """q, k, v: [ΣL, H, dh]   offsets: [B+1]   ->   [ΣL, H, dh]"""
    total, H, dh = q.shape
    if total == 0:
        return q * 0.0  # keeps the graph: empty input, empty gradient
    plan = plan_buckets(offsets) if buckets is None else buckets
    tiles = [to_slots(x, plan.q_layout).split(plan.q_sizes) for x in (q, k, v)]
    parts = []
    for bk, qs, ks, vs in zip(plan.buckets, *tiles):
        n, T = bk.size, bk.q_len
        qt, kt, vt = (x.view(n, T, H, dh).transpose(1, 2) for x in (qs, ks, vs))  # [n, H, T, dh]
        mask = None if bk.k_valid is None else bk.k_valid[:, None, None, :]  # [n, 1, 1, T]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)  # [n, H, T, dh]
        parts.append(o.transpose(1, 2).reshape(n * T, H, dh))
    return from_slots(torch.cat(parts) if len(parts) > 1 else parts[0], plan.q_layout)
