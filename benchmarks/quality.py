"""GEM's prediction quality against the baselines, on a held-out synthetic world and MovieLens-100K.

    python -m benchmarks.quality [--quick | --smoke] [--jobs N] [--out benchmarks/results/quality.json]

Results and how to read them: docs/quality.md (the reported run: `--jobs 2 --threads 1`; the
same main study on an Intel Xeon: `--jobs 2 --threads 1 --skip scaling movielens --out
benchmarks/results/quality_xeon.json`).

Four studies, all in one process, each model trained by the same loop (below) on the same
examples in the same order, for the same number of steps, with the same optimizer:

1. **GEM vs baselines** on a world whose seed (`WORLD_SEED` = 20261202) was never used while
   building the model: GEM `small`, the DLRM-style baseline (gem.baselines.DLRMModel) and the
   same GEM with padded dense attention (gem.baselines.PaddedKunlunModel). NE per task and
   surface (tasks and surfaces as gem.eval's report finds them in the data), the Bayes-optimal NE
   (NE of the world's true probabilities) and the share of the best baseline's gap to Bayes that
   GEM closes: (best_baseline_ne - gem_ne) / (best_baseline_ne - bayes_ne). Every model is
   trained under each of MODES[...]["seeds"] (init and data order, paired across models; seed 0
   is the main run) and every NE is the mean over those seeds, with GEM's paired per-seed
   difference to each baseline and its standard error (`main.paired_diff`). `main.gap_split`
   splits the Bayes gap: logistic regressions on the world's own logit terms
   (gem.data.synthetic.SyntheticWorld.logit_terms), with and without the latent user x campaign
   affinity, show how much of the gap no single example's features reveal.
2. **CompSkip** on vs off: GEM `small` with the same seeds, data and steps;
   `compskip_ne_delta_rel` = |NE(on) - NE(off)| / NE(off) on the headline NE, each the mean over
   the paired seeds.
3. **Scaling**: NE against the history length the model reads (a grid of max_seq_len) for a few
   model widths, on a world with long histories (same seed, longer mean history).
4. **MovieLens-100K** (gem.data.movielens: rating >= 4 is a click, 5 a conversion, time split):
   AUC and NE of GEM against both baselines (all three at the `tiny` width in `full`: the
   budget of a shared 2-core machine).

Sizes per mode are in MODES; `full` (128k training impressions per model, every model over three
paired seeds; the scaling grid 25,600 impressions per run) takes ~75 min on an idle 2-core machine
with --jobs 2: see docs/quality.md. benchmarks.scaling runs the scaling grid at several budgets.

The training loop is `gem train`'s, minus DeepSpeed (a world of one): gem.data.ShardedLoader
(seeded epoch permutations), gem.model.loss.multitask_bce (every task the model has a head for;
conversion on clicked impressions only), gem.train.optim.build_optimizer (AdamW, linear warmup
then cosine to 10%), gradient-norm clipping at TrainingSpec.grad_clip, fp32 (`gem train`'s default precision; on this
CPU, without bf16 matmul units, bf16 autocast made GEM ~10x slower). Evaluation is gem.eval's: collect_predictions over the whole eval split, then
metrics_from_predictions and build_eval_report. Synthetic training examples are seen once
(num_train_examples = steps x batch): no repeats, as in production. Every model is evaluated
after its last step (fixed steps, no best-step selection).

Writes the JSON and two PNGs beside it (`quality.png`: NE by task and surface with Bayes,
CompSkip and MovieLens; `quality_scaling.png`: the scaling curves).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from gem.api.types import ModelSpec, SyntheticDataSpec, TrainingSpec  # noqa: E402
from gem.baselines import DLRMConfig, DLRMModel, PaddedKunlunModel  # noqa: E402
from gem.data import Examples, ShardedLoader  # noqa: E402
from gem.data.synthetic import SyntheticWorld  # noqa: E402
from gem.eval.evaluate import collect_predictions, metrics_from_predictions  # noqa: E402
from gem.eval.metrics import normalized_entropy  # noqa: E402
from gem.eval.report import build_eval_report  # noqa: E402
from gem.model import GEMModel, config_from_spec, kunlun_config  # noqa: E402
from gem.model.loss import multitask_bce  # noqa: E402
from gem.modules import KunlunModel, from_v1_batch  # noqa: E402
from gem.modules.kunlun import KunlunLayer  # noqa: E402
from gem.train.optim import build_optimizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
QUALITY_OUT = RESULTS / "quality.json"  # the report of record (--out's default)
WORLD_SEED = 20261202  # held out: no model or default was tuned on this world
TRAIN_SEED = 0  # parameter init and data order, identical for every model
MODELS = ("gem", "dlrm", "padded")
BASELINES = ("dlrm", "padded")
MAIN_KINDS = (*MODELS, "gem_compskip_off")  # trained under every seed of the main study

# Each mode: sizes of every study. `smoke` is for the test (seconds), `quick` for development
# (minutes), `full` the reported run. Main comparison: GEM `small` (quick/full); smoke uses `tiny`.
MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(
        preset="tiny", world=dict(num_users=2000, num_ads=400, mean_history_len=24.0), eval_examples=1200,
        steps=12, batch=32, max_seq_len=64, lr=2e-3, warmup=4, seeds=(0, 1),
        scaling=dict(preset="tiny", mean_history_len=32.0, lengths=(8, 32), dims=(16, 32), steps=6, batch=32,
                     eval_examples=500),
        movielens=dict(preset="tiny", steps=6, batch=32, max_seq_len=32, eval_examples=800),
    ),
    "quick": dict(
        preset="small", world=dict(num_users=4000, num_ads=1000, mean_history_len=48.0), eval_examples=2000,
        steps=30, batch=32, max_seq_len=128, lr=2e-3, warmup=3, seeds=(0,),
        scaling=dict(preset="tiny", mean_history_len=64.0, lengths=(16, 64), dims=(16, 32), steps=20,
                     batch=32, eval_examples=1000),
        movielens=dict(preset="tiny", steps=20, batch=64, max_seq_len=64, eval_examples=2000),
    ),
    "full": dict(
        preset="small", world=dict(num_users=4000, num_ads=1000, mean_history_len=48.0), eval_examples=20000,
        steps=1000, batch=128, max_seq_len=128, lr=2e-3, warmup=50, seeds=(0, 1, 2),
        scaling=dict(preset="tiny", mean_history_len=192.0, lengths=(16, 64, 256, 1024), dims=(16, 32, 64),
                     steps=800, batch=32, eval_examples=4000),
        movielens=dict(preset="tiny", steps=200, batch=64, max_seq_len=64, eval_examples=5000),
    ),
}


# --------------------------------------------------------------------------- models


class OverBatch(nn.Module):
    """A model that reads GemInputs behind the trainer's Batch interface (as GEMModel does)."""

    def __init__(self, model: nn.Module, max_seq_len: int):
        super().__init__()
        self.inner, self.max_seq_len = model, max_seq_len

    def forward(self, batch) -> dict[str, torch.Tensor]:
        return self.inner(from_v1_batch(batch))

    def auxiliary_loss(self, batch) -> torch.Tensor | None:
        aux = getattr(self.inner, "auxiliary_loss", None)
        return None if aux is None else aux(from_v1_batch(batch))


class LogitSum(nn.Module):
    """GEM and DLRM trained as one model, their logits added per task (`gem_plus_dlrm`, a
    benchmarks.diagnose probe: does a jointly trained DLRM branch give GEM DLRM's user x ad
    affinity?). `shared_embeddings`: the DLRM branch reads GEM's tables, so the dot products'
    gradient reaches GEM's embeddings directly; otherwise it keeps its own."""

    def __init__(self, gem: KunlunModel, dlrm: DLRMModel, *, shared_embeddings: bool):
        super().__init__()
        if shared_embeddings:
            dlrm.embeddings = gem.embeddings  # one module, registered twice; parameters() dedups it
        self.gem, self.dlrm = gem, dlrm

    def forward(self, inputs) -> dict[str, torch.Tensor]:
        a, b = self.gem(inputs), self.dlrm(inputs)
        return {task: a[task] + b[task] for task in a}


class FirstSummaryLayer(KunlunLayer):
    """A Kunlun layer that pools the HSP summary only in layer 0; later layers reuse it, as
    CompSkip's local layers do (`gem_compskip_off_first_summary`, a benchmarks.diagnose probe: with
    CompSkip off, is the click history term lost because the last summary pools events that block
    attention has already mixed?)."""

    def refreshes_summary(self) -> bool:
        return self.index == 0


class FirstSummaryModel(KunlunModel):
    layer_cls = FirstSummaryLayer


class EarlyRecentLayer(FirstSummaryLayer):
    """FirstSummaryLayer whose layer 0 also takes the summary gate's last K events before its block
    attention, as CompSkip's global layer 0 does (`gem_compskip_off_early_recent`: is the rest of
    the click loss layer 0's MoWE reading recent events that attention has mixed?)."""

    def reads_recent_after_attention(self) -> bool:
        return self.index != 0


class EarlyRecentModel(KunlunModel):
    layer_cls = EarlyRecentLayer


# CompSkip off (both paths in every layer) and the diagnose probes that make it read what CompSkip reads.
COMPSKIP_OFF_MODELS = {"gem_compskip_off": KunlunModel, "gem_compskip_off_first_summary": FirstSummaryModel,
                       "gem_compskip_off_early_recent": EarlyRecentModel}


# benchmarks.diagnose's variants, recorded before the affinity branch became the default (stop 34):
# each changes that design, so its command still reproduces its JSON. gem_compskip_off is not among
# them: it is also the main study's CompSkip off, which follows the default.
PRE_BRANCH_DESIGN = dict(match_flags=True, affinity_branch=False)
PRE_BRANCH_VARIANTS = ("gem_no_match", "gem_wide_dots", "gem_plus_dlrm", "gem_plus_dlrm_shared",
                       "gem_plus_dlrm_no_match", "gem_compskip_off_first_summary", "gem_compskip_off_early_recent")


def model_spec(preset: str, max_seq_len: int, embedding_dim: int | None = None) -> ModelSpec:
    return ModelSpec(preset=preset, max_seq_len=max_seq_len, embedding_dim=embedding_dim)


def build(kind: str, spec: ModelSpec, *, seed: int = TRAIN_SEED, gem_config: dict[str, Any] | None = None) -> nn.Module:
    """gem (as `gem train` builds it), gem_no_match (no exact-match flags on the events),
    gem_compskip_off[_first_summary|_early_recent], gem_wide_off, gem_wide_dots,
    gem_plus_dlrm[_shared|_no_match] (LogitSum), gem_plus_decayed_dlrm_no_match (GEM without the
    flags, with KunlunConfig.affinity_branch), dlrm or padded; initialised under `seed`.
    `gem_config`: KunlunConfig fields set on gem, padded and gem_compskip_off (--gem-config: a
    candidate design in the main study; DLRM stays the baseline)."""
    cfg = config_from_spec(spec)
    torch.manual_seed(seed)
    base = kunlun_config(cfg)
    if gem_config and kind in ("gem", "padded", "gem_compskip_off"):
        base = dataclasses.replace(base, **gem_config)
    if kind == "gem":
        return OverBatch(KunlunModel(base), cfg.max_seq_len) if gem_config else GEMModel(cfg)
    if kind in PRE_BRANCH_VARIANTS:  # recorded as changes to the design before the affinity branch
        base = dataclasses.replace(base, **PRE_BRANCH_DESIGN)
    if kind == "gem_no_match":
        return OverBatch(KunlunModel(dataclasses.replace(base, match_flags=False)), cfg.max_seq_len)
    if kind in COMPSKIP_OFF_MODELS:
        return OverBatch(COMPSKIP_OFF_MODELS[kind](dataclasses.replace(base, compskip=False)), cfg.max_seq_len)
    if kind == "gem_wide_off":
        return OverBatch(KunlunModel(dataclasses.replace(base, wide_heads=False)), cfg.max_seq_len)
    if kind == "gem_wide_dots":
        return OverBatch(KunlunModel(dataclasses.replace(base, wide_dots=True)), cfg.max_seq_len)
    if kind in ("gem_plus_dlrm", "gem_plus_dlrm_shared", "gem_plus_dlrm_no_match"):
        # GEM first: its initial weights are those of kind "gem" (of "gem_no_match" without the flags)
        gem = KunlunModel(dataclasses.replace(base, match_flags=not kind.endswith("_no_match")))
        dlrm = DLRMModel(DLRMConfig(base=base))
        return OverBatch(LogitSum(gem, dlrm, shared_embeddings=kind.endswith("_shared")), cfg.max_seq_len)
    if kind == "gem_plus_decayed_dlrm_no_match":  # KunlunConfig.affinity_branch: LogitSum's weights, in one model
        return OverBatch(KunlunModel(dataclasses.replace(base, match_flags=False, affinity_branch=True)),
                         cfg.max_seq_len)
    if kind == "dlrm":
        return OverBatch(DLRMModel(DLRMConfig(base=base)), cfg.max_seq_len)
    if kind == "padded":
        return OverBatch(PaddedKunlunModel(base), cfg.max_seq_len)
    raise ValueError(f"unknown model kind {kind!r}")


# --------------------------------------------------------------------------- train + eval


def train_steps(model: nn.Module, train: Examples, *, steps: int, batch: int, lr: float, warmup: int,
                max_seq_len: int, seed: int = TRAIN_SEED, bf16: bool = False) -> Iterator[tuple[int, float]]:
    """The training loop (module docstring); yields (step, loss) after each optimizer step, so a
    caller can evaluate along the way (benchmarks.wide_heads' learning curves)."""
    training = TrainingSpec(steps=steps, batch_size=batch, learning_rate=lr, warmup_steps=warmup, seed=seed)
    optimizer, scheduler = build_optimizer(model, training)
    loader = ShardedLoader(train, batch_size=batch, max_seq_len=max_seq_len, rank=0, world_size=1, seed=seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    model.train()
    for step in range(1, steps + 1):
        b = loader.next_batch()
        with autocast:
            loss, _ = multitask_bce(model(b), b)
            aux = model.auxiliary_loss(b) if hasattr(model, "auxiliary_loss") else None
            if aux is not None:  # the generative objective over the history (KunlunConfig.generative_loss_weight)
                loss = loss + aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if training.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
        optimizer.step()
        scheduler.step()
        yield step, float(loss.detach())


def train_and_evaluate(model: nn.Module, train: Examples, eval_: Examples, *, steps: int, batch: int, lr: float,
                       warmup: int, max_seq_len: int, seed: int = TRAIN_SEED, bf16: bool = False) -> dict[str, Any]:
    """Train `steps` steps, then evaluate on the whole eval split: metrics, eval report, timings."""
    t0 = time.perf_counter()
    losses = [loss for _, loss in train_steps(model, train, steps=steps, batch=batch, lr=lr, warmup=warmup,
                                              max_seq_len=max_seq_len, seed=seed, bf16=bf16)]
    train_s = time.perf_counter() - t0
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    model.eval()

    def predict(b):
        with autocast:
            return model(b)

    t1 = time.perf_counter()
    preds = collect_predictions(predict, eval_, max_seq_len=max_seq_len, rank=0, world_size=1,
                                device=torch.device("cpu"))
    metrics = metrics_from_predictions([preds])
    report = build_eval_report([preds], eval_, metrics=metrics, step=steps)
    return {
        "metrics": metrics, "report": report, "params": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_s, 1), "eval_seconds": round(time.perf_counter() - t1, 1),
        "final_train_loss": float(np.mean(losses[-max(1, steps // 10):])) if losses else None,
    }


def _f(x: Any) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def task_surface_ne(report: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """{"task/surface": {"ne": .., "bayes": .., "auc": .., "n": ..}} from an eval report, plus "task/all"."""
    out: dict[str, dict[str, float | None]] = {}
    for task, block in report["tasks"].items():
        out[f"{task}/all"] = {"ne": _f(block["ne"]), "bayes": _f(block["bayesNe"]), "auc": _f(block["auc"]),
                              "n": block["n"]}
        for sid, g in block["bySurface"].items():
            out[f"{task}/{g.get('name', sid)}"] = {"ne": _f(g["ne"]), "bayes": _f(g.get("bayesNe")),
                                                  "auc": _f(g.get("auc")), "n": g["n"]}
    return out


def compare(seed_runs: list[dict[str, dict[str, Any]]]) -> tuple[dict, dict, dict, dict, dict]:
    """Over every task/surface of GEM's report, from one {model: run} per seed:
    (ne: the mean over seeds, gap closed, beats, ne_by_seed, paired: GEM minus each baseline).

    One seed's NE wanders by more than the models differ (docs/quality.md), so every figure is a
    mean over paired seeds (same init seed and data order for every model), and `paired` gives
    the mean and standard error of GEM's per-seed difference to each baseline (negative: GEM better).
    """
    pers = [{k: task_surface_ne(r["report"]) for k, r in runs.items()} for runs in seed_runs]
    ne, gap, beats, by_seed, paired = {}, {}, {}, {}, {}
    for key, g in pers[0]["gem"].items():
        by_seed[key] = {m: [per[m].get(key, {}).get("ne") for per in pers] for m in MODELS}
        row = {m: (float(np.mean(v)) if all(x is not None for x in v) else None) for m, v in by_seed[key].items()}
        row["bayes"] = g["bayes"]
        ne[key] = row
        paired[key] = {}
        for b in BASELINES:
            if row["gem"] is None or row[b] is None:
                continue
            d = np.array(by_seed[key]["gem"]) - np.array(by_seed[key][b])
            paired[key][b] = {"mean": float(d.mean()),
                              "std_error": float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None}
        base = [row[m] for m in BASELINES if row[m] is not None]
        if row["gem"] is None or not base:
            gap[key], beats[key] = None, None
            continue
        best = min(base)
        beats[key] = bool(all(row["gem"] < b for b in base))
        if row["bayes"] is not None and best - row["bayes"] > 0:
            gap[key] = (best - row["gem"]) / (best - row["bayes"])
        else:
            gap[key] = None
    return ne, gap, beats, by_seed, paired


# --------------------------------------------------------------------------- studies
#
# Every training run is a job: a plain dict (picklable) naming its data, model and budget.
# `run_job` rebuilds the data from that dict (the world is seeded: every process gets the same
# examples), so jobs can run serially or in a process pool (--jobs) with identical results.


def synthetic_spec(mode: dict[str, Any], *, mean_history_len: float, train_examples: int,
                   eval_examples: int) -> SyntheticDataSpec:
    w = mode["world"]
    return SyntheticDataSpec(seed=WORLD_SEED, num_users=w["num_users"], num_ads=w["num_ads"],
                             num_train_examples=train_examples, num_eval_examples=eval_examples,
                             mean_history_len=mean_history_len)


_DATA_CACHE: dict[str, tuple[Examples, Examples]] = {}


def load_data(data: dict[str, Any]) -> tuple[Examples, Examples]:
    """(train, eval) of a job's data: a synthetic world spec, or MovieLens-100K."""
    key = json.dumps(data, sort_keys=True)
    if key not in _DATA_CACHE:
        if data["source"] == "synthetic":
            pair = SyntheticWorld(SyntheticDataSpec(**data["spec"])).splits()
        else:
            from gem.data.movielens import movielens_examples
            from gem.data.parquet import slice_examples

            train, eval_ = movielens_examples(max_history=data["max_history"])
            if data["eval_examples"] is not None and len(eval_) > data["eval_examples"]:
                eval_ = slice_examples(eval_, np.arange(data["eval_examples"]))  # the earliest eval ratings
            pair = train, eval_
        _DATA_CACHE.clear()  # one data set at a time: worlds are large
        _DATA_CACHE[key] = pair
    return _DATA_CACHE[key]


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(job["threads"])
    train, eval_ = load_data(job["data"])
    seed = job.get("seed", TRAIN_SEED)
    model = build(job["kind"], model_spec(job["preset"], job["max_seq_len"], job.get("embedding_dim")), seed=seed,
                  gem_config=job.get("gem_config"))
    run = train_and_evaluate(model, train, eval_, steps=job["steps"], batch=job["batch"], lr=job["lr"],
                             warmup=job["warmup"], max_seq_len=job["max_seq_len"], seed=seed)
    run["history_len"] = {"mean": float(train.seq_lengths.mean()), "p90": float(np.quantile(train.seq_lengths, 0.9)),
                          "max": int(train.seq_lengths.max())}
    run["examples"] = {"train": len(train), "eval": len(eval_)}
    return run


def study_cli(description: str, default_out: Path, argv: list[str] | None,
              extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The command line of the studies built on this module's runs (data_scaling, wide_heads,
    diagnose): --smoke, --out, --threads, --jobs, and whatever `extra` adds."""
    p = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(p)
    p.add_argument("--smoke", action="store_true", help="the test's run: tiny models, a few steps (seconds)")
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once, in a process pool (results are identical to --jobs 1)")
    args = p.parse_args(argv)
    args.default_out = default_out  # study_command records --out only where it differs
    return args


def shown_path(path: Path) -> str:
    """A path as a recorded command shows it: relative to the repository where it is inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def study_command(module: str, args: argparse.Namespace) -> str:
    """The command that reproduces a study's JSON, as recorded in it (study_cli's options; a study
    appends its own)."""
    return (f"python -m {module}" + (" --smoke" if args.smoke else "")
            + (f" --jobs {args.jobs}" if args.jobs > 1 else "") + f" --threads {args.threads}"
            + (f" --out {shown_path(args.out)}" if args.out != args.default_out else ""))


def study_machine(args: argparse.Namespace, load_before: tuple[float, ...]) -> dict[str, Any]:
    """Where a study ran: torch, CPU, workers x threads, load averages before and now."""
    return {"torch": torch.__version__, **machine.cpu(),
            "workers": args.jobs, "threads": args.threads,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()]}


def write_study(doc: dict[str, Any], out: Path, plot: Any) -> None:
    """The JSON (strict: no NaN) and `plot(doc, PNG path)` beside it; without matplotlib (an
    optional dependency), the JSON alone."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    try:
        plot(doc, out.with_suffix(".png"))
    except ImportError:
        pass


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_jobs(jobs: dict[str, dict[str, Any]], workers: int, fn=None) -> dict[str, dict[str, Any]]:
    """Every job's run, `fn(job)` (default run_job: a module-level function, so a spawned worker
    can import it), serially (workers <= 1) or in a spawn-started process pool."""
    fn = fn or run_job
    out: dict[str, dict[str, Any]] = {}

    def done(name: str, run: dict[str, Any]) -> None:
        out[name] = run
        _log(f"{name}: ne {run['metrics']['ne']:.4f}, train {run['train_seconds']} s, eval {run['eval_seconds']} s "
             f"({len(out)}/{len(jobs)})")

    if workers <= 1:
        for name, job in jobs.items():
            done(name, fn(job))
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        # the most expensive first, so the pool's tail is short (order does not change any result)
        order = sorted(jobs, key=lambda n: -_cost(jobs[n]))
        futures = {pool.submit(fn, jobs[name]): name for name in order}
        for fut in as_completed(futures):
            done(futures[fut], fut.result())
    return {name: out[name] for name in jobs}


def _cost(job: dict[str, Any]) -> float:
    """A rough relative cost of a job: examples x history read x width (DLRM: a tenth)."""
    spec = job["data"].get("spec", {})
    hist = min(job["max_seq_len"], 3 * spec.get("mean_history_len", job["max_seq_len"]))
    width = job.get("embedding_dim") or config_from_spec(model_spec(job["preset"], job["max_seq_len"])).embedding_dim
    cost = job["steps"] * job["batch"] * hist * width * (1.5 if job["kind"].startswith("gem_compskip_off") else 1.0)
    return cost / 10 if job["kind"] == "dlrm" else cost


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    m = run["metrics"]
    keep = {k: _f(v) for k, v in m.items() if k.split("/")[0] in ("ne", "auc", "bayes_ne", "calibration")
            or k in ("ne", "loss")}
    return {"metrics": keep, "params": run["params"], "train_seconds": run["train_seconds"],
            "eval_seconds": run["eval_seconds"], "final_train_loss": run["final_train_loss"]}


def plan_main(mode: dict[str, Any], threads: int, kinds: tuple[str, ...] = MAIN_KINDS) -> dict[str, dict[str, Any]]:
    steps, batch = mode["steps"], mode["batch"]
    spec = synthetic_spec(mode, mean_history_len=mode["world"]["mean_history_len"], train_examples=steps * batch,
                          eval_examples=mode["eval_examples"])
    data = {"source": "synthetic", "spec": spec.model_dump(mode="json")}

    def job(kind: str, seed: int) -> dict[str, Any]:
        return dict(data=data, kind=kind, preset=mode["preset"], max_seq_len=mode["max_seq_len"], steps=steps,
                    batch=batch, lr=mode["lr"], warmup=mode["warmup"], threads=threads, seed=seed)

    jobs = {f"main/{kind}": job(kind, TRAIN_SEED) for kind in kinds}
    # Every model again under other seeds (init and data order): one run's NE wanders by more than
    # the models differ, so comparisons are means over paired seeds.
    for seed in mode["seeds"]:
        if seed != TRAIN_SEED:
            jobs.update({f"seeds/s{seed}/{kind}": job(kind, seed) for kind in kinds})
    return jobs


def runs_by_seed(mode: dict[str, Any], res: dict[str, dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """{seed: {model kind: run}} of the main comparison; seed 0's runs are the main/ jobs."""
    return {seed: {k: r for k in MAIN_KINDS if (r := res.get(f"main/{k}" if seed == TRAIN_SEED else f"seeds/s{seed}/{k}"))}
            for seed in mode["seeds"]}


def compskip_study(by_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """CompSkip on vs off, paired by seed; the headline is the mean NE over the seeds."""
    pairs = {seed: (runs["gem"], runs["gem_compskip_off"]) for seed, runs in by_seed.items()}
    runs = by_seed[TRAIN_SEED]
    per_seed = [{"seed": seed, "on": on["metrics"]["ne"], "off": off["metrics"]["ne"],
                 "delta_rel": (on["metrics"]["ne"] - off["metrics"]["ne"]) / off["metrics"]["ne"],
                 "train_seconds": {"on": on["train_seconds"], "off": off["train_seconds"]}}
                for seed, (on, off) in pairs.items()]
    ne_on = float(np.mean([p["on"] for p in per_seed]))
    ne_off = float(np.mean([p["off"] for p in per_seed]))
    deltas = np.array([p["delta_rel"] for p in per_seed])
    tasks = [k for k in runs["gem"]["metrics"] if k.startswith("ne/") and k in runs["gem_compskip_off"]["metrics"]]
    per_task = {}
    for k in tasks:
        on_k = float(np.mean([on["metrics"][k] for on, _ in pairs.values()]))
        off_k = float(np.mean([off["metrics"][k] for _, off in pairs.values()]))
        per_task[k] = {"on": _f(on_k), "off": _f(off_k), "delta_rel": _f((on_k - off_k) / off_k) if off_k else None}
    ons = np.array([p["on"] for p in per_seed])
    return {
        "seeds": list(by_seed),
        "ne_on": ne_on, "ne_off": ne_off,
        "delta_rel": abs(ne_on - ne_off) / ne_off,
        # the noise the bar sits in: how far one seed's paired difference, and one seed's NE, wander
        "delta_rel_std_error": float(deltas.std(ddof=1) / math.sqrt(len(deltas))) if len(deltas) > 1 else None,
        "gem_seed_spread_rel": float(ons.std(ddof=1) / ons.mean()) if len(ons) > 1 else None,
        "per_seed": per_seed,
        "per_task": per_task,
    }


# Logit terms a predictor is given in each row of the gap split (SyntheticWorld.logit_terms).
GAP_SPLIT = {"without_affinity": ("affinity_campaign", "affinity_ad"), "with_campaign_affinity": ("affinity_ad",)}


def _logistic_ne(x_train: np.ndarray, y_train: np.ndarray, x_eval: np.ndarray, y_eval: np.ndarray) -> float:
    """NE on eval of a logistic regression fitted on train (a handful of columns: L-BFGS in
    float64 is exact and takes a second; not worth a scikit-learn dependency)."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-12
    xt, xe = (torch.as_tensor((x - mu) / sd, dtype=torch.float64) for x in (x_train, x_eval))
    yt = torch.as_tensor(y_train, dtype=torch.float64)
    w = torch.zeros(xt.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(xt @ w[1:] + w[0], yt)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        p = torch.sigmoid(xe @ w[1:] + w[0]).numpy()
    return float(normalized_entropy(y_eval, p))


def gap_split(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per task: NE of logistic regressions given the world's exact logit terms, all but the
    latent affinity ("without_affinity") or all but its ad-specific part ("with_campaign_affinity"),
    beside the Bayes-optimal NE. The terms are the truth, so these predictors know more than any
    model does (exact per-id biases, the exact history term); what separates them from Bayes is
    the user x ad affinity, which no single example's features reveal and a model must learn
    across examples (a user's interests from their histories, an ad's from who engages with it)."""
    world = SyntheticWorld(SyntheticDataSpec(**data["spec"]))
    train, eval_ = load_data(data)
    terms = {"train": world.logit_terms(train), "eval": world.logit_terms(eval_)}
    out: dict[str, dict[str, float]] = {}
    for task in ("click", "conversion", "dwell"):
        cols, rows = {}, {}
        for split, ex in (("train", train), ("eval", eval_)):
            t = {k: v for k, v in terms[split][task].items() if k != "intercept"}
            if task == "conversion":  # the label is sigmoid(logit) x P(converted within the window)
                t["window"] = np.log(world.conversion_window_prob(ex.objective))
            cols[split] = t
            rows[split] = ex.click > 0 if task == "conversion" else np.ones(len(ex), bool)
        y = {split: getattr(ex, task)[rows[split]] for split, ex in (("train", train), ("eval", eval_))}
        p_true = getattr(eval_, f"p_{task}")[rows["eval"]]
        row = {"bayes": float(normalized_entropy(y["eval"], p_true))}
        for name, hidden in GAP_SPLIT.items():
            keep = [k for k in cols["train"] if k not in hidden]
            x = {split: np.stack([cols[split][k][rows[split]] for k in keep], 1) for split in cols}
            row[name] = _logistic_ne(x["train"], y["train"], x["eval"], y["eval"])
        out[task] = row
    return out


def study_main(mode: dict[str, Any], jobs: dict[str, dict[str, Any]], res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    by_seed = runs_by_seed(mode, res)
    runs = by_seed[TRAIN_SEED]
    ne, gap, beats, ne_by_seed, paired = compare([{k: r[k] for k in MODELS} for r in by_seed.values()])
    compskip = compskip_study(by_seed) if "gem_compskip_off" in runs else {"skipped": True, "delta_rel": None}
    job = jobs["main/gem"]
    return {
        "world": job["data"]["spec"],
        "setup": {"preset": job["preset"], "steps": job["steps"], "batch": job["batch"],
                  "max_seq_len": job["max_seq_len"], "lr": job["lr"], "warmup_steps": job["warmup"],
                  "train_examples": runs["gem"]["examples"]["train"], "eval_examples": runs["gem"]["examples"]["eval"],
                  "history_len": runs["gem"]["history_len"]},
        "seeds": list(by_seed),
        "ne": ne, "gap_closed": gap, "gem_beats_baselines": beats,
        "ne_by_seed": ne_by_seed, "paired_diff": paired,
        "gap_split": gap_split(job["data"]),
        "compskip": compskip,
        "compskip_ne_delta_rel": compskip["delta_rel"],
        "runs": {k: _summary(r) for k, r in runs.items()},
        "task_surface": {k: task_surface_ne(r["report"]) for k, r in runs.items()},
    }


def plan_scaling(mode: dict[str, Any], threads: int) -> dict[str, dict[str, Any]]:
    sc = mode["scaling"]
    spec = synthetic_spec(mode, mean_history_len=sc["mean_history_len"], train_examples=sc["steps"] * sc["batch"],
                          eval_examples=sc["eval_examples"])
    data = {"source": "synthetic", "spec": spec.model_dump(mode="json")}
    return {f"scaling/d{dim}/L{L}": dict(data=data, kind="gem", preset=sc["preset"], max_seq_len=L, embedding_dim=dim,
                                         steps=sc["steps"], batch=sc["batch"], lr=mode["lr"],
                                         warmup=max(1, sc["steps"] // 20), threads=threads)
            for dim in sc["dims"] for L in sc["lengths"]}


def study_scaling(mode: dict[str, Any], jobs: dict[str, dict[str, Any]],
                  res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    sc = mode["scaling"]
    grid: list[dict[str, Any]] = []
    for name, job in jobs.items():
        if not name.startswith("scaling/"):
            continue
        run, m = res[name], res[name]["metrics"]
        grid.append({"embedding_dim": job["embedding_dim"], "max_seq_len": job["max_seq_len"], "params": run["params"],
                     "ne": _f(m["ne"]), **{k: _f(v) for k, v in m.items() if k.startswith("ne/")},
                     "train_seconds": run["train_seconds"]})
    gains = {}
    for dim in sc["dims"]:
        row = sorted((g for g in grid if g["embedding_dim"] == dim), key=lambda g: g["max_seq_len"])
        short, long = row[0]["ne"], row[-1]["ne"]
        gains[str(dim)] = (short - long) / short if short else None
    ordered = [gains[str(d)] for d in sc["dims"]]
    first = res[next(n for n in jobs if n.startswith("scaling/"))]
    return {
        "world": next(j for n, j in jobs.items() if n.startswith("scaling/"))["data"]["spec"],
        "setup": {"preset": sc["preset"], "steps": sc["steps"], "batch": sc["batch"], "lr": mode["lr"],
                  "lengths": list(sc["lengths"]), "embedding_dims": list(sc["dims"]),
                  "train_examples": first["examples"]["train"], "eval_examples": first["examples"]["eval"],
                  "history_len": first["history_len"]},
        "grid": grid,
        "ne_gain_longest_vs_shortest_rel": gains,
        "longer_histories_help_larger_models_more": (
            bool(all(b > a for a, b in zip(ordered, ordered[1:]))) if None not in ordered else None),
    }


def plan_movielens(mode: dict[str, Any], threads: int) -> dict[str, dict[str, Any]]:
    from gem.data.movielens import find_movielens

    try:
        find_movielens()
    except FileNotFoundError:
        return {}
    ml = mode["movielens"]
    data = {"source": "movielens", "max_history": ml["max_seq_len"], "eval_examples": ml["eval_examples"]}
    return {f"movielens/{kind}": dict(data=data, kind=kind, preset=ml["preset"], max_seq_len=ml["max_seq_len"],
                                      steps=ml["steps"], batch=ml["batch"], lr=mode["lr"],
                                      warmup=max(1, ml["steps"] // 20), threads=threads)
            for kind in MODELS}


def study_movielens(mode: dict[str, Any], jobs: dict[str, dict[str, Any]],
                    res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    names = [n for n in jobs if n.startswith("movielens/")]
    if not names:
        from gem.data.movielens import find_movielens

        try:
            find_movielens()
        except FileNotFoundError as e:
            return {"available": False, "reason": str(e)}
    ml = mode["movielens"]
    first = res[names[0]]
    out: dict[str, Any] = {"available": True,
                           "setup": {"preset": ml["preset"], "steps": ml["steps"], "batch": ml["batch"],
                                     "max_seq_len": ml["max_seq_len"], "lr": mode["lr"],
                                     "train_examples": first["examples"]["train"],
                                     "eval_examples": first["examples"]["eval"],
                                     "epochs": ml["steps"] * ml["batch"] / first["examples"]["train"]},
                           "models": {}}
    for name in names:
        kind, m = name.split("/", 1)[1], res[name]["metrics"]
        out["models"][kind] = {"ne_click": _f(m.get("ne/click")), "auc_click": _f(m.get("auc/click")),
                               "ne_conversion": _f(m.get("ne/conversion")), "auc_conversion": _f(m.get("auc/conversion")),
                               "ne": _f(m["ne"]), "train_seconds": res[name]["train_seconds"],
                               "params": res[name]["params"]}
    g, base = out["models"]["gem"], [out["models"][b] for b in BASELINES]
    out["gem_beats_baselines"] = {
        k: (bool(all(g[k] < b[k] for b in base)) if k.startswith("ne") else bool(all(g[k] > b[k] for b in base)))
        for k in ("ne_click", "auc_click", "ne_conversion", "auc_conversion")
        if g[k] is not None and all(b[k] is not None for b in base)}
    return out


# --------------------------------------------------------------------------- report


def targets(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    main = doc["main"]
    beats = [v for v in main["gem_beats_baselines"].values() if v is not None]
    gaps = {k: v for k, v in main["gap_closed"].items() if v is not None}
    worst = min(gaps.values()) if gaps else None
    return {
        "gem_beats_both_baselines_everywhere": {"value": f"{sum(beats)}/{len(beats)} task/surface",
                                                "met": bool(beats) and all(beats)},
        "gap_closed_min": {"value": worst, "target": ">= 0.5", "met": worst is not None and worst >= 0.5,
                           "worst": min(gaps, key=gaps.get) if gaps else None},
        "compskip_ne_delta_rel": {"value": doc["compskip_ne_delta_rel"], "target": "<= 0.001",
                                  "met": doc["compskip_ne_delta_rel"] is not None and doc["compskip_ne_delta_rel"] <= 0.001},
    }


MODEL_COLORS = {"gem": "tab:blue", "dlrm": "tab:orange", "padded": "tab:green", "gem_wide_dots": "tab:purple",
                "gem_plus_dlrm": "tab:red", "gem_plus_dlrm_shared": "tab:brown", "gem_compskip_off": "tab:gray",
                "gem_compskip_off_first_summary": "tab:olive", "gem_compskip_off_early_recent": "tab:cyan",
                "gem_no_match": "tab:pink", "gem_plus_dlrm_no_match": "darkred",
                "gem_plus_decayed_dlrm_no_match": "darkgreen"}


def plot_main(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ne = doc["ne"]
    tasks = list(dict.fromkeys(k.split("/")[0] for k in ne))
    ml = doc["movielens"]
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(5.5 * len(tasks) + 4.5, 4.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        keys = [k for k in ne if k.split("/")[0] == task]
        x = np.arange(len(keys))
        for i, m in enumerate(MODELS):
            ax.bar(x + (i - 1) * 0.27, [ne[k][m] if ne[k][m] is not None else np.nan for k in keys], 0.27,
                   label=m, color=MODEL_COLORS[m])
        bayes = [ne[k]["bayes"] if ne[k]["bayes"] is not None else np.nan for k in keys]
        ax.hlines(bayes, x - 0.42, x + 0.42, colors="k", linestyles="dashed", label="Bayes-optimal")
        lo = np.nanmin(bayes + [ne[k][m] or np.nan for k in keys for m in MODELS])
        ax.set_ylim(max(0.0, lo - 0.05), None)
        ax.set_xticks(x, [k.split("/", 1)[1] for k in keys], rotation=20)
        ax.set_title(f"{task}: NE by surface (lower is better)")
        ax.legend(fontsize=8)
    ax = axes[0, -1]
    if ml.get("available"):
        cols = ("auc_click", "auc_conversion")
        x = np.arange(len(cols))
        for i, m in enumerate(MODELS):
            ax.bar(x + (i - 1) * 0.27, [ml["models"][m][c] or np.nan for c in cols], 0.27, label=m,
                   color=MODEL_COLORS[m])
        ax.set_xticks(x, ["AUC click\n(rating>=4)", "AUC conversion\n(5 | >=4)"])
        ax.set_ylim(0.5, None)
        ax.set_title("MovieLens-100K (higher is better)")
        ax.legend(fontsize=8)
    else:
        # Say why (skipped, or the loader's error) rather than leave an empty chart.
        ax.text(0.5, 0.5, f"MovieLens-100K: {ml['reason']}", ha="center", wrap=True)
        ax.axis("off")
    delta = doc["compskip_ne_delta_rel"]
    fig.suptitle(f"GEM vs baselines, held-out world seed {WORLD_SEED}; CompSkip on vs off: "
                 + (f"{100 * delta:.2f}% relative NE" if delta is not None else "skipped")
                 + (f"\nGEM: {doc['gem_config']}" if doc.get("gem_config") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scaling(scaling: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = scaling["grid"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    dims = scaling["setup"]["embedding_dims"]
    for dim in dims:
        row = sorted((g for g in grid if g["embedding_dim"] == dim), key=lambda g: g["max_seq_len"])
        axes[0].plot([g["max_seq_len"] for g in row], [g["ne"] for g in row], marker="o",
                     label=f"d={dim} ({row[0]['params'] / 1e6:.2f} M params)")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("history length read (max_seq_len)")
    axes[0].set_ylabel("NE (mean of click, conversion)")
    axes[0].set_title("NE vs sequence length")
    axes[0].legend(fontsize=8)
    for L in scaling["setup"]["lengths"]:
        row = sorted((g for g in grid if g["max_seq_len"] == L), key=lambda g: g["params"])
        axes[1].plot([g["params"] for g in row], [g["ne"] for g in row], marker="o", label=f"L={L}")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("parameters")
    axes[1].set_title("NE vs model size")
    axes[1].legend(fontsize=8)
    fig.suptitle("GEM scaling (tiny preset, widths and history lengths)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_gem_config(p: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """--gem-config FIELD=JSON ... -> {field: value}, each field one of KunlunConfig's."""
    from gem.modules.config import KunlunConfig

    fields = {f.name for f in dataclasses.fields(KunlunConfig)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            p.error(f"--gem-config {item!r}: expected FIELD=JSON with FIELD a KunlunConfig field "
                    f"(e.g. affinity_branch=true), got {name!r}")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            p.error(f"--gem-config {item!r}: {value!r} is not JSON (true, false, a number or a quoted string)")
    return out


def with_gem_config(jobs: dict[str, dict[str, Any]], gem_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The jobs with a candidate design (parse_gem_config's fields) on every GEM run; build() leaves
    DLRM alone. No fields: the jobs unchanged."""
    return {name: dict(job, gem_config=gem_config) for name, job in jobs.items()} if gem_config else jobs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a development run (minutes), smaller everything")
    g.add_argument("--smoke", action="store_true", help="the test's run: tiny models, a few steps (seconds)")
    p.add_argument("--out", type=Path, default=QUALITY_OUT)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: 1 when the machine is busier than its cores, else all cores:"
                        " on a shared machine a 2-thread op waits a scheduler slice for its second thread)")
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once, in a process pool (results are identical to --jobs 1)")
    p.add_argument("--skip", nargs="*", default=[], choices=("compskip", "scaling", "movielens"),
                   help="leave a study out (recorded as skipped)")
    p.add_argument("--gem-config", nargs="+", default=[], metavar="FIELD=JSON",
                   help="a candidate design: KunlunConfig fields for GEM, padded GEM and CompSkip off "
                        "(e.g. match_flags=false affinity_branch=true); DLRM is unchanged")
    args = p.parse_args(argv)
    gem_config = parse_gem_config(p, args.gem_config)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    t0 = time.time()
    load_before = os.getloadavg()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(args.threads or (1 if load_before[0] > cores - 0.5 else cores))
    threads = torch.get_num_threads()
    _log(f"mode {name}, {args.jobs} worker(s) of {threads} thread(s), load {load_before[0]:.1f}")
    kinds = tuple(k for k in MAIN_KINDS if not (k == "gem_compskip_off" and "compskip" in args.skip))
    jobs = plan_main(mode, threads, kinds)
    if "scaling" not in args.skip:
        jobs.update(plan_scaling(mode, threads))
    if "movielens" not in args.skip:
        jobs.update(plan_movielens(mode, threads))
    jobs = with_gem_config(jobs, gem_config)  # every study's GEM runs are the candidate
    res = run_jobs(jobs, args.jobs)
    main_study = study_main(mode, jobs, res)
    scaling = {"skipped": True} if "scaling" in args.skip else study_scaling(mode, jobs, res)
    movielens = ({"available": False, "reason": "skipped"} if "movielens" in args.skip
                 else study_movielens(mode, jobs, res))
    command = "python -m benchmarks.quality" + {"smoke": " --smoke", "quick": " --quick", "full": ""}[name]
    doc: dict[str, Any] = {
        "command": command + (f" --jobs {args.jobs}" if args.jobs > 1 else "")
        + (f" --threads {args.threads}" if args.threads else "")
        + (f" --skip {' '.join(args.skip)}" if args.skip else "")
        + (f" --gem-config {' '.join(args.gem_config)}" if args.gem_config else "")
        + (f" --out {shown_path(args.out)}" if args.out != QUALITY_OUT else ""),
        "mode": name,
        "world_seed": WORLD_SEED,
        "train_seed": TRAIN_SEED,
        **({"gem_config": gem_config} if gem_config else {}),
        "ne": main_study["ne"],
        "gap_closed": main_study["gap_closed"],
        "compskip_ne_delta_rel": main_study["compskip_ne_delta_rel"],
        "main": main_study,
        "scaling": scaling,
        "movielens": movielens,
        "precision": "fp32",
        "machine": {"cpu_threads": torch.get_num_threads(), "workers": args.jobs, "torch": torch.__version__,
                    **machine.cpu(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
    }
    doc["targets"] = targets(doc)
    doc["wall_seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, allow_nan=False, default=float) + "\n")
    try:
        plot_main(doc, args.out.with_suffix(".png"))
        if not scaling.get("skipped"):
            plot_scaling(scaling, args.out.with_name(args.out.stem + "_scaling.png"))
    except ImportError:  # matplotlib is optional: the JSON alone
        pass
    print(json.dumps({"ne": doc["ne"], "gap_closed": doc["gap_closed"], "targets": doc["targets"]}, indent=1))
    return 0 if all(t["met"] for t in doc["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
