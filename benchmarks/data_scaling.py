"""NE against training impressions: how far more data takes GEM and DLRM on the held-out world.

    python -m benchmarks.data_scaling --jobs 2 --threads 1   # the reported run (70 min on a shared 2-core machine)
    python -m benchmarks.data_scaling --smoke                # the test's run (seconds)
    -> benchmarks/results/data_scaling.json, data_scaling.png

The quality benchmark (benchmarks/quality.py) trains every model on one budget, 128k impressions.
Its half-gap bar asks how close to Bayes a model gets; this study asks what the training data
itself allows: GEM `small` and DLRM are trained, as there (the same world, loop, optimizer and
evaluation: quality.run_job), on a ladder of budgets, each its own run with its own warmup +
cosine schedule over steps x batch impressions seen once. Per task it reports NE at every budget,
the Bayes NE of the eval split, the NE gained per doubling of the data over the last three rungs
(a least-squares line in log2(impressions)), and the half-gap target: half of DLRM's gap to Bayes
at 128k impressions (`target_budget`), the quality bar restated against this study's baseline.

`doublings_to_target` extends each model's last-three-rung line to that target. It is an
extrapolation, and an optimistic one: NE against log(data) flattens as it approaches its floor,
so the real budget is at least that large when the curve keeps bending the way it does here.

One seed per rung (seed 0, quality's main run): the rungs are independent runs, so the noise of
one run (docs/quality.md: ~0.2% on click) shows as wiggles between neighbours.
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

from benchmarks import quality  # noqa: E402

TASKS = ("click", "conversion", "dwell")

MODES: dict[str, dict[str, Any]] = {
    "smoke": dict(quality="smoke", preset="tiny", batch=32, eval_examples=600, max_seq_len=64,
                  steps={"gem": (4, 8, 16), "dlrm": (4, 8, 16, 32)}, target_steps=8),
    "full": dict(quality="full", preset="small", batch=128, eval_examples=20000, max_seq_len=128,
                 steps={"gem": (250, 500, 1000, 2000), "dlrm": (250, 500, 1000, 2000, 4000, 8000)},
                 target_steps=1000),
}


def plan(mode: dict[str, Any], threads: int) -> dict[str, dict[str, Any]]:
    q = quality.MODES[mode["quality"]]
    jobs = {}
    for kind, ladder in mode["steps"].items():
        for steps in ladder:
            spec = quality.synthetic_spec(q, mean_history_len=q["world"]["mean_history_len"],
                                          train_examples=steps * mode["batch"], eval_examples=mode["eval_examples"])
            jobs[f"{kind}/{steps}"] = dict(
                data={"source": "synthetic", "spec": spec.model_dump(mode="json")}, kind=kind,
                preset=mode["preset"], max_seq_len=mode["max_seq_len"], steps=steps, batch=mode["batch"],
                lr=q["lr"], warmup=min(q["warmup"], max(1, steps // 5)), threads=threads, seed=quality.TRAIN_SEED)
    return jobs


def slope_per_doubling(impressions: list[int], ne: list[float]) -> float:
    """NE change per doubling of the training impressions: least squares over the points given."""
    return float(np.polyfit(np.log2(np.asarray(impressions, float)), np.asarray(ne, float), 1)[0])


def study(mode: dict[str, Any], jobs: dict[str, dict[str, Any]], res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    batch = mode["batch"]
    curves: dict[str, dict[str, Any]] = {}
    bayes: dict[str, float] = {}
    for kind, ladder in mode["steps"].items():
        rows = []
        for steps in ladder:
            run = res[f"{kind}/{steps}"]
            table = quality.task_surface_ne(run["report"])
            per = {task: table[f"{task}/all"] for task in TASKS if f"{task}/all" in table}
            rows.append({"steps": steps, "impressions": steps * batch, "ne": quality._f(run["metrics"]["ne"]),
                         **{task: row["ne"] for task, row in per.items()}, "train_seconds": run["train_seconds"]})
            bayes.update({task: row["bayes"] for task, row in per.items()})  # one eval split: the same every rung
        curves[kind] = {"points": rows}
    target_budget = mode["target_steps"] * batch
    base = next(r for r in curves["dlrm"]["points"] if r["impressions"] == target_budget)
    targets = {task: base[task] - 0.5 * (base[task] - bayes[task]) for task in bayes}
    for kind, c in curves.items():
        tail = c["points"][-3:]
        c["slope_per_doubling"], c["doublings_to_target"] = {}, {}
        for task in bayes:
            s = slope_per_doubling([r["impressions"] for r in tail], [r[task] for r in tail])
            c["slope_per_doubling"][task] = s
            gap = targets[task] - tail[-1][task]  # negative while the target is still ahead
            c["doublings_to_target"][task] = 0.0 if gap >= 0 else (gap / s if s < 0 else None)
    return {"curves": curves, "bayes": bayes, "half_gap_target": targets, "target_budget": target_budget,
            "world": next(iter(jobs.values()))["data"]["spec"]}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(doc["bayes"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for kind, c in doc["curves"].items():
            pts = c["points"]
            ax.plot([p["impressions"] for p in pts], [p[task] for p in pts], marker="o",
                    color=quality.MODEL_COLORS[kind], label=kind)
        ax.axhline(doc["bayes"][task], color="k", linestyle="dashed", label="Bayes-optimal")
        ax.axhline(doc["half_gap_target"][task], color="tab:red", linestyle="dotted",
                   label="half of DLRM's gap at the quality budget")
        ax.axvline(doc["target_budget"], color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training impressions (each seen once)")
        ax.set_title(f"{task} NE (lower is better)")
        ax.legend(fontsize=8)
    fig.suptitle(f"NE against training data, held-out world seed {quality.WORLD_SEED}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = quality.study_cli(__doc__.split("\n\n")[0], quality.RESULTS / "data_scaling.json", argv)
    import torch

    name = "smoke" if args.smoke else "full"
    mode = MODES[name]
    t0, load_before = time.time(), os.getloadavg()
    torch.set_num_threads(args.threads)
    jobs = plan(mode, args.threads)
    res = quality.run_jobs(jobs, args.jobs)
    doc = {"command": quality.study_command("benchmarks.data_scaling", args),
           "mode": name, "world_seed": quality.WORLD_SEED, "train_seed": quality.TRAIN_SEED,
           "preset": mode["preset"], "batch": mode["batch"], "max_seq_len": mode["max_seq_len"],
           **study(mode, jobs, res), "precision": "fp32",
           "machine": quality.study_machine(args, load_before),
           "wall_seconds": round(time.time() - t0, 1)}
    quality.write_study(doc, args.out, plot)
    print(json.dumps({k: doc[k] for k in ("bayes", "half_gap_target")}, indent=1))
    for kind, c in doc["curves"].items():
        print(kind, json.dumps({"points": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                                           for r in c["points"]], "doublings_to_target": c["doublings_to_target"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
