"""What the models learned, on the held-out world: which terms of the true logit each captures,
and whether block attention loses anything against dense attention.

    python -m benchmarks.diagnose --jobs 2 --threads 1   # the reported run (~1 h on 2 idle cores)
    python -m benchmarks.diagnose --smoke                # the test's run (seconds)
    -> benchmarks/results/diagnose.json, diagnose.png
    python -m benchmarks.diagnose --variant gem_wide_dots --jobs 2 --threads 1  # -> diagnose_gem_wide_dots.json, .png
    (likewise every other kind in VARIANTS)
    python -m benchmarks.diagnose --jobs 2 --threads 1 --out benchmarks/results/diagnose_xeon.json
    -> the main runs on another CPU; a variant run there compares with them through
       --baseline benchmarks/results/diagnose_xeon.json (the recorded command names both)

Two questions benchmarks.quality and benchmarks.data_scaling leave open (docs/quality.md):

1. **Terms.** Every true logit of the synthetic world is a sum of known terms
   (gem.data.synthetic.SyntheticWorld.logit_terms: per-ad biases, the user's click bias, surface
   and objective biases, the history term, the user x ad affinity split into its campaign and ad
   parts). Regressing a model's eval logit on those terms by least squares says how far the model
   moves its logit with each one: coefficient 1 is the world's own weight, 0 a term the model
   ignores, between them a term it has learnt in part (a per-id bias estimated from a few
   examples is shrunk toward zero). `r2` is the share of the model logit's variance the terms
   explain. Conversion is fitted on the model's logit of an *eventual* conversion,
   logit(p / P(conversion lands in the attribution window)), which is what the terms add up to.
   The world's own probabilities, put through the same fit, give coefficients of exactly 1
   (`bayes`): the check that the fit reads the terms right.
2. **Attention.** GEM and padded GEM differ only in the local layer's attention (64-event blocks
   against dense attention over the whole history), so they compute the same function on every
   example whose tiers each fit in one block. NE on the examples with a longer tier ("long") and
   the rest ("short"), and each trained model's NE with the other attention swapped in under the
   same weights, separate what blocks cannot see from run-to-run training differences.

Runs: GEM, padded GEM and DLRM exactly as in the quality benchmark's main study (quality.run_job's
jobs: its seeds, data, steps and loop; the NE of each run equals the quality report's to the last
digit), plus GEM and DLRM on twice the data (data_scaling's 256k rung, seed 0), where DLRM has
overtaken GEM on conversion and dwell.

`--variant KIND` (one of VARIANTS, a benchmarks.quality.build kind) trains that model on GEM's
jobs instead (the same data, seeds and steps) and puts it beside GEM and DLRM as `--baseline`
(a full run's JSON, default benchmarks/results/diagnose.json) has them: its runs are the same
jobs, and seeded single-thread runs reproduce to the last digit on the same kind of CPU, so they
are not trained again. On another CPU they differ by about a seed's spread: each JSON's `machine`
names its CPU (benchmarks.machine.cpu), so compare a variant with its baseline per seed and in the
mean, not to the last digit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import data_scaling, quality  # noqa: E402

TASKS = ("click", "conversion", "dwell")
KINDS = ("gem", "padded", "dlrm")  # of the quality benchmark's main study
MORE_DATA_KINDS = ("gem", "dlrm")
MAIN_OUT = quality.RESULTS / "diagnose.json"  # the main run's JSON (a variant's default baseline)
SWAP = {"gem": "padded", "padded": "gem"}  # the model whose attention is swapped in at evaluation
# --variant: GEM whose wide heads also read dot products (KunlunConfig.wide_dots); GEM and DLRM trained
# as one model, logits added, the DLRM branch with its own tables or GEM's (quality.LogitSum); GEM with
# CompSkip off (both paths in every layer: which terms it learns less, as its click NE trails GEM's);
# CompSkip off whose summary is layer 0's, pooled before any attention (quality.FirstSummaryModel), and
# that probe with layer 0's last K events also taken before its attention (quality.EarlyRecentModel);
# GEM without the events' exact-match flags (KunlunConfig.match_flags), alone, beside a DLRM branch, and
# with the affinity branch (KunlunConfig.affinity_branch: a DLRM whose history pools decay with age)
VARIANTS = ("gem_wide_dots", "gem_plus_dlrm", "gem_plus_dlrm_shared", "gem_compskip_off",
            "gem_compskip_off_first_summary", "gem_compskip_off_early_recent", "gem_no_match",
            "gem_plus_dlrm_no_match", "gem_plus_decayed_dlrm_no_match")

MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(quality="smoke", data_scaling="smoke", more_data_steps=16),
    "full": dict(quality="full", data_scaling="full", more_data_steps=2000),
}


def plan(mode: dict[str, Any], threads: int) -> dict[str, dict[str, Any]]:
    """The quality study's jobs for KINDS under each of its seeds, and data_scaling's rung of
    more_data_steps for MORE_DATA_KINDS: the same dicts, so the same runs."""
    q = quality.MODES[mode["quality"]]
    main = quality.plan_main(q, threads)
    jobs = {}
    for seed in q["seeds"]:
        for kind in KINDS:
            jobs[f"s{seed}/{kind}"] = main[f"main/{kind}" if seed == quality.TRAIN_SEED else f"seeds/s{seed}/{kind}"]
    ladder = data_scaling.plan(data_scaling.MODES[mode["data_scaling"]], threads)
    for kind in MORE_DATA_KINDS:
        jobs[f"more/{kind}"] = ladder[f"{kind}/{mode['more_data_steps']}"]
    return jobs


def plan_variant(mode: dict[str, Any], threads: int, variant: str) -> dict[str, dict[str, Any]]:
    """GEM's jobs of plan() with the model swapped for `variant`: the same data, seeds and steps."""
    return {name.replace("/gem", f"/{variant}"): dict(job, kind=variant)
            for name, job in plan(mode, threads).items() if name.endswith("/gem")}


# --------------------------------------------------------------------------- per run


def long_history_mask(ex, model_cfg, max_seq_len: int) -> np.ndarray:
    """[N] bool: examples with a tier holding more than one attention block of events among the
    most recent max_seq_len (what the model reads: gem.data.batch.make_batch). Elsewhere block
    and dense attention compute the same function."""
    lengths = ex.seq_lengths
    owner = np.repeat(np.arange(len(ex)), lengths)
    first_kept = ex.seq_offsets[1:] - np.minimum(lengths, max_seq_len)
    kept = np.arange(int(ex.seq_offsets[-1])) >= first_kept[owner]
    names = model_cfg.features.event_types  # position = the event-type id (seq_type)
    long = np.zeros(len(ex), bool)
    for tier in model_cfg.tiers:
        ids = [names.index(t) for t in tier.event_types]
        in_tier = kept & np.isin(ex.seq_type, ids)
        long |= np.bincount(owner[in_tier], minlength=len(ex)) > tier.block_size
    return long


def _label_rows(cols: dict[str, np.ndarray], task: str) -> np.ndarray:
    rows = np.isfinite(cols[task])
    return rows & (cols["click"] > 0) if task == "conversion" else rows


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p.astype(np.float64), 1e-6, 1 - 1e-6)
    return np.log(p) - np.log1p(-p)


def term_fit(world, ex, probs: dict[str, np.ndarray], cols: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per task: least-squares coefficients of logit(probs[task]) on the world's logit terms, over
    the rows where the task's label exists; r2 of the fit. Conversion: the eventual-conversion
    logit (probability divided by the attribution-window probability)."""
    terms = world.logit_terms(ex)
    out: dict[str, Any] = {}
    for task in TASKS:
        if task not in probs:
            continue
        rows = _label_rows(cols, task)
        p = probs[task].astype(np.float64)
        if task == "conversion":
            p = p / world.conversion_window_prob(ex.objective)
        y = _logit(p[rows])
        names = [k for k in terms[task] if k != "intercept"]
        x = np.column_stack([np.ones(int(rows.sum()))] + [terms[task][k][rows] for k in names])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        resid = y - x @ coef
        out[task] = {"coef": dict(zip(names, map(float, coef[1:]))), "intercept": float(coef[0]),
                     "r2": float(1.0 - resid.var() / y.var())}
    return out


def _predict(model, eval_, max_seq_len: int) -> dict[str, np.ndarray]:
    import torch

    from gem.eval.evaluate import collect_predictions

    model.eval()
    with torch.no_grad():
        return collect_predictions(model, eval_, max_seq_len=max_seq_len, rank=0, world_size=1,
                                   device=torch.device("cpu"))


def _task_ne(cols: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, float]:
    from gem.eval.evaluate import metrics_from_predictions

    m = metrics_from_predictions([{k: v[rows] for k, v in cols.items()}])
    return {task: quality._f(m.get(f"ne/{task}")) for task in TASKS if f"ne/{task}" in m}


def swapped(model, kind: str, spec):
    """The trained `kind` model's weights under the other attention (SWAP[kind])."""
    from gem.baselines import PaddedKunlunModel
    from gem.model import config_from_spec, kunlun_config
    from gem.modules import KunlunModel

    cfg = config_from_spec(spec)
    inner = model if kind == "gem" else model.inner  # GEMModel is a KunlunModel; padded is wrapped
    other = (PaddedKunlunModel if SWAP[kind] == "padded" else KunlunModel)(kunlun_config(cfg))
    other.load_state_dict(inner.state_dict())
    return quality.OverBatch(other, cfg.max_seq_len)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train as quality.run_job does, then the term fit, and for GEM / padded GEM the long/short
    split and the swapped attention."""
    import torch

    from gem.api.types import SyntheticDataSpec
    from gem.data.synthetic import SyntheticWorld
    from gem.eval.evaluate import metrics_from_predictions
    from gem.model import config_from_spec, kunlun_config

    torch.set_num_threads(job["threads"])
    train, eval_ = quality.load_data(job["data"])
    spec = quality.model_spec(job["preset"], job["max_seq_len"])
    model = quality.build(job["kind"], spec, seed=job["seed"])
    t0 = time.perf_counter()
    for _ in quality.train_steps(model, train, steps=job["steps"], batch=job["batch"], lr=job["lr"],
                                 warmup=job["warmup"], max_seq_len=job["max_seq_len"], seed=job["seed"]):
        pass
    train_s, t1 = time.perf_counter() - t0, time.perf_counter()
    cols = _predict(model, eval_, job["max_seq_len"])
    assert np.array_equal(cols["click"], eval_.click), "predictions out of the eval split's order"
    world = SyntheticWorld(SyntheticDataSpec(**job["data"]["spec"]))
    every = np.ones(len(eval_), bool)
    headline = metrics_from_predictions([cols])["ne"]  # quality's metrics["ne"]: equal to its report's
    run: dict[str, Any] = {
        "metrics": {"ne": float(headline)}, "ne": _task_ne(cols, every),
        "train_seconds": round(train_s, 1), "eval_seconds": round(time.perf_counter() - t1, 1),
        "terms": term_fit(world, eval_, {t: cols[f"pred_{t}"] for t in TASKS if f"pred_{t}" in cols}, cols),
    }
    if job["kind"] in SWAP:
        long = long_history_mask(eval_, kunlun_config(config_from_spec(spec)), job["max_seq_len"])
        other = _predict(swapped(model, job["kind"], spec), eval_, job["max_seq_len"])
        run["attention"] = {"n_long": int(long.sum()), "n": len(eval_),
                            "long": _task_ne(cols, long), "short": _task_ne(cols, ~long),
                            "swapped_all": _task_ne(other, every), "swapped_long": _task_ne(other, long)}
    return run


def bayes_terms(data: dict[str, Any]) -> dict[str, Any]:
    """term_fit of the world's own probabilities: every coefficient 1, r2 1."""
    from gem.api.types import SyntheticDataSpec
    from gem.data.synthetic import SyntheticWorld

    _, eval_ = quality.load_data(data)
    cols = {t: getattr(eval_, t) for t in TASKS}
    world = SyntheticWorld(SyntheticDataSpec(**data["spec"]))
    return term_fit(world, eval_, {t: getattr(eval_, f"p_{t}") for t in TASKS}, cols)


# --------------------------------------------------------------------------- study


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs))


def _se(xs: list[float]) -> float | None:
    return float(np.std(xs, ddof=1) / np.sqrt(len(xs))) if len(xs) > 1 else None


def _seed_mean_terms(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each task's term fit averaged over the seeds' runs, with every seed's coefficients."""
    return {task: {"coef": {k: _mean([r["terms"][task]["coef"][k] for r in rs]) for k in rs[0]["terms"][task]["coef"]},
                   "coef_by_seed": {k: [r["terms"][task]["coef"][k] for r in rs] for k in rs[0]["terms"][task]["coef"]},
                   "r2": _mean([r["terms"][task]["r2"] for r in rs])}
            for task in rs[0]["terms"]}


def _budgets(jobs: dict[str, dict[str, Any]], seed: int, kind: str) -> dict[str, int]:
    one, more = jobs[f"s{seed}/{kind}"], jobs[f"more/{kind}"]
    return {"quality_budget": one["steps"] * one["batch"], "more_data": more["steps"] * more["batch"]}


def study(mode: dict[str, Any], jobs: dict[str, dict[str, Any]], res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    seeds = quality.MODES[mode["quality"]]["seeds"]
    runs = {kind: [res[f"s{s}/{kind}"] for s in seeds] for kind in KINDS}
    terms: dict[str, Any] = {"quality_budget": {}, "more_data": {}}
    for kind, rs in runs.items():
        terms["quality_budget"][kind] = _seed_mean_terms(rs)
    for kind in MORE_DATA_KINDS:
        terms["more_data"][kind] = res[f"more/{kind}"]["terms"]
    attention: dict[str, Any] = {"n": runs["gem"][0]["attention"]["n"], "n_long": runs["gem"][0]["attention"]["n_long"]}
    for kind in SWAP:
        a = [r["attention"] for r in runs[kind]]
        attention[kind] = {
            "all": {t: _mean([r["ne"][t] for r in runs[kind]]) for t in TASKS},
            **{part: {t: _mean([x[part][t] for x in a]) for t in TASKS}
               for part in ("long", "short", "swapped_all", "swapped_long")}}
    # GEM minus padded GEM per seed, in % of padded GEM's NE (quality's paired_diff is in NE)
    diff = {}
    for part in ("all", "long", "short"):
        diff[part] = {}
        for t in TASKS:
            def ne_of(kind: str, i: int) -> float:
                return runs[kind][i]["ne"][t] if part == "all" else runs[kind][i]["attention"][part][t]
            d = [100 * (ne_of("gem", i) / ne_of("padded", i) - 1) for i in range(len(seeds))]
            diff[part][t] = {"by_seed": d, "mean": _mean(d), "std_error": _se(d)}
    attention["gem_minus_padded_pct"] = diff
    # Largest NE change from swapping the attention under fixed weights, any run, any task
    attention["max_swap_change"] = {
        part: max(abs(r["attention"][f"swapped_{part}"][t] - (r["ne"][t] if part == "all" else r["attention"]["long"][t]))
                  for kind in SWAP for r in runs[kind] for t in TASKS)
        for part in ("all", "long")}
    ne = {name: run["ne"] for name, run in res.items()}
    return {"seeds": list(seeds), "ne": ne, "terms": terms, "bayes_terms": bayes_terms(jobs[f"s{seeds[0]}/gem"]["data"]),
            "attention": attention, "budgets": _budgets(jobs, seeds[0], "gem"),
            "world": jobs[f"s{seeds[0]}/gem"]["data"]["spec"]}


def check_baseline(mode: dict[str, Any], jobs: dict[str, dict[str, Any]], variant: str,
                   base: dict[str, Any], base_path: Path) -> None:
    """Refuse, before any training, a --baseline that is not a run on the variant's world, budgets
    and seeds (a missing file reads as {})."""
    seeds = quality.MODES[mode["quality"]]["seeds"]
    if (base.get("world") != jobs[f"s{seeds[0]}/{variant}"]["data"]["spec"]
            or base.get("budgets") != _budgets(jobs, seeds[0], variant) or base.get("seeds") != list(seeds)):
        raise SystemExit(f"--baseline {base_path} is not a run on this variant's world, budgets and seeds: run "
                         f"`python -m benchmarks.diagnose{' --smoke' if mode is MODES['smoke'] else ''}` "
                         "to write it first, or pass the matching --baseline")


def variant_study(mode: dict[str, Any], jobs: dict[str, dict[str, Any]], res: dict[str, dict[str, Any]],
                  variant: str, base: dict[str, Any], base_path: Path) -> dict[str, Any]:
    """The variant's NE and term fits beside the baseline run's GEM and DLRM on the same jobs
    (check_baseline first), and its NE minus GEM's per run and task (negative: the variant is better)."""
    seeds = quality.MODES[mode["quality"]]["seeds"]
    world, budgets = jobs[f"s{seeds[0]}/{variant}"]["data"]["spec"], _budgets(jobs, seeds[0], variant)
    runs = [f"s{s}" for s in seeds] + ["more"]
    terms = {"quality_budget": {variant: _seed_mean_terms([res[f"s{s}/{variant}"] for s in seeds])},
             "more_data": {variant: res[f"more/{variant}"]["terms"]}}
    for budget in terms:
        for kind in MORE_DATA_KINDS:
            terms[budget][kind] = base["terms"][budget][kind]
    ne = {name: run["ne"] for name, run in res.items()}
    ne.update({f"{r}/{kind}": base["ne"][f"{r}/{kind}"] for r in runs for kind in MORE_DATA_KINDS})
    minus_gem = {r: {t: ne[f"{r}/{variant}"][t] - ne[f"{r}/gem"][t] for t in TASKS} for r in runs}
    return {"variant": variant, "baseline": quality.shown_path(base_path), "seeds": list(seeds), "ne": ne, "ne_minus_gem": minus_gem,
            "ne_minus_gem_seed_mean": {t: _mean([minus_gem[f"s{s}"][t] for s in seeds]) for t in TASKS},
            "terms": terms, "bayes_terms": base["bayes_terms"], "budgets": budgets, "world": world}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["gem", doc["variant"], "dlrm"] if "variant" in doc else ["gem", "dlrm"]
    bars = [(budget, kind) for budget in ("quality_budget", "more_data") for kind in kinds]
    b = doc["budgets"]
    fig, axes = plt.subplots(1, len(TASKS), figsize=(5.5 * len(TASKS), 4.4), squeeze=False)
    for ax, task in zip(axes[0], TASKS):
        names = list(doc["bayes_terms"][task]["coef"])
        x = np.arange(len(names))
        w = 0.8 / len(bars)
        for i, (budget, kind) in enumerate(bars):
            coef = doc["terms"][budget][kind][task]["coef"]
            ax.bar(x + (i - (len(bars) - 1) / 2) * w, [coef[n] for n in names], w,
                   color=quality.MODEL_COLORS[kind], alpha=1.0 if budget == "more_data" else 0.5,
                   label=f"{kind}, {b[budget] // 1000}k impressions")
        ax.axhline(1.0, color="k", linestyle="dashed", linewidth=0.8, label="the world's weight")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{task}: logit coefficient per true term")
    handles, labels = axes[0][0].get_legend_handles_labels()  # one legend below, clear of the bars
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"What each model's logit follows, held-out world seed {quality.WORLD_SEED}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _variant_args(p) -> None:
    p.add_argument("--variant", choices=VARIANTS, help="train this model on GEM's jobs instead of the main runs")
    p.add_argument("--baseline", type=Path, default=MAIN_OUT,
                   help="with --variant: the main run's JSON whose GEM and DLRM it is compared with")


def main(argv: list[str] | None = None) -> int:
    args = quality.study_cli(__doc__.split("\n\n")[0], MAIN_OUT, argv, extra=_variant_args)
    import torch

    name = "smoke" if args.smoke else "full"
    mode = MODES[name]
    if args.variant:
        args.default_out = quality.RESULTS / f"diagnose_{args.variant}.json"
        if args.out == MAIN_OUT:
            args.out = args.default_out  # never overwrite the main run's
    base = json.loads(args.baseline.read_text()) if args.variant and args.baseline.exists() else {}
    t0, load_before = time.time(), os.getloadavg()
    torch.set_num_threads(args.threads)
    if args.variant:
        jobs = plan_variant(mode, args.threads, args.variant)
        check_baseline(mode, jobs, args.variant, base, args.baseline)
    else:
        jobs = plan(mode, args.threads)
    res = quality.run_jobs(jobs, args.jobs, fn=run_job)
    body = variant_study(mode, jobs, res, args.variant, base, args.baseline) if args.variant else study(mode, jobs, res)
    command = (quality.study_command("benchmarks.diagnose", args) + (f" --variant {args.variant}" if args.variant else "")
               + (f" --baseline {quality.shown_path(args.baseline)}" if args.variant and args.baseline != MAIN_OUT else ""))
    doc = {"command": command, "mode": name, "world_seed": quality.WORLD_SEED, **body, "precision": "fp32",
           "machine": quality.study_machine(args, load_before),
           "wall_seconds": round(time.time() - t0, 1)}
    quality.write_study(doc, args.out, plot)
    print(json.dumps({"terms": doc["terms"]["quality_budget"], **{k: doc[k] for k in ("attention", "ne_minus_gem")
                                                                   if k in doc}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
