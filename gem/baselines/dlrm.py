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

from gem.modules.config import KunlunConfig, Task
from gem.modules.embeddings import FeatureEmbeddings
from gem.modules.heads import multitask_loss
from gem.modules.inputs import GemInputs
from gem.ops import segment_sum


@dataclass(kw_only=True, slots=True, frozen=True)
class DLRMConfig:
    base: KunlunConfig
    """Features, tasks and the embedding width are taken from this config."""
    bottom_hidden: int = 64
    top_hidden: int = 128


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
        self.n_tok = n_tok
        self.top = nn.Sequential(nn.Linear(d + n_tok * (n_tok - 1) // 2, cfg.top_hidden), nn.ReLU(),
                                 nn.Linear(cfg.top_hidden, cfg.top_hidden), nn.ReLU(),
                                 nn.Linear(cfg.top_hidden, len(self.tasks)))

    def forward(self, inputs: GemInputs) -> dict[str, torch.Tensor]:
        d = self.cfg.base.dim
        x = self.embeddings.non_sequence(inputs)  # [B, N_ns, d]
        pooled, log_len = [], []
        for name in self.event_types:
            seq = inputs.sequences[name]
            e = self.embeddings.events(seq)  # [ΣL, d]
            pooled.append(segment_sum(e, seq.offsets) / math.sqrt(d))  # [B, d]
            log_len.append(torch.log1p(seq.offsets.diff().float()))
        dense = torch.cat([inputs.dense, torch.stack(log_len, dim=1)], dim=1)
        bottom = self.bottom(dense)  # [B, d]
        tokens = torch.cat([x, torch.stack(pooled, dim=1), bottom[:, None]], dim=1)  # [B, n_tok, d]
        dots = torch.bmm(tokens, tokens.transpose(1, 2))  # [B, n_tok, n_tok]
        iu = torch.triu_indices(self.n_tok, self.n_tok, offset=1, device=dots.device)
        z = torch.cat([bottom, dots[:, iu[0], iu[1]]], dim=1)
        logits = self.top(z)  # [B, T]
        return {t.name: logits[:, i].float() for i, t in enumerate(self.tasks)}

    def loss(self, inputs: GemInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return multitask_loss(self(inputs), inputs.labels, self.tasks, inputs.weight)
