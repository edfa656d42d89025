"""Run a model over the eval split on every rank and compute metrics over all ranks' shards.

Tasks (the whole funnel): `click` on every impression, `conversion` (post-click, inside the
attribution window) on clicked impressions, and `dwell` (awareness) wherever its label is known;
a task is evaluated when the model has a head for it. Keys: `ne/<task>`, `auc/<task>`,
`calibration/<task>`, `log_loss/<task>`, `bayes_ne/<task>` (NE of the true probabilities, synthetic
data only), `loss`, `num_examples` and the headline `ne` (mean NE of click and conversion: the
number every job has reported since v1). `by_surface=True` adds the same per-surface keys with a
`@surface=<name>` suffix (`ne/dwell@surface=reels`); the eval report (gem/eval/report.py) always
holds them, and per-objective conversion metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from gem.data import Batch, Examples, eval_batches
from gem.data.synthetic import SURFACES
from gem.eval.metrics import headline_ne, log_loss, task_metrics

TASKS = ("click", "conversion")  # the headline NE's tasks
FUNNEL = ("click", "conversion", "dwell")  # every task evaluated when the model predicts it
EVAL_BATCH_SIZE = 512  # eval needs no gradients: bigger batches, fewer (collective) forwards
_COLUMNS = ("weight", "click", "conversion", "dwell", "p_click", "p_conversion", "p_dwell", "surface", "objective")

PredictFn = Callable[[Batch], dict[str, torch.Tensor]]  # batch -> logits per task, each [B]


@torch.no_grad()
def collect_predictions(predict: PredictFn, examples: Examples, *, max_seq_len: int, rank: int, world_size: int,
                        device: torch.device) -> dict[str, np.ndarray]:
    """This rank's predictions (`pred_<task>` for each task the model predicts), labels, true
    probabilities, surface and objective (padding rows dropped)."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in _COLUMNS}
    for batch in eval_batches(examples, batch_size=EVAL_BATCH_SIZE, max_seq_len=max_seq_len, rank=rank,
                              world_size=world_size):
        logits = predict(batch.to(device))
        for task in FUNNEL:
            if task in logits:
                cols.setdefault(f"pred_{task}", []).append(torch.sigmoid(logits[task].float()).cpu().numpy())
        for name in _COLUMNS:
            cols[name].append(getattr(batch, name).numpy())
    out = {k: np.concatenate(v) for k, v in cols.items()}
    keep = out.pop("weight") > 0
    return {k: v[keep] for k, v in out.items()}


def _task_rows(cols: dict[str, np.ndarray], task: str) -> np.ndarray:
    """Rows where the task's label exists: conversion only after a click, none where the label is NaN."""
    rows = np.isfinite(cols[task])
    if task == "conversion":
        rows &= cols["click"] > 0
    return rows


def _metrics_of(cols: dict[str, np.ndarray], rows: np.ndarray | None, prefix: str, suffix: str,
                with_bayes: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for task in FUNNEL:
        if f"pred_{task}" not in cols:
            continue
        m = _task_rows(cols, task) if rows is None else _task_rows(cols, task) & rows
        p_true = cols[f"p_{task}"][m] if with_bayes and f"p_{task}" in cols else None
        for key, value in task_metrics(task, cols[task][m], cols[f"pred_{task}"][m], p_true, prefix=prefix).items():
            out[key + suffix] = value
    return out


def metrics_from_predictions(parts: list[dict[str, np.ndarray]], *, prefix: str = "",
                             by_surface: bool = False) -> dict[str, float]:
    """Metrics over the union of every rank's predictions (see the module docstring for the keys).

    bayes_ne is reported without a prefix only (a prefixed run, e.g. a teacher, shares the data).
    """
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    with_bayes = not prefix
    metrics = _metrics_of(cols, None, prefix, "", with_bayes)
    # The training objective on the eval split: the sum of the tasks' BCEs.
    loss = 0.0
    for task in FUNNEL:
        m = _task_rows(cols, task) if task in cols and f"pred_{task}" in cols else None
        if m is not None and m.any():
            loss += log_loss(cols[task][m], cols[f"pred_{task}"][m])
    metrics[f"{prefix}loss"] = loss
    metrics[f"{prefix}ne"] = headline_ne(metrics, TASKS, prefix)
    metrics[f"{prefix}num_examples"] = float(len(cols["click"]))
    if by_surface and "surface" in cols:
        for s in np.unique(cols["surface"]):
            metrics.update(_metrics_of(cols, cols["surface"] == s, prefix, f"@surface={surface_name(int(s))}",
                                       with_bayes))
    return metrics


def surface_name(s: int) -> str:
    return SURFACES[s] if 0 <= s < len(SURFACES) else str(s)


def finite_or_none(metrics: dict[str, float]) -> dict[str, float | None]:
    """JSON has no NaN: undefined metrics (e.g. AUC with a single class) become null."""
    return {k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}
