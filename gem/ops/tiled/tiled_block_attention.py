"""block_attention as a reshape: segments laid out in [num_blocks, block] slots, dense per-block attention.

Each segment is padded only to a multiple of the block (plus the optional shift), so the work
is linear in ΣL: doubling a sequence doubles its blocks.

On CPU, and for training anywhere, it runs `BlockSoftmaxAttention`: an explicit forward and
backward of batched matmuls over head-major blocks with one fused softmax pass each way. On CPU
the fused `scaled_dot_product_attention` is slow for 64-token sequences (its backward ~2x slower
again in bf16), while batched 64x64 bf16 matmuls run near the bf16 matmul rate. Forward-only
calls elsewhere (GPU inference) use the fused kernel.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gem.ops.common import BlockPlan, from_slots, plan_blocks, to_slots, with_zero_row


def to_blocks(x: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """[ΣL, ...] -> [num_blocks, block, ...] (padding slots are zeros)."""
    return to_slots(x, plan.layout).view(plan.num_blocks, plan.block, *x.shape[1:])


def from_blocks(xb: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """[num_blocks, block, ...] -> [ΣL, ...]"""
    return from_slots(xb.reshape(plan.num_blocks * plan.block, *xb.shape[2:]), plan.layout)


class _ToHeadBlocks(torch.autograd.Function):
    """[ΣL, H, dh] -> head-major blocks [H·nb, block, dh] in one gather (layout change included).

    Padding slots read an arbitrary real row (`src_any`): their keys are masked and their queries'
    outputs dropped, so their content never matters and their gradients are exactly zero.
    """

    @staticmethod
    def forward(ctx, x, src_any, dst, block: int):
        ctx.save_for_backward(dst)
        ctx.heads = x.shape[1]
        return x.transpose(0, 1).index_select(1, src_any).view(-1, block, x.shape[2])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (dst,) = ctx.saved_tensors
        g = grad.reshape(ctx.heads, -1, grad.shape[-1])  # [H, slots, dh]
        return g.permute(1, 0, 2).index_select(0, dst), None, None, None


class _FromHeadBlocks(torch.autograd.Function):
    """Head-major blocks [H·nb, block, dh] -> [ΣL, H, dh] (padding slots dropped)."""

    @staticmethod
    def forward(ctx, ob, dst, src_zero, heads: int):
        ctx.save_for_backward(src_zero)
        ctx.block = ob.shape[1]
        return ob.reshape(heads, -1, ob.shape[-1]).permute(1, 0, 2).index_select(0, dst)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (src_zero,) = ctx.saved_tensors
        g = with_zero_row(grad).transpose(0, 1).index_select(1, src_zero)  # padding slots: zero gradient
        return g.view(-1, ctx.block, grad.shape[-1]), None, None, None


class BlockSoftmaxAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale + bias) v over [N, T, dh] tiles (N = heads x blocks).

    bias: additive key mask [N, 1, T] (0 or -inf; every block has a valid key) or None.
    Scores come out of one fused scale-and-add matmul (baddbmm), the softmax and its backward
    are single fused passes (fp32 inside, stored in the input dtype), and the probabilities are
    saved (N·T² values: at T=64 about the size of q).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale: float):
        if bias is None:
            s = torch.bmm(q, k.transpose(1, 2)) * scale
        else:
            s = torch.baddbmm(bias.expand(q.shape[0], q.shape[1], k.shape[1]), q, k.transpose(1, 2), alpha=scale)
        p = torch.softmax(s, dim=-1)  # [N, T, T]
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return torch.bmm(p, v)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, p = ctx.saved_tensors
        go = grad_out.to(q.dtype)
        dv = torch.bmm(p.transpose(1, 2), go)
        ds = torch._softmax_backward_data(torch.bmm(go, v.transpose(1, 2)), p, -1, p.dtype)
        dq = torch.baddbmm(q, ds, k, beta=0.0, alpha=ctx.scale)
        dk = torch.baddbmm(k, ds.transpose(1, 2), q, beta=0.0, alpha=ctx.scale)
        return dq, dk, dv, None, None


def tiled_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                          block_size: int, shift: int, scale: float | None,
                          plan: BlockPlan | None = None, align: str = "start") -> torch.Tensor:
    """q, k, v: [ΣL, H, dh]  ->  [ΣL, H, dh]"""
    if q.shape[0] == 0:
        return q * 0.0  # keeps the graph: empty input, empty gradient
    if plan is None:
        plan = plan_blocks(offsets, block_size, shift=shift, align=align)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    all_valid = plan.all_valid
    if q.device.type == "cpu" or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        H = q.shape[1]
        src_any = plan.src.clamp(max=q.shape[0] - 1)  # padding slots read any real row
        qb, kb, vb = (_ToHeadBlocks.apply(x, src_any, plan.dst, plan.block) for x in (q, k, v))  # [H·nb, T, dh]
        bias = None
        if not all_valid:
            neg = torch.zeros(plan.valid.shape, device=q.device, dtype=q.dtype).masked_fill(~plan.valid, float("-inf"))
            bias = neg.repeat(H, 1)[:, None, :]  # [H·nb, 1, T], head-major like the blocks
        ob = BlockSoftmaxAttention.apply(qb, kb, vb, bias, scale)
        return _FromHeadBlocks.apply(ob, plan.dst, plan.src, H)
    qb, kb, vb = (to_blocks(x, plan).transpose(1, 2) for x in (q, k, v))  # [nb, H, block, dh]
    mask = None if all_valid else plan.valid[:, None, None, :]  # [nb, 1, 1, block]
    ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)  # [nb, H, block, dh]
    return from_blocks(ob.transpose(1, 2), plan)
