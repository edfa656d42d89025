"""Shared vocabulary of the jagged ops: the kernel switch, offsets helpers and dense tiles.

Jagged layout (docs/architecture.md, "Jagged layout"): B variable-length sequences are stored
back to back, `values: [ΣL, ...]`, and `offsets: int64 [B+1]` delimits them
(`offsets[0] = 0`, `offsets[b+1] - offsets[b] = L_b`). Nothing in the model is padded to the
batch's longest sequence.

The fast ("tiled") kernels turn jagged work into a few dense tiles so that matmuls run on
contiguous blocks:

* **Buckets** (`plan_buckets`): examples sorted by length and cut into groups; each group is
  padded only to its own longest member. The cuts come from a small dynamic programme that
  minimises `Σ_groups n_g · Lq_g · Lk_g + overhead · num_groups`, i.e. the padded work plus a
  fixed price per dense call.
* **Blocks** (`plan_blocks`): every segment cut into fixed `block`-token pieces aligned to the
  segment's own first or last token (optionally shifted); a segment is padded only to a multiple
  of the block.

Both are described by integer index tensors computed once per batch (a SlotLayout: the slot of
every jagged row); moving data into and out of tiles is a permutation each way, whose backward is
the opposite permutation, so no scatter-add is ever needed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch


class Kernel(str, enum.Enum):
    """Which implementation an op dispatches to."""

    PYTORCH = "pytorch"
    """Plain padded + masked reference (gem/ops/pytorch/pt_*.py): readable, fp32-exact, slow."""
    TILED = "tiled"
    """Length-bucketed / block-tiled dense kernels (gem/ops/tiled/tiled_*.py): the fast path."""


DEFAULT_KERNEL = Kernel.TILED


def check_offsets(offsets: torch.Tensor, num_values: int, name: str = "offsets") -> None:
    torch._assert(offsets.dim() == 1 and offsets.numel() >= 1, f"{name} must be 1-D [B+1]")
    torch._assert(not offsets.is_floating_point(), f"{name} must be an integer tensor")
    if not torch.jit.is_tracing() and offsets.device.type == "cpu":
        torch._assert(int(offsets[0]) == 0, f"{name}[0] must be 0")
        torch._assert(int(offsets[-1]) == num_values,
                      f"{name}[-1] ({int(offsets[-1])}) must equal the number of values ({num_values})")
        # Decreasing offsets (a negative length) made some ops fail deep inside and others (the
        # last-k gather, the merge reference) return rows of the wrong segments.
        drops = torch.nonzero(offsets.diff() < 0)
        if drops.numel():
            i = int(drops[0])
            raise ValueError(f"{name} must be non-decreasing (offsets[b+1] - offsets[b] is segment b's length): "
                             f"{name}[{i}] = {int(offsets[i])} > {name}[{i + 1}] = {int(offsets[i + 1])}")


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """[B] -> [B+1], starting at 0."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def segment_ids(offsets: torch.Tensor, num_values: int | None = None) -> torch.Tensor:
    """The segment each value belongs to, int64 [ΣL]. Pass num_values (ΣL) where the caller knows
    it: otherwise a GPU reads ΣL back from the device (a sync) before it can allocate the output."""
    B = offsets.numel() - 1
    return torch.repeat_interleave(torch.arange(B, device=offsets.device), offsets.diff(), output_size=num_values)


def positions_in_segment(offsets: torch.Tensor, num_values: int | None = None) -> torch.Tensor:
    """0, 1, ..., L_b - 1 for every segment, int64 [ΣL] (num_values: as in segment_ids)."""
    seg = segment_ids(offsets, num_values)
    return torch.arange(seg.numel(), device=offsets.device) - offsets[seg]


def with_zero_row(values: torch.Tensor) -> torch.Tensor:
    """values with one extra all-zero row at the end: index ΣL reads zeros (a tile's padding)."""
    return torch.cat([values, values.new_zeros((1,) + tuple(values.shape[1:]))], dim=0)


# --------------------------------------------------------------------------- slot layouts


@dataclass(frozen=True)
class SlotLayout:
    """Jagged rows [N, ...] <-> dense slots [num_slots, ...]: row r lives in slot dst[r].

    Every row has exactly one slot and the other slots are zeros, so moving data either way is a
    permutation; its backward is the opposite permutation (a gather), never a scatter-add.
    """

    dst: torch.Tensor  # int64 [N]
    num_slots: int
    src: torch.Tensor | None = None  # int64 [num_slots]: the row in each slot, N for an empty slot

    def __post_init__(self) -> None:
        if self.src is None:
            src = torch.full((self.num_slots,), self.dst.numel(), dtype=torch.int64, device=self.dst.device)
            if self.dst.numel():
                src[self.dst] = torch.arange(self.dst.numel(), device=self.dst.device)
            object.__setattr__(self, "src", src)


def _gather_with_zeros(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] where index == len(x) reads a zero row (both directions below are gathers:
    a row copy per index, much faster on CPU than index_copy_ / scatter-add)."""
    return with_zero_row(x).index_select(0, index)


class _ToSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, zero_pad: bool) -> torch.Tensor:
        ctx.save_for_backward(dst)
        if zero_pad:
            return _gather_with_zeros(x, src)
        return x.index_select(0, src.clamp(max=max(x.shape[0] - 1, 0)))  # padding slots: any real row

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (dst,) = ctx.saved_tensors
        return grad.index_select(0, dst), None, None, None


class _FromSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, slots: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(src)
        return slots.index_select(0, dst)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (src,) = ctx.saved_tensors
        return _gather_with_zeros(grad, src), None, None


def to_slots(x: torch.Tensor, layout: SlotLayout, *, zero_pad: bool = True) -> torch.Tensor:
    """[N, ...] -> [num_slots, ...]: zeros where no row lives, or (zero_pad=False, for callers
    that never use those slots, e.g. padded query rows whose outputs are dropped) any row."""
    if x.shape[0] == 0:
        zero_pad = True
    return _ToSlots.apply(x, layout.dst, layout.src, zero_pad)


def from_slots(slots: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
    """[num_slots, ...] -> [N, ...]"""
    return _FromSlots.apply(slots, layout.dst, layout.src)


# --------------------------------------------------------------------------- buckets


@dataclass(frozen=True)
class Bucket:
    """One dense tile of whole segments: `examples` padded to `q_len` query and `k_len` key rows."""

    examples: torch.Tensor  # int64 [n], which segments, in tile order
    q_len: int
    k_len: int
    k_valid: torch.Tensor | None  # bool [n, k_len], None when no key slot is padding

    @property
    def size(self) -> int:
        return int(self.examples.numel())


@dataclass(frozen=True)
class BucketPlan:
    """Buckets laid out back to back: bucket i owns slots [Σ_{j<i} n_j·q_len_j, ...) of q_layout."""

    buckets: list[Bucket]
    q_layout: SlotLayout
    k_layout: SlotLayout  # the same object as q_layout for self-attention
    q_lengths: np.ndarray | None = None  # the segment lengths it was planned for (check_plan)
    k_lengths: np.ndarray | None = None
    # First query slot and query tile length of every bucket, int64 [num_buckets] on the plan's
    # device: copied there while planning, not on every call that needs them (a blocking copy).
    q_tile_starts: torch.Tensor | None = None
    q_tile_lens: torch.Tensor | None = None

    def check(self, q_offsets: torch.Tensor | None, k_offsets: torch.Tensor, *, broadcast_rows: int = 0) -> None:
        """Refuse a plan made for other segment lengths (CPU offsets only: no device sync). Such a
        plan once ran silently, reading rows of the wrong segments. `q_offsets` None: broadcast
        queries, nominal segments of `broadcast_rows` rows each (tiled_gdpa._broadcast_q)."""
        if self.q_lengths is None or k_offsets.device.type != "cpu" or (
                q_offsets is not None and q_offsets.device.type != "cpu"):
            return
        q_lengths = np.full(k_offsets.numel() - 1, broadcast_rows) if q_offsets is None else q_offsets.diff().numpy()
        for side, planned, lengths in (("query", self.q_lengths, q_lengths), ("key", self.k_lengths,
                                                                             k_offsets.diff().numpy())):
            if not np.array_equal(planned, lengths):
                raise ValueError(f"buckets were planned for other {side} segment lengths than this call's "
                                 f"offsets: pass plan_buckets(...) of these offsets, or no buckets")

    @property
    def q_sizes(self) -> list[int]:
        return [bk.size * bk.q_len for bk in self.buckets]

    @property
    def k_sizes(self) -> list[int]:
        return [bk.size * bk.k_len for bk in self.buckets]

    def k_tiles(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-bucket key tiles of to_slots(k, k_layout) (slots past the tiles are dropped)."""
        sizes = self.k_sizes
        return slots.narrow(0, 0, sum(sizes)).split(sizes)

    @property
    def examples(self) -> torch.Tensor:
        """All segments with queries, in tile order, int64 [n_total]."""
        return torch.cat([bk.examples for bk in self.buckets])

    def __len__(self) -> int:
        return len(self.buckets)


def _round_up(x: np.ndarray | int, multiple: int):
    return -(-x // multiple) * multiple


def bucket_cuts(q_lens: np.ndarray, k_lens: np.ndarray, *, overhead: float) -> list[tuple[int, int]]:
    """Cut segments (sorted by q_len, then k_len) into contiguous groups minimising padded work.

    Cost of a group [i, j): (j - i) · max(q_lens[i:j]) · max(k_lens[i:j]) + overhead. A dynamic
    programme over the ends of runs of equal (q_len, k_len): splitting such a run never lowers the
    padded work, so groups only end where the lengths change. O(R²) for R distinct lengths.
    """
    n = len(q_lens)
    if n == 0:
        return []
    q = q_lens.astype(np.float64)
    k = k_lens.astype(np.float64)
    change = np.flatnonzero((q[1:] != q[:-1]) | (k[1:] != k[:-1])) + 1
    ends = np.concatenate([change, [n]])  # candidate group ends (exclusive), ascending
    starts = np.concatenate([[0], change])  # candidate group starts
    best = np.zeros(len(ends) + 1)  # best[r]: cost of segments [0, starts[r]) ... with best[0] = 0
    arg = np.zeros(len(ends) + 1, dtype=np.int64)
    for r, j in enumerate(ends, start=1):
        s = starts[:r]  # every candidate start before this end
        kmax = _suffix_max(k, s, j)
        cost = best[:r] + (j - s) * q[j - 1] * kmax + overhead  # q sorted: group max is q[j-1]
        i = int(np.argmin(cost))
        best[r], arg[r] = cost[i], i
    cuts, r = [], len(ends)
    while r > 0:
        i = int(arg[r])
        cuts.append((int(starts[i]), int(ends[r - 1])))
        r = i
    return cuts[::-1]


def _suffix_max(k: np.ndarray, starts: np.ndarray, end: int) -> np.ndarray:
    """max(k[s:end]) for every s in starts (ascending)."""
    run_max = np.maximum.accumulate(k[:end][::-1])[::-1]  # run_max[i] = max(k[i:end])
    return run_max[starts]


def plan_buckets(q_offsets: torch.Tensor, k_offsets: torch.Tensor | None = None, *,
                 overhead: float = 16384.0, round_to: int = 8) -> BucketPlan:
    """Group segments into dense tiles (see module doc). k_offsets None: keys are the queries.

    `overhead` is the fixed price of one dense call in units of padded (query x key) pairs;
    `round_to` rounds a tile's lengths up (fewer distinct shapes) unless all its segments have the
    same length, in which case the tile is exact and needs no mask. Segments without queries get
    no tile (they produce no output rows).
    """
    self_attn = k_offsets is None
    k_offsets = q_offsets if self_attn else k_offsets
    dev = q_offsets.device
    B = q_offsets.numel() - 1
    q_lens_t, k_lens_t = q_offsets.diff(), k_offsets.diff()
    q_lens, k_lens = torch.stack([q_lens_t, k_lens_t]).cpu().numpy()  # the lengths, read from the device once
    order = np.lexsort((k_lens, q_lens))  # by q length, ties by k length
    order = order[q_lens[order] > 0]
    cuts = bucket_cuts(q_lens[order], k_lens[order], overhead=overhead)
    order_t = torch.as_tensor(order, device=dev)  # one copy to the device; every bucket is a slice of it
    buckets = []
    q_first, k_first = np.zeros(B, np.int64), np.zeros(B, np.int64)  # first slot of every example
    q_base = k_base = 0
    for i, j in cuts:
        ex_np = order[i:j]
        n = len(ex_np)
        q_len, k_len = _tile_len(q_lens[ex_np], round_to), _tile_len(k_lens[ex_np], round_to)
        if self_attn:
            q_len = k_len = max(q_len, k_len)
        q_first[ex_np] = q_base + np.arange(n) * q_len
        k_first[ex_np] = k_base + np.arange(n) * k_len
        q_base, k_base = q_base + n * q_len, k_base + n * k_len
        ex = order_t[i:j]
        # Every key slot valid: decided on the host lengths (bool(kv.all()) synced once per bucket).
        kv = None if bool((k_lens[ex_np] >= k_len).all()) else (
            torch.arange(k_len, device=dev)[None, :] < k_lens_t[ex][:, None])  # [n, k_len]
        buckets.append(Bucket(ex, q_len, k_len, kv))
    q_layout = _layout(q_offsets, q_first, q_base, int(q_lens.sum()))
    tile_lens = np.array([bk.q_len for bk in buckets], dtype=np.int64)
    tile_sizes = np.array([bk.size * bk.q_len for bk in buckets], dtype=np.int64)
    tiles = torch.as_tensor(np.stack([np.cumsum(tile_sizes) - tile_sizes, tile_lens]), device=dev).unbind(0)
    if self_attn:
        return BucketPlan(buckets, q_layout, q_layout, q_lens, k_lens, *tiles)
    # Keys of segments without queries sit in slots after every tile (never read): a layout
    # must give every row a slot.
    orphans = np.flatnonzero((q_lens == 0) & (k_lens > 0))
    k_first[orphans] = k_base + np.concatenate([[0], np.cumsum(k_lens[orphans])[:-1]]).astype(np.int64)
    k_layout = _layout(k_offsets, k_first, k_base + int(k_lens[orphans].sum()), int(k_lens.sum()))
    return BucketPlan(buckets, q_layout, k_layout, q_lens, k_lens, *tiles)


def _tile_len(lengths: np.ndarray, round_to: int) -> int:
    """A tile's length: the exact length when all are equal (no padding at all), else rounded up."""
    top = int(lengths.max())
    return top if int(lengths.min()) == top else int(_round_up(top, round_to))


def _layout(offsets: torch.Tensor, first_slot: np.ndarray, num_slots: int, num_rows: int) -> SlotLayout:
    """Row r of segment b at position p lives in slot first_slot[b] + p."""
    seg = segment_ids(offsets, num_rows)
    pos = torch.arange(seg.numel(), device=offsets.device) - offsets[seg]
    return SlotLayout(torch.as_tensor(first_slot, device=offsets.device)[seg] + pos, num_slots)


# --------------------------------------------------------------------------- blocks


@dataclass(frozen=True)
class BlockPlan:
    """Segments cut into fixed blocks: slot s of the [num_blocks * block] layout holds row src[s]."""

    block: int
    num_blocks: int
    src: torch.Tensor  # int64 [num_blocks * block], jagged row of each slot (ΣL for padding)
    dst: torch.Tensor  # int64 [ΣL], slot of each jagged row
    valid: torch.Tensor  # bool [num_blocks, block]
    block_segment: torch.Tensor  # int64 [num_blocks], the segment each block belongs to
    shift: int = 0
    align: str = "start"
    lengths: torch.Tensor | None = None  # int64 [B], the segment lengths it was planned for

    @property
    def layout(self) -> SlotLayout:
        return SlotLayout(self.dst, self.num_blocks * self.block, self.src)

    @property
    def all_valid(self) -> bool:
        """valid.all(), from the sizes: each row fills one slot (no device sync per call)."""
        return self.num_blocks * self.block == self.dst.numel()

    def check(self, offsets: torch.Tensor, rows: int, block_size: int, shift: int, align: str) -> None:
        """Refuse a plan of other blocks or another batch (segment lengths compared for CPU offsets
        only: no device sync). Such a plan once ran silently with its own blocks."""
        if ((self.block, self.shift, self.align) != (block_size, shift, align) or self.dst.numel() != rows
                or (offsets.device.type == "cpu" and self.lengths is not None
                    and not torch.equal(self.lengths.cpu().long(), offsets.diff().long()))):
            raise ValueError(f"plan was made for block_size={self.block}, shift={self.shift}, align={self.align!r} "
                             f"and other segments ({self.dst.numel()} rows); this call has block_size={block_size}, "
                             f"shift={shift}, align={align!r} and {rows} rows: pass plan_blocks(offsets, "
                             f"block_size, shift=shift, align=align) or no plan")


BLOCK_ALIGNS = ("start", "end")


def block_leads(lengths: torch.Tensor, block: int, *, shift: int = 0, align: str = "start") -> torch.Tensor:
    """Empty slots before each segment in its blocks' layout, int64 [B]: token i of a segment is in
    block (lead + i) // block.

    align="start": blocks start at the segment's first token (the kernel library's reference);
    lead = shift. align="end": blocks end at its last (most recent) token, so the newest events
    always share one full block and the short block, if any, holds the oldest; lead = -(L + shift)
    mod block. shift moves every boundary by `shift` tokens (alternating shifts across layers let
    information cross block edges).
    """
    if not 0 <= shift < block:
        raise ValueError(f"block shift must be in [0, {block}), got {shift}")
    if align == "start":
        return torch.full_like(lengths, shift)
    if align == "end":
        return torch.remainder(-(lengths + shift), block)
    raise ValueError(f"block align must be one of {BLOCK_ALIGNS}, got {align!r}")


def plan_blocks(offsets: torch.Tensor, block: int, *, shift: int = 0, align: str = "start") -> BlockPlan:
    """Cut every segment into `block`-token blocks aligned to its first or last row (block_leads)."""
    lengths = offsets.diff()  # [B]
    lead = block_leads(lengths, block, shift=shift, align=align)  # [B]
    blocks_per_seg = torch.div(lengths + lead + block - 1, block, rounding_mode="floor")  # [B]
    blocks_per_seg = torch.where(lengths > 0, blocks_per_seg, torch.zeros_like(blocks_per_seg))
    first_block = offsets_of(blocks_per_seg)  # [B+1]
    num_blocks, total = torch.stack([first_block[-1], offsets[-1]]).tolist()  # one read from the device
    seg = segment_ids(offsets, total)  # [ΣL]
    pos = torch.arange(total, device=offsets.device) - offsets[seg]  # [ΣL]
    dst = first_block[seg] * block + lead[seg] + pos  # [ΣL]
    src = torch.full((num_blocks * block,), total, dtype=torch.int64, device=offsets.device)
    src[dst] = torch.arange(total, device=offsets.device)
    valid = (src != total).view(num_blocks, block)
    block_segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), blocks_per_seg,
                                            output_size=num_blocks)
    return BlockPlan(block, num_blocks, src, dst, valid, block_segment, shift, align, lengths)
