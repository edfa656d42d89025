"""What the trainer trains: a Task builds the model and says how to compute its loss.

The trainer (gem/train/trainer.py) owns everything else: DeepSpeed, data order, evaluation,
checkpoints, MLflow and the final report. GEM pretraining and distillation are two Tasks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from gem.api.types import DataSpec, GEMTraining
from gem.data import Batch, Examples, build_splits
from gem.model import GEMModel, config_from_spec
from gem.model.loss import multitask_bce

LossFn = tuple[torch.Tensor, dict[str, torch.Tensor]]


class Task(Protocol):
    manifest: Any  # GEMTraining | LoopFMDistill
    max_seq_len: int  # events of history the model reads

    def build_model(self) -> nn.Module: ...

    def loss(self, model: nn.Module, batch: Batch) -> LossFn:
        """(total loss, named parts for logging)."""
        ...

    def reference_metrics(self, evaluate: Any) -> dict[str, float]:
        """Metrics of fixed models to report beside the trained one (e.g. the teacher's)."""
        ...


def load_splits(data: DataSpec) -> tuple[Examples, Examples]:
    if data.source != "synthetic":
        raise NotImplementedError(
            f"data.source {data.source!r} is not supported by this trainer yet: use data.source: synthetic"
        )
    return build_splits(data.synthetic)


class GEMTask:
    """Pretrain GEM on click + post-click conversion."""

    def __init__(self, manifest: GEMTraining):
        self.manifest = manifest
        self.config = config_from_spec(manifest.spec.model)
        self.max_seq_len = self.config.max_seq_len

    def build_model(self) -> nn.Module:
        return GEMModel(self.config)

    def loss(self, model: nn.Module, batch: Batch) -> LossFn:
        return multitask_bce(model(batch), batch)

    def reference_metrics(self, evaluate: Any) -> dict[str, float]:
        return {}
