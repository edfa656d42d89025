"""Why GEM has wide heads: the probes behind them, side by side in one run.

    python -m benchmarks.wide_heads [--smoke] [--jobs N] [--out benchmarks/results/wide_heads.json]

Same held-out world, data order and optimizer as benchmarks.quality's main study (fp32, AdamW,
warmup + cosine, data seen once); results and how to read them: docs/quality.md.

1. **Learning curves**: GEM `small` with wide heads (the default), the same GEM without them
   (`KunlunConfig.wide_heads=False`: every logit through the deep heads over the flattened trunk)
   and DLRM, NE per task on held-out and on already-trained examples every `every` steps. Without
   wide heads conversion stays at NE ~1 on both: not overfitting, the signal never gets in.
2. **Noise probe**: an embeddings-only model (FeatureEmbeddings -> LN -> MultiTaskHeads over the
   non-sequence tokens X⁰: the wide heads alone) trained with k tokens of fresh N(0, 1) noise
   flattened in beside X⁰. k = 44 is the number of tokens GEM `small`'s deep head reads beside
   X's 5 (X_sum 16 + sequence summaries 28): if noise of that width stops a per-id signal from
   being learned, the trunk's tokens (noise as far as conversion is concerned) can too.

Writes the JSON and `wide_heads.png` (the curves and the probe) beside it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import quality as Q  # noqa: E402
from gem.data import Examples  # noqa: E402
from gem.data.parquet import slice_examples  # noqa: E402
from gem.eval.evaluate import FUNNEL, collect_predictions, metrics_from_predictions  # noqa: E402
from gem.model import config_from_spec, kunlun_config  # noqa: E402
from gem.modules import from_v1_batch  # noqa: E402
from gem.modules.embeddings import FeatureEmbeddings  # noqa: E402
from gem.modules.heads import MultiTaskHeads  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(preset="tiny", world=Q.MODES["smoke"]["world"], steps=6, every=3, batch=32, max_seq_len=64,
                  lr=2e-3, warmup=2, eval_examples=300, noise_tokens=(0, 4), noise_steps=6),
    "full": dict(preset="small", world=Q.MODES["full"]["world"], steps=600, every=100, batch=128, max_seq_len=128,
                 lr=2e-3, warmup=50, eval_examples=4000, noise_tokens=(0, 11, 44), noise_steps=300),
}
CURVE_MODELS = ("gem", "gem_wide_off", "dlrm")


class EmbeddingsOnly(nn.Module):
    """The wide heads alone, with `noise_tokens` tokens of fresh N(0, 1) noise beside X⁰."""

    def __init__(self, cfg, noise_tokens: int):
        super().__init__()
        self.noise_tokens = noise_tokens
        self.embeddings = FeatureEmbeddings(cfg)
        self.norm = nn.LayerNorm(cfg.dim)
        self.heads = MultiTaskHeads((cfg.num_non_seq_tokens + noise_tokens) * cfg.dim, cfg)

    def forward(self, batch) -> dict[str, torch.Tensor]:
        inputs = from_v1_batch(batch)
        x0 = self.embeddings.non_sequence(inputs)  # [B, N_ns, d]
        noise = torch.randn(x0.shape[0], self.noise_tokens, x0.shape[2], dtype=x0.dtype)
        return self.heads(self.norm(torch.cat([x0, noise], dim=1)).flatten(1), inputs.surface)


def build(kind: str, mode: dict[str, Any], seed: int = Q.TRAIN_SEED) -> nn.Module:
    """noise<k> (EmbeddingsOnly with k noise tokens), else benchmarks.quality's model kinds."""
    spec = Q.model_spec(mode["preset"], mode["max_seq_len"])
    if not kind.startswith("noise"):
        return Q.build(kind, spec, seed=seed)
    torch.manual_seed(seed)
    return EmbeddingsOnly(kunlun_config(config_from_spec(spec)), int(kind[len("noise"):]))


def _ne(model: nn.Module, examples: Examples, max_seq_len: int) -> dict[str, float]:
    model.eval()
    preds = collect_predictions(model, examples, max_seq_len=max_seq_len, rank=0, world_size=1,
                                device=torch.device("cpu"))
    model.train()
    m = metrics_from_predictions([preds])
    return {t: float(m[f"ne/{t}"]) for t in FUNNEL if f"ne/{t}" in m}


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train one model for `steps`, NE on the eval split and on trained examples every `every` steps."""
    torch.set_num_threads(job["threads"])
    mode = MODES[job["mode"]]
    train, eval_ = data(job["mode"])
    seen = slice_examples(train, np.arange(min(len(train), mode["eval_examples"])))  # trained on by the end
    model = build(job["kind"], mode)
    steps = job["steps"]
    curve, t0 = [], time.perf_counter()
    for step, _ in Q.train_steps(model, train, steps=steps, batch=mode["batch"], lr=mode["lr"], warmup=mode["warmup"],
                                 max_seq_len=mode["max_seq_len"]):
        if step % job["every"] == 0 or step == steps:
            curve.append({"step": step, "eval": _ne(model, eval_, mode["max_seq_len"]),
                          "train": _ne(model, seen, mode["max_seq_len"])})
    return {"curve": curve, "seconds": round(time.perf_counter() - t0, 1),
            "params": sum(p.numel() for p in model.parameters())}


_DATA: dict[str, tuple[Examples, Examples]] = {}


def data(mode_name: str) -> tuple[Examples, Examples]:
    """(train, eval) of benchmarks.quality's held-out world at this mode's size."""
    if mode_name not in _DATA:
        mode = MODES[mode_name]
        spec = Q.synthetic_spec(mode, mean_history_len=mode["world"]["mean_history_len"],
                                train_examples=mode["steps"] * mode["batch"], eval_examples=mode["eval_examples"])
        _DATA[mode_name] = Q.load_data({"source": "synthetic", "spec": spec.model_dump(mode="json")})
    return _DATA[mode_name]


def plan(mode_name: str, threads: int) -> dict[str, dict[str, Any]]:
    mode = MODES[mode_name]
    jobs = {f"curve/{k}": dict(mode=mode_name, kind=k, steps=mode["steps"], every=mode["every"], threads=threads)
            for k in CURVE_MODELS}
    jobs.update({f"noise/{n}": dict(mode=mode_name, kind=f"noise{n}", steps=mode["noise_steps"],
                                    every=mode["noise_steps"], threads=threads) for n in mode["noise_tokens"]})
    return jobs


def run_all(jobs: dict[str, dict[str, Any]], workers: int) -> dict[str, dict[str, Any]]:
    if workers <= 1:
        return {name: run_job(job) for name, job in jobs.items()}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    order = sorted(jobs, key=lambda n: n.startswith("noise"))  # the long curves first
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futures = {name: pool.submit(run_job, jobs[name]) for name in order}
        return {name: futures[name].result() for name in jobs}


def summarise(mode_name: str, res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    mode = MODES[mode_name]
    curves = {k.split("/", 1)[1]: r for k, r in res.items() if k.startswith("curve/")}
    final = {k: r["curve"][-1]["eval"] for k, r in curves.items()}
    noise = {int(k.split("/", 1)[1]): r["curve"][-1] for k, r in res.items() if k.startswith("noise/")}
    return {
        "setup": {k: mode[k] for k in ("preset", "steps", "batch", "max_seq_len", "lr", "warmup", "eval_examples",
                                       "noise_steps")},
        "curves": curves,
        "final_eval_ne": final,
        "wide_heads_gain_rel": {t: (final["gem_wide_off"][t] - final["gem"][t]) / final["gem_wide_off"][t]
                                for t in final["gem"]},
        "noise_probe": {str(n): {"eval": v["eval"], "train": v["train"]} for n, v in sorted(noise.items())},
    }


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = doc["curves"]
    tasks = list(doc["final_eval_ne"]["gem"])
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.6 * (len(tasks) + 1), 4), squeeze=False)
    colors = {"gem": "tab:blue", "gem_wide_off": "tab:purple", "dlrm": "tab:orange"}
    for ax, task in zip(axes[0], tasks):
        for kind, run in curves.items():
            steps = [p["step"] for p in run["curve"]]
            ax.plot(steps, [p["eval"][task] for p in run["curve"]], marker="o", color=colors[kind], label=kind)
            ax.plot(steps, [p["train"][task] for p in run["curve"]], ls=":", color=colors[kind])
        ax.set_title(f"{task} NE (solid: held out, dotted: trained on)")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    ax = axes[0, -1]
    probe = doc["noise_probe"]
    ax.bar(list(probe), [v["eval"]["conversion"] for v in probe.values()], color="tab:gray")
    ax.set_ylim(min(v["eval"]["conversion"] for v in probe.values()) - 0.03, None)
    ax.set_xlabel("noise tokens beside X⁰")
    ax.set_title("embeddings-only heads: conversion NE")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = Q.study_cli(__doc__.split("\n\n")[0], Q.RESULTS / "wide_heads.json", argv)
    name = "smoke" if args.smoke else "full"
    t0 = time.time()
    res = run_all(plan(name, args.threads), args.jobs)
    doc = {"command": Q.study_command("benchmarks.wide_heads", args),
           "mode": name, "world_seed": Q.WORLD_SEED, **summarise(name, res),
           "wall_seconds": round(time.time() - t0, 1)}
    Q.write_study(doc, args.out, plot)
    print(json.dumps({"final_eval_ne": doc["final_eval_ne"], "noise_probe": doc["noise_probe"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
