"""Run a model over the eval split on every rank and compute metrics over all ranks' shards."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from gem.data import Batch, Examples, eval_batches
from gem.eval.metrics import headline_ne, log_loss, task_metrics

TASKS = ("click", "conversion")
EVAL_BATCH_SIZE = 512  # eval needs no gradients: bigger batches, fewer (collective) forwards

PredictFn = Callable[[Batch], dict[str, torch.Tensor]]  # batch -> logits per task, each [B]


@torch.no_grad()
def collect_predictions(predict: PredictFn, examples: Examples, *, max_seq_len: int, rank: int, world_size: int,
                        device: torch.device) -> dict[str, np.ndarray]:
    """This rank's predictions, labels and true probabilities (padding rows dropped)."""
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("weight", "click", "conversion", "p_click", "p_conversion",
                                                          "pred_click", "pred_conversion")}
    for batch in eval_batches(examples, batch_size=EVAL_BATCH_SIZE, max_seq_len=max_seq_len, rank=rank,
                              world_size=world_size):
        logits = predict(batch.to(device))
        for task in TASKS:
            cols[f"pred_{task}"].append(torch.sigmoid(logits[task].float()).cpu().numpy())
        for name in ("weight", "click", "conversion", "p_click", "p_conversion"):
            cols[name].append(getattr(batch, name).numpy())
    out = {k: np.concatenate(v) for k, v in cols.items()}
    keep = out.pop("weight") > 0
    return {k: v[keep] for k, v in out.items()}


def metrics_from_predictions(parts: list[dict[str, np.ndarray]], *, prefix: str = "") -> dict[str, float]:
    """Metrics over the union of every rank's predictions.

    click: all impressions; conversion: post-click CVR, so only clicked impressions count.
    """
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    clicked = cols["click"] > 0
    metrics: dict[str, float] = {}
    metrics.update(task_metrics("click", cols["click"], cols["pred_click"], None if prefix else cols["p_click"],
                                prefix=prefix))
    metrics.update(task_metrics("conversion", cols["conversion"][clicked], cols["pred_conversion"][clicked],
                                None if prefix else cols["p_conversion"][clicked], prefix=prefix))
    # The training objective on the eval split: click BCE + post-click conversion BCE.
    conv_loss = log_loss(cols["conversion"][clicked], cols["pred_conversion"][clicked]) if clicked.any() else 0.0
    metrics[f"{prefix}loss"] = log_loss(cols["click"], cols["pred_click"]) + conv_loss
    metrics[f"{prefix}ne"] = headline_ne(metrics, TASKS, prefix)
    metrics[f"{prefix}num_examples"] = float(len(cols["click"]))
    return metrics


def finite_or_none(metrics: dict[str, float]) -> dict[str, float | None]:
    """JSON has no NaN: undefined metrics (e.g. AUC with a single class) become null."""
    return {k: (float(v) if math.isfinite(v) else None) for k, v in metrics.items()}
