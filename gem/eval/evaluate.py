"""Run a model over the eval split on every rank and compute metrics over all ranks' shards.

Tasks (the whole funnel): `click` on every impression, `conversion` (post-click, inside the
attribution window) on clicked impressions, and `dwell` (awareness) wherever its label is known;
a task is evaluated when the model has a head for it. Keys: `ne/<task>`, `auc/<task>`,
`calibration/<task>`, `log_loss/<task>`, `bayes_ne/<task>` (NE of the true probabilities, synthetic
data only), `loss`, `num_examples` and the headline `ne` (mean NE of click and conversion: the
number every job has reported since v1). `by_surface=True` adds the same per-surface keys with a
`@surface=<name>` suffix (`ne/dwell@surface=reels`); the eval report (gem/eval/report.py) always
holds them, and per-objective conversion metrics.

What the trainer's evaluation reports, and `gem eval` reproduces from a checkpoint alone:

    per_source = predictions_by_source(predict, data.eval_sources, ..., gather=all_gather_objects)
    evaluation = evaluate_sources(per_source, data.evaluated)   # .metrics, .predictions, .surface_metrics

under `eval_autocast(device, precision)`, with `as_trained(model, precision)` for a model rebuilt
from `model.pt` (which holds fp32 master weights) when the run trained in bf16 / mxfp8.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gem.data import Batch, Examples, eval_batches
from gem.data.synthetic import SURFACES
from gem.eval.metrics import headline_ne, log_loss, task_metrics
from gem.parallel.plan import BF16_PRECISIONS  # the precisions the trainer runs in DeepSpeed's bf16 mode

TASKS = ("click", "conversion")  # the headline NE's tasks
FUNNEL = ("click", "conversion", "dwell")  # every task evaluated when the model predicts it
EVAL_BATCH_SIZE = 512  # eval needs no gradients: bigger batches, fewer (collective) forwards
_COLUMNS = ("weight", "click", "conversion", "dwell", "p_click", "p_conversion", "p_dwell", "surface", "objective")

PredictFn = Callable[[Batch], dict[str, torch.Tensor]]  # batch -> logits per task, each [B]
#: This rank's predictions -> every data shard's, in shard order (None for a rank whose copy does not count).
GatherFn = Callable[[dict[str, np.ndarray]], list[dict[str, np.ndarray] | None]]


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


def predictions_by_source(predict: PredictFn, eval_sources: Mapping[str, Examples], *, max_seq_len: int, rank: int,
                          world_size: int, device: torch.device, gather: GatherFn | None = None
                          ) -> dict[str, list[dict[str, np.ndarray]]]:
    """Per source (gem.data.sources.DataSplits.eval_sources), every data shard's predictions in shard
    order (= the source's eval order). Collective when `gather` is (e.g. gem.train.dist.all_gather_objects)."""
    per_source: dict[str, list[dict[str, np.ndarray]]] = {}
    for name, examples in eval_sources.items():
        mine = collect_predictions(predict, examples, max_seq_len=max_seq_len, rank=rank, world_size=world_size,
                                   device=device)
        parts = gather(mine) if gather is not None else [mine]
        per_source[name] = [p for p in parts if p is not None]
    return per_source


@dataclass(frozen=True)
class Evaluation:
    metrics: dict[str, float]
    """The eval metrics (the final report's): headline keys over the evaluated sources and, when the
    data mixes several sources, every key of every source again with an `@<source>` suffix."""
    predictions: list[dict[str, np.ndarray]]
    """The headline split's predictions, in its order (gem/eval/report.py lines them up with it)."""
    surface_metrics: dict[str, float] = field(default_factory=dict)
    """Per-surface keys (`ne/click@surface=feed`), MLflow only; empty unless asked for."""


def evaluate_sources(per_source: Mapping[str, list[dict[str, np.ndarray]]], evaluated: list[str], *,
                     by_surface: bool = False) -> Evaluation:
    """The trainer's metrics from predictions_by_source: the headline over the `evaluated` sources
    (DataSplits.evaluated) and, with several sources, each source's own (`ne/click@<source>`, evaluated or not)."""
    predictions = [p for name in evaluated for p in per_source[name]]
    metrics = metrics_from_predictions(predictions)
    surface: dict[str, float] = {}
    if by_surface:
        surface = {k: v for k, v in metrics_from_predictions(predictions, by_surface=True).items() if k not in metrics}
    if len(per_source) > 1:  # a mix (DataSplits.mixed): the effect of each source's weight, visible per source
        for name, parts in per_source.items():
            metrics.update({f"{k}@{name}": v for k, v in metrics_from_predictions(parts).items()})
    return Evaluation(metrics=metrics, predictions=predictions, surface_metrics=surface)


def _precision(precision: Any) -> str:
    return str(getattr(precision, "value", precision) or "fp32")


def eval_autocast(device: torch.device, precision: Any) -> contextlib.AbstractContextManager:
    """The trainer's forward precision: bf16 autocast for bf16 / mxfp8 (DeepSpeed's bf16 mode), else none."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=_precision(precision) in BF16_PRECISIONS)


def as_trained(model: torch.nn.Module, precision: Any) -> torch.nn.Module:
    """A model rebuilt from a checkpoint's model.pt (fp32 master weights) as the trainer ran it:
    mxfp8's MX Linears swapped in (gem.train.precision.apply_precision) and, for bf16 / mxfp8, the
    parameters in bf16 as DeepSpeed's bf16 mode holds them (it casts parameters only, not buffers)."""
    precision = _precision(precision)
    if precision == "mxfp8":
        from gem.train.precision import apply_precision

        model = apply_precision(model, precision)
    if precision in BF16_PRECISIONS:
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    return model


def surface_name(s: int) -> str:
    return SURFACES[s] if 0 <= s < len(SURFACES) else str(s)


def finite_or_none(metrics: dict[str, float]) -> dict[str, float | None]:
    """JSON has no NaN: undefined metrics (e.g. AUC with a single class) become null."""
    return {k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}
