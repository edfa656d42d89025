"""`python -m benchmarks.diagnose --smoke`, and the two tools it rests on, checked against
sources outside its own bookkeeping: the world's true probabilities (the term fit must give them
coefficients of exactly 1), the quality benchmark's own run of the same job (the same NE), and
a plain per-example count of each tier's events (the long-history split)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from benchmarks import diagnose, quality
from gem.api.types import SyntheticDataSpec
from gem.data.batch import make_batch
from gem.data.synthetic import SyntheticWorld
from gem.eval.evaluate import metrics_from_predictions
from gem.model import config_from_spec, kunlun_config
from gem.modules import KunlunModel, PRESETS


def test_diagnose_smoke(tmp_path):
    out = tmp_path / "diagnose.json"
    assert diagnose.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "smoke" and doc["world_seed"] == quality.WORLD_SEED
    # The recorded command reproduces this JSON: the --out it was written to included.
    assert doc["command"] == f"python -m benchmarks.diagnose --smoke --threads 1 --out {out.resolve()}"
    world = SyntheticWorld(SyntheticDataSpec(**doc["world"]))

    # The fit reads the terms right: the world's own probabilities get every coefficient 1, and
    # the terms are exactly SyntheticWorld.logit_terms' (minus the intercept).
    ex = world.sample(quality.MODES["smoke"]["eval_examples"], split=1)
    terms = world.logit_terms(ex)
    for task, fit in doc["bayes_terms"].items():
        assert set(fit["coef"]) == set(terms[task]) - {"intercept"}
        assert all(math.isclose(c, 1.0, abs_tol=1e-4) for c in fit["coef"].values()), (task, fit)
        assert fit["r2"] > 0.9999
    for budget in ("quality_budget", "more_data"):
        for kind, per_task in doc["terms"][budget].items():
            for task, fit in per_task.items():
                assert set(fit["coef"]) == set(doc["bayes_terms"][task]["coef"])
                assert all(math.isfinite(c) for c in fit["coef"].values()) and 0.0 <= fit["r2"] <= 1.0

    # The same runs as the quality benchmark: its run_job of s0/gem's job gives the same NE.
    jobs = diagnose.plan(diagnose.MODES["smoke"], threads=1)
    run = quality.run_job(jobs["s0/gem"])
    for task, ne in doc["ne"]["s0/gem"].items():
        assert math.isclose(ne, run["metrics"][f"ne/{task}"], rel_tol=1e-9), task

    # The attention split: long + short = all; GEM minus padded recomputed from the per-part NEs.
    att = doc["attention"]
    assert 0 < att["n_long"] < att["n"] == len(ex)
    seeds = doc["seeds"]
    for t in ("click",):
        d0 = 100 * (doc["ne"][f"s{seeds[0]}/gem"][t] / doc["ne"][f"s{seeds[0]}/padded"][t] - 1)
        assert math.isclose(att["gem_minus_padded_pct"]["all"][t]["by_seed"][0], d0, rel_tol=1e-9)
    assert out.with_suffix(".png").stat().st_size > 0

    # --variant: GEM's jobs with only the model swapped, beside this run's GEM and DLRM.
    variant_jobs = diagnose.plan_variant(diagnose.MODES["smoke"], 1, "gem_wide_dots")
    assert set(variant_jobs) == {n.replace("/gem", "/gem_wide_dots") for n in jobs if n.endswith("/gem")}
    for name, job in variant_jobs.items():
        assert job == dict(jobs[name.replace("gem_wide_dots", "gem")], kind="gem_wide_dots")
    vout = tmp_path / "variant.json"
    assert diagnose.main(["--smoke", "--variant", "gem_wide_dots", "--baseline", str(out), "--out", str(vout)]) == 0
    v = json.loads(vout.read_text())
    assert v["variant"] == "gem_wide_dots" and v["baseline"] == str(out.resolve())  # outside the repo: as given
    assert v["command"] == (f"python -m benchmarks.diagnose --smoke --threads 1 --out {vout.resolve()} "
                            f"--variant gem_wide_dots --baseline {out.resolve()}")
    for kind in ("gem", "dlrm"):
        assert v["ne"][f"s{seeds[0]}/{kind}"] == doc["ne"][f"s{seeds[0]}/{kind}"]
        assert v["terms"]["more_data"][kind] == doc["terms"]["more_data"][kind]
    direct = diagnose.run_job(variant_jobs["s0/gem_wide_dots"])  # the variant's NE is its own run's
    assert v["ne"]["s0/gem_wide_dots"] == direct["ne"]
    diff = v["ne_minus_gem"]["s0"]
    assert diff == {t: v["ne"]["s0/gem_wide_dots"][t] - doc["ne"]["s0/gem"][t] for t in diagnose.TASKS}
    assert any(d != 0.0 for d in diff.values())  # another model, not GEM again
    assert vout.with_suffix(".png").stat().st_size > 0
    # A baseline from another world, or none, is refused before any training.
    diagnose.check_baseline(diagnose.MODES["smoke"], variant_jobs, "gem_wide_dots", doc, out)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(doc, world=dict(doc["world"], seed=1))))
    for baseline in (other, tmp_path / "missing.json"):
        with pytest.raises(SystemExit, match="not a run on this variant's world"):
            diagnose.main(["--smoke", "--variant", "gem_wide_dots", "--baseline", str(baseline),
                           "--out", str(tmp_path / "never.json")])
    assert not (tmp_path / "never.json").exists()


def test_long_history_mask_counts_each_tiers_recent_events():
    mode = quality.MODES["smoke"]
    spec = SyntheticDataSpec(seed=quality.WORLD_SEED, num_users=300, num_ads=100, mean_history_len=40.0)
    ex = SyntheticWorld(spec).sample(300, split=1)
    cfg = kunlun_config(config_from_spec(quality.model_spec(mode["preset"], mode["max_seq_len"])))
    names = cfg.features.event_types
    want = []
    for i in range(len(ex)):  # one example at a time, as a reader would count
        types = ex.seq_type[ex.seq_offsets[i]:ex.seq_offsets[i + 1]][-mode["max_seq_len"]:]
        want.append(any(sum(names[t] in tier.event_types for t in types) > tier.block_size for tier in cfg.tiers))
    got = diagnose.long_history_mask(ex, cfg, mode["max_seq_len"])
    assert got.tolist() == want and 0 < got.sum() < len(ex)


def test_swapped_attention_agrees_on_short_histories_only():
    """GEM's weights under dense attention: the same predictions wherever every tier fits in one
    block, different ones on the long histories (what the swap probe measures)."""
    mode = quality.MODES["smoke"]
    spec = SyntheticDataSpec(seed=quality.WORLD_SEED, num_users=300, num_ads=100, mean_history_len=40.0)
    ex = SyntheticWorld(spec).sample(400, split=1)
    mspec = quality.model_spec(mode["preset"], mode["max_seq_len"])
    gem = quality.build("gem", mspec, seed=3)
    with torch.no_grad():  # move the weights off their init so every layer matters
        for p in gem.parameters():
            p.add_(0.05 * torch.randn_like(p))
    long = diagnose.long_history_mask(ex, kunlun_config(config_from_spec(mspec)), mode["max_seq_len"])
    a = diagnose._predict(gem, ex, mode["max_seq_len"])
    b = diagnose._predict(diagnose.swapped(gem, "gem", mspec), ex, mode["max_seq_len"])
    diff = np.abs(a["pred_click"] - b["pred_click"])
    assert diff[~long].max() < 1e-5
    assert diff[long].max() > 1e-3
    # and back: padded GEM's weights under block attention
    padded = quality.build("padded", mspec, seed=3)
    c = diagnose._predict(padded, ex, mode["max_seq_len"])
    d = diagnose._predict(diagnose.swapped(padded, "padded", mspec), ex, mode["max_seq_len"])
    assert np.abs(c["pred_click"] - d["pred_click"])[~long].max() < 1e-5
    m = metrics_from_predictions([a])
    assert math.isfinite(m["ne/click"])


def test_the_decayed_variant_is_gem_without_flags_with_the_affinity_branch():
    """gem_plus_decayed_dlrm_no_match is built in one model (KunlunConfig.affinity_branch, whose
    test shows it equals the LogitSum of the two): its trunk starts as kind gem_no_match does."""
    mspec = quality.model_spec(quality.MODES["smoke"]["preset"], quality.MODES["smoke"]["max_seq_len"])
    model = quality.build("gem_plus_decayed_dlrm_no_match", mspec, seed=3).inner
    assert model.cfg.affinity_branch and not model.cfg.match_flags and model.affinity.log_decay is not None
    alone = quality.build("gem_no_match", mspec, seed=3).inner.state_dict()
    trunk = {k: v for k, v in model.state_dict().items() if not k.startswith("affinity.")}
    assert trunk.keys() == alone.keys() and all(torch.equal(v, alone[k]) for k, v in trunk.items())
    # since stop 34 it is the default GEM, weight for weight
    default = quality.build("gem", mspec, seed=3).state_dict()
    assert default.keys() == model.state_dict().keys()
    assert all(torch.equal(v, default[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("variant", quality.PRE_BRANCH_VARIANTS)
def test_the_recorded_variants_keep_the_design_they_were_recorded_on(variant):
    """The variants recorded before the affinity branch became the default change that design (match
    flags, no branch), so their commands still reproduce their JSON; only their own change differs."""
    mspec = quality.model_spec(quality.MODES["smoke"]["preset"], quality.MODES["smoke"]["max_seq_len"])
    model = quality.build(variant, mspec, seed=3).inner
    gem = getattr(model, "gem", model)  # LogitSum's GEM part
    assert gem.cfg.affinity_branch is False and gem.affinity is None
    assert gem.cfg.match_flags == (not variant.endswith("no_match"))


@pytest.mark.parametrize("kind", ["gem_plus_dlrm", "gem_plus_dlrm_shared", "gem_plus_dlrm_no_match"])
def test_gem_plus_dlrm_adds_the_two_models_logits(kind):
    """The LogitSum variants: GEM's part starts as kind "gem" (or "gem_no_match") does, every task's logit is GEM's plus
    DLRM's, and only the shared variant hands DLRM's gradient to GEM's embedding tables."""
    mode = quality.MODES["smoke"]
    spec = SyntheticDataSpec(seed=quality.WORLD_SEED, num_users=300, num_ads=100, mean_history_len=40.0)
    ex = SyntheticWorld(spec).sample(200, split=1)
    mspec = quality.model_spec(mode["preset"], mode["max_seq_len"])
    both = quality.build(kind, mspec, seed=3)
    gem, dlrm = both.inner.gem, both.inner.dlrm
    if kind.endswith("_no_match"):  # GEM's part is kind "gem_no_match": no exact-match embedding
        alone = quality.build("gem_no_match", mspec, seed=3).inner.state_dict()
        assert not any("match_emb" in k for k in alone)
    else:  # the design the variants were recorded on: flags, no affinity branch
        alone = quality.build("gem", mspec, seed=3, gem_config=quality.PRE_BRANCH_DESIGN).inner.state_dict()
    assert all(torch.equal(v, alone[k]) for k, v in gem.state_dict().items()) and len(alone) == len(gem.state_dict())
    shared = kind.endswith("_shared")
    assert (dlrm.embeddings is gem.embeddings) == shared
    n = {name: sum(p.numel() for p in m.parameters()) for name, m in (("both", both), ("gem", gem), ("dlrm", dlrm))}
    assert n["both"] == n["gem"] + n["dlrm"] - (sum(p.numel() for p in gem.embeddings.parameters()) if shared else 0)

    with torch.no_grad():  # off the init, so that neither branch is near zero
        for p in both.parameters():
            p.add_(0.05 * torch.randn_like(p))
    preds = {name: diagnose._predict(m, ex, mode["max_seq_len"]) for name, m in
             (("both", both), ("gem", quality.OverBatch(gem, mode["max_seq_len"])),
              ("dlrm", quality.OverBatch(dlrm, mode["max_seq_len"])))}
    for task in ("click", "dwell"):
        logit = {name: np.log(p[f"pred_{task}"]) - np.log1p(-p[f"pred_{task}"]) for name, p in preds.items()}
        np.testing.assert_allclose(logit["both"], logit["gem"] + logit["dlrm"], atol=2e-4)
        assert np.abs(logit["dlrm"]).max() > 1e-2

    inputs = quality.from_v1_batch(make_batch(ex, np.arange(32), max_seq_len=mode["max_seq_len"]))
    dlrm(inputs)["click"].sum().backward()  # DLRM's branch alone
    reached = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in gem.embeddings.parameters()]
    assert any(reached) == shared


@pytest.mark.parametrize("variant", diagnose.VARIANTS)
def test_every_variant_is_a_model_the_study_can_train_and_plot(variant):
    """`--variant` trains for an hour before it plots: a kind that quality.build cannot make or the
    plot has no colour for must fail here instead."""
    mode = quality.MODES["smoke"]
    model = quality.build(variant, quality.model_spec(mode["preset"], mode["max_seq_len"]), seed=0)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert variant in quality.MODEL_COLORS


def test_first_summary_layers_all_read_the_summary_layer_0_pooled():
    """gem_compskip_off_first_summary (quality.FirstSummaryModel): CompSkip off, both paths in every
    layer, but every layer's summary gate reads the very summary layer 0 pooled before any
    attention; the hook it overrides (KunlunLayer.refreshes_summary) changes nothing by default."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=3, compskip=False)
    spec = SyntheticDataSpec(seed=quality.WORLD_SEED, num_users=50, num_ads=40, mean_history_len=40.0)
    inputs = quality.from_v1_batch(make_batch(SyntheticWorld(spec).sample(6, split=1), np.arange(6),
                                              max_seq_len=cfg.tiers[0].max_seq_len))
    torch.manual_seed(0)
    model = quality.FirstSummaryModel(cfg)
    assert [(len(l.hsp) > 0, len(l.seq_ffn) > 0, len(l.attn) > 0) for l in model.layers] == [
        (True, True, True), (False, True, True), (False, True, True)]
    produced, consumed = {}, {}
    for name, hsp in model.layers[0].hsp.items():
        hsp.register_forward_hook(lambda m, a, out, name=name: produced.__setitem__(name, out))
    for i, layer in enumerate(model.layers):
        for name, gate in layer.summary.items():
            gate.register_forward_hook(lambda m, a, out, i=i, name=name: consumed.__setitem__((i, name), a[0]))
    model(inputs)
    for t in cfg.tiers:
        assert all(consumed[(i, t.name)] is produced[t.name] for i in range(3))  # the very tensor
    lengths = model.tier_lengths(inputs)
    assert ["hsp" in layer.flops(inputs.size, lengths) for layer in model.layers] == [True, False, False]
    # By default every layer pools, and layer 0 starts from the same weights as the probe's.
    torch.manual_seed(0)
    plain = KunlunModel(cfg)
    assert all(len(l.hsp) == len(cfg.tiers) for l in plain.layers)
    first = model.state_dict()
    assert all(torch.equal(v, first[k]) for k, v in plain.state_dict().items() if k.startswith("layers.0."))


def test_early_recent_layer_0_takes_its_recent_events_before_attention():
    """gem_compskip_off_early_recent (quality.EarlyRecentModel): the first-summary probe whose
    layer 0 takes the summary gate's last K events before its block attention, as CompSkip's
    global layer 0 does; later layers take them after theirs, and so does every layer by default
    (KunlunLayer.reads_recent_after_attention)."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=3, compskip=False)
    spec = SyntheticDataSpec(seed=quality.WORLD_SEED, num_users=50, num_ads=40, mean_history_len=40.0)
    inputs = quality.from_v1_batch(make_batch(SyntheticWorld(spec).sample(6, split=1), np.arange(6),
                                              max_seq_len=cfg.tiers[0].max_seq_len))

    def recent_reads(model):
        """(layer, tier) -> whether the gate's events are the attention's input or output."""
        seen, read = {}, {}
        for i, layer in enumerate(model.layers):
            for name, attn in layer.attn.items():
                attn.register_forward_hook(lambda m, a, out, i=i, name=name: seen.__setitem__((i, name), (a[0], out)))
            for name, gate in layer.summary.items():
                gate.register_forward_hook(lambda m, a, out, i=i, name=name: read.__setitem__((i, name), a[1]))
        model(inputs)
        return {key: ("before" if read[key] is seen[key][0] else "after" if read[key].values is seen[key][1] else None)
                for key in read}

    torch.manual_seed(0)
    probe = quality.EarlyRecentModel(cfg)
    reads = recent_reads(probe)
    assert reads == {(i, t.name): "before" if i == 0 else "after" for i in range(3) for t in cfg.tiers}
    assert [len(l.hsp) > 0 for l in probe.layers] == [True, False, False]  # the first-summary probe's pooling
    torch.manual_seed(0)
    plain = KunlunModel(cfg)
    assert set(recent_reads(plain).values()) == {"after"}
    built = quality.build("gem_compskip_off_early_recent", quality.model_spec("tiny", 32)).inner
    assert type(built) is quality.EarlyRecentModel and not built.cfg.compskip
