"""jagged_attention and block_attention (+ time rotary): tiled kernels against the references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from gem.ops import Kernel, block_attention, jagged_attention, plan_blocks, plan_buckets, time_rotary
from gem.ops.common import bucket_cuts
from gem.ops.testing import assert_fwd_bwd_close, make_offsets

lengths_st = st.lists(st.integers(0, 150), min_size=1, max_size=6)
FAST = settings(max_examples=12, deadline=None)


def _qkv(total: int, H: int = 2, dh: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, H, dh, generator=g) for _ in range(3)]


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 10_000))
def test_jagged_attention_matches_reference(lengths, seed):
    offsets = make_offsets(lengths)
    q, k, v = _qkv(sum(lengths), seed=seed)
    assert_fwd_bwd_close(lambda q, k, v: jagged_attention(q, k, v, offsets, kernel=Kernel.PYTORCH),
                         lambda q, k, v: jagged_attention(q, k, v, offsets, kernel=Kernel.TILED), [q, k, v])


def test_jagged_attention_equals_per_sequence_sdpa_and_bf16_is_close():
    lengths = [1, 37, 200, 64, 0, 5]
    offsets = make_offsets(lengths)
    q, k, v = _qkv(sum(lengths), H=4, dh=32)
    out = jagged_attention(q, k, v, offsets)
    for b in range(len(lengths)):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        if hi > lo:
            want = F.scaled_dot_product_attention(*(x[lo:hi].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
            torch.testing.assert_close(out[lo:hi], want, atol=1e-5, rtol=1e-4)
    out16 = jagged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), offsets)
    torch.testing.assert_close(out16.float(), out, atol=3e-2, rtol=3e-2)


def test_bucket_plan_covers_every_row_once_and_bounds_padding():
    lengths = torch.exp(5 + torch.randn(64, generator=torch.Generator().manual_seed(1))).round().clamp(8, 2048)
    offsets = make_offsets(lengths.long().tolist())
    plan = plan_buckets(offsets)
    dst = plan.q_layout.dst
    assert dst.unique().numel() == dst.numel() == int(offsets[-1]) and int(dst.max()) < plan.q_layout.num_slots
    assert sorted(plan.examples.tolist()) == list(range(64))
    padded = sum(bk.size * bk.q_len**2 for bk in plan.buckets)
    ideal = float((lengths**2).sum())
    assert padded < 1.5 * ideal + 16384 * len(plan)
    # With no call overhead the DP puts equal lengths together and nothing else.
    assert bucket_cuts(torch.tensor([3, 3, 5]).numpy(), torch.tensor([3, 3, 5]).numpy(), overhead=0) == [(0, 2), (2, 3)]


@FAST
@given(lengths=lengths_st, block=st.sampled_from([4, 16, 64]), shift_frac=st.floats(0, 0.99),
       align=st.sampled_from(["start", "end"]), seed=st.integers(0, 10_000))
def test_block_attention_matches_reference(lengths, block, shift_frac, align, seed):
    offsets = make_offsets(lengths)
    shift = int(shift_frac * block)
    q, k, v = _qkv(sum(lengths), seed=seed)
    g = torch.Generator().manual_seed(seed)
    phase = torch.rand(sum(lengths), generator=g) * 50

    def run(kernel):
        return lambda q, k, v: block_attention(q, k, v, offsets, block_size=block, shift=shift, align=align,
                                               rotary_phase=phase, kernel=kernel)

    assert_fwd_bwd_close(run(Kernel.PYTORCH), run(Kernel.TILED), [q, k, v])


def test_block_attention_is_local_and_full_attention_inside_one_block():
    lengths = [130, 64, 3]
    offsets = make_offsets(lengths)
    q, k, v = _qkv(sum(lengths))
    out = block_attention(q, k, v, offsets, block_size=64)
    # A segment no longer than a block: block attention == full attention.
    lo = 130
    torch.testing.assert_close(out[lo:lo + 64], jagged_attention(q[lo:lo + 64], k[lo:lo + 64], v[lo:lo + 64],
                                                                  make_offsets([64])), atol=1e-5, rtol=1e-4)
    # Changing a key in block 1 of segment 0 leaves block 0 and block 2 untouched.
    k2 = k.clone()
    k2[70] += 5.0
    out2 = block_attention(q, k2, v, offsets, block_size=64)
    assert torch.equal(out2[:64], out[:64]) and torch.equal(out2[128:], out[128:])
    assert not torch.allclose(out2[64:128], out[64:128])


def test_block_plan_pads_only_to_a_block_multiple():
    offsets = make_offsets([1, 64, 65, 0, 200])
    plan = plan_blocks(offsets, 64)
    assert plan.num_blocks == 1 + 1 + 2 + 0 + 4
    assert plan.block_segment.tolist() == [0, 1, 2, 2, 4, 4, 4, 4]
    shifted = plan_blocks(offsets, 64, shift=32)
    assert shifted.num_blocks == 1 + 2 + 2 + 0 + 4
    ended = plan_blocks(offsets, 64, align="end")
    assert ended.num_blocks == plan.num_blocks
    # The last (newest) block of every segment is full unless the segment is shorter than a block.
    last = {int(seg): i for i, seg in enumerate(ended.block_segment)}
    assert [int(ended.valid[last[b]].sum()) for b in (0, 1, 2, 4)] == [1, 64, 64, 64]
    assert [int(plan.valid[last[b]].sum()) for b in (0, 1, 2, 4)] == [1, 64, 1, 8]


def _one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one query row [H, dh] over keys/values [n, H, dh] -> [H, dh]."""
    w = torch.softmax(torch.einsum("hd,jhd->hj", q, k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("hj,jhd->hd", w, v)


def test_end_aligned_blocks_give_the_newest_event_the_newest_block_of_keys():
    lengths = [70, 200, 10]
    offsets = make_offsets(lengths)
    q, k, v = _qkv(sum(lengths))
    for kernel in (Kernel.PYTORCH, Kernel.TILED):
        out = block_attention(q, k, v, offsets, block_size=64, align="end", kernel=kernel)
        for b, L in enumerate(lengths):
            hi = int(offsets[b + 1])
            keys = slice(hi - min(L, 64), hi)  # the newest min(L, 64) events
            torch.testing.assert_close(out[hi - 1], _one_query(q[hi - 1], k[keys], v[keys]), atol=1e-5, rtol=1e-4)
    # Start-aligned, the newest of 70 events sits in a block of 6.
    start = block_attention(q, k, v, offsets, block_size=64, align="start")
    torch.testing.assert_close(start[69], _one_query(q[69], k[64:70], v[64:70]), atol=1e-5, rtol=1e-4)


def test_time_rotary_matches_reference_keeps_norms_and_is_relative():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, 16, generator=g)
    phase = torch.rand(10, generator=g) * 100
    # The phase is data (event times): gradients flow to x only.
    assert_fwd_bwd_close(lambda x: time_rotary(x, phase, kernel=Kernel.PYTORCH),
                         lambda x: time_rotary(x, phase, kernel=Kernel.TILED), [x], atol=1e-4)
    y = time_rotary(x, phase)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # Shifting every phase by the same amount leaves all q·k scores unchanged.
    q, k = time_rotary(x, phase), time_rotary(x.flip(0), phase)
    q2, k2 = time_rotary(x, phase + 7.0), time_rotary(x.flip(0), phase + 7.0)
    torch.testing.assert_close(torch.einsum("ihd,jhd->hij", q, k), torch.einsum("ihd,jhd->hij", q2, k2),
                               atol=1e-4, rtol=1e-4)


def test_dispatchers_reject_bad_shapes():
    q, k, v = _qkv(10)
    with pytest.raises(Exception, match="offsets"):
        jagged_attention(q, k, v, make_offsets([3, 3]))
    with pytest.raises(Exception, match="same shape"):
        block_attention(q, k[:5], v, make_offsets([10]))
    with pytest.raises(ValueError, match="shift"):
        block_attention(q, k, v, make_offsets([10]), block_size=4, shift=4)
    with pytest.raises(ValueError, match="align"):
        block_attention(q, k, v, make_offsets([10]), block_size=4, align="middle")


def test_time_rotary_is_exact_for_large_and_negative_phases():
    """Phases given in float64 far from 0 (raw seconds, unix times, negative deltas): the tiled
    kernel once rounded them to float32 first (a unix time moved by up to 64 rad) and disagreed
    with the reference by up to 5.9; scores still depend on phase differences only."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 16, generator=g)
    small = (torch.rand(8, generator=g, dtype=torch.float64) - 0.5) * 100
    for offset in (1e6, -1e6, 1.7e9):
        phase = small + offset
        want = time_rotary(x, phase, kernel=Kernel.PYTORCH)
        torch.testing.assert_close(time_rotary(x, phase, kernel=Kernel.TILED), want, atol=1e-5, rtol=1e-5)
        q, k = time_rotary(x, phase), time_rotary(x.flip(0), phase)
        q0, k0 = time_rotary(x, small), time_rotary(x.flip(0), small)
        torch.testing.assert_close(torch.einsum("ihd,jhd->hij", q, k), torch.einsum("ihd,jhd->hij", q0, k0),
                                   atol=1e-4, rtol=1e-4)


def test_block_attention_bf16_forward_and_backward_are_close_to_fp32():
    """The bf16 path (bf16 blocks, bf16 mask bias, the hand-written backward) had no test; lengths
    around the block (64, 65) and an empty segment, shifted blocks, rotary phases."""
    lengths = [1, 40, 64, 65, 0, 130]
    offsets = make_offsets(lengths)
    q, k, v = _qkv(sum(lengths), H=4, dh=32)
    phase = torch.arange(sum(lengths), dtype=torch.float32)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

    def run(dtype, kernel):
        xs = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)]
        out = block_attention(*xs, offsets, block_size=64, shift=16, rotary_phase=phase, kernel=kernel)
        (out.float() * w).sum().backward()
        return [out.float()] + [x.grad.float() for x in xs]

    for got, want in zip(run(torch.bfloat16, Kernel.TILED), run(torch.float32, Kernel.PYTORCH)):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_block_attention_refuses_a_plan_made_for_other_blocks():
    """A precomputed plan with another shift or alignment (or for another batch) once ran with its
    own blocks, silently: only block_size was compared."""
    offsets = make_offsets([40, 70])
    q, k, v = _qkv(110)
    for plan in (plan_blocks(offsets, 64, shift=32), plan_blocks(offsets, 64, align="end"),
                 plan_blocks(make_offsets([40, 71]), 64), plan_blocks(make_offsets([70, 40]), 64)):
        with pytest.raises(ValueError, match="plan was made for block_size=64"):
            block_attention(q, k, v, offsets, block_size=64, plan=plan)
    torch.testing.assert_close(block_attention(q, k, v, offsets, block_size=64, plan=plan_blocks(offsets, 64)),
                               block_attention(q, k, v, offsets, block_size=64))
