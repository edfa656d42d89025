"""The GEM model `gem train` trains: the Kunlun architecture (gem/modules) over the training Batch.

`GEMModel(cfg)` is gem.modules.KunlunModel built from a GEMConfig (gem.model.config.kunlun_config)
that also accepts the trainer's `gem.data.Batch` (converted by gem.modules.from_v1_batch: one
jagged sequence per event type). It keeps the small surface other tools rely on:

* `max_seq_len`: events of history the model reads;
* `norm_out`: the LayerNorm over the head input [B, N_ns + ..., d], whose first token is the user
  token after the interaction layers and whose tokens from cfg.num_non_seq_tokens on are the
  summaries (X_sum and the sequence summaries): what GEM v1's norm_out held in the same places.
"""

from __future__ import annotations

import torch
from torch import nn

from gem.data.batch import Batch
from gem.model.config import GEMConfig, kunlun_config
from gem.modules import GemInputs, KunlunModel, from_v1_batch


class GEMModel(KunlunModel):
    def __init__(self, cfg: GEMConfig):
        super().__init__(kunlun_config(cfg))
        self.gem_config = cfg

    @property
    def max_seq_len(self) -> int:
        return self.gem_config.max_seq_len

    @property
    def norm_out(self) -> nn.LayerNorm:
        return self.head_norm

    def forward(self, batch: Batch | GemInputs) -> dict[str, torch.Tensor]:
        """Logits per task, each float32 [B]."""
        return super().forward(batch if isinstance(batch, GemInputs) else from_v1_batch(batch))

    def auxiliary_loss(self, batch: Batch | GemInputs) -> torch.Tensor | None:
        """KunlunModel.auxiliary_loss over the trainer's Batch (None: no generative objective)."""
        if self.generative is None:
            return None
        return super().auxiliary_loss(batch if isinstance(batch, GemInputs) else from_v1_batch(batch))
