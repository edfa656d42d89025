"""gdpa: tiled kernel against the reference in every regime the model uses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.ops import ACTIVATIONS, Kernel, gdpa
from gem.ops.common import plan_buckets
from gem.ops.testing import assert_fwd_bwd_close, make_offsets

FAST = settings(max_examples=10, deadline=None)
lengths_st = st.lists(st.integers(0, 90), min_size=1, max_size=5)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_every_activation_maps_zero_to_zero():
    z = torch.zeros(3)
    for name, act in ACTIVATIONS.items():
        assert torch.equal(act(z), z), name


@FAST
@given(lengths=lengths_st, act=st.sampled_from(sorted(ACTIVATIONS)), window=st.sampled_from([None, 0, 3]),
       seed=st.integers(0, 1000))
def test_self_gdpa_with_window_matches_reference(lengths, act, window, seed):
    offsets = make_offsets(lengths)
    H, dh = 2, 8
    q, k, v = (_rand(sum(lengths), H, dh, seed=seed + i) * 0.5 for i in range(3))

    def run(kernel):
        return lambda q, k, v: gdpa(q, k, v, q_offsets=offsets, k_offsets=offsets, activation=act,
                                    qk_scale=0.3, window=window, kernel=kernel)

    assert_fwd_bwd_close(run(Kernel.PYTORCH), run(Kernel.TILED), [q, k, v], atol=1e-5, rtol=1e-4)


@FAST
@given(lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=5),
       seed=st.integers(0, 1000))
def test_jagged_queries_over_other_jagged_keys_match_reference(lengths, seed):
    """Cross-attention shape: every example has its own query and key lengths (either may be 0)."""
    q_off, k_off = make_offsets([a for a, _ in lengths]), make_offsets([b for _, b in lengths])
    q = _rand(int(q_off[-1]), 2, 8, seed=seed)
    k, v = _rand(int(k_off[-1]), 2, 8, seed=seed + 1), _rand(int(k_off[-1]), 2, 8, seed=seed + 2)

    def run(kernel):
        return lambda q, k, v: gdpa(q, k, v, q_offsets=q_off, k_offsets=k_off, activation="relu2",
                                    qk_scale=0.05, kernel=kernel)

    assert_fwd_bwd_close(run(Kernel.PYTORCH), run(Kernel.TILED), [q, k, v])


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 1000))
def test_short_dense_kv_matches_reference_with_per_head_activations(lengths, seed):
    """The personalised-FFN shape: long jagged queries, n=5 keys per example given dense."""
    B, n, H, dh = len(lengths), 5, 2, 8
    q_offsets = make_offsets(lengths)
    q = _rand(sum(lengths), H, dh, seed=seed)
    k, v = _rand(B, n, H, dh, seed=seed + 1), _rand(B, n, H, dh, seed=seed + 2)
    acts = ("silu", "gelu_tanh")

    def run(kernel):
        return lambda q, k, v: gdpa(q, k, v, q_offsets=q_offsets, activation=acts, qk_scale=1 / n, kernel=kernel)

    assert_fwd_bwd_close(run(Kernel.PYTORCH), run(Kernel.TILED), [q, k, v])


@FAST
@given(lengths=st.lists(st.integers(0, 40), min_size=2, max_size=8), seed=st.integers(0, 1000))
def test_short_dense_kv_with_many_buckets_matches_reference(lengths, seed):
    """overhead=0 makes the planner cut a tile per distinct length, so the head-major tile layout
    of the short-KV path is exercised across many buckets, forward and backward."""
    B, n, H, dh = len(lengths), 3, 4, 4
    q_offsets = make_offsets(lengths)
    plan = plan_buckets(q_offsets, make_offsets([n] * B), overhead=0.0)
    q = _rand(sum(lengths), H, dh, seed=seed)
    k, v = _rand(B, n, H, dh, seed=seed + 1), _rand(B, n, H, dh, seed=seed + 2)

    def run(kernel):
        return lambda q, k, v: gdpa(q, k, v, q_offsets=q_offsets, activation="gelu", qk_scale=0.5, kernel=kernel,
                                    buckets=plan if kernel == Kernel.TILED else None)

    assert_fwd_bwd_close(run(Kernel.PYTORCH), run(Kernel.TILED), [q, k, v])


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 1000))
def test_broadcast_seed_queries_match_reference(lengths, seed):
    """The seed-pooling shape: Nq learned queries shared by all examples over long jagged keys."""
    Nq, H, dh = 6, 2, 8
    k_offsets = make_offsets(lengths)
    q = _rand(Nq, H, dh, seed=seed)
    k, v = _rand(sum(lengths), H, dh, seed=seed + 1), _rand(sum(lengths), H, dh, seed=seed + 2)

    def run(kernel):
        return lambda q, k, v: gdpa(q, k, v, k_offsets=k_offsets, broadcast_q=True, activation="gelu",
                                    qk_scale=0.1, kernel=kernel)

    assert_fwd_bwd_close(run(Kernel.PYTORCH), run(Kernel.TILED), [q, k, v])
    out = gdpa(q, k, v, k_offsets=k_offsets, broadcast_q=True)
    assert out.shape == (len(lengths), Nq, H, dh)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.count_nonzero(out[b]) == 0  # no events: act(0) = 0 everywhere


def test_gdpa_semantics_scale_after_activation_and_no_normalisation():
    q = torch.tensor([[[1.0, 0.0]]])  # [1, 1, 2]
    k = torch.tensor([[[2.0, 0.0]], [[-1.0, 0.0]]])  # [2, 1, 2]
    v = torch.tensor([[[1.0, 1.0]], [[10.0, 10.0]]])
    off_q, off_k = make_offsets([1]), make_offsets([2])
    out = gdpa(q, k, v, q_offsets=off_q, k_offsets=off_k, activation="relu", qk_scale=0.5)
    # scores (2, -1) -> relu (2, 0) -> * 0.5 -> (1, 0) -> 1 * v0
    torch.testing.assert_close(out, torch.tensor([[[1.0, 1.0]]]))
    raw = gdpa(q, k, v, q_offsets=off_q, k_offsets=off_k, activation="raw", qk_scale=1.0)
    torch.testing.assert_close(raw, torch.tensor([[[2.0 - 10.0, 2.0 - 10.0]]]))


def test_gdpa_bf16_is_close_to_fp32():
    offsets = make_offsets([50, 3, 120])
    q, k, v = (_rand(173, 4, 32, seed=i) * 0.3 for i in range(3))
    want = gdpa(q, k, v, q_offsets=offsets, k_offsets=offsets, qk_scale=1 / 64)
    got = gdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_offsets=offsets, k_offsets=offsets, qk_scale=1 / 64)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=5e-2)


def test_gdpa_argument_errors():
    q = torch.zeros(4, 2, 8)
    off = make_offsets([4])
    with pytest.raises(ValueError, match="unknown GDPA activation"):
        gdpa(q, q, q, q_offsets=off, k_offsets=off, activation="softmax")
    with pytest.raises(ValueError, match="per-head"):
        gdpa(q, q, q, q_offsets=off, k_offsets=off, activation=("relu",))
    with pytest.raises(ValueError, match="window"):
        gdpa(q, q, q, k_offsets=off, broadcast_q=True, window=2)


def test_broadcast_queries_over_an_empty_batch_give_an_empty_result():
    """B = 0 (no examples): the tiled kernel once raised IndexError where the reference gives [0, Nq, H, dh]."""
    q, empty = _rand(3, 2, 4), torch.zeros(0, 2, 4)
    for kernel in (Kernel.PYTORCH, Kernel.TILED):
        out = gdpa(q, empty, empty, k_offsets=make_offsets([]), broadcast_q=True, kernel=kernel)
        assert out.shape == (0, 3, 2, 4)


def test_a_bucket_plan_of_other_lengths_is_refused():
    """buckets planned for another batch with the same number of rows once ran silently, reading
    rows of the wrong segments; the model's own memoised plans still pass."""
    from gem.ops import jagged_attention

    off, other = make_offsets([3, 5]), make_offsets([5, 3])
    q = _rand(8, 2, 4)
    dense = _rand(2, 4, 2, 4)
    with pytest.raises(ValueError, match="planned for other query segment lengths"):
        jagged_attention(q, q, q, off, buckets=plan_buckets(other))
    with pytest.raises(ValueError, match="planned for other query segment lengths"):
        gdpa(q, q, q, q_offsets=off, k_offsets=off, buckets=plan_buckets(other))
    with pytest.raises(ValueError, match="planned for other key segment lengths"):
        gdpa(q, q, q, q_offsets=off, k_offsets=off, buckets=plan_buckets(off, other))
    with pytest.raises(ValueError, match="planned for other key segment lengths"):
        gdpa(q, dense, dense, q_offsets=off, buckets=plan_buckets(off, make_offsets([3, 3])))
    seeds = _rand(6, 2, 4)
    with pytest.raises(ValueError, match="planned for other key segment lengths"):
        gdpa(seeds, q, q, k_offsets=off, broadcast_q=True, buckets=plan_buckets(make_offsets([6, 6]), other))
    good = gdpa(seeds, q, q, k_offsets=off, broadcast_q=True, buckets=plan_buckets(make_offsets([6, 6]), off))
    torch.testing.assert_close(good, gdpa(seeds, q, q, k_offsets=off, broadcast_q=True))
