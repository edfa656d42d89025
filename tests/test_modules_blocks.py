"""Modules against their plain references: SumKronLinear, MoWE vs Wukong layers, HSP, PFFN,
block attention layer, OneSeq encoder and the multi-task heads."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from gem.modules import PRESETS, set_kernel
from gem.modules.attention import BlockAttentionLayer
from gem.modules.common import block_pairs
from gem.modules.heads import MultiTaskHeads, multitask_loss
from gem.modules.hsp import HierarchicalSeedPooling, SumKronLinear
from gem.modules.mowe import MixtureOfWukongExperts
from gem.modules.oneseq import OneSeqEncoder, TierBatch
from gem.modules.pffn import PersonalizedFFN, TokenFFN
from gem.modules.wukong import WukongLayer
from gem.modules.embeddings import FeatureEmbeddings
from gem.modules.inputs import EventSequence, GemInputs, single_id_bag
from gem.ops import Kernel, plan_blocks
from gem.ops.testing import make_offsets

CFG = PRESETS["tiny"]
TIER = CFG.tiers[0]
FAST = settings(max_examples=6, deadline=None)
lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=4)


def _tier_batch(lengths, seed=0, dim=TIER.dim):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return TierBatch(torch.randn(n, dim, generator=g), make_offsets(lengths), torch.rand(n, generator=g) * 60)


def _grads(module, inputs, out_fn, seed=0):
    module.zero_grad()
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = out_fn(module, *xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * w).sum().backward()
    gx = [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]  # no path (empty batch): zero
    return out.detach(), gx, {n: p.grad.clone() for n, p in module.named_parameters()
                                                 if p.grad is not None}


def _assert_same(a, b, atol=1e-5, rtol=1e-4):
    out_a, gx_a, gp_a = a
    out_b, gx_b, gp_b = b
    torch.testing.assert_close(out_a, out_b, atol=atol, rtol=rtol)
    for x, y in zip(gx_a, gx_b):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)
    for n in gp_a.keys() | gp_b.keys():  # a parameter with no path to the output (empty batch) is zero
        ga, gb = gp_a.get(n), gp_b.get(n)
        ga = torch.zeros_like(gb) if ga is None else ga
        gb = torch.zeros_like(ga) if gb is None else gb
        torch.testing.assert_close(ga, gb, atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m}")


def _kernel_pair(module, inputs, out_fn):
    """The module under the plain reference kernel and under the tiled kernel: same outputs and grads."""
    ref = _grads(set_kernel(copy.deepcopy(module), Kernel.PYTORCH), inputs, out_fn)
    fast = _grads(set_kernel(module, Kernel.TILED), inputs, out_fn)
    _assert_same(ref, fast)
    return fast


def test_sum_kron_linear_matches_its_definition():
    skl = SumKronLinear(6, 3, 5, 4, rank=3)
    x = torch.randn(2, 6, 5)
    _assert_same(_grads(skl, [x], lambda m, x: m(x)), _grads(skl, [x], lambda m, x: m.reference(x)))
    assert sum(p.numel() for p in skl.parameters()) == 3 * (6 * 3 + 5 * 4)


def test_mowe_equals_separate_wukong_layers_and_slices_compose():
    torch.manual_seed(0)
    B, N_z, d, M, n, k, hid = 3, 7, 8, 3, 6, 2, 16
    mowe = MixtureOfWukongExperts(num_in=N_z, num_out=5, dim=d, num_experts=M, expert_tokens=n, rank=k, hidden=hid)
    layers = [WukongLayer(num_tokens=n, dim=d, num_fm=n // 2, num_lcb=n - n // 2, rank=k, hidden=hid) for _ in range(M)]
    for layer in layers:  # non-trivial norms and biases
        for p in layer.parameters():
            p.data.add_(0.1 * torch.randn_like(p))
    w_in = [torch.randn(N_z, n) for _ in range(M)]
    mowe.load_experts(layers, w_in)
    z = torch.randn(B, N_z, d, requires_grad=True)
    got = mowe.forward_experts(z)  # [B, M, n, d]
    want = torch.stack([layers[m](torch.einsum("bzd,ze->bed", z, w_in[m])) for m in range(M)], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(got)
    (gz,) = torch.autograd.grad((got * g).sum(), z, retain_graph=True)
    (gz_ref,) = torch.autograd.grad((want * g).sum(), z)
    torch.testing.assert_close(gz, gz_ref, atol=1e-5, rtol=1e-4)
    # Expert parallelism: the ranks' slices, concatenated, are the whole mixture.
    parts = [mowe.forward_experts(z, MixtureOfWukongExperts.expert_slice(r, 3, M)) for r in range(3)]
    torch.testing.assert_close(torch.cat(parts, dim=1), got)
    assert mowe(z).shape == (B, 5, d)


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 100))
def test_hsp_reference_kernel_gradients_and_batch_independence(lengths, seed):
    torch.manual_seed(seed)
    hsp = HierarchicalSeedPooling(TIER, rank=2, activation="gelu_tanh")
    tb = _tier_batch(lengths, seed)
    fast = _kernel_pair(hsp, [tb.values], lambda m, v: m(tb.replace_values(v)))
    out = fast[0]
    assert out.shape == (len(lengths), TIER.num_summary_tokens, TIER.dim)
    # Jagged batch == every example alone (no padding, no leakage between examples).
    for b, n in enumerate(lengths):
        lo = int(tb.offsets[b])
        alone = hsp(TierBatch(tb.values[lo:lo + n], make_offsets([n]), tb.phase[lo:lo + n]))
        torch.testing.assert_close(out[b:b + 1], alone.detach(), atol=1e-5, rtol=1e-4)


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 100))
def test_hsp_matches_its_plain_per_example_form(lengths, seed):
    """Both kernels run the same module code, so the kernel pair above cannot see a wiring error
    (a dropped norm, the scale before the activation, another compression): this spells HSP out."""
    torch.manual_seed(seed)
    hsp = HierarchicalSeedPooling(TIER, rank=2, activation="gelu_tanh")
    tb = _tier_batch(lengths, seed)
    out = hsp(tb).detach()
    n, H, dh, dt = TIER.num_seeds, TIER.num_heads, TIER.head_dim, TIER.dim
    q = hsp.q_norm(hsp.w_q(hsp.seed_norm(hsp.seeds)).view(n, H, dh)) * dh**-0.5  # [n_seed, H, dh]
    for b, L in enumerate(lengths):
        lo = int(tb.offsets[b])
        k, v = hsp.w_kv(tb.values[lo:lo + L]).view(L, 2, H, dh).unbind(1)
        scores = torch.einsum("shd,thd->hst", q, hsp.k_norm(k))  # [H, n_seed, L]
        pooled = torch.einsum("hst,thd->shd", F.gelu(scores, approximate="tanh") / TIER.max_seq_len, v)
        want = hsp.out_norm(hsp.compress.reference(pooled.reshape(1, n, dt)))
        torch.testing.assert_close(out[b:b + 1], want.detach(), atol=1e-5, rtol=1e-4)


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 100))
def test_pffn_matches_a_per_example_generated_ffn(lengths, seed):
    torch.manual_seed(seed)
    n_sum = CFG.num_sum_tokens
    pffn = PersonalizedFFN(TIER, dim=CFG.dim, num_sum_tokens=n_sum, activation="silu")
    tb = _tier_batch(lengths, seed)
    x_sum = torch.randn(len(lengths), n_sum, CFG.dim)
    fast = _kernel_pair(pffn, [tb.values, x_sum], lambda m, v, xs: m(tb.replace_values(v), xs))
    # Plain form: per example b, an FFN with weights W1_h = K_bh (n_sum x dh), W2_h = V_bh.
    H, dh = TIER.num_heads, TIER.head_dim
    for b, n in enumerate(lengths):
        lo = int(tb.offsets[b])
        s = pffn.norm_in(tb.values[lo:lo + n])  # [n, d_t]
        k, v = pffn.w_kv(x_sum[b]).view(n_sum, 2, H, dh).unbind(1)
        k = pffn.k_norm(k)
        hidden = F.silu(torch.einsum("thd,jhd->thj", s.view(n, H, dh) * dh**-0.5, k))  # [n, H, n_sum]
        want = pffn.out_norm(torch.einsum("thj,jhd->thd", hidden, v).reshape(n, TIER.dim) / n_sum + s)
        torch.testing.assert_close(fast[0][lo:lo + n], want.detach(), atol=1e-5, rtol=1e-4)


@FAST
@given(lengths=lengths_st, seed=st.integers(0, 100))
def test_token_ffn_baseline_is_the_pffn_block_with_one_static_ffn(lengths, seed):
    """The benchmark's baseline differs from the PFFN only in the FFN: a PFFN whose summary is the
    same for every example is a static FFN of width H·n_sum with block-diagonal weights, and a
    TokenFFN holding those weights (and the same norms) gives the same output."""
    torch.manual_seed(seed)
    n_sum, H, dh, dt = CFG.num_sum_tokens, TIER.num_heads, TIER.head_dim, TIER.dim
    pffn = PersonalizedFFN(TIER, dim=CFG.dim, num_sum_tokens=n_sum, activation="gelu")
    ffn = TokenFFN(TIER, mult=1, activation="gelu")
    with torch.no_grad():
        for p in [*pffn.norm_in.parameters(), *pffn.out_norm.parameters()]:
            p.normal_()
        ffn.norm_in.load_state_dict(pffn.norm_in.state_dict())
        ffn.out_norm.load_state_dict(pffn.out_norm.state_dict())
        one = torch.randn(n_sum, CFG.dim)
        k, v = pffn.w_kv(one).view(n_sum, 2, H, dh).unbind(1)
        k = pffn.k_norm(k) * dh**-0.5
        ffn.w1, ffn.w2 = torch.nn.Linear(dt, H * n_sum), torch.nn.Linear(H * n_sum, dt)
        ffn.w1.bias.zero_()
        ffn.w2.bias.zero_()
        ffn.w1.weight.zero_()
        ffn.w2.weight.zero_()
        for h in range(H):
            rows, cols = slice(h * n_sum, (h + 1) * n_sum), slice(h * dh, (h + 1) * dh)
            ffn.w1.weight[rows, cols] = k[:, h]
            ffn.w2.weight[cols, rows] = v[:, h].T / n_sum
    tb = _tier_batch(lengths, seed)
    want = pffn(tb, one.expand(len(lengths), n_sum, CFG.dim))
    torch.testing.assert_close(ffn(tb), want, atol=1e-5, rtol=1e-4)


@FAST
@given(lengths=lengths_st, shift=st.sampled_from([0, 8]), align=st.sampled_from(["start", "end"]),
       seed=st.integers(0, 100))
def test_block_attention_layer_kernels_and_batch_independence(lengths, shift, align, seed):
    torch.manual_seed(seed)
    tier = dataclasses.replace(TIER, block_align=align)
    layer = BlockAttentionLayer(tier, shift=shift)
    tb = _tier_batch(lengths, seed)
    # The FLOP count's (query, key) pairs are the blocks the kernel actually builds.
    plan = plan_blocks(tb.offsets, tier.block_size, shift=shift, align=align)
    assert block_pairs(tb.offsets.diff(), tier.block_size, shift, align) == float((plan.valid.sum(1) ** 2).sum())
    out = _kernel_pair(layer, [tb.values], lambda m, v: m(tb.replace_values(v)))[0]
    for b, n in enumerate(lengths):
        lo = int(tb.offsets[b])
        alone = layer(TierBatch(tb.values[lo:lo + n], make_offsets([n]), tb.phase[lo:lo + n]))
        torch.testing.assert_close(out[lo:lo + n], alone.detach(), atol=1e-5, rtol=1e-4)


def test_block_attention_layer_matches_its_plain_form():
    """S + W_o · BlockAttn(RoPE(q), RoPE(k), v), spelled out with the reference ops (the kernel pair
    shares the layer's wiring: swapped q/k or a rotated v would pass it)."""
    from gem.ops import block_attention, time_rotary

    torch.manual_seed(0)
    layer = BlockAttentionLayer(TIER, shift=TIER.block_size // 2)
    tb = _tier_batch([0, 5, 40, 17])
    H, dh = TIER.num_heads, TIER.head_dim
    q, k, v = layer.w_qkv(layer.norm(tb.values)).view(-1, 3, H, dh).unbind(1)
    q, k = (time_rotary(x, tb.phase, kernel=Kernel.PYTORCH) for x in (q, k))
    o = block_attention(q, k, v, tb.offsets, block_size=TIER.block_size, shift=TIER.block_size // 2,
                        kernel=Kernel.PYTORCH)
    want = tb.values + layer.w_o(o.flatten(1))
    torch.testing.assert_close(layer(tb), want, atol=1e-5, rtol=1e-4)


def _inputs_with(clicks: list[list[int]], convs: list[list[int]], imps: list[list[int]]) -> GemInputs:
    """Timestamps per example and event type; ids = timestamps so the order is visible."""
    B = len(clicks)

    def seq(ts):
        flat = torch.tensor([t for ex in ts for t in ex], dtype=torch.int64)
        return EventSequence(make_offsets([len(ex) for ex in ts]), flat, {"item": flat, "campaign": flat})

    ids = torch.arange(B)
    given = {"click": seq(clicks), "conversion": seq(convs), "impression": seq(imps)}
    # Every other event type of the schema (e.g. organic engagement) is present and empty.
    sequences = {t: given[t] if t in given else seq([[] for _ in range(B)]) for t in CFG.features.event_types}
    return GemInputs(request_time=torch.full((B,), 10_000), surface=torch.zeros(B, dtype=torch.int64),
                     sparse={n: single_id_bag(ids) for n in ("user", "ad", "campaign", "advertiser")},
                     dense=torch.zeros(B, 2), sequences=sequences)


def test_oneseq_encoder_merges_by_time_truncates_and_matches_reference_kernel():
    torch.manual_seed(0)
    emb = FeatureEmbeddings(CFG)
    enc = OneSeqEncoder(CFG, TIER)  # engaged tier: clicks + conversions
    inputs = _inputs_with(clicks=[[5, 9], [1]], convs=[[7], []], imps=[[2], [3]])
    candidate = torch.randn(2, CFG.dim)
    tb = enc(inputs, emb, candidate)
    assert tb.offsets.tolist() == [0, 3, 4]
    # Token 1 of example 0 is the conversion at t=7: equal to encoding that event alone.
    alone = enc(_inputs_with(clicks=[[]], convs=[[7]], imps=[[]]), emb, candidate[:1])
    torch.testing.assert_close(tb.values[1], alone.values[0])
    ref = set_kernel(copy.deepcopy(enc), Kernel.PYTORCH)(inputs, emb, candidate)
    torch.testing.assert_close(ref.values, tb.values)
    # Target-aware: the candidate changes the event tokens.
    assert not torch.allclose(enc(inputs, emb, -candidate).values, tb.values)
    # Truncation keeps the most recent events.
    many = _inputs_with(clicks=[list(range(100))], convs=[[]], imps=[[]])
    assert enc(many, emb, candidate[:1]).offsets.tolist() == [0, TIER.max_seq_len]


@pytest.mark.parametrize("match_flags", [True, False])
def test_oneseq_match_flags_mark_events_on_the_candidates_ids_only_when_on(match_flags):
    """E_match tells an event on the candidate's ad / campaign from any other; match_flags=False
    builds no match embedding, and then only the product term sees the candidate."""
    cfg = dataclasses.replace(CFG, match_flags=match_flags)
    torch.manual_seed(0)
    emb, enc = FeatureEmbeddings(cfg), OneSeqEncoder(cfg, TIER)
    assert (enc.match_emb is not None) == match_flags
    assert any("match_emb" in k for k in enc.state_dict()) == match_flags
    with torch.no_grad():
        enc.target.weight.zero_()  # silence the product term: what is left of the candidate is E_match
    inputs = _inputs_with(clicks=[[5, 9]], convs=[[]], imps=[[]])  # the event at t=5 has ids 5
    candidate = torch.randn(1, cfg.dim)
    on_event = dataclasses.replace(inputs, sparse={**inputs.sparse, "ad": single_id_bag(torch.tensor([5])),
                                                   "campaign": single_id_bag(torch.tensor([5]))})
    a, b = enc(inputs, emb, candidate).values, enc(on_event, emb, candidate).values
    assert torch.equal(a[1], b[1])  # the event at t=9 matches neither candidate
    assert torch.equal(a[0], b[0]) != match_flags


def test_heads_use_the_example_surface_and_losses_are_masked():
    torch.manual_seed(0)
    heads = MultiTaskHeads(12, CFG)
    h = torch.randn(4, 12)
    surface = torch.tensor([0, 1, 0, 1])
    out = heads(h, surface)
    assert set(out) == {"dwell", "click", "conversion"} and out["click"].shape == (4,)
    # Perturbing surface-1 towers changes only the surface-1 examples.
    with torch.no_grad():
        heads.tower2_b.view(len(CFG.tasks), CFG.features.num_surfaces)[:, 1] += 1.0
    out2 = heads(h, surface)
    assert torch.equal(out2["click"][[0, 2]], out["click"][[0, 2]])
    assert not torch.allclose(out2["click"][[1, 3]], out["click"][[1, 3]])
    # Conversion exists only after a click: unclicked examples get no conversion gradient.
    logits = {k: v.detach().requires_grad_() for k, v in out.items()}
    labels = {"click": torch.tensor([1.0, 0.0, 1.0, 0.0]), "conversion": torch.tensor([1.0, 0.0, 0.0, 0.0]),
              "dwell": torch.tensor([1.0, float("nan"), 0.0, 1.0])}  # NaN: this source does not know it
    loss, parts = multitask_loss(logits, labels, CFG.tasks)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.count_nonzero(logits["conversion"].grad[[1, 3]]) == 0
    assert torch.count_nonzero(logits["conversion"].grad[[0, 2]]) == 2
    assert logits["dwell"].grad[1] == 0 and torch.count_nonzero(logits["dwell"].grad) == 3
    want = F.binary_cross_entropy_with_logits(logits["conversion"][[0, 2]], labels["conversion"][[0, 2]])
    torch.testing.assert_close(parts["conversion"], want)


def test_rmsnorm_with_hand_written_backward_equals_torch():
    from gem.modules.common import RMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(16), torch.nn.RMSNorm(16)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    x = torch.randn(5, 3, 16)
    _assert_same(_grads(ours, [x], lambda m, x: m(x)), _grads(ref, [x], lambda m, x: m(x)))


def test_rmsnorm_is_the_same_function_in_bf16_and_float64():
    """eps=None is float32's eps for every dtype. nn.RMSNorm's bf16 eps (0.0078) exceeds the mean
    square of small inputs such as the PFFN keys (~1e-3 at init): the bf16 model once computed
    x/sqrt(0.009) where fp32 computed x/sqrt(0.001). float64 inputs (gradcheck) once raised."""
    from gem.modules.common import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16)
    x = torch.randn(8, 16) * 0.03  # mean square ~1e-3
    want = norm(x)
    torch.testing.assert_close(norm(x.bfloat16()).float(), want, atol=2e-2, rtol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(norm(x.bfloat16()).float(), want, atol=2e-2, rtol=2e-2)
    norm64 = copy.deepcopy(norm).double()
    torch.testing.assert_close(norm64(x.double()).float(), want)
    assert torch.autograd.gradcheck(norm64, (x.double().requires_grad_(),))
