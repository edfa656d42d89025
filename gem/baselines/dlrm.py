"""A DLRM-style baseline (Naumov et al. 2019): embeddings, dot interaction, MLPs
(gem.modules.dot_interaction, whose docstring has the formula).

Each event type's history is reduced to the sum of its events' embeddings (plus a log-length
feature): no order, no time, no interaction between events and the candidate before the dot
products. This is the bar GEM must beat on NE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem.modules.config import KunlunConfig
from gem.modules.dot_interaction import DotInteraction
from gem.modules.heads import multitask_loss
from gem.modules.inputs import GemInputs


@dataclass(kw_only=True, slots=True, frozen=True)
class DLRMConfig:
    base: KunlunConfig
    """Features, tasks and the embedding width are taken from this config."""
    bottom_hidden: int = 64
    top_hidden: int = 128


class DLRMModel(DotInteraction):
    def __init__(self, cfg: DLRMConfig):
        super().__init__(cfg.base, bottom_hidden=cfg.bottom_hidden, top_hidden=cfg.top_hidden)
        self.cfg = cfg

    def loss(self, inputs: GemInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return multitask_loss(self(inputs), inputs.labels, self.tasks, inputs.weight)
