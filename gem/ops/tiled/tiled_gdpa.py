"""gdpa over dense tiles.

* Jagged queries (self-attention-like, or long queries over short per-example keys as in the
  personalised FFN): segments grouped into length buckets (common.plan_buckets with cost
  n · Tq · Tk), one batched matmul pair per bucket. With short dense per-example keys (the
  PFFN) the query tiles are gathered straight into head-major order and every example's keys
  into tile order, once each, so each bucket is two contiguous bmm calls.
* Broadcast queries (seed pooling: the same Nq learned queries for every example, long keys):
  the keys are bucketed by length and each tile scores them against the shared queries.

No key mask is applied anywhere: padded key slots are zeros, their scores are 0 and act(0) = 0.
"""

from __future__ import annotations

import torch

from gem.ops.activations import apply_per_head
from gem.ops.common import BucketPlan, SlotLayout, from_slots, offsets_of, plan_buckets, to_slots


def tiled_gdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offsets: torch.Tensor | None,
               k_offsets: torch.Tensor, activations: tuple[str, ...], qk_scale: float,
               window: int | None, broadcast_q: bool, buckets: BucketPlan | None = None,
               dense_kv: bool = False) -> torch.Tensor:
    """dense_kv: k, v are [B, n, H, dh] (every example has n keys), else jagged [ΣLk, H, dh]."""
    if broadcast_q:
        return _broadcast_q(q, k, v, k_offsets, activations, qk_scale, buckets)
    total_q, H, dh = q.shape
    if total_q == 0:
        return q * 0.0  # keeps the graph: empty input, empty gradient
    plan = plan_buckets(q_offsets, k_offsets) if buckets is None else buckets
    if dense_kv and window is None:
        return _short_dense_kv(q, k, v * qk_scale if qk_scale != 1.0 else v, plan, activations)
    # P·c·V = c·(P V): put the scale on whichever is smallest (short dense values: once here).
    scale_v = dense_kv and qk_scale != 1.0
    if scale_v:
        v = v * qk_scale
    # Padded query rows only produce dropped outputs (and get zero gradient): no zero fill needed.
    q_tiles = to_slots(q, plan.q_layout, zero_pad=False).split(plan.q_sizes)
    if not dense_kv:
        k_tiles = plan.k_tiles(to_slots(k, plan.k_layout))
        v_tiles = plan.k_tiles(to_slots(v, plan.k_layout))
    parts = []
    for i, (bk, qs) in enumerate(zip(plan.buckets, q_tiles)):
        n = bk.size
        qt = qs.view(n, bk.q_len, H, dh).transpose(1, 2)  # [n, H, Tq, dh]
        if dense_kv:  # short per-example keys: gather this bucket's examples
            kt, vt = (x.index_select(0, bk.examples).transpose(1, 2) for x in (k, v))  # [n, H, Tk, dh]
        else:
            kt, vt = (x[i].view(n, bk.k_len, H, dh).transpose(1, 2) for x in (k_tiles, v_tiles))
        s = torch.matmul(qt, kt.transpose(-1, -2))  # [n, H, Tq, Tk]
        if window is not None:
            i_ = torch.arange(bk.q_len, device=s.device)[:, None]
            j_ = torch.arange(bk.k_len, device=s.device)[None, :]
            s = s.masked_fill((i_ - j_).abs() > window, 0.0)
        p = apply_per_head(s, activations, head_dim=1)
        if qk_scale != 1.0 and not scale_v and bk.k_len <= q.shape[-1]:
            p = p * qk_scale
        o = torch.matmul(p, vt)  # [n, H, Tq, dh]
        if qk_scale != 1.0 and not scale_v and bk.k_len > q.shape[-1]:
            o = o * qk_scale
        parts.append(o.transpose(1, 2).reshape(n * bk.q_len, H, dh))
    return from_slots(torch.cat(parts) if len(parts) > 1 else parts[0], plan.q_layout)


def _head_major_layout(plan: BucketPlan, H: int) -> SlotLayout:
    """Rows (token, head) of q.view(ΣL·H, dh) -> slots laid out [n, H, Tq] per bucket: the tiles
    come out of one gather already head-major (no transpose copy either way)."""
    dst = plan.q_layout.dst
    dev = dst.device
    if plan.q_tile_starts is not None:  # made while planning: no host -> device copy per call
        starts, tq = plan.q_tile_starts, plan.q_tile_lens
    else:
        sizes = torch.tensor(plan.q_sizes, device=dev)
        starts = torch.cumsum(sizes, 0) - sizes
        tq = torch.tensor([bk.q_len for bk in plan.buckets], device=dev)
    b = torch.searchsorted(starts, dst, right=True) - 1  # the bucket of every token
    local, t = dst - starts[b], tq[b]
    first = H * starts[b] + (local // t) * H * t + local % t  # head 0 of this token
    heads = torch.arange(H, device=dev)
    return SlotLayout((first[:, None] + heads[None, :] * t[:, None]).reshape(-1), H * plan.q_layout.num_slots)


def _short_dense_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BucketPlan,
                    activations: tuple[str, ...]) -> torch.Tensor:
    """Long jagged queries over n short keys per example (the personalised FFN), v pre-scaled.

    One gather puts the query tiles head-major, one gather puts every example's keys and values
    in tile order; each bucket is then two contiguous batched matmuls [n·H, Tq, dh] x [n·H, dh, Tk]."""
    total_q, H, dh = q.shape
    layout = _head_major_layout(plan, H)
    q_tiles = to_slots(q.reshape(total_q * H, dh), layout, zero_pad=False).split([H * s for s in plan.q_sizes])
    sizes = [bk.size for bk in plan.buckets]
    order = plan.examples
    k_tiles = k.index_select(0, order).permute(0, 2, 3, 1).split(sizes)  # [n, H, dh, Tk]
    v_tiles = v.index_select(0, order).transpose(1, 2).split(sizes)  # [n, H, Tk, dh]
    parts = []
    for bk, qs, kt, vt in zip(plan.buckets, q_tiles, k_tiles, v_tiles):
        nh = bk.size * H
        s = torch.bmm(qs.view(nh, bk.q_len, dh), kt.reshape(nh, dh, -1))  # [n·H, Tq, Tk]
        p = apply_per_head(s.view(bk.size, H, bk.q_len, -1), activations, head_dim=1).view(nh, bk.q_len, -1)
        parts.append(torch.bmm(p, vt.reshape(nh, -1, dh)).view(nh * bk.q_len, dh))
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    return from_slots(out, layout).view(total_q, H, dh)


def _broadcast_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_offsets: torch.Tensor,
                 activations: tuple[str, ...], qk_scale: float, buckets: BucketPlan | None) -> torch.Tensor:
    """q: [Nq, H, dh] shared by all examples; k, v: [ΣLk, H, dh] -> [B, Nq, H, dh]."""
    Nq, H, dh = q.shape
    B = k_offsets.numel() - 1
    if buckets is None:
        # Nominal query segments of length Nq, so the cost model is n · Nq · Tk.
        q_offsets = offsets_of(torch.full((B,), Nq, dtype=torch.int64, device=k_offsets.device))
        buckets = plan_buckets(q_offsets, k_offsets)
    plan = buckets
    if not plan.buckets:  # no examples (B = 0) or no queries (Nq = 0): nothing to pool
        return (q * 0.0).unsqueeze(0).expand(B, Nq, H, dh).contiguous()
    k_tiles = plan.k_tiles(to_slots(k, plan.k_layout))
    v_tiles = plan.k_tiles(to_slots(v, plan.k_layout))
    qt = q.permute(1, 2, 0)  # [H, dh, Nq]
    parts = []
    for bk, ks, vs in zip(plan.buckets, k_tiles, v_tiles):
        n = bk.size
        kt, vt = (x.view(n, bk.k_len, H, dh).transpose(1, 2) for x in (ks, vs))  # [n, H, Tk, dh]
        s = torch.matmul(kt, qt)  # [n, H, Tk, Nq]: keys along rows
        p = apply_per_head(s, activations, head_dim=1)
        parts.append(torch.matmul(p.transpose(-1, -2), vt).transpose(1, 2))  # [n, Nq, H, dh]
    out = torch.cat(parts) if len(parts) > 1 else parts[0]  # [B, Nq, H, dh] in tile order
    if qk_scale != 1.0:
        out = out * qk_scale  # the smallest place for the scale: [B, Nq, H, dh]
    order = plan.examples
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out.index_select(0, inverse)
