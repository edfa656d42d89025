"""A DLRM-style baseline (Naumov et al. 2019): embeddings, dot interaction, MLPs.

    tokens = [pooled sparse bags ‖ bottom-MLP(dense) ‖ content ‖ surface ‖ Σ-pooled events per type]
    z = [bottom ‖ upper triangle of tokens·tokensᵀ]
    logit_t = top-MLP(z)[t]

Each event type's history is reduced to the sum of its events' embeddings (plus a log-length
feature): no order, no time, no interaction between events and the candidate before the dot
products. This is the bar GEM must beat on NE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gem.modules.common import pairwise_dots
from gem.modules.config import KunlunConfig, Task
from gem.modules.embeddings import FeatureEmbeddings
from gem.modules.heads import multitask_loss
from gem.modules.inputs import GemInputs


@dataclass(kw_only=True, slots=True, frozen=True)
class DLRMConfig:
    base: KunlunConfig
    """Features, tasks and the embedding width are taken from this config."""
    bottom_hidden: int = 64
    top_hidden: int = 128
    history_decay: bool = False
    """Weight each history event by exp(-age · r) before pooling, one learnt rate r per event type
    (starting at one per day), so that the history's dot products with the candidate carry
    recency. A probe of docs/quality.md: the route by which DLRM learns the user x ad affinity,
    given the recency that GEM's exact-match flags otherwise supply. Off: the classic sum."""


class DLRMModel(nn.Module):
    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        self.cfg = cfg
        base, d = cfg.base, cfg.base.dim
        self.tasks: tuple[Task, ...] = base.tasks
        self.embeddings = FeatureEmbeddings(base)
        self.event_types = base.features.event_types
        self.bottom = nn.Sequential(nn.Linear(base.features.num_dense + len(self.event_types), cfg.bottom_hidden),
                                    nn.ReLU(), nn.Linear(cfg.bottom_hidden, d))
        n_tok = base.num_non_seq_tokens + len(self.event_types) + 1  # + the bottom-MLP token
        self.top = nn.Sequential(nn.Linear(d + n_tok * (n_tok - 1) // 2, cfg.top_hidden), nn.ReLU(),
                                 nn.Linear(cfg.top_hidden, cfg.top_hidden), nn.ReLU(),
                                 nn.Linear(cfg.top_hidden, len(self.tasks)))
        # log of the decay rates, 1/s; torch.full draws nothing, so the other weights are as without it
        self.log_decay = (nn.Parameter(torch.full((len(self.event_types),), math.log(1.0 / 86400.0)))
                          if cfg.history_decay else None)

    def forward(self, inputs: GemInputs) -> dict[str, torch.Tensor]:
        x = self.embeddings.non_sequence(inputs)  # [B, N_ns, d]
        log_len = [torch.log1p(inputs.sequences[name].offsets.diff().float()) for name in self.event_types]
        dense = torch.cat([inputs.dense, torch.stack(log_len, dim=1)], dim=1)
        bottom = self.bottom(dense)  # [B, d]
        tokens = torch.cat([x, self.pooled_history(inputs), bottom[:, None]], dim=1)  # [B, n_tok, d]
        z = torch.cat([bottom, pairwise_dots(tokens)], dim=1)
        logits = self.top(z)  # [B, T]
        return {t.name: logits[:, i].float() for i, t in enumerate(self.tasks)}

    def pooled_history(self, inputs: GemInputs) -> torch.Tensor:
        """Each event type's history as one token [B, num_event_types, d] (FeatureEmbeddings.pooled_events),
        each event weighted by exp(-age · rate) with history_decay."""
        return self.embeddings.pooled_events(inputs, None if self.log_decay is None else self.log_decay.exp())

    def loss(self, inputs: GemInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return multitask_loss(self(inputs), inputs.labels, self.tasks, inputs.weight)
