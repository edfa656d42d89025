"""Multi-task BCE over the funnel: click on every impression, conversion (post-click CVR) only on
clicked ones, and the awareness label dwell wherever it is known.

`task_labels` / `task_masks` keep their v1 meaning (click and conversion: the distillation
tasks use them); `multitask_bce` trains every task the model has logits for.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gem.data.batch import Batch


def task_masks(batch: Batch) -> dict[str, torch.Tensor]:
    """Which examples carry a label for each task, float [B] (a NaN label, unknown to its source, does not)."""
    known = torch.isfinite(batch.conversion).to(batch.weight.dtype)
    return {"click": batch.weight, "conversion": batch.weight * torch.nan_to_num(batch.click, nan=0.0) * known}


def task_labels(batch: Batch) -> dict[str, torch.Tensor]:
    """Labels with unknown (NaN) values zeroed: their masks are 0, and 0 * NaN would still be NaN."""
    return {"click": batch.click, "conversion": torch.nan_to_num(batch.conversion, nan=0.0)}


def funnel_labels_and_masks(batch: Batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """task_labels / task_masks plus dwell (awareness): masked where unknown (NaN, e.g. a source without it)."""
    labels, masks = task_labels(batch), task_masks(batch)
    dwell = getattr(batch, "dwell", None)
    if dwell is not None:
        known = torch.isfinite(dwell)
        labels["dwell"] = torch.where(known, dwell, torch.zeros_like(dwell))
        masks["dwell"] = batch.weight * known.to(batch.weight.dtype)
    return labels, masks


def masked_bce(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean BCE over the examples where mask is 1 (0 if there are none)."""
    per_example = F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none")
    return (per_example * mask).sum() / mask.sum().clamp_min(1.0)


def multitask_bce(logits: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of the per-task losses, and each task's loss for logging."""
    labels, masks = funnel_labels_and_masks(batch)
    parts = {task: masked_bce(logits[task], labels[task], masks[task]) for task in logits}
    return sum(parts.values()), parts
