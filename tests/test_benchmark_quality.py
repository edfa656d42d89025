"""`python -m benchmarks.quality --smoke` (tiny models, a few steps) writes a well-formed quality.json.

Checked against sources independent of the benchmark's own bookkeeping: the task/surface keys
against the tasks the model has heads for and the surfaces the held-out world's eval split holds;
every NE finite and no better than the Bayes-optimal NE of the world's true probabilities; the
gap-closed and CompSkip figures recomputed from the NEs they are derived from.
"""

from __future__ import annotations

import json
import math

import numpy as np

from benchmarks import quality
from gem.api.types import ModelSpec, SyntheticDataSpec
from gem.data.synthetic import SyntheticWorld
from gem.eval.evaluate import FUNNEL, surface_name
from gem.model import config_from_spec


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def test_quality_benchmark_smoke(tmp_path):
    out = tmp_path / "quality.json"
    quality.main(["--smoke", "--out", str(out)])  # exit status: whether the bars are met (not here)
    doc = json.loads(out.read_text())
    assert doc["mode"] == "smoke" and doc["world_seed"] == quality.WORLD_SEED
    assert doc["command"] == f"python -m benchmarks.quality --smoke --out {out.resolve()}"

    # Keys: every task the model predicts x (all + every surface of the eval split).
    mode = quality.MODES["smoke"]
    spec = SyntheticDataSpec(**doc["main"]["world"])
    assert spec.seed == quality.WORLD_SEED
    eval_ = SyntheticWorld(spec).sample(mode["eval_examples"], split=1)
    tasks = [t for t in FUNNEL if t in config_from_spec(ModelSpec(preset=mode["preset"])).tasks]
    surfaces = [surface_name(int(s)) for s in np.unique(eval_.surface)]
    assert len(surfaces) >= 2
    expected = {f"{t}/{s}" for t in tasks for s in ["all", *surfaces]}
    assert set(doc["ne"]) == expected

    # Every NE is the mean over the paired seeds; seed 0's is the main runs' own report.
    seeds = list(mode["seeds"])
    assert doc["main"]["seeds"] == seeds and len(seeds) >= 2
    for key, row in doc["ne"].items():
        assert set(row) == {"gem", "dlrm", "padded", "bayes"}, key
        assert all(_finite(v) for v in row.values()), (key, row)
        by_seed = doc["main"]["ne_by_seed"][key]
        for model in ("gem", "dlrm", "padded"):
            assert row["bayes"] <= row[model], (key, row)
            assert len(by_seed[model]) == len(seeds) and math.isclose(row[model], np.mean(by_seed[model]), rel_tol=1e-12)
            assert by_seed[model][0] == doc["main"]["task_surface"][model][key]["ne"]
        assert len(set(by_seed["gem"])) == len(seeds)  # other seeds are other runs
        best = min(row["dlrm"], row["padded"])
        assert math.isclose(doc["gap_closed"][key], (best - row["gem"]) / (best - row["bayes"]), rel_tol=1e-9)
        for b in ("dlrm", "padded"):
            d = np.array(by_seed["gem"]) - np.array(by_seed[b])
            pd = doc["main"]["paired_diff"][key][b]
            assert math.isclose(pd["mean"], d.mean(), rel_tol=1e-9, abs_tol=1e-12)
            assert math.isclose(pd["std_error"], d.std(ddof=1) / math.sqrt(len(d)), rel_tol=1e-9, abs_tol=1e-12)

    # Gap split: predictors given the world's true logit terms. More terms, lower NE; never below
    # Bayes (up to the sampling noise of a fit), and Bayes is the report's.
    split = doc["main"]["gap_split"]
    assert set(split) == set(tasks)
    for task, row in split.items():
        assert math.isclose(row["bayes"], doc["ne"][f"{task}/all"]["bayes"], rel_tol=1e-6)
        assert row["bayes"] - 0.01 < row["with_campaign_affinity"] < row["without_affinity"] < 1.0, (task, row)

    # CompSkip: paired seeds, seed 0 being the main runs; the headline is the mean over seeds.
    cs = doc["main"]["compskip"]
    assert [p["seed"] for p in cs["per_seed"]] == seeds
    first = cs["per_seed"][0]
    assert first["on"] == doc["main"]["runs"]["gem"]["metrics"]["ne"]
    assert first["off"] == doc["main"]["runs"]["gem_compskip_off"]["metrics"]["ne"]
    assert len({p["on"] for p in cs["per_seed"]}) == len(cs["per_seed"])  # other seeds are other runs
    on, off = np.mean([p["on"] for p in cs["per_seed"]]), np.mean([p["off"] for p in cs["per_seed"]])
    assert math.isclose(cs["ne_on"], on, rel_tol=1e-12) and math.isclose(cs["ne_off"], off, rel_tol=1e-12)
    assert math.isclose(doc["compskip_ne_delta_rel"], abs(on - off) / off, rel_tol=1e-12)
    assert _finite(cs["delta_rel_std_error"]) and cs["delta_rel_std_error"] >= 0

    sc = doc["scaling"]
    assert len(sc["grid"]) == len(mode["scaling"]["lengths"]) * len(mode["scaling"]["dims"])
    assert all(_finite(g["ne"]) for g in sc["grid"])
    assert {(g["embedding_dim"], g["max_seq_len"]) for g in sc["grid"]} == {
        (d, L) for d in mode["scaling"]["dims"] for L in mode["scaling"]["lengths"]}
    # a larger width has more parameters: the size axis is real
    params = {g["embedding_dim"]: g["params"] for g in sc["grid"]}
    assert sorted(params, key=params.get) == sorted(params)

    ml = doc["movielens"]
    try:
        from gem.data.movielens import find_movielens

        find_movielens()
        available = True
    except FileNotFoundError:
        available = False
    assert ml["available"] is available
    if available:
        assert set(ml["models"]) == {"gem", "dlrm", "padded"}
        for row in ml["models"].values():
            assert 0.0 < row["auc_click"] < 1.0 and _finite(row["ne_click"]) and _finite(row["ne"])

    assert set(doc["targets"]) == {"gem_beats_both_baselines_everywhere", "gap_closed_min", "compskip_ne_delta_rel"}
    assert all(isinstance(t["met"], bool) for t in doc["targets"].values())
    assert out.with_suffix(".png").stat().st_size > 0
    assert out.with_name("quality_scaling.png").stat().st_size > 0


def test_a_candidate_design_replaces_gem_padded_and_compskip_off_but_not_dlrm(capsys):
    """--gem-config: the KunlunConfig fields reach GEM, padded GEM and CompSkip off (each under its
    own attention and schedule), DLRM stays the baseline; --skip compskip plans no CompSkip-off run;
    a field KunlunConfig lacks, or a value that is not JSON, is an error that names it."""
    import pytest

    from gem.baselines import DLRMModel, PaddedKunlunModel

    mode = quality.MODES["smoke"]
    mspec = quality.model_spec(mode["preset"], mode["max_seq_len"])
    cand = {"match_flags": True, "affinity_branch": False}  # the design before the branch
    for kind in ("gem", "padded", "gem_compskip_off"):
        inner = quality.build(kind, mspec, gem_config=cand).inner
        assert not inner.cfg.affinity_branch and inner.cfg.match_flags and inner.affinity is None
        assert isinstance(inner, PaddedKunlunModel) == (kind == "padded")
        assert inner.cfg.compskip == (kind != "gem_compskip_off")
    default = quality.build("gem", mspec)  # without it: the default GEM, with the branch
    assert default.cfg.affinity_branch and not default.cfg.match_flags and default.affinity is not None
    assert type(quality.build("dlrm", mspec, gem_config=cand).inner) is DLRMModel

    kinds = tuple(k for k in quality.MAIN_KINDS if k != "gem_compskip_off")
    jobs = quality.plan_main(mode, 1, kinds)
    assert {j["kind"] for j in jobs.values()} == {"gem", "dlrm", "padded"}
    assert len(jobs) == len(kinds) * len(mode["seeds"])
    inner = quality.build("gem", quality.model_spec("tiny", 32, embedding_dim=16), gem_config=cand).inner
    assert inner.cfg.dim == 16 and not inner.cfg.affinity_branch  # a scaling run's width, the candidate's fields

    # rejected before any training
    for bad, needle in (("nosuch=1", "got 'nosuch'"), ("affinity_branch=yes", "'yes' is not JSON")):
        with pytest.raises(SystemExit):
            quality.main(["--smoke", "--gem-config", bad])
        assert needle in capsys.readouterr().err


def test_the_training_loop_adds_a_candidates_generative_objective():
    """--gem-config generative_loss_weight=...: the loop trains GEM on the task losses plus the
    model's generative objective over the history (KunlunModel.auxiliary_loss), so the candidate's
    first step already moves the weights differently; the default GEM has none."""
    import torch

    train, _ = SyntheticWorld(SyntheticDataSpec(num_users=60, num_ads=40, num_train_examples=64,
                                                num_eval_examples=8)).splits()
    mspec = quality.model_spec("tiny", 32)
    assert quality.build("gem", mspec).auxiliary_loss(None) is None  # GEMModel: off, never converts the batch
    after = {}
    for weight in (0.0, 1.0):
        model = quality.build("gem", mspec, gem_config={"generative_loss_weight": weight})
        steps = list(quality.train_steps(model, train, steps=1, batch=32, lr=1e-2, warmup=1, max_seq_len=32))
        after[weight] = (steps[0][1], model.inner.embeddings.tables["campaign"].weight.detach().clone())
    (loss_off, table_off), (loss_on, table_on) = after[0.0], after[1.0]
    assert loss_on > loss_off + 1.0  # the objective's cross-entropy over the batch's ids is in the loss
    assert not torch.equal(table_off, table_on)
