"""Block-aligned sparse attention over jagged segments, with optional time-based rotary.

Every segment is cut into fixed `block_size`-token blocks; a query attends, with softmax and
scale 1/sqrt(dh), only to the keys of its own block. The cost is O(ΣL · block_size · d): linear
in sequence length. align="start" starts the blocks at the segment's first token (notes section
4, the kernel library's block-attention reference); align="end" ends them at its last, so the
most recent events always share a full block (docs/architecture.md §8). `shift` moves the block
boundaries by that many tokens, so alternating shifts across layers let information cross block
edges [PROPOSAL].

    q, k, v: [ΣL, H, dh]  offsets: int64 [B+1]  rotary_phase: float [ΣL] | None  ->  [ΣL, H, dh]

With rotary_phase, q and k are first rotated by gem.ops.rotary.time_rotary.
"""

from __future__ import annotations

import torch

from gem.ops.common import BLOCK_ALIGNS, DEFAULT_KERNEL, BlockPlan, Kernel, check_offsets
from gem.ops.pytorch.pt_block_attention import pytorch_block_attention
from gem.ops.rotary import DEFAULT_ROTARY_BASE, time_rotary
from gem.ops.tiled.tiled_block_attention import tiled_block_attention


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                    block_size: int = 64, shift: int = 0, align: str = "start", scale: float | None = None,
                    rotary_phase: torch.Tensor | None = None, rotary_base: float = DEFAULT_ROTARY_BASE,
                    rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                    kernel: Kernel = DEFAULT_KERNEL, plan: BlockPlan | None = None) -> torch.Tensor:
    """See the module docstring. plan / rotary_cos_sin: per-batch precomputations (tiled only)."""
    torch._assert(q.dim() == 3, "q must be [ΣL, H, dh]")
    torch._assert(k.shape == q.shape, "k must be the same shape as q")
    torch._assert(v.shape == q.shape, "v must be the same shape as q")
    check_offsets(offsets, q.shape[0])
    if block_size < 1 or not 0 <= shift < block_size:
        raise ValueError(f"need block_size >= 1 and 0 <= shift < block_size, got {block_size}, {shift}")
    if align not in BLOCK_ALIGNS:
        raise ValueError(f"align must be one of {BLOCK_ALIGNS}, got {align!r}")
    if rotary_phase is not None:
        q = time_rotary(q, rotary_phase, base=rotary_base, kernel=kernel, cos_sin=rotary_cos_sin)
        k = time_rotary(k, rotary_phase, base=rotary_base, kernel=kernel, cos_sin=rotary_cos_sin)
    if kernel == Kernel.PYTORCH:
        return pytorch_block_attention(q, k, v, offsets, block_size=block_size, shift=shift, scale=scale,
                                       align=align)
    if plan is not None:
        plan.check(offsets, q.shape[0], block_size, shift, align)
    return tiled_block_attention(q, k, v, offsets, block_size=block_size, shift=shift, scale=scale, plan=plan,
                                 align=align)
