"""GEM's scaling study at several data budgets: NE against history length and width, per budget.

    python -m benchmarks.scaling [--smoke] [--jobs N] [--budgets STEPS ...] [--gem-config FIELD=JSON ...]
                                 [--out benchmarks/results/scaling.json]

benchmarks.quality's scaling study (its `plan_scaling` grid and `study_scaling` summary: GEM
`tiny` at several widths x max_seq_len values, on the held-out world with long histories, same
optimizer and data order) trained for each budget in `budgets` (steps of batch 32; the eval
examples are the same for every budget). quality.json records one budget; this one shows whether
the answer to "do longer histories help larger models more" changes as the models see more data.
`--gem-config` trains a candidate design (KunlunConfig fields, as in benchmarks.quality), e.g. the
design before the affinity branch: `match_flags=true affinity_branch=false`.
Results and how to read them: docs/quality.md ("Scaling").

Writes the JSON (`budgets`: each budget's `study_scaling` summary) and `scaling.png` beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import quality as Q  # noqa: E402

#: Steps per run for each budget; the grid, world and batch are benchmarks.quality's of that mode.
BUDGETS = {"smoke": (4, 8), "full": (800, 3200)}


def budget_mode(mode_name: str, steps: int) -> dict[str, Any]:
    """benchmarks.quality's mode with its scaling grid trained for `steps` steps."""
    mode = copy.deepcopy(Q.MODES[mode_name])
    mode["scaling"]["steps"] = steps
    return mode


def plan(mode_name: str, budgets: tuple[int, ...], threads: int,
         gem_config: dict[str, Any] | None = None) -> dict[int, dict[str, dict[str, Any]]]:
    """{steps: benchmarks.quality.plan_scaling's jobs with that many steps (and `gem_config`)}."""
    return {steps: Q.with_gem_config(Q.plan_scaling(budget_mode(mode_name, steps), threads), gem_config or {})
            for steps in budgets}


def run(mode_name: str, budgets: tuple[int, ...], threads: int, workers: int,
        gem_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every budget's grid in one process pool (the longest runs first); {str(steps): summary}."""
    plans = plan(mode_name, budgets, threads, gem_config)
    flat = {f"b{steps}/{name}": job for steps, jobs in plans.items() for name, job in jobs.items()}
    res = Q.run_jobs(flat, workers)
    out = {}
    for steps, jobs in plans.items():
        out[str(steps)] = Q.study_scaling(budget_mode(mode_name, steps), jobs,
                                          {name: res[f"b{steps}/{name}"] for name in jobs})
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = doc["budgets"]
    fig, axes = plt.subplots(1, len(budgets) + 1, figsize=(4.8 * (len(budgets) + 1), 4.2), squeeze=False)
    for ax, (steps, study) in zip(axes[0], budgets.items()):
        for dim in study["setup"]["embedding_dims"]:
            row = sorted((g for g in study["grid"] if g["embedding_dim"] == dim), key=lambda g: g["max_seq_len"])
            ax.plot([g["max_seq_len"] for g in row], [g["ne"] for g in row], marker="o",
                    label=f"d={dim} ({row[0]['params'] / 1e6:.2f} M)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("history length read (max_seq_len)")
        ax.set_ylabel("NE (mean of click, conversion)")
        ax.set_title(f"{int(steps) * study['setup']['batch']:,} training impressions")
        ax.legend(fontsize=8)
    ax = axes[0, -1]
    for steps, study in budgets.items():
        gains = study["ne_gain_longest_vs_shortest_rel"]
        ax.plot([int(d) for d in gains], [100 * g for g in gains.values()], marker="o",
                label=f"{int(steps) * study['setup']['batch']:,} impressions")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("width d")
    ax.set_ylabel("NE gain, longest vs shortest history (%)")
    ax.set_title("does a longer history help wider models more?")
    ax.legend(fontsize=8)
    fig.suptitle("GEM scaling by data budget (tiny preset)" + (f"; GEM: {doc['gem_config']}" if doc.get("gem_config") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--budgets", type=int, nargs="+", default=None, metavar="STEPS",
                       help=f"steps per run, one grid each (default: {BUDGETS['full']}; --smoke: {BUDGETS['smoke']})")
        p.add_argument("--gem-config", nargs="+", default=[], metavar="FIELD=JSON",
                       help="a candidate design: KunlunConfig fields (e.g. match_flags=true affinity_branch=false)")

    args = Q.study_cli(__doc__.split("\n\n")[0], Q.RESULTS / "scaling.json", argv, extra)
    name = "smoke" if args.smoke else "full"
    budgets = tuple(args.budgets or BUDGETS[name])
    if any(b < 1 for b in budgets) or len(set(budgets)) != len(budgets):
        raise SystemExit(f"--budgets must be distinct step counts >= 1, got {' '.join(map(str, budgets))}")
    gem_config = Q.parse_gem_config(argparse.ArgumentParser(prog="python -m benchmarks.scaling"), args.gem_config)
    t0, load_before = time.time(), os.getloadavg()
    doc = {"command": Q.study_command("benchmarks.scaling", args)
           + (f" --budgets {' '.join(map(str, budgets))}" if args.budgets else "")
           + (f" --gem-config {' '.join(args.gem_config)}" if args.gem_config else ""),
           "mode": name, "world_seed": Q.WORLD_SEED, **({"gem_config": gem_config} if gem_config else {}),
           "budgets": run(name, budgets, args.threads, args.jobs, gem_config)}
    doc["gain_by_budget"] = {steps: s["ne_gain_longest_vs_shortest_rel"] for steps, s in doc["budgets"].items()}
    doc["machine"] = Q.study_machine(args, load_before)
    doc["wall_seconds"] = round(time.time() - t0, 1)
    Q.write_study(doc, args.out, plot)
    print(json.dumps(doc["gain_by_budget"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
