"""block_attention as a reshape: segments laid out in [num_blocks, block] slots, one SDPA call.

Each segment is padded only to a multiple of the block (plus the optional shift), so the work
is linear in ΣL: doubling a sequence doubles its blocks.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gem.ops.common import BlockPlan, from_slots, plan_blocks, to_slots


def to_blocks(x: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """[ΣL, ...] -> [num_blocks, block, ...] (padding slots are zeros)."""
    return to_slots(x, plan.layout).view(plan.num_blocks, plan.block, *x.shape[1:])


def from_blocks(xb: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """[num_blocks, block, ...] -> [ΣL, ...]"""
    return from_slots(xb.reshape(plan.num_blocks * plan.block, *xb.shape[2:]), plan.layout)


def tiled_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                          block_size: int, shift: int, scale: float | None,
                          plan: BlockPlan | None = None) -> torch.Tensor:
    """q, k, v: [ΣL, H, dh]  ->  [ΣL, H, dh]"""
    if q.shape[0] == 0:
        return q * 0.0  # keeps the graph: empty input, empty gradient
    if plan is None:
        plan = plan_blocks(offsets, block_size, shift=shift)
    # On CPU the fused attention's bf16 backward is ~2x slower than its fp32 one at 64-token
    # blocks (benchmarks/model.py measures the whole model both ways): train the core in fp32.
    core = torch.float32 if q.device.type == "cpu" and q.requires_grad and q.dtype != torch.float32 else q.dtype
    qb, kb, vb = (to_blocks(x.to(core), plan).transpose(1, 2) for x in (q, k, v))  # [nb, H, block, dh]
    mask = None if bool(plan.valid.all()) else plan.valid[:, None, None, :]  # [nb, 1, 1, block]
    ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)  # [nb, H, block, dh]
    return from_blocks(ob.transpose(1, 2), plan).to(q.dtype)
