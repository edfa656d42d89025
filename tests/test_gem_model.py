"""Jagged attention equals the padded+masked reference (values and gradients); model sanity."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem.api.types import ModelSpec, SyntheticDataSpec
from gem.data import build_splits, make_batch
from gem.model import build_model, config_from_spec
from gem.model.jagged import jagged_attention
from gem.model.reference import pt_padded_attention

import numpy as np
import pytest


def _offsets(lengths):
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    return off


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6), nq=st.integers(1, 4),
       heads=st.sampled_from([1, 2]), dh=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_jagged_attention_matches_padded_reference(lengths, nq, heads, dh, seed):
    g = torch.Generator().manual_seed(seed)
    off = _offsets(lengths)
    total = int(off[-1])
    q = torch.randn(len(lengths), nq, heads, dh, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, heads, dh, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, heads, dh, generator=g, dtype=torch.float64, requires_grad=True)
    out = jagged_attention(q, k, v, off)
    ref = pt_padded_attention(q, k, v, off)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v), allow_unused=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v), allow_unused=True)
    for name, a, b in zip("qkv", grads, ref_grads):
        if b is None:  # no events at all: k/v get no gradient
            assert a is None or a.abs().max() == 0
            continue
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=f"grad of {name}")


def test_jagged_attention_fp32_tolerance():
    torch.manual_seed(0)
    off = _offsets([5, 0, 17, 1])
    q = torch.randn(4, 3, 2, 16, requires_grad=True)
    k, v = torch.randn(23, 2, 16), torch.randn(23, 2, 16)
    torch.testing.assert_close(jagged_attention(q, k, v, off), pt_padded_attention(q, k, v, off))


@pytest.fixture(scope="module")
def batch():
    train, _ = build_splits(SyntheticDataSpec(num_users=50, num_ads=40, num_train_examples=16, num_eval_examples=1))
    return make_batch(train, np.arange(8), max_seq_len=64)


def test_model_outputs_one_logit_per_task(batch):
    torch.manual_seed(0)
    model = build_model(ModelSpec(preset="tiny"))
    out = model(batch)
    assert set(out) == {"click", "conversion", "dwell"} and all(v.shape == (8,) for v in out.values())


def test_an_example_only_sees_its_own_history(batch):
    torch.manual_seed(0)
    model = build_model(ModelSpec(preset="tiny", num_layers=2)).eval()
    before = model(batch)["click"]
    lo, hi = int(batch.seq_offsets[3]), int(batch.seq_offsets[4])
    batch.seq_ad_id[lo:hi] = (batch.seq_ad_id[lo:hi] + 7) % 40  # change example 3's history only
    after = model(batch)["click"]
    changed = (before - after).abs() > 1e-6
    assert changed.tolist() == [i == 3 for i in range(8)]


def test_presets_and_overrides():
    cfg = config_from_spec(ModelSpec(preset="small", embedding_dim=96, num_heads=3, max_seq_len=32))
    assert (cfg.embedding_dim, cfg.num_heads, cfg.num_layers, cfg.max_seq_len) == (96, 3, 2, 32)
    with pytest.raises(ValueError, match="numHeads"):
        config_from_spec(ModelSpec(preset="tiny", num_heads=5))  # tiny's width 32 is not divisible by 5
    sizes = [sum(p.numel() for p in build_model(ModelSpec(preset=p)).parameters()) for p in ("tiny", "small")]
    assert sizes[0] < sizes[1]
