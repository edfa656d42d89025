"""DLRM's dot interaction (Naumov et al. 2019) as one module: embeddings, dot products, MLPs.

    tokens = [pooled sparse bags ‖ bottom-MLP(dense) ‖ content ‖ surface ‖ pooled events per type]
    z = [bottom ‖ upper triangle of tokens·tokensᵀ]
    logit_t = top-MLP(z)[t]

Each event type's history is one token, the sum of its events' embeddings (optionally each
weighted by exp(-age · r), one learnt rate r per type), plus a log-length feature. It is the DLRM
baseline (gem.baselines.DLRMModel, plain sums) and, with KunlunConfig.affinity_branch, a branch
beside Kunlun's trunk with its own tables and decayed pools (docs/architecture.md §11): the route
by which DLRM learns the user x ad affinity (docs/quality.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gem.modules.common import linear_flops, pairwise_dots, pairwise_dots_flops
from gem.modules.config import KunlunConfig, Task
from gem.modules.embeddings import FeatureEmbeddings
from gem.modules.inputs import GemInputs


class DotInteraction(nn.Module):
    def __init__(self, base: KunlunConfig, *, bottom_hidden: int = 64, top_hidden: int = 128,
                 history_decay: bool = False):
        super().__init__()
        d = base.dim
        self.tasks: tuple[Task, ...] = base.tasks
        self.embeddings = FeatureEmbeddings(base)
        self.event_types = base.features.event_types
        self.bottom = nn.Sequential(nn.Linear(base.features.num_dense + len(self.event_types), bottom_hidden),
                                    nn.ReLU(), nn.Linear(bottom_hidden, d))
        self.num_tokens = base.num_non_seq_tokens + len(self.event_types) + 1  # + the bottom-MLP token
        n = self.num_tokens
        self.top = nn.Sequential(nn.Linear(d + n * (n - 1) // 2, top_hidden), nn.ReLU(),
                                 nn.Linear(top_hidden, top_hidden), nn.ReLU(),
                                 nn.Linear(top_hidden, len(self.tasks)))
        # log of the decay rates, 1/s, starting at one per day; torch.full draws nothing, so the
        # other weights are as without it
        self.log_decay = (nn.Parameter(torch.full((len(self.event_types),), math.log(1.0 / 86400.0)))
                          if history_decay else None)

    def forward(self, inputs: GemInputs) -> dict[str, torch.Tensor]:
        """Logits per task, each float32 [B]."""
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

    def flops(self, batch: int) -> float:
        """Forward matmul FLOPs of one batch: the dense and content projections, both MLPs, the dot products."""
        mlps = sum(linear_flops(batch, m.in_features, m.out_features)
                   for m in (*self.bottom, *self.top) if isinstance(m, nn.Linear))
        d = self.bottom[-1].out_features
        return self.embeddings.flops(batch) + mlps + pairwise_dots_flops(batch, self.num_tokens, d)
