"""The generative objective over the event history (gem.modules.generative) against a plain
per-event loop, and how it joins the model: off by default, no change to the rest of the model,
gradients into both embedding sets, the trainer's loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from gem.modules import PRESETS, KunlunModel
from gem.modules.embeddings import FeatureEmbeddings, hash_ids
from gem.modules.generative import HistoryGenerativeLoss
from gem.modules.inputs import random_inputs

CFG = PRESETS["tiny"]
GEN = dataclasses.replace(CFG, generative_loss_weight=0.5)


def reference_loss(emb: FeatureEmbeddings, inputs, scale: float, stride: int = 1) -> torch.Tensor:
    """One event at a time: its history's other events averaged, scored against every distinct id
    of the batch's scored events, cross-entropy; mean over events, then over tables. `stride`:
    score every stride-th event that has another in its history (type by type, example by example)."""
    names, tables = emb.cfg.features.event_types, emb.cfg.features.event_tables
    rows = {t: emb.tables[t].weight for t in tables}

    def row_ids(t, ids):
        return hash_ids(ids, emb.buckets[t], emb.salts[t])

    events = []  # (example, {table: hashed id}) of every event, every type
    for name in names:
        seq = inputs.sequences[name]
        for b in range(inputs.size):
            for i in range(int(seq.offsets[b]), int(seq.offsets[b + 1])):
                events.append((b, {t: int(row_ids(t, seq.ids[t][i:i + 1])) for t in tables}))
    by_example: dict[int, list[dict[str, int]]] = {}
    for b, ids in events:
        by_example.setdefault(b, []).append(ids)
    scored = [(b, ids) for b, ids in events if len(by_example[b]) >= 2][::stride]
    total = 0.0
    for t in tables:
        cand = sorted({ids[t] for _, ids in scored})
        losses = []
        for b, ids in scored:
            vec = [sum(rows[u][e[u]] for u in tables) for e in by_example[b]]
            mine = sum(rows[u][ids[u]] for u in tables)
            ctx = (sum(vec) - mine) / (len(vec) - 1)
            logits = scale * torch.stack([ctx @ rows[t][c] for c in cand])
            losses.append(F.cross_entropy(logits[None], torch.tensor([cand.index(ids[t])])))
        total = total + torch.stack(losses).mean()
    return total / len(tables)


def test_matches_the_per_event_loop_in_value_and_gradient():
    torch.manual_seed(0)
    emb = FeatureEmbeddings(CFG)
    gen = HistoryGenerativeLoss(CFG.dim)
    inputs = random_inputs(CFG, torch.tensor([5, 1, 0, 7, 3]), seed=3)  # a lone event and an empty history
    got = gen(emb, inputs)
    want = reference_loss(emb, inputs, float(gen.log_scale.detach().exp()[0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g_got = torch.autograd.grad(got, emb.tables["campaign"].weight)[0]
    g_want = torch.autograd.grad(reference_loss(emb, inputs, float(gen.log_scale.detach().exp()[0])),
                                 emb.tables["campaign"].weight)[0]
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-4)


def test_histories_of_fewer_than_two_events_give_a_zero_loss_that_still_backpropagates():
    torch.manual_seed(0)
    emb, gen = FeatureEmbeddings(CFG), HistoryGenerativeLoss(CFG.dim)
    loss = gen(emb, random_inputs(CFG, torch.tensor([1, 0, 1]), seed=1))
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    loss.backward()  # every rank runs the same backward, even with nothing to score


def test_max_events_scores_every_kth_event():
    """With a cap, the loss is the uncapped loop's over every k-th scorable event."""
    torch.manual_seed(0)
    emb = FeatureEmbeddings(CFG)
    inputs = random_inputs(CFG, torch.tensor([9, 6, 8]), seed=2)
    gen = HistoryGenerativeLoss(CFG.dim, max_events=8)  # 23 events -> every 3rd: 8
    scale = float(gen.log_scale.detach().exp()[0])
    capped = gen(emb, inputs)
    torch.testing.assert_close(capped, reference_loss(emb, inputs, scale, stride=3), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(capped, reference_loss(emb, inputs, scale))


def test_off_by_default_and_on_it_changes_nothing_else_in_the_model():
    assert CFG.generative_loss_weight == 0.0
    inputs = random_inputs(CFG, torch.tensor([4, 9, 2]), seed=0)
    torch.manual_seed(0)
    off = KunlunModel(CFG)
    torch.manual_seed(0)
    on = KunlunModel(GEN)
    assert off.generative is None and off.auxiliary_loss(inputs) is None
    extra = {k for k in on.state_dict()} - set(off.state_dict())
    assert extra == {"generative.0.log_scale", "generative.1.log_scale"}  # the trunk's tables and the branch's
    for k, v in off.state_dict().items():
        torch.testing.assert_close(on.state_dict()[k], v)  # same initial weights: it draws nothing
    out_on, out_off = on(inputs), off(inputs)
    for t in out_off:
        torch.testing.assert_close(out_on[t], out_off[t])  # predictions never read it


def test_the_model_loss_adds_the_weighted_objective_and_trains_both_embedding_sets():
    torch.manual_seed(0)
    model = KunlunModel(GEN)
    inputs = random_inputs(GEN, torch.tensor([6, 3, 8, 2]), seed=4)
    total, parts = model.loss(inputs)
    aux = model.auxiliary_loss(inputs)
    sets = [model.embeddings, model.affinity.embeddings]
    want = 0.5 * sum(g(e, inputs) for g, e in zip(model.generative, sets)) / 2
    torch.testing.assert_close(parts["generative"], want)
    torch.testing.assert_close(aux, want)
    torch.testing.assert_close(total, sum(v for k, v in parts.items() if k != "generative") + want)
    aux.backward()
    for e in sets:
        assert bool(e.tables["campaign"].weight.grad.abs().gt(0).any())
        assert bool(e.tables["item"].weight.grad.abs().gt(0).any())


def test_a_negative_or_infinite_weight_is_refused_by_name():
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="generative_loss_weight"):
            dataclasses.replace(CFG, generative_loss_weight=bad)
