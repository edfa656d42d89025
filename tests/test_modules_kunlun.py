"""The whole Kunlun model (tiny): reference vs tiled kernels, batch independence, CompSkip,
FLOP counts against PyTorch's own counter, bf16, and the baselines."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem.api.types import SyntheticDataSpec
from gem.baselines import DLRMConfig, DLRMModel, PaddedKunlunModel
from gem.data import build_splits, make_batch
from gem.modules import PRESETS, KunlunModel, from_v1_batch, set_kernel
from gem.modules.attention import BlockAttentionLayer
from gem.modules.dot_interaction import DotInteraction
from gem.modules.heads import multitask_loss
from gem.ops import Kernel

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def batch():
    train, _ = build_splits(SyntheticDataSpec(num_users=50, num_ads=40, num_train_examples=64, num_eval_examples=8))
    return from_v1_batch(make_batch(train, np.arange(6), max_seq_len=CFG.tiers[0].max_seq_len))


def _model(cfg=CFG, seed=0, cls=KunlunModel):
    torch.manual_seed(seed)
    return cls(cfg)


def _select(inputs, b):
    """Example b of a GemInputs batch, as a batch of one."""
    from gem.modules.inputs import EventSequence, GemInputs
    from gem.ops.testing import make_offsets

    def sl(values, offsets):
        return values[int(offsets[b]):int(offsets[b + 1])]

    seqs = {k: EventSequence(make_offsets([int(s.offsets[b + 1] - s.offsets[b])]), sl(s.timestamps, s.offsets),
                             {t: sl(i, s.offsets) for t, i in s.ids.items()}, sl(s.surface, s.offsets))
            for k, s in inputs.sequences.items()}
    sparse = {k: (sl(ids, off), make_offsets([int(off[b + 1] - off[b])])) for k, (ids, off) in inputs.sparse.items()}
    return GemInputs(inputs.request_time[b:b + 1], inputs.surface[b:b + 1], sparse, inputs.dense[b:b + 1], seqs)


def test_reference_and_tiled_kernels_agree_on_outputs_and_gradients(batch):
    fast = _model()
    ref = set_kernel(copy.deepcopy(fast), Kernel.PYTORCH)
    out_f, out_r = fast(batch), ref(batch)
    for t in out_f:
        torch.testing.assert_close(out_f[t], out_r[t], atol=1e-5, rtol=1e-4)
    fast.loss(batch)[0].backward()
    ref.loss(batch)[0].backward()
    for (n, pf), (_, pr) in zip(fast.named_parameters(), ref.named_parameters()):
        if pf.grad is not None or pr.grad is not None:
            torch.testing.assert_close(pf.grad, pr.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_examples_do_not_see_each_other(batch):
    model = _model().eval()
    together = model(batch)
    for b in range(batch.size):
        alone = model(_select(batch, b))
        for t in together:
            torch.testing.assert_close(together[t][b:b + 1], alone[t], atol=1e-5, rtol=1e-4)


def test_compskip_alternates_layers_and_reuses_the_cached_summary(batch):
    model = _model(dataclasses.replace(CFG, num_layers=4))
    for i, layer in enumerate(model.layers):
        even = i % 2 == 0
        assert (len(layer.hsp) > 0, len(layer.seq_ffn) > 0, len(layer.attn) > 0) == (even, even, not even)
    produced, consumed = {}, {}
    for i, layer in enumerate(model.layers):
        for name, hsp in layer.hsp.items():
            hsp.register_forward_hook(lambda m, a, out, i=i, name=name: produced.__setitem__((i, name), out))
        for name, gate in layer.summary.items():
            gate.register_forward_hook(lambda m, a, out, i=i, name=name: consumed.__setitem__((i, name), a[0]))
    model(batch)
    for t in CFG.tiers:
        for odd in (1, 3):
            assert consumed[(odd, t.name)] is produced[(odd - 1, t.name)]  # the very tensor, not a recompute
    # FLOP count: odd layers have no HSP/PFFN work, even layers no attention.
    lengths = model.tier_lengths(batch)
    for i, layer in enumerate(model.layers):
        f = layer.flops(batch.size, lengths)
        assert ("hsp" in f and "pffn" in f) == (i % 2 == 0) and ("block_attention" in f) == (i % 2 == 1)
    off = _model(dataclasses.replace(CFG, num_layers=4, compskip=False))
    total_on, total_off = sum(model.flops(lengths).values()), sum(off.flops(lengths).values())
    assert 0.3 < 1 - total_on / total_off < 0.5


@pytest.mark.parametrize("seq_ffn,wide_dots", [("pffn", False), ("token_ffn", False), ("pffn", True)])
def test_flop_count_matches_pytorch_flop_counter(seq_ffn, wide_dots):
    """With equal histories that are a multiple of the block, the tiled kernels do no padded work,
    so the shape-based count must equal what PyTorch's counter sees (matmuls only). The
    token_ffn model is the benchmark's baseline for the PFFN: its count is the ideal's numerator."""
    cfg = dataclasses.replace(CFG, num_layers=2, seq_ffn=seq_ffn, wide_dots=wide_dots)
    model = _model(cfg)
    train, _ = build_splits(SyntheticDataSpec(num_users=50, num_ads=40, num_train_examples=64, num_eval_examples=8,
                                              mean_history_len=64))
    b = make_batch(train, np.arange(4), max_seq_len=64)
    # Rewrite the event types so each tier gets exactly 32 events per example (a multiple of block 16).
    b.seq_offsets = torch.arange(5) * 64
    b.seq_type = torch.tensor(([0] * 32 + [1] * 32) * 4)
    b.seq_ad_id, b.seq_campaign_id = torch.arange(256) % 40, torch.arange(256) % 5
    b.seq_timestamp = torch.arange(256)
    b.seq_surface = torch.arange(256) % 2
    inputs = from_v1_batch(b)
    lengths = model.tier_lengths(inputs)
    counted = sum(model.flops(lengths).values())
    with FlopCounterMode(display=False) as fc:
        model(inputs)  # with gradients on, block attention runs as explicit (counted) batched matmuls
    assert fc.get_total_flops() == pytest.approx(counted, rel=1e-6)


def test_wide_heads_add_a_logit_read_from_the_raw_tokens(batch):
    """logits = deep heads over the trunk + wide heads over X⁰ (the embeddings as they are), and
    wide_heads=False leaves only the deep term (no wide parameters, fewer counted FLOPs)."""
    model = _model()
    got = model(batch)
    x0 = model.embeddings.non_sequence(batch)
    wide = model.wide_heads(model.wide_input(x0, batch), batch.surface)
    deep_only = copy.deepcopy(model)
    deep_only.wide_heads = None
    deep = deep_only(batch)
    for t in got:
        torch.testing.assert_close(got[t], deep[t] + wide[t])
        assert not torch.allclose(wide[t], torch.zeros_like(wide[t]))
    # The wide term reads X⁰ only: a different history changes the deep term, never the wide one.
    shuffled = copy.copy(batch)
    shuffled.sequences = {k: copy.copy(s) for k, s in batch.sequences.items()}
    for s in shuffled.sequences.values():
        s.ids = {t: i.flip(0) for t, i in s.ids.items()}
    again = model.wide_heads(model.wide_input(model.embeddings.non_sequence(shuffled), shuffled),
                              shuffled.surface)
    for t in got:
        torch.testing.assert_close(again[t], wide[t])
        assert not torch.allclose(model(shuffled)[t], got[t])
    off = _model(dataclasses.replace(CFG, wide_heads=False))
    assert off.wide_heads is None and not any(n.startswith("wide") for n, _ in off.named_parameters())
    lengths = model.tier_lengths(batch)
    extra = sum(model.flops(lengths).values()) - sum(off.flops(lengths).values())
    assert extra == pytest.approx(model.wide_heads.flops(batch.size))
    # The wide path trains the embeddings directly.
    model.zero_grad()
    x0 = model.embeddings.non_sequence(batch)
    model.wide_heads(model.wide_input(x0, batch), batch.surface)["conversion"].sum().backward()
    assert model.embeddings.tables["item"].weight.grad.abs().sum() > 0


def test_wide_dots_add_the_pairwise_dot_products_of_the_raw_tokens(batch):
    """wide_dots=True: the wide input is [flatten(LN(X⁰)) ‖ triu(T·Tᵀ)] over T = [X⁰ ‖ each event
    type's sum-pooled history / √d], checked against a loop over pairs; the history now reaches the
    wide term, and the extra FLOPs are counted."""
    model = _model(dataclasses.replace(CFG, wide_dots=True))
    x0 = model.embeddings.non_sequence(batch)
    got = model.wide_input(x0, batch)
    d, n_ns = CFG.dim, CFG.num_non_seq_tokens
    pooled = []
    for e in CFG.features.event_types:
        seq = batch.sequences[e]
        ev = model.embeddings.events(seq)
        pooled.append(torch.stack([ev[a:b].sum(0) for a, b in zip(seq.offsets[:-1].tolist(), seq.offsets[1:].tolist())]))
    tokens = torch.cat([x0, torch.stack(pooled, 1) / d**0.5], dim=1)
    n = tokens.shape[1]
    want = torch.stack([(tokens[:, i] * tokens[:, j]).sum(-1) for i in range(n) for j in range(i + 1, n)], dim=1)
    torch.testing.assert_close(got[:, : n_ns * d], model.wide_norm(x0).flatten(1))
    torch.testing.assert_close(got[:, n_ns * d:], want)
    assert got.shape[1] == n_ns * d + n * (n - 1) // 2
    # No parameters: the same state-dict keys as the default model (checkpoints keep loading).
    assert model.state_dict().keys() == _model().state_dict().keys()
    # A different history changes the wide term now.
    shuffled = copy.copy(batch)
    shuffled.sequences = {k: copy.copy(s) for k, s in batch.sequences.items()}
    for s in shuffled.sequences.values():
        s.ids = {t: i.flip(0) for t, i in s.ids.items()}
    assert not torch.allclose(model.wide_input(x0, shuffled), got)
    plain = _model()
    lengths = model.tier_lengths(batch)
    extra = sum(model.flops(lengths).values()) - sum(plain.flops(lengths).values())
    wide_in_extra = n * (n - 1) // 2 * 2.0 * CFG.head_hidden * batch.size  # the heads' wider first layer
    assert extra == pytest.approx(2.0 * batch.size * n * n * d + wide_in_extra)
    with pytest.raises(ValueError, match="wide_dots=True needs wide_heads=True"):
        dataclasses.replace(CFG, wide_dots=True, wide_heads=False)


def test_bf16_autocast_is_close_to_fp32(batch):
    """Logits at init are ~0.1: the tolerance must be well below that to mean anything (bf16
    RMSNorms with bf16's eps once moved them by 0.07; bf16 rounding alone moves them ~0.002)."""
    model = _model()
    want = model(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(batch)
    for t in want:
        assert want[t].abs().max() > 0.05  # the logits are not ~0, so atol below is a real bound
        torch.testing.assert_close(got[t], want[t], atol=1e-2, rtol=1e-2)
    # Gradients too (bf16's eps in the RMSNorms once put some 70% off): relative error of each parameter's.
    grads = []
    for autocast in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(batch)[0]
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for n, g in grads[0].items():
        assert float((grads[1][n] - g).norm() / g.norm().clamp_min(1e-12)) < 0.1, n


def test_padded_baseline_equals_block_attention_when_one_block_holds_everything(batch):
    """Full attention over a padded history == block attention when every history fits in one block,
    in the shifted local layer too (4 layers: shifts 0 and 64; histories <= 64 = block - shift)."""
    big_block = tuple(dataclasses.replace(t, block_size=128) for t in CFG.tiers)
    cfg = dataclasses.replace(CFG, tiers=big_block, num_layers=4)
    jagged, padded = _model(cfg), _model(cfg, cls=PaddedKunlunModel)
    padded.load_state_dict(jagged.state_dict())
    assert any(isinstance(m, BlockAttentionLayer) for m in padded.modules())
    for t, v in jagged(batch).items():
        torch.testing.assert_close(padded(batch)[t], v, atol=1e-5, rtol=1e-4)
    lengths = jagged.tier_lengths(batch)
    assert sum(padded.flops(lengths).values()) >= sum(jagged.flops(lengths).values())


def test_dlrm_baseline_trains_a_step(batch):
    model = _model(cls=lambda c: DLRMModel(DLRMConfig(base=c)))
    loss, parts = model.loss(batch)
    loss.backward()
    assert set(parts) == {"dwell", "click", "conversion"} and torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if not n.startswith("embeddings.tables"))


def test_dot_interaction_history_decay_weights_each_event_by_its_age(batch):
    """history_decay (the affinity branch's): each event's embedding is weighted by exp(-age · rate)
    before pooling, the rate learnt per event type; off (DLRM's) it is the plain sum and has no rate."""
    plain = _model(cls=DotInteraction)
    decayed = _model(cls=lambda c: DotInteraction(c, history_decay=True))
    assert plain.log_decay is None and not any("log_decay" in k for k in plain.state_dict())
    decayed.load_state_dict(plain.state_dict(), strict=False)  # the same tables
    d = CFG.dim
    got = decayed.pooled_history(batch)
    for i, name in enumerate(decayed.event_types):
        seq = batch.sequences[name]
        for b in range(batch.size):
            lo, hi = int(seq.offsets[b]), int(seq.offsets[b + 1])
            e = decayed.embeddings.events(seq)[lo:hi]
            age = (batch.request_time[b] - seq.timestamps[lo:hi]).float().clamp_min(0)
            want = (e * torch.exp(-age / 86400.0)[:, None]).sum(0) / d ** 0.5
            torch.testing.assert_close(got[b, i], want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, plain.pooled_history(batch))
    with torch.no_grad():  # a rate of ~0: every event weighs 1, the plain sum
        decayed.log_decay.fill_(-60.0)
    torch.testing.assert_close(decayed.pooled_history(batch), plain.pooled_history(batch))
    with torch.no_grad():
        decayed.log_decay.fill_(-11.0)
    multitask_loss(decayed(batch), batch.labels, decayed.tasks, batch.weight)[0].backward()
    assert decayed.log_decay.grad is not None and bool(decayed.log_decay.grad.abs().gt(0).any())


def test_affinity_branch_adds_a_decayed_dlrm_built_after_the_trunk(batch):
    """affinity_branch: the logits are the trunk's plus those of a DLRM with decayed history pools
    and tables of its own; built last, so the trunk's initial weights are those of the model
    without it, and the pair is exactly GEM and that DLRM trained as one (benchmarks.quality's
    LogitSum: the recorded diagnose variant gem_plus_decayed_dlrm_no_match)."""
    assert CFG.affinity_branch and not CFG.match_flags  # the default design
    cfg = dataclasses.replace(CFG, affinity_branch=False)
    model = _model()
    torch.manual_seed(0)
    trunk, dlrm = KunlunModel(cfg), DotInteraction(cfg, history_decay=True)
    assert _model(cfg).affinity is None and not any(k.startswith("affinity.") for k in trunk.state_dict())
    state = model.state_dict()
    want = {**trunk.state_dict(), **{f"affinity.{k}": v for k, v in dlrm.state_dict().items()}}
    assert state.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(state[k], v), k
    assert model.affinity.embeddings is not model.embeddings
    got, a, b = model(batch), trunk(batch), dlrm(batch)
    for t in got:
        torch.testing.assert_close(got[t], a[t] + b[t], atol=0, rtol=0)
    model.loss(batch)[0].backward()
    assert model.affinity.log_decay.grad is not None and bool(model.affinity.top[-1].weight.grad.abs().gt(0).any())


def test_an_empty_candidate_bag_matches_nothing_instead_of_a_neighbours_id(batch):
    """An example whose candidate-ad bag is empty has no id to match its events against; the
    flags once read the next example's first id (offsets[b] points there), leaking it."""
    from gem.modules.inputs import GemInputs

    model = _model().eval()
    ids, _ = batch.sparse["ad"]
    b = 1
    clicks = batch.sequences["click"]
    lo, hi = int(clicks.offsets[b]), int(clicks.offsets[b + 1])
    items = clicks.ids["item"].clone()
    items[lo:hi] = ids[b + 1]  # example b clicked the next example's candidate ad
    seqs = dict(batch.sequences, click=dataclasses.replace(clicks, ids=dict(clicks.ids, item=items)))
    sparse = dict(batch.sparse)
    bag_off = torch.arange(batch.size + 1) - (torch.arange(batch.size + 1) > b).long()  # bag b empty
    sparse["ad"] = (torch.cat([ids[:b], ids[b + 1:]]), bag_off)
    inputs = GemInputs(batch.request_time, batch.surface, sparse, batch.dense, seqs)
    together, alone = model(inputs), model(_select(inputs, b))
    assert hi > lo
    for t in together:
        torch.testing.assert_close(together[t][b:b + 1], alone[t], atol=1e-5, rtol=1e-4)


def _tier0(**kw):
    return dataclasses.replace(CFG, tiers=(dataclasses.replace(CFG.tiers[0], **kw),) + CFG.tiers[1:])


NONSENSE_CONFIGS = {
    # what each once did instead of a config error
    "num_layers": (lambda: dataclasses.replace(CFG, num_layers=0), "'NoneType' has no attribute 'to' at forward"),
    "dim": (lambda: dataclasses.replace(CFG, dim=0), "ZeroDivisionError"),
    "num_sum_tokens": (lambda: dataclasses.replace(CFG, num_sum_tokens=0), "ZeroDivisionError at forward"),
    "sum_kron_rank": (lambda: dataclasses.replace(CFG, sum_kron_rank=0), "a reshape error at forward"),
    "num_time_buckets": (lambda: dataclasses.replace(CFG, num_time_buckets=0), "index_select error"),
    "num_experts": (lambda: dataclasses.replace(CFG, num_experts=0), "a model without interaction"),
    "num_shared_experts \\+ num_surface_experts": (lambda: dataclasses.replace(
        CFG, num_shared_experts=0, num_surface_experts=0), "NaN logits (a softmax over no experts)"),
    "rotary_scale": (lambda: dataclasses.replace(CFG, rotary_scale=float("nan")), "NaN logits"),
    "features.num_surfaces": (lambda: dataclasses.replace(CFG, features=dataclasses.replace(CFG.features,
                                                                                           num_surfaces=0)), ""),
    "features.event_tables": (lambda: dataclasses.replace(CFG, features=dataclasses.replace(
        CFG.features, event_tables=("nope",))), "KeyError at forward"),
    "features.tables\\[item\\].num_buckets": (lambda: dataclasses.replace(CFG, features=dataclasses.replace(
        CFG.features, tables=tuple(dataclasses.replace(t, num_buckets=0) if t.name == "item" else t
                                   for t in CFG.features.tables))), "ZeroDivisionError when ids are hashed"),
    "sparse feature user: pooling": (lambda: dataclasses.replace(CFG, features=dataclasses.replace(CFG.features, sparse=(
        dataclasses.replace(CFG.features.sparse[0], pooling="avg"),) + CFG.features.sparse[1:])), "summed"),
    "tasks": (lambda: dataclasses.replace(CFG, tasks=()), "TypeError in the loss"),
    "tiers must name": (lambda: dataclasses.replace(CFG, tiers=()), "torch.cat of nothing at forward"),
    "tiers must have distinct names": (lambda: dataclasses.replace(CFG, tiers=(CFG.tiers[0], CFG.tiers[0])),
                       "the second tier silently replaced the first"),
    "tier engaged: num_heads": (lambda: _tier0(num_heads=0), "ZeroDivisionError"),
    "tier engaged: max_seq_len": (lambda: _tier0(max_seq_len=0), "ZeroDivisionError"),
    "tier engaged: block_size": (lambda: _tier0(block_size=0), "'block shift must be in [0, 0)' at forward"),
    "tier engaged: num_recent": (lambda: _tier0(num_recent=0), "'k must be >= 1' at forward"),
    "tier engaged: event_types": (lambda: _tier0(event_types=()), "'one offsets tensor per input' at forward"),
}


@pytest.mark.parametrize("field", sorted(NONSENSE_CONFIGS))
def test_a_nonsense_config_is_refused_naming_the_field(field):
    make, _before = NONSENSE_CONFIGS[field]
    with pytest.raises(ValueError, match=f"^{field}"):
        make()


def test_an_unknown_gdpa_activation_is_refused_when_the_model_is_built():
    with pytest.raises(ValueError, match="^gdpa_activation: unknown GDPA activation"):
        KunlunModel(dataclasses.replace(CFG, gdpa_activation="softmax"))
