"""Non-sequence tokens X⁰ [B, N_ns, d] and the raw per-event embeddings.

* sparse categorical features: hashed ids -> pooled embedding bags (sum/mean), one token each;
* dense features: one linear map to num_dense_tokens tokens;
* content embeddings (any encoder's vectors for the ad's text/image/video): projected, one token each;
* the request's surface: one token.
Tables are shared by name, so the candidate ad and the ads in the history use the same rows.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from gem.modules.common import linear_flops
from gem.modules.config import KunlunConfig
from gem.modules.inputs import EventSequence, GemInputs
from gem.ops import segment_ids, segment_sum


def hash_ids(ids: torch.Tensor, buckets: int, salt: int) -> torch.Tensor:
    """Multiplicative hashing of ids into [0, buckets) (Knuth's constant). Any int64 is valid
    (docs/data.md: negative and 64-bit hashed ids included): the product wraps modulo 2^64 and
    `%` (torch.remainder) takes the divisor's sign, so every row is in range."""
    return ((ids + salt) * 2654435761) % buckets


class FeatureEmbeddings(nn.Module):
    def __init__(self, cfg: KunlunConfig):
        super().__init__()
        f, d = cfg.features, cfg.dim
        self.cfg = cfg
        self.tables = nn.ModuleDict({t.name: nn.Embedding(t.num_buckets, d) for t in f.tables})
        self.salts = {t.name: zlib.crc32(t.name.encode()) % 9973 for t in f.tables}  # fixed per table name
        self.buckets = {t.name: t.num_buckets for t in f.tables}
        self.dense = nn.Linear(f.num_dense, cfg.num_dense_tokens * d)
        self.content = nn.ModuleDict({c.name: nn.Linear(c.dim, d) for c in f.content})
        self.surface = nn.Embedding(f.num_surfaces, d)
        for emb in list(self.tables.values()) + [self.surface]:
            nn.init.normal_(emb.weight, std=1.0 / math.sqrt(d))

    def lookup(self, table: str, ids: torch.Tensor, offsets: torch.Tensor | None = None,
               pooling: str = "sum") -> torch.Tensor:
        """[N, d] for single ids, or [B, d] bags pooled with offsets [B+1].

        The table is always called as a module (not through its weight), so sharded tables
        (gem.parallel) and ZeRO-3's parameter gathering see every lookup.
        """
        e = self.tables[table](hash_ids(ids, self.buckets[table], self.salts[table]))  # [N, d]
        if offsets is None:
            return e
        # One id per example: nothing to pool. Checked on CPU offsets only: elsewhere the check is a
        # device sync per feature, and pooling one row gives the same values.
        if (offsets.device.type == "cpu" and ids.numel() == offsets.numel() - 1
                and bool((offsets.diff() == 1).all())):
            return e
        pooled = segment_sum(e, offsets)  # [B, d]
        if pooling == "mean":
            pooled = pooled / offsets.diff().clamp_min(1).unsqueeze(1).to(pooled.dtype)
        return pooled

    def non_sequence(self, inputs: GemInputs) -> torch.Tensor:
        """[B, N_ns, d]"""
        f, B, d = self.cfg.features, inputs.size, self.cfg.dim
        tokens = [self.lookup(s.table, *inputs.sparse[s.name], pooling=s.pooling) for s in f.sparse]
        tokens += list(self.dense(inputs.dense).view(B, self.cfg.num_dense_tokens, d).unbind(1))
        tokens += [self.content[c.name](inputs.content[c.name]) for c in f.content]
        tokens.append(self.surface(inputs.surface.clamp(0, f.num_surfaces - 1)))
        return torch.stack(tokens, dim=1)

    def events(self, seq: EventSequence, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the event's id embeddings over the event tables, [ΣL or len(rows), d]."""
        out = None
        for table in self.cfg.features.event_tables:
            ids = seq.ids[table] if rows is None else seq.ids[table][rows]
            e = self.lookup(table, ids)
            out = e if out is None else out + e
        return out

    def pooled_events(self, inputs: GemInputs, decay_rates: torch.Tensor | None = None) -> torch.Tensor:
        """Each event type's history as one token: the sum of its events' embeddings / √d, so a
        long history's token stays near the others' scale. [B, num_event_types, d]
        decay_rates [num_event_types], 1/s: weight each event by exp(-age · rate of its type)."""
        pooled = []
        for i, name in enumerate(self.cfg.features.event_types):
            seq = inputs.sequences[name]
            e = self.events(seq)  # [ΣL, d]
            if decay_rates is not None:
                seg = segment_ids(seq.offsets, e.shape[0])
                age = (inputs.request_time[seg] - seq.timestamps).float().clamp_min(0)  # s
                e = e * torch.exp(-age * decay_rates[i]).to(e.dtype)[:, None]
            pooled.append(segment_sum(e, seq.offsets))
        return torch.stack(pooled, dim=1) / math.sqrt(self.cfg.dim)

    def flops(self, batch: int) -> float:
        f, d = self.cfg.features, self.cfg.dim
        return linear_flops(batch, f.num_dense, self.cfg.num_dense_tokens * d) + sum(
            linear_flops(batch, c.dim, d) for c in f.content)
