"""The evaluation report: eval_report.json + eval_report.png (rank 0, logged to MLflow under eval/).

Input: the all-gathered predictions of gem.eval.evaluate.collect_predictions (one dict per
rank, in rank order -- which is the eval split's order, padding removed) and the eval split
itself (for per-example attributes such as `surface`).

JSON (`eval_report.json`):

    {"step": 600, "numExamples": 4000,
     "metrics": {...the eval metrics...},
     "tasks": {"click": {"ne": .., "bayesNe": .., "auc": .., "calibration": .., "baseRate": .., "n": ..,
                          "bySurface": {"0": {"name": "feed", "ne": .., "bayesNe": .., "auc": ..,
                                              "calibration": .., "baseRate": .., "n": ..}, ...},
                          "byObjective": {"purchase": {...same keys...}, "install": {...}},
                          "calibrationCurve": [{"meanPred": .., "meanLabel": .., "n": ..}, ...]},
               "conversion": {... over clicked impressions only ...},
               "dwell": {... awareness, where its label is known (when the model predicts it) ...}}}

`bayesNe` (NE of the true probabilities) is present only where they are known (synthetic data;
null for real logs). `bySurface` keys are surface ids (gem.data.synthetic.SURFACES names them);
`byObjective` splits by the campaign's objective (what a conversion means): `purchase`, `install`,
`unknown` for a source that records none, and `objective-<id>` for each other id. PNG: per task a
reliability diagram (mean label vs mean prediction in equal-count bins) and NE by surface with
Bayes NE beside it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from gem.data.synthetic import OBJECTIVES
from gem.eval.evaluate import FUNNEL, _task_rows, surface_name
from gem.eval.metrics import auc, calibration, normalized_entropy

TASKS = FUNNEL  # those the predictions hold are reported
NUM_BINS = 10
MISSING_OBJECTIVE = -1  # a source without objectives (gem.data.parquet.MISSING_INT["objective"])


def _f(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def calibration_curve(y: np.ndarray, p: np.ndarray, bins: int = NUM_BINS) -> list[dict[str, float | None]]:
    """Equal-count bins of predictions: mean prediction, mean label, count (null where a bin holds a NaN)."""
    if y.size == 0:
        return []
    order = np.argsort(p, kind="mergesort")
    out = []
    for chunk in np.array_split(order, min(bins, y.size)):
        out.append({"meanPred": _f(float(p[chunk].mean())), "meanLabel": _f(float(y[chunk].mean())),
                    "n": int(chunk.size)})
    return out


def _group(y: np.ndarray, p: np.ndarray, p_true: np.ndarray | None) -> dict[str, Any]:
    known = p_true is not None and p_true.size > 0 and bool(np.isfinite(p_true).all())
    return {
        "n": int(y.size),
        "baseRate": _f(float(y.mean())) if y.size else None,
        "ne": _f(normalized_entropy(y, p)),
        "bayesNe": _f(normalized_entropy(y, p_true)) if known else None,
        "auc": _f(auc(y, p)),
        "calibration": _f(calibration(y, p)),
    }


def _task_block(y: np.ndarray, p: np.ndarray, p_true: np.ndarray | None, surface: np.ndarray,
                objective: np.ndarray | None) -> dict[str, Any]:
    block: dict[str, Any] = _group(y, p, p_true)
    block["bySurface"] = {}
    for s in np.unique(surface):
        m = surface == s
        block["bySurface"][str(int(s))] = {"name": surface_name(int(s)),
                                           **_group(y[m], p[m], None if p_true is None else p_true[m])}
    if objective is not None:
        block["byObjective"] = {}
        for o in np.unique(objective):
            m = objective == o
            block["byObjective"][objective_name(int(o))] = _group(y[m], p[m], None if p_true is None else p_true[m])
    block["calibrationCurve"] = calibration_curve(y, p)
    return block


def objective_name(o: int) -> str:
    """byObjective's key: the known objectives by name, `unknown` where a source records none (Parquet's
    missing value, -1), any other id (a source with more objectives) by its own `objective-<id>`."""
    if 0 <= o < len(OBJECTIVES):
        return OBJECTIVES[o]
    return "unknown" if o == MISSING_OBJECTIVE else f"objective-{o}"


def _column(cols: dict[str, np.ndarray], eval_examples: Any, name: str, n: int) -> np.ndarray | None:
    """A per-example attribute: from the predictions, else from the eval split when it lines up."""
    if name in cols:
        return cols[name]
    if eval_examples is not None and len(eval_examples) == n and hasattr(eval_examples, name):
        return np.asarray(getattr(eval_examples, name))
    return None


def build_eval_report(parts: list[dict[str, np.ndarray]], eval_examples: Any, *, metrics: dict[str, float] | None = None,
                      step: int | None = None) -> dict[str, Any]:
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    n = len(cols["click"])
    surface = _column(cols, eval_examples, "surface", n)
    surface = np.zeros(n, np.int64) if surface is None else surface
    objective = _column(cols, eval_examples, "objective", n)
    tasks = {}
    for task in FUNNEL:
        if f"pred_{task}" not in cols or task not in cols:
            continue
        m = _task_rows(cols, task)
        p_true = cols[f"p_{task}"][m] if f"p_{task}" in cols else None
        tasks[task] = _task_block(cols[task][m], cols[f"pred_{task}"][m], p_true, surface[m],
                                  None if objective is None else objective[m])
    return {"step": step, "numExamples": n,
            "metrics": {k: _f(v) for k, v in (metrics or {}).items()}, "tasks": tasks}


def _legend(ax: Any, loc: str) -> None:
    """A legend where something was drawn (an empty task has no curve: no matplotlib warning)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc=loc)


def plot_eval_report(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if t in report["tasks"]]
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 8.5), squeeze=False)
    for i, task in enumerate(tasks):
        block = report["tasks"][task]
        ax = axes[0, i]
        curve = block["calibrationCurve"]
        curve = [c for c in curve if c["meanPred"] is not None and c["meanLabel"] is not None]
        if curve:
            xs, ys = [c["meanPred"] for c in curve], [c["meanLabel"] for c in curve]
            hi = max(max(xs), max(ys), 1e-3) * 1.05
            ax.plot([0, hi], [0, hi], color="grey", lw=1, ls="--", label="perfect")
            ax.plot(xs, ys, marker="o", label="model")
        cal = block["calibration"]
        ax.set_title(f"{task}: calibration (sum p / positives = {'undefined' if cal is None else f'{cal:.3f}'})")
        ax.set_xlabel("mean prediction (equal-count bins)")
        ax.set_ylabel("observed rate")
        _legend(ax, "upper left")
        ax = axes[1, i]
        groups = ["all"] + [v.get("name", f"surface {s}") for s, v in block["bySurface"].items()]
        ne = [block["ne"]] + [v["ne"] for v in block["bySurface"].values()]
        bayes = [block["bayesNe"]] + [v["bayesNe"] for v in block["bySurface"].values()]
        x = np.arange(len(groups))
        nan = float("nan")
        ax.bar(x - 0.2, [v if v is not None else nan for v in ne], 0.4, label="NE (model)")
        if any(v is not None for v in bayes):
            ax.bar(x + 0.2, [v if v is not None else nan for v in bayes], 0.4, label="Bayes NE (true p)")
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_xticks(x, groups)
        ax.set_ylabel("normalized entropy (lower is better)")
        ax.set_title(f"{task}: NE by surface")
        _legend(ax, "lower right")
    fig.suptitle(f"eval report, step {report.get('step')}, {report['numExamples']} examples")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_eval_report(parts: list[dict[str, np.ndarray]], eval_examples: Any, directory: str | Path, *,
                      metrics: dict[str, float] | None = None, step: int | None = None) -> list[Path]:
    """Write eval_report.json and eval_report.png (needs matplotlib) into directory; returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    report = build_eval_report(parts, eval_examples, metrics=metrics, step=step)
    js = directory / "eval_report.json"
    js.write_text(json.dumps(report, indent=1, allow_nan=False))  # strict JSON: undefined values are null
    try:
        png = plot_eval_report(report, directory / "eval_report.png")
    except ImportError:  # matplotlib is optional: the JSON alone
        return [js]
    return [js, png]
