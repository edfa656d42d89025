"""AdamW and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from gem.api.types import TrainingSpec

MIN_LR_RATIO = 0.1  # cosine decays to 10% of the peak, not 0: the last steps still learn


def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak LR after `step` optimizer steps: linear warmup, then cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: nn.Module, training: TrainingSpec) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    # No weight decay on embeddings, norms and biases: decaying rarely-seen id rows to zero
    # hurts more than it regularises.
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=training.learning_rate, betas=(0.9, 0.98),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup_steps=training.warmup_steps, total_steps=training.steps)
    )
    return optimizer, scheduler
