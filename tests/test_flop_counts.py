"""The analytic FLOP counts (gem/modules `flops`) against what PyTorch's FlopCounterMode sees.

The counts back compskip_flop_reduction, mfu and every "ideal (FLOP count)" in
benchmarks/results/model.json. Conventions (docs/benchmarks.md, "FLOP counts"):
- matmul-like work only (a multiply-add is 2 FLOPs); embedding lookups, norms, activations,
  softmax and other element-wise ops are not counted (FlopCounterMode does not count them either);
- the count is the model's useful work on the jagged shapes: the tiled kernels also compute on
  padded tile slots (length buckets rounded up, partial attention blocks), which FlopCounterMode
  sees and the count leaves out. The tests add that padding back from the same plans the kernels
  use, so every component must match exactly; any other difference is a count that is wrong;
- a training step is 3x the forward (the backward of a matmul is two matmuls of the same size).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gem.baselines import PaddedKunlunModel
from gem.modules import PRESETS, KunlunModel
from gem.modules.inputs import random_inputs
from gem.ops.testing import random_lengths

# Which module (by its path in the model) each count component is measured in.
_LAYER_PARTS = {"weight_gen": "weight_gen", "seq_ffn": None, "hsp": "hsp", "attn": "block_attention",
                "summary": "summary", "mowe": "mowe"}
_TOP_PARTS = {"embeddings": "embeddings", "encoders": "oneseq", "final_weight_gen": "weight_gen",
              "heads": "heads", "wide_heads": "heads"}


def _component(path: str, ffn: str) -> str | None:
    """FlopCounterMode's module path -> the count's component, at the depth that owns the work."""
    parts = path.split(".")[1:]  # drop the root class name
    if len(parts) == 2 and parts[0] == "embeddings":  # non_sequence() is a method: only its linears are modules
        return "embeddings"
    if len(parts) == 2 and parts[0] == "encoders":
        return "oneseq"
    if len(parts) == 1 and parts[0] in ("final_weight_gen", "heads", "wide_heads"):
        return _TOP_PARTS[parts[0]]
    if len(parts) == 1 and parts[0] == "affinity":  # its own embeddings, MLPs and dot products
        return "affinity_branch"
    if len(parts) >= 3 and parts[0] == "layers" and parts[2] in _LAYER_PARTS:
        per_tier = parts[2] in ("seq_ffn", "hsp", "attn", "summary")
        if len(parts) == (4 if per_tier else 3):
            return ffn if parts[2] == "seq_ffn" else _LAYER_PARTS[parts[2]]
    return None


def _inputs(cfg, batch: int, max_len: int, seed: int = 0):
    lengths = random_lengths(torch.Generator().manual_seed(seed), batch, max_len=max_len)
    return random_inputs(cfg, lengths, seed=seed, type_probs=(0.5, 0.35, 0.15))  # the benchmark's mix


def _measure(model, inputs) -> tuple[dict[str, float], float, float]:
    """Forward FLOPs per component, the forward total and the backward total, as FlopCounterMode sees them."""
    ffn = "pffn" if model.cfg.seq_ffn == "pffn" else "token_ffn"
    with sdpa_kernel(SDPBackend.MATH):  # the CPU's fused SDPA has no FLOP formula; the math path is matmuls
        with FlopCounterMode(display=False, depth=None) as fc:
            loss, _ = model.loss(inputs)
        per: dict[str, float] = defaultdict(float)
        counts = {path: sum(ops.values()) for path, ops in fc.get_flop_counts().items()}
        for path, n in counts.items():
            c = _component(path, ffn)
            if c is not None:
                per[c] += n
        forward = fc.get_total_flops()
        # What the root runs itself (wide_input's pairwise dots, counted under "heads"), outside every child.
        outer = [p for p in counts if p not in ("Global", model.__class__.__name__)
                 and not any(p.startswith(q + ".") for q in counts if q.count(".") >= 1)]
        root = forward - sum(counts[p] for p in outer)
        if root:
            per["heads"] += root
        with FlopCounterMode(display=False) as fc:
            loss.backward()
    return dict(per), forward, fc.get_total_flops()


def _tile_padding(model, inputs) -> dict[str, float]:
    """FLOPs the tiled kernels spend on padded slots, from the plans they use (TierBatch memoises
    them per batch, so these are the same objects the forward planned)."""
    _, tiers = model.encode(inputs)
    cfg, pad = model.cfg, defaultdict(float)
    for layer in model.layers:
        for t in cfg.tiers:
            tb, per_pair = tiers[t.name], 2 * 2.0 * t.dim  # scores + values, all heads
            useful = float(tb.lengths.sum())
            if layer.runs_global and cfg.seq_ffn == "pffn":
                tiles = sum(bk.size * bk.q_len * bk.k_len for bk in tb.kv_buckets(cfg.num_sum_tokens).buckets)
                pad["pffn"] += per_pair * (tiles - useful * cfg.num_sum_tokens)
            if layer.pools_summary:
                tiles = sum(bk.size * bk.q_len * bk.k_len for bk in tb.seed_buckets(t.num_seeds).buckets)
                pad["hsp"] += per_pair * (tiles - useful * t.num_seeds)
            if layer.runs_local and not isinstance(model, PaddedKunlunModel):
                plan = tb.block_plan(t.block_size, layer.attn[t.name].shift, t.block_align)
                tiles = plan.num_blocks * plan.block**2
                pad["block_attention"] += per_pair * (tiles - float((plan.valid.sum(1).double() ** 2).sum()))
    return dict(pad)


CASES = [("tiny", True, 32, 512), ("tiny", False, 32, 512), ("small", True, 16, 1024), ("small", False, 16, 1024),
         ("base", True, 4, 300), ("base", False, 4, 300)]


@pytest.mark.parametrize("preset,compskip,batch,max_len", CASES)
def test_every_component_count_matches_flop_counter(preset, compskip, batch, max_len):
    """Seeded LogNormal histories (the benchmark's distribution, shorter): per component, the
    count plus the tiles' padding equals what ran, exactly; and the backward is 2x the forward.
    `large` passes too (checked by hand) but takes ~1 min a case, so it is left out."""
    cfg = dataclasses.replace(PRESETS[preset], compskip=compskip)
    if preset == "base":  # 4 layers (alternating block shifts), 6 head experts; small's tables: sizes are not counted
        cfg = dataclasses.replace(cfg, features=PRESETS["small"].features)
    inputs = _inputs(cfg, batch, max_len)
    torch.manual_seed(0)
    model = KunlunModel(cfg)
    counted = model.flops(model.tier_lengths(inputs))
    measured, forward, backward = _measure(model, inputs)
    padding = _tile_padding(model, inputs)
    assert set(measured) == set(counted), "a component runs matmuls the count does not name (or the reverse)"
    for k in counted:
        assert measured[k] == pytest.approx(counted[k] + padding.get(k, 0.0), rel=1e-9), k
    assert forward == pytest.approx(sum(measured.values()), rel=1e-9)  # no matmul outside a counted component
    # The padding is a small share of the work at these lengths (the useful count is what MFU credits).
    assert 1.0 <= forward / sum(counted.values()) < 1.08
    # "3 x forward" for a training step: the backward does 2x the forward's matmul work, less the
    # input gradients nobody needs (the dense features', the seeds'); under 1% here.
    assert backward / forward == pytest.approx(2.0, rel=0.01)


@pytest.mark.parametrize("seq_ffn,wide_dots,align,affinity", [("token_ffn", False, "start", False),
                                                              ("pffn", True, "start", False),
                                                              ("pffn", False, "end", True)])
def test_variant_counts_match_flop_counter(seq_ffn, wide_dots, align, affinity):
    """The PFFN benchmark's per-token-FFN baseline (its ideal's numerator), the wide dots,
    attention blocks anchored at the most recent event, and the affinity branch."""
    cfg = PRESETS["tiny"]
    cfg = dataclasses.replace(cfg, seq_ffn=seq_ffn, token_ffn_mult=4, wide_dots=wide_dots, affinity_branch=affinity,
                              tiers=tuple(dataclasses.replace(t, block_align=align) for t in cfg.tiers))
    inputs = _inputs(cfg, 16, 512, seed=1)
    torch.manual_seed(0)
    model = KunlunModel(cfg)
    counted = model.flops(model.tier_lengths(inputs))
    measured, forward, _ = _measure(model, inputs)
    padding = _tile_padding(model, inputs)
    assert ("affinity_branch" in counted) == affinity
    for k in counted:
        assert measured[k] == pytest.approx(counted[k] + padding.get(k, 0.0), rel=1e-9), k
    assert forward == pytest.approx(sum(measured.values()), rel=1e-9)


def test_padded_baseline_count_matches_flop_counter():
    """train_step_ideal_vs_padded's numerator: the padded model's dense attention over [B, Lmax]
    is what it really computes, so its count includes the padding (and matches exactly)."""
    cfg = PRESETS["tiny"]
    inputs = _inputs(cfg, 16, 512)
    torch.manual_seed(0)
    model = PaddedKunlunModel(cfg)
    counted = model.flops(model.tier_lengths(inputs))
    measured, _, _ = _measure(model, inputs)
    padding = _tile_padding(model, inputs)
    for k in counted:
        assert measured[k] == pytest.approx(counted[k] + padding.get(k, 0.0), rel=1e-9), k
