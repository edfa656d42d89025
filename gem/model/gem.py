"""GEM model v1 (kept for comparison; `build_model` now builds gem.model.kunlun.GEMModel):
candidate-aware jagged attention over the event history, an interaction MLP, one logit per task.

    non-sequence tokens X [B, 5, d]  (user, ad, campaign, surface, dense)
    learned seeds        [B, n_seed, d]
    queries Q = [X ‖ seeds]            [B, Nq, d]
    events S                           [ΣL, d]     (jagged, offsets [B+1]; item + campaign + type
                                                    + age bucket + match-with-candidate flag)
    for each layer:  Q = Q + CrossAttn(LN(Q), S);  Q = Q + MLP(LN(Q))
    h = MLP(flatten(Q))                [B, hidden]
    logits = {click: [B], conversion: [B]}

The candidate ad and campaign tokens are queries, so the model can look for past events on
the same campaign and weigh them by type and age; the seeds summarise the history
independently of the candidate. The full Kunlun architecture (gem/modules, docs/architecture.md)
replaced it behind the same `build_model(spec)`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gem.data.batch import Batch
from gem.model.config import GEMConfig
from gem.model.embeddings import NUM_NON_SEQ_TOKENS, FeatureEmbeddings
from gem.model.jagged import jagged_attention, segment_ids

TASKS = ("click", "conversion")


class MLP(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class CrossAttentionBlock(nn.Module):
    """Pre-LN block: the query tokens attend over their own example's events, then an MLP."""

    def __init__(self, d: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm_q = nn.LayerNorm(d)
        self.norm_kv = nn.LayerNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wkv = nn.Linear(d, 2 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.norm_mlp = nn.LayerNorm(d)
        self.mlp = MLP(d, 4 * d, d)

    def forward(self, x: torch.Tensor, seq: torch.Tensor, offsets: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        B, Nq, d = x.shape
        H = self.num_heads
        q = self.wq(self.norm_q(x)).view(B, Nq, H, d // H)  # [B, Nq, H, dh]
        k, v = self.wkv(self.norm_kv(seq)).view(-1, 2, H, d // H).unbind(1)  # [ΣL, H, dh] each
        attn = jagged_attention(q, k, v, offsets, seg=seg)  # [B, Nq, H, dh]
        x = x + self.wo(attn.reshape(B, Nq, d))
        return x + self.mlp(self.norm_mlp(x))


class GEMModelV1(nn.Module):
    def __init__(self, cfg: GEMConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.embedding_dim
        self.features = FeatureEmbeddings(cfg)
        self.seeds = nn.Parameter(torch.randn(cfg.num_seeds, d) * d**-0.5)
        self.blocks = nn.ModuleList(CrossAttentionBlock(d, cfg.num_heads) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(d)
        num_queries = NUM_NON_SEQ_TOKENS + cfg.num_seeds
        self.interaction = MLP(num_queries * d, cfg.hidden_dim, cfg.hidden_dim)
        self.heads = nn.ModuleDict({task: nn.Linear(cfg.hidden_dim, 1) for task in TASKS})

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Logits per task, each [B]."""
        B = batch.size
        x = self.features.non_sequence(batch)  # [B, 5, d]
        x = torch.cat([x, self.seeds.expand(B, -1, -1)], dim=1)  # [B, Nq, d]
        seg = segment_ids(batch.seq_offsets)  # [ΣL], the example of each event
        seq = self.features.sequence(batch, seg)  # [ΣL, d]
        for block in self.blocks:
            x = block(x, seq, batch.seq_offsets, seg)  # [B, Nq, d]
        h = F.gelu(self.interaction(self.norm_out(x).flatten(1)))  # [B, hidden]
        return {task: head(h).squeeze(-1) for task, head in self.heads.items()}
