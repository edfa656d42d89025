"""Turning a Batch into tokens: non-sequence tokens [B, N_ns, d] and event tokens [ΣL, d]."""

from __future__ import annotations

import math

import torch
from torch import nn

from gem.data.batch import Batch
from gem.data.synthetic import NUM_DENSE
from gem.model.config import GEMConfig

NUM_SURFACE_BUCKETS = 8  # more than the synthetic world's surfaces: room for new ones
NUM_EVENT_TYPE_BUCKETS = 8
NUM_NON_SEQ_TOKENS = 5  # user, ad, campaign, surface, dense
NUM_MATCH_BUCKETS = 4  # event vs candidate: 0 unrelated, 1 same campaign, 2 same ad (3: same ad, other campaign)


def hash_ids(ids: torch.Tensor, buckets: int, salt: int) -> torch.Tensor:
    """Multiplicative hashing of non-negative ids into [0, buckets): unseen ids still get a row."""
    # Knuth's constant keeps nearby ids apart; int64 cannot overflow for ids < 2^32.
    return ((ids + salt) * 2654435761) % buckets


def time_bucket(age_s: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-spaced age buckets: 1 min -> 2, 1 h -> 12, 1 day -> 21, 1 month -> 31 (3 buckets per e-fold)."""
    return (torch.log1p(age_s.clamp_min(0) / 60.0) * 3.0).long().clamp(max=num_buckets - 1)


class FeatureEmbeddings(nn.Module):
    def __init__(self, cfg: GEMConfig):
        super().__init__()
        d = cfg.embedding_dim
        self.cfg = cfg
        self.user = nn.Embedding(cfg.user_buckets, d)
        self.item = nn.Embedding(cfg.item_buckets, d)  # shared: the candidate ad and past events
        self.campaign = nn.Embedding(cfg.campaign_buckets, d)  # shared as well
        self.surface = nn.Embedding(NUM_SURFACE_BUCKETS, d)
        self.dense = nn.Linear(NUM_DENSE, d)
        self.event_type = nn.Embedding(NUM_EVENT_TYPE_BUCKETS, d)
        self.event_age = nn.Embedding(cfg.num_time_buckets, d)
        # Target-aware flag per event: same campaign / same ad as the candidate (SIM-style "hard
        # search" signal). Attention could discover it from the shared id tables alone, but slowly.
        self.event_match = nn.Embedding(NUM_MATCH_BUCKETS, d)
        self.seq_norm = nn.LayerNorm(d)
        for emb in (self.user, self.item, self.campaign, self.surface, self.event_type, self.event_age,
                    self.event_match):
            nn.init.normal_(emb.weight, std=1.0 / math.sqrt(d))

    def non_sequence(self, batch: Batch) -> torch.Tensor:
        """[B, NUM_NON_SEQ_TOKENS, d]"""
        c = self.cfg
        tokens = [
            self.user(hash_ids(batch.user_id, c.user_buckets, salt=1)),
            self.item(hash_ids(batch.ad_id, c.item_buckets, salt=2)),
            self.campaign(hash_ids(batch.campaign_id, c.campaign_buckets, salt=3)),
            self.surface(batch.surface % NUM_SURFACE_BUCKETS),
            self.dense(batch.dense),
        ]
        return torch.stack(tokens, dim=1)  # [B, 5, d]

    def sequence(self, batch: Batch, seg: torch.Tensor) -> torch.Tensor:
        """One token per event, [ΣL, d]: what it was on + what happened + how long ago + relation to the candidate."""
        c = self.cfg
        same_campaign = batch.seq_campaign_id == batch.campaign_id.index_select(0, seg)  # [ΣL]
        same_ad = batch.seq_ad_id == batch.ad_id.index_select(0, seg)  # [ΣL]
        e = (
            self.item(hash_ids(batch.seq_ad_id, c.item_buckets, salt=2))
            + self.campaign(hash_ids(batch.seq_campaign_id, c.campaign_buckets, salt=3))
            + self.event_type(batch.seq_type % NUM_EVENT_TYPE_BUCKETS)
            + self.event_age(time_bucket(batch.seq_age, c.num_time_buckets))
            + self.event_match(same_campaign.long() + 2 * same_ad.long())
        )  # [ΣL, d]
        return self.seq_norm(e)
