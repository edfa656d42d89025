"""What the trainer trains: a Task builds the model and says how to compute its loss.

The trainer (gem/train/trainer.py) owns everything else: DeepSpeed, data order, evaluation,
checkpoints, MLflow and the final report. GEM pretraining and distillation are two Tasks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from gem.api.types import DataSpec, GEMTraining
from gem.data import Batch, Examples, ShardedLoader, build_splits
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


def load_splits(data: DataSpec) -> tuple[Any, Examples]:
    """(train, eval): train is Examples (synthetic) or a streamed ParquetSource (parquet, see docs/data.md)."""
    if str(data.source) == "parquet":
        from gem.data.parquet import load_parquet_splits

        return load_parquet_splits(data.path)
    if str(data.source) != "synthetic":
        raise NotImplementedError(f"data.source {data.source!r} is not supported by this trainer")
    return build_splits(data.synthetic)


def build_train_loader(train: Any, **kwargs: Any) -> Any:
    """ShardedLoader over in-memory Examples, ParquetLoader over a ParquetSource (same interface)."""
    if isinstance(train, Examples):
        return ShardedLoader(train, **kwargs)
    from gem.data.parquet import ParquetLoader

    return ParquetLoader(train, **kwargs)


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
