"""What the trainer trains: a Task builds the model and says how to compute its loss.

The trainer (gem/train/trainer.py) owns everything else: DeepSpeed, data order, evaluation,
checkpoints, MLflow and the final report. GEM pretraining and distillation are two Tasks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from gem.api.types import DataSpec, GEMTraining
from gem.data import Batch, Examples
from gem.data.errors import SpecError
from gem.data.sources import load_data
from gem.model import GEMModel, config_from_spec
from gem.model.loss import multitask_bce
from gem.modules import from_v1_batch

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


def load_splits(data: DataSpec, *, max_history: int = 64) -> tuple[Any, Examples]:
    """(train, eval) of a single-source spec: train is Examples or a streamed ParquetSource (docs/data.md).

    Mixed specs (data.sources) go through gem.data.sources.load_data, which the trainer uses.
    """
    splits = load_data(data, max_history=max_history)
    if splits.mixed:
        raise SpecError("spec.data.sources: this command reads one data source; data.sources mixes several: "
                        "use data.source (or one entry in data.sources)")
    return next(iter(splits.train.values())), splits.eval


class GEMTask:
    """Pretrain GEM on click + post-click conversion."""

    def __init__(self, manifest: GEMTraining):
        self.manifest = manifest
        self.config = config_from_spec(manifest.spec.model)
        self.max_seq_len = self.config.max_seq_len

    def build_model(self) -> nn.Module:
        return GEMModel(self.config)

    def loss(self, model: nn.Module, batch: Batch) -> LossFn:
        gem = getattr(model, "module", model)  # `model` is DeepSpeed's engine
        if getattr(gem, "generative", None) is None:  # off, or a model without it (a subclass's baseline)
            return multitask_bce(model(batch), batch)
        # With the generative objective over the history (spec.model.generativeLossWeight): the
        # batch converted once for both. Its tables are called as modules, so ZeRO-3 gathers them.
        inputs = from_v1_batch(batch)
        total, parts = multitask_bce(model(inputs), batch)
        aux = gem.auxiliary_loss(inputs)
        return total + aux, {**parts, "generative": aux}

    def reference_metrics(self, evaluate: Any) -> dict[str, float]:
        return {}
