"""Full softmax self-attention inside every jagged segment.

Used by the padded-attention GEM baseline's jagged twin and by the attention benchmark;
GEM itself uses block_attention (local) and gdpa (summaries, personalised FFN).

    q, k, v: [ΣL, H, dh]  offsets: int64 [B+1]  ->  [ΣL, H, dh]
"""

from __future__ import annotations

import torch

from gem.ops.common import DEFAULT_KERNEL, BucketPlan, Kernel, check_offsets
from gem.ops.pytorch.pt_jagged_attention import pytorch_jagged_attention
from gem.ops.tiled.tiled_jagged_attention import tiled_jagged_attention


def jagged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                     scale: float | None = None, kernel: Kernel = DEFAULT_KERNEL,
                     buckets: BucketPlan | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v per segment; scale defaults to 1/sqrt(dh).

    buckets: a precomputed common.plan_buckets(offsets), reused across layers (tiled only).
    """
    torch._assert(q.dim() == 3, "q must be [ΣL, H, dh]")
    torch._assert(k.shape == q.shape, "k must be the same shape as q")
    torch._assert(v.shape == q.shape, "v must be the same shape as q")
    check_offsets(offsets, q.shape[0])
    if buckets is not None:
        buckets.check(offsets, offsets)
    if kernel == Kernel.PYTORCH:
        return pytorch_jagged_attention(q, k, v, offsets, scale=scale)
    return tiled_jagged_attention(q, k, v, offsets, scale=scale, buckets=buckets)
