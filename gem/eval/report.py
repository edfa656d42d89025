"""The evaluation report: eval_report.json + eval_report.png (rank 0, logged to MLflow under eval/).

Input: the all-gathered predictions of gem.eval.evaluate.collect_predictions (one dict per
rank, in rank order -- which is the eval split's order, padding removed) and the eval split
itself (for per-example attributes such as `surface`).

JSON (`eval_report.json`):

    {"step": 600, "numExamples": 4000,
     "metrics": {...the eval metrics...},
     "tasks": {"click": {"ne": .., "bayesNe": .., "auc": .., "calibration": .., "baseRate": .., "n": ..,
                          "bySurface": {"0": {"ne": .., "bayesNe": .., "auc": .., "n": ..}, ...},
                          "calibrationCurve": [{"meanPred": .., "meanLabel": .., "n": ..}, ...]},
               "conversion": {... over clicked impressions only ...}}}

`bayesNe` (NE of the true probabilities) is present only where they are known (synthetic data;
null for real logs). PNG: per task a reliability diagram (mean label vs mean prediction in
equal-count bins) and NE by surface with Bayes NE beside it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from gem.eval.metrics import auc, calibration, normalized_entropy

TASKS = ("click", "conversion")
NUM_BINS = 10


def _f(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def calibration_curve(y: np.ndarray, p: np.ndarray, bins: int = NUM_BINS) -> list[dict[str, float]]:
    """Equal-count bins of predictions: mean prediction, mean label, count."""
    if y.size == 0:
        return []
    order = np.argsort(p, kind="mergesort")
    out = []
    for chunk in np.array_split(order, min(bins, y.size)):
        out.append({"meanPred": float(p[chunk].mean()), "meanLabel": float(y[chunk].mean()), "n": int(chunk.size)})
    return out


def _task_block(y: np.ndarray, p: np.ndarray, p_true: np.ndarray, surface: np.ndarray) -> dict[str, Any]:
    known = p_true.size > 0 and bool(np.isfinite(p_true).all())
    block: dict[str, Any] = {
        "n": int(y.size),
        "baseRate": _f(float(y.mean())) if y.size else None,
        "ne": _f(normalized_entropy(y, p)),
        "bayesNe": _f(normalized_entropy(y, p_true)) if known else None,
        "auc": _f(auc(y, p)),
        "calibration": _f(calibration(y, p)),
        "bySurface": {},
        "calibrationCurve": calibration_curve(y, p),
    }
    for s in np.unique(surface):
        m = surface == s
        block["bySurface"][str(int(s))] = {
            "n": int(m.sum()),
            "ne": _f(normalized_entropy(y[m], p[m])),
            "bayesNe": _f(normalized_entropy(y[m], p_true[m])) if known else None,
            "auc": _f(auc(y[m], p[m])),
        }
    return block


def build_eval_report(parts: list[dict[str, np.ndarray]], eval_examples: Any, *, metrics: dict[str, float] | None = None,
                      step: int | None = None) -> dict[str, Any]:
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    n = len(cols["click"])
    surface = np.asarray(eval_examples.surface)[:n] if len(eval_examples) == n else np.zeros(n, np.int64)
    clicked = cols["click"] > 0
    tasks = {
        "click": _task_block(cols["click"], cols["pred_click"], cols["p_click"], surface),
        "conversion": _task_block(cols["conversion"][clicked], cols["pred_conversion"][clicked],
                                  cols["p_conversion"][clicked], surface[clicked]),
    }
    return {"step": step, "numExamples": n,
            "metrics": {k: _f(v) for k, v in (metrics or {}).items()}, "tasks": tasks}


def plot_eval_report(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(TASKS), figsize=(5 * len(TASKS), 8.5))
    for i, task in enumerate(TASKS):
        block = report["tasks"][task]
        ax = axes[0, i]
        curve = block["calibrationCurve"]
        if curve:
            xs, ys = [c["meanPred"] for c in curve], [c["meanLabel"] for c in curve]
            hi = max(max(xs), max(ys), 1e-3) * 1.05
            ax.plot([0, hi], [0, hi], color="grey", lw=1, ls="--", label="perfect")
            ax.plot(xs, ys, marker="o", label="model")
        ax.set_title(f"{task}: calibration (sum p / positives = {block['calibration'] or float('nan'):.3f})")
        ax.set_xlabel("mean prediction (equal-count bins)")
        ax.set_ylabel("observed rate")
        ax.legend(loc="upper left")
        ax = axes[1, i]
        groups = ["all"] + [f"surface {s}" for s in block["bySurface"]]
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
        ax.legend(loc="lower right")
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
    js.write_text(json.dumps(report, indent=1))
    try:
        png = plot_eval_report(report, directory / "eval_report.png")
    except ImportError:  # matplotlib is optional: the JSON alone
        return [js]
    return [js, png]
