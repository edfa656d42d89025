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


def test_spec_affinity_branch_switches_the_branch_and_the_trunks_match_flags():
    """spec.model.affinityBranch (default true): the DLRM branch beside the trunk; false builds the
    trunk alone with exact-match flags on its events, the best design measured without the branch."""
    from gem.model import kunlun_config

    for preset in ("tiny", "small", "base", "large"):
        on = kunlun_config(config_from_spec(ModelSpec(preset=preset)))
        off = kunlun_config(config_from_spec(ModelSpec(preset=preset, affinity_branch=False)))
        assert (on.affinity_branch, on.match_flags) == (True, False), preset
        assert (off.affinity_branch, off.match_flags) == (False, True), preset
    with_branch, alone = (build_model(ModelSpec(affinity_branch=b)) for b in (True, False))
    assert alone.affinity is None and with_branch.affinity is not None
    assert all(e.match_emb is not None for e in alone.encoders.values())
    assert all(e.match_emb is None for e in with_branch.encoders.values())
    with pytest.raises(ValueError, match="affinityBranch"):
        ModelSpec.model_validate({"affinityBranch": "maybe"})


def test_spec_generative_loss_weight_reaches_the_model_and_the_trainers_loss():
    """spec.model.generativeLossWeight (default 0: off) turns on the generative objective over the
    history (gem.modules.generative); GEMTask's loss adds it, weighted, as the part "generative"."""
    from gem.api import parse_object
    from gem.model import kunlun_config
    from gem.train.task import GEMTask

    assert ModelSpec().generative_loss_weight == 0.0 and build_model(ModelSpec()).generative is None
    assert kunlun_config(config_from_spec(ModelSpec(generative_loss_weight=0.3))).generative_loss_weight == 0.3
    with pytest.raises(ValueError, match="generativeLossWeight"):
        ModelSpec.model_validate({"generativeLossWeight": -1})
    train, _ = build_splits(SyntheticDataSpec(num_users=50, num_ads=40, num_train_examples=32, num_eval_examples=8))
    batch = make_batch(train, np.arange(8), max_seq_len=64)
    losses = {}
    for w in (0.0, 2.0):
        task = GEMTask(parse_object({"apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining", "metadata": {"name": "g"},
                                     "spec": {"model": {"preset": "tiny", "generativeLossWeight": w}}}))
        torch.manual_seed(0)
        model = task.build_model()
        losses[w] = task.loss(model, batch)
    (off, off_parts), (on, on_parts) = losses[0.0], losses[2.0]
    assert "generative" not in off_parts and float(on_parts["generative"].detach()) > 0
    torch.testing.assert_close(on, off + on_parts["generative"])  # the same model otherwise


# --------------------------------------------------------------------------- degenerate batches
# What real ads traffic produces: no history, one event type missing, histories past max_seq_len,
# lengths at block multiples +- 1 (tiny: block 16, max_seq_len 64), tied / unsorted / future
# timestamps, ids outside the tables.

T_REQ = 1_700_000_000


def _history(length, seed, types=None):
    r = np.random.default_rng(seed)
    return dict(ts=np.sort(T_REQ - r.integers(60, 30 * 86400, length)),
                types=r.integers(0, 4, length) if types is None else np.full(length, types),
                ad=r.integers(0, 40, length), camp=r.integers(0, 10, length), surf=r.integers(0, 4, length),
                user=seed, ad_id=seed % 7, camp_id=seed % 3, surface=seed % 4, dense=[0.1 * seed, -0.2])


def _v1_batch(examples):
    from gem.data.batch import Batch

    B = len(examples)
    off = torch.from_numpy(np.concatenate([[0], np.cumsum([len(e["ts"]) for e in examples])]).astype(np.int64))

    def seq(key):
        return torch.from_numpy(np.concatenate([np.asarray(e[key], np.int64) for e in examples]))

    def per(key):
        return torch.tensor([e[key] for e in examples], dtype=torch.int64)

    return Batch(user_id=per("user"), ad_id=per("ad_id"), campaign_id=per("camp_id"), advertiser_id=per("camp_id"),
                 surface=per("surface"), request_time=torch.full((B,), T_REQ),
                 dense=torch.tensor([e["dense"] for e in examples], dtype=torch.float32), seq_offsets=off,
                 seq_ad_id=seq("ad"), seq_campaign_id=seq("camp"), seq_type=seq("types"), seq_timestamp=seq("ts"),
                 seq_surface=seq("surf"), click=torch.arange(B) % 2.0, conversion=torch.zeros(B),
                 p_click=torch.zeros(B), p_conversion=torch.zeros(B), weight=torch.ones(B),
                 dwell=torch.full((B,), float("nan")), p_dwell=torch.zeros(B),
                 objective=torch.zeros(B, dtype=torch.int64))


def _shuffled(e):
    """The same events in a random order (every per-event field permuted together)."""
    perm = np.random.default_rng(1).permutation(len(e["ts"]))
    return dict(e, **{k: np.asarray(e[k])[perm] for k in ("ts", "types", "ad", "camp", "surf")})


DEGENERATE = {
    "no_history": lambda: _history(0, 100),
    "one_event": lambda: _history(1, 101),
    "impressions_only": lambda: _history(20, 102, types=0),  # the engaged tier is empty
    "clicks_only": lambda: _history(20, 103, types=1),  # the impressions tier is empty
    "past_max_seq_len": lambda: _history(200, 104),
    **{f"length_{n}": (lambda n=n: _history(n, 105 + n, types=1)) for n in (15, 16, 17, 63, 64, 65)},
    "tied_timestamps": lambda: dict(_history(30, 110), ts=np.full(30, T_REQ - 1000)),
    "unsorted_timestamps": lambda: _shuffled(_history(30, 111)),
    "future_events": lambda: dict(_history(30, 112), ts=T_REQ + 10**6 + np.arange(30)),
    "ids_outside_tables": lambda: dict(_history(20, 113), ad=np.array([2**62, -2**62, -1, 10**12] * 5),
                                       camp=np.array([-7, 2**63 - 1, 10**15, 0] * 5), user=-(2**63),
                                       ad_id=-5, camp_id=2**62),
    "surfaces_outside_range": lambda: dict(_history(20, 114), surf=np.array([9, -3, 4, 100] * 5), surface=7),
}


@pytest.fixture(scope="module")
def degenerate_models():
    from gem.baselines import DLRMConfig, DLRMModel, PaddedKunlunModel
    from gem.modules import set_kernel
    from gem.ops import Kernel

    torch.manual_seed(0)
    gem = build_model(ModelSpec(preset="tiny")).eval()
    torch.manual_seed(0)
    dlrm, padded = DLRMModel(DLRMConfig(base=gem.cfg)).eval(), PaddedKunlunModel(gem.cfg).eval()
    import copy
    return {"gem": gem, "gem_reference_kernels": set_kernel(copy.deepcopy(gem), Kernel.PYTORCH),
            "dlrm": dlrm, "padded_gem": padded}


def _fwd_bwd(model, examples):
    from gem.modules import from_v1_batch

    model.zero_grad(set_to_none=True)
    out = model(from_v1_batch(_v1_batch(examples)))
    sum(v.sum() * (i + 1) for i, v in enumerate(out.values())).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {t: v.detach() for t, v in out.items()}, grads


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_degenerate_examples_are_finite_and_independent(case, degenerate_models):
    """Forward + backward finite; the other examples unchanged by adding the odd one; the odd one
    the same alone as in the batch; tiled and reference kernels agree (outputs and gradients)."""
    others = [_history(n, s) for s, n in enumerate([5, 40, 17])]
    odd = DEGENERATE[case]()
    batch = others[:1] + [odd] + others[1:]
    runs = {}
    for name, model in degenerate_models.items():
        out, grads = runs[name] = _fwd_bwd(model, batch)
        without, alone = _fwd_bwd(model, others)[0], _fwd_bwd(model, [odd])[0]
        for n, g in grads.items():
            assert torch.isfinite(g).all(), f"{name}: grad of {n}"
        for t in out:
            assert torch.isfinite(out[t]).all(), f"{name}: {t}"
            torch.testing.assert_close(torch.cat([out[t][:1], out[t][2:]]), without[t], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out[t][1:2], alone[t], atol=1e-5, rtol=1e-4)
    (out_t, grads_t), (out_r, grads_r) = runs["gem"], runs["gem_reference_kernels"]
    for t in out_t:
        torch.testing.assert_close(out_t[t], out_r[t], atol=1e-5, rtol=1e-4)
    assert grads_t.keys() == grads_r.keys()
    for n in grads_t:
        torch.testing.assert_close(grads_t[n], grads_r[n], atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_documented_handling_of_out_of_contract_histories():
    """docs/data.md: seq_timestamp ascending and <= request_time, ids any int64 (hashed into the
    tables). The model needs neither order nor the bound: OneSeq sorts by time (stable), and an
    event's age is clamped at 0, so a shuffled history equals the sorted one and a future event
    equals one at the request time; any int64 id hashes to a row in range."""
    from gem.modules.embeddings import hash_ids

    torch.manual_seed(0)
    model = build_model(ModelSpec(preset="tiny")).eval()
    base = [_history(30, 1), _history(70, 2)]
    want = model(_v1_batch(base))
    got = model(_v1_batch([_shuffled(base[0]), _shuffled(base[1])]))
    for t in want:
        torch.testing.assert_close(got[t], want[t], atol=1e-5, rtol=1e-4)
    now = dict(base[0], ts=np.full(30, T_REQ))
    later = dict(base[0], ts=np.full(30, T_REQ + 3600))
    torch.testing.assert_close(model(_v1_batch([later]))["click"], model(_v1_batch([now]))["click"])
    ids = torch.tensor([-(2**63), -1, 0, 1, 2**62, 2**63 - 1])
    rows = hash_ids(ids, 2048, 17)
    assert bool(((rows >= 0) & (rows < 2048)).all())
    small = [0, 1, 12345]  # no int64 wrap-around: the documented formula exactly
    assert hash_ids(torch.tensor(small), 2048, 17).tolist() == [((i + 17) * 2654435761) % 2048 for i in small]


def test_an_empty_batch_gives_empty_logits_and_a_zero_loss(degenerate_models):
    """B = 0 (e.g. a filter that kept no example): HSP's tiled seed pooling once raised IndexError
    and the heads could not reshape 0 elements; now every model returns [0] logits."""
    from gem.modules.inputs import random_inputs

    inputs = random_inputs(degenerate_models["gem"].cfg, torch.zeros(0, dtype=torch.int64))
    for name, model in degenerate_models.items():
        out = model(inputs)
        assert set(out) == {"click", "conversion", "dwell"}, name
        assert all(v.shape == (0,) for v in out.values()), name
        loss, _ = model.loss(inputs)
        loss.backward()
        assert float(loss.detach()) == 0.0, name


def test_an_event_type_outside_the_schema_is_refused_naming_seq_type():
    """seq_type 4 (or -1) names no event type: such events were dropped from the history silently."""
    from gem.modules import from_v1_batch

    for bad in (4, -1):
        ex = dict(_history(10, 7), types=np.array([0, 1, 2, 3, bad, 0, 1, 2, 3, 0]))
        with pytest.raises(ValueError, match=r"seq_type must be in \[0, 4\): 0 impression, 1 click.*got values in"):
            from_v1_batch(_v1_batch([ex]))
    from_v1_batch(_v1_batch([_history(10, 7)]))  # 0-3: fine
