"""Segment reductions and the OneSeq merge: tiled kernels against the references."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.ops import Kernel, jagged_last_k, oneseq_merge, oneseq_merge_index, segment_mean, segment_sum
from gem.ops.testing import assert_fwd_bwd_close, make_offsets

FAST = settings(max_examples=15, deadline=None)
lengths_st = st.lists(st.integers(0, 30), min_size=1, max_size=6)


@FAST
@given(lengths=lengths_st, k=st.integers(1, 12), seed=st.integers(0, 1000))
def test_segment_ops_match_reference(lengths, k, seed):
    offsets = make_offsets(lengths)
    x = torch.randn(sum(lengths), 3, 4, generator=torch.Generator().manual_seed(seed))
    assert_fwd_bwd_close(lambda x: segment_sum(x, offsets, kernel=Kernel.PYTORCH),
                         lambda x: segment_sum(x, offsets, kernel=Kernel.TILED), [x])
    assert_fwd_bwd_close(lambda x: jagged_last_k(x, offsets, k, kernel=Kernel.PYTORCH)[0],
                         lambda x: jagged_last_k(x, offsets, k, kernel=Kernel.TILED)[0], [x])
    _, mask_ref = jagged_last_k(x, offsets, k, kernel=Kernel.PYTORCH)
    _, mask = jagged_last_k(x, offsets, k)
    assert torch.equal(mask, mask_ref)
    mean = segment_mean(x, offsets)
    for b, n in enumerate(lengths):
        want = x[int(offsets[b]):int(offsets[b + 1])].mean(0) if n else torch.zeros(3, 4)
        torch.testing.assert_close(mean[b], want)


@FAST
@given(seqs=st.lists(st.lists(st.lists(st.integers(0, 20), max_size=8), min_size=3, max_size=3),
                     min_size=1, max_size=4),
       max_len=st.sampled_from([None, 1, 5]))
def test_oneseq_merge_matches_reference(seqs, max_len):
    """seqs[i][b] = timestamps of input i for example b (few distinct values: many ties)."""
    timestamps = [torch.tensor([t for ex in s for t in sorted(ex)], dtype=torch.int64) for s in seqs]
    offsets = [make_offsets([len(ex) for ex in s]) for s in seqs]
    ref = oneseq_merge_index(timestamps, offsets, max_seq_len=max_len, kernel=Kernel.PYTORCH)
    fast = oneseq_merge_index(timestamps, offsets, max_seq_len=max_len, kernel=Kernel.TILED)
    for r, f in zip(ref, fast):
        assert torch.equal(r, f)


def test_oneseq_merge_orders_by_time_and_keeps_the_most_recent():
    clicks_t, clicks_o = torch.tensor([5, 9, 1]), make_offsets([2, 1])
    convs_t, convs_o = torch.tensor([7, 0, 3]), make_offsets([1, 2])
    values = [torch.tensor([[10.0], [11.0], [12.0]]), torch.tensor([[20.0], [21.0], [22.0]])]
    v, t, off, src = oneseq_merge(values, [clicks_t, convs_t], [clicks_o, convs_o])
    assert off.tolist() == [0, 3, 6]
    assert t.tolist() == [5, 7, 9, 0, 1, 3]
    assert src.tolist() == [0, 1, 0, 1, 0, 1]
    assert v.squeeze(1).tolist() == [10.0, 20.0, 11.0, 21.0, 12.0, 22.0]
    _, t2, off2, _ = oneseq_merge(values, [clicks_t, convs_t], [clicks_o, convs_o], max_seq_len=2)
    assert off2.tolist() == [0, 2, 4] and t2.tolist() == [7, 9, 1, 3]


def test_every_op_refuses_decreasing_offsets_naming_them():
    """A negative segment length once failed deep inside ('repeats can not be negative', a shape
    mismatch) or, in jagged_last_k and the merge reference, returned rows of other segments."""
    import pytest

    from gem.ops import block_attention, gdpa, jagged_attention

    x = torch.randn(6, 2, 4)
    bad = torch.tensor([0, 4, 2, 6])
    dense = torch.randn(3, 2, 2, 4)
    calls = {
        "segment_sum": lambda kn: segment_sum(x, bad, kernel=kn),
        "jagged_last_k": lambda kn: jagged_last_k(x, bad, 2, kernel=kn),
        "jagged_attention": lambda kn: jagged_attention(x, x, x, bad, kernel=kn),
        "block_attention": lambda kn: block_attention(x, x, x, bad, block_size=4, kernel=kn),
        "gdpa": lambda kn: gdpa(x, x, x, q_offsets=bad, k_offsets=make_offsets([6, 0, 0]), kernel=kn),
        "gdpa_dense": lambda kn: gdpa(x, dense, dense, q_offsets=bad, kernel=kn),
        "gdpa_broadcast": lambda kn: gdpa(x[:2], x, x, k_offsets=bad, broadcast_q=True, kernel=kn),
        "oneseq_merge": lambda kn: oneseq_merge_index([torch.arange(6)], [bad], kernel=kn),
    }
    for name, call in calls.items():
        for kernel in (Kernel.PYTORCH, Kernel.TILED):
            with pytest.raises(ValueError, match=r"offsets.* must be non-decreasing.*\[1\] = 4 > .*\[2\] = 2"):
                call(kernel)


def test_oneseq_merge_orders_fractional_timestamps_in_both_kernels():
    """The reference once sorted by int(time), so 1.2, 1.7 (input 0) and 1.5 (input 1) tied at 1
    and kept input order, while the tiled kernel ordered them by time."""
    ts = [torch.tensor([1.2, 1.7], dtype=torch.float64), torch.tensor([1.5], dtype=torch.float64)]
    offsets = [make_offsets([2]), make_offsets([1])]
    for kernel in (Kernel.PYTORCH, Kernel.TILED):
        index, _, source = oneseq_merge_index(ts, offsets, kernel=kernel)
        assert index.tolist() == [0, 2, 1] and source.tolist() == [0, 1, 0], kernel
